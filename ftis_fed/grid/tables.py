"""The grid's tables, computed from the finished cells' files: final accuracies per cell, mean ± sd
over seeds, paired differences per seed, training diagnostics, and the paired per-prompt
differences with their intervals (``grid.stats``) that the verdicts (``grid.claims``) read. Every
accuracy is the grid's metric (``grid.metric``: greedy, the default, or sampled pass@1)."""

from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Sequence

import numpy as np

from ftis_fed.grid.claims import BASELINE, REFERENCE
from ftis_fed.grid.metric import GREEDY, Metric, MissingMetric
from ftis_fed.grid.plan import Cell, method_order
from ftis_fed.grid.records import (cell_rows, evaluation_records, final_eval, num, participant_rows,
                                   prompt_records, prompt_vectors, shared_start)

#: The keys of the greedy tables (``Metric.keys`` of another metric).
METRICS = GREEDY.keys
#: Training diagnostics the summary averages over rounds and seeds (what each method did to the peers'
#: samples: how much of the own reward signal there was, how far the peers' samples were, what the
#: filter dropped).
DIAGNOSTICS = ("reward/mean", "reward/groups_with_signal", "offpolicy/kl_mean", "offpolicy/ratio_mean",
               "offpolicy/truncated_frac", "offpolicy/filtered_frac", "train/seconds")


def check_metric(cells: Sequence[Cell], out: Path, metric: Metric) -> list[int]:
    """The distinct ``k`` of the sampled evaluations the summary reads (sorted; [] for greedy, which
    every cell has). Raises ``MissingMetric`` naming every finished cell whose final evaluation lacks
    ``metric``: the metrics rows' ID key, or the per-prompt ``k`` / ``sampled`` counts."""
    if metric == GREEDY:
        return []
    ks, bad = set(), []
    for c in cells:
        cell_dir = out / "cells" / c.name
        if not (cell_dir / "done.json").exists():
            continue
        finals = final_eval(cell_rows(cell_dir)).values()
        recs = evaluation_records(prompt_records(cell_dir))
        if finals and recs and all(math.isfinite(num(r.get(metric.key("id")))) for r in finals) \
                and all(r.get("k") and r.get("sampled") is not None for r in recs):
            ks |= {int(r["k"]) for r in recs}
            continue
        cfg = cell_dir / "run" / "config.json"
        samples = f"= {json.loads(cfg.read_text()).get('eval_samples', 0)}" if cfg.exists() else "not recorded"
        bad.append(f"{c.name} (eval-samples {samples})")
    if bad:
        raise MissingMetric(f"--metric {metric.name}: {len(bad)} finished cell(s) have no sampled evaluation "
                            f"({metric.key('id')} in run/metrics.jsonl.gz, k / sampled in run/eval_prompts.jsonl.gz): "
                            f"{', '.join(bad)}; run them with --run-config eval-samples=K (K >= 1), or summarise "
                            "with --metric greedy")
    return sorted(ks)


def cell_results(cells: Sequence[Cell], out: Path, metric: Metric = GREEDY) -> list[dict]:
    """One row per finished cell × participant: the final held-out accuracies (``metric``'s keys), read
    from the cell's metrics.jsonl (nothing is typed in)."""
    table = []
    for c in cells:
        done = out / "cells" / c.name / "done.json"
        if not done.exists():
            continue
        seconds = num(json.loads(done.read_text()).get("seconds"))
        for p, r in sorted(final_eval(cell_rows(out / "cells" / c.name)).items()):
            row = {"cell": c.name, "method": c.method, "mode": c.mode, "groups": c.groups, "seed": c.seed,
                   "participant": p, "round": int(r["round"]), "cell_seconds": seconds}
            for m in metric.keys:
                row[m] = num(r.get(m))
            row["eval/id/n"] = num(r.get("eval/id/n"))
            table.append(row)
    return table



def _mean_sd(xs: Sequence[float]) -> tuple[float, float]:
    xs = [x for x in xs if math.isfinite(x)]
    if not xs:
        return float("nan"), float("nan")
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def summarize(results: Sequence[dict], reference: str = REFERENCE,
              metrics: Sequence[str] = METRICS) -> tuple[list[dict], list[dict]]:
    """(per method × participant: mean ± sd over seeds of each of ``metrics`` (keys of ``results``);
        per method × participant: paired difference reference − method over the seeds both have)."""
    by = defaultdict(dict)                               # (method, participant) -> seed -> row
    for r in results:
        by[(r["method"], r["participant"])][r["seed"]] = r
    summary = []
    for (method, p), seeds in sorted(by.items()):
        row = {"method": method, "participant": p, "seeds": len(seeds)}
        for m in metrics:
            row[m + ":mean"], row[m + ":sd"] = _mean_sd([s[m] for s in seeds.values()])
        summary.append(row)
    paired = []
    for (method, p), seeds in sorted(by.items()):
        ref_method = reference + ("/h" if method.endswith("/h") else "")
        ref = by.get((ref_method, p))
        if ref is None or method == ref_method:
            continue
        common = sorted(set(seeds) & set(ref))
        if not common:
            continue
        row = {"method": method, "reference": ref_method, "participant": p, "seeds": len(common)}
        for m in metrics:
            diffs = [ref[s][m] - seeds[s][m] for s in common]
            row[m + ":diff_mean"], row[m + ":diff_sd"] = _mean_sd(diffs)
            row[m + ":ref_wins"] = sum(d > 0 for d in diffs if math.isfinite(d))
            row[m + ":ref_losses"] = sum(d < 0 for d in diffs if math.isfinite(d))
        paired.append(row)
    return summary, paired


def train_diagnostics(cells: Sequence[Cell], out: Path) -> list[dict]:
    """Per method × participant: each ``DIAGNOSTICS`` key averaged over the training rounds of a cell,
    then mean ± sd over the finished cells (seeds); read from the metrics files."""
    per: dict[tuple[str, str], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for c in cells:
        if not (out / "cells" / c.name / "done.json").exists():
            continue
        rows = participant_rows(cell_rows(out / "cells" / c.name), "train")
        for p in sorted({r["participant"] for r in rows}):
            for k in DIAGNOSTICS:
                vs = [num(r.get(k)) for r in rows if r["participant"] == p]
                vs = [v for v in vs if math.isfinite(v)]
                if vs:
                    per[(c.method, p)][k].append(statistics.fmean(vs))
    table = []
    for (method, p), ks in sorted(per.items(), key=lambda kv: (method_order(kv[0][0]), kv[0][1])):
        row = {"method": method, "participant": p}
        for k in DIAGNOSTICS:
            row[k + ":mean"], row[k + ":sd"] = _mean_sd(ks.get(k, []))
        table.append(row)
    return table



def _peer_rows(cells: Sequence[Cell], out: Path, prefix: str, suffix: str):
    """(cell, receiver, peer, the receiver's training rows) for each finished cell and each receiver
    and peer (not the receiver itself) whose rows carry ``<prefix>/<peer>/<suffix>``."""
    for c in cells:
        if not (out / "cells" / c.name / "done.json").exists():
            continue
        rows = participant_rows(cell_rows(out / "cells" / c.name), "train")
        keys = {(r["participant"], k.split("/")[1]) for r in rows for k in r
                if k.startswith(prefix + "/") and k.endswith("/" + suffix) and k.count("/") == 2}
        for receiver, peer in sorted(keys):
            if peer != receiver:
                yield c, receiver, peer, [r for r in rows if r["participant"] == receiver]


#: per-sample KL columns of ``filter_table``: (metrics key suffix, how a cell's rounds combine)
FILTER_COLUMNS = (("kl_p50", "mean"), ("kl_p90", "mean"), ("kl_p99", "mean"), ("kl_max", "max"),
                  ("kl_ge_g_frac", "mean"), ("filtered_frac", "mean"))


def filter_table(cells: Sequence[Cell], out: Path) -> list[dict]:
    """Per method × receiver × peer source: the per-sample KL of the peer's samples at the receiver,
    from the cells whose rows carry the quantiles (``offpolicy/<peer>/kl_p50``, ...: cells made before
    them give no row). Per cell over its training rounds: the mean of each round's quantiles
    (``kl_p50``, ``kl_p90``, ``kl_p99``: of that round's first update's samples), the largest
    ``kl_max``, the mean share at or above g (``kl_ge_g_frac``) and the mean share the filter dropped
    (``filtered_frac``); then per method the mean over the seeds (``kl_max``: their largest)."""
    per: dict[tuple[str, str, str], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for c, receiver, peer, mine in _peer_rows(cells, out, "offpolicy", "kl_p50"):
        for col, how in FILTER_COLUMNS:
            vs = [num(r.get(f"offpolicy/{peer}/{col}")) for r in mine]
            vs = [v for v in vs if math.isfinite(v)]
            if vs:
                per[(c.method, receiver, peer)][col].append(max(vs) if how == "max" else statistics.fmean(vs))
    table = []
    for (method, receiver, peer), cols in sorted(per.items(), key=lambda kv: (method_order(kv[0][0]), kv[0][1:])):
        row = {"method": method, "participant": receiver, "peer": peer, "seeds": len(cols.get("kl_p50", []))}
        for col, how in FILTER_COLUMNS:
            vs = cols.get(col, [])
            row[col] = (max(vs) if how == "max" else statistics.fmean(vs)) if vs else math.nan
        table.append(row)
    return table


#: columns of ``guard_table``: (column, metrics key; ``{peer}``: the peer source, else the receiver's key)
GUARD_COLUMNS = (("kept", "guard/kept_peers"), ("weight", "guard/{peer}/weight"), ("cos", "guard/{peer}/cos"),
                 ("own_cos", "guard/own_cos"))


def guard_table(cells: Sequence[Cell], out: Path) -> list[dict]:
    """Per method × receiver × peer, from the cells whose rows carry the guard's keys
    (``source-adapt = guard``, ``learn/guard.py``; other cells give no row, so their summaries are
    unchanged): per cell over its training rounds, the share of rounds whose update kept the peers
    (``guard/kept_peers``: the receiver's, the same for each of its peers), the mean alignment weight
    of the peer's samples and the share of rounds it was 0, the mean cosines of the peer's and the own
    samples' gradients with the validation gradient; then the mean over the seeds, with the per-seed
    range of ``kept`` and ``weight`` (``_min`` / ``_max``)."""
    per: dict[tuple[str, str, str], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for c, receiver, peer, mine in _peer_rows(cells, out, "guard", "weight"):
        for col, key in GUARD_COLUMNS:
            vs = [num(r.get(key.format(peer=peer))) for r in mine]
            vs = [v for v in vs if math.isfinite(v)]
            if vs:
                per[(c.method, receiver, peer)][col].append(statistics.fmean(vs))
                if col == "weight":
                    per[(c.method, receiver, peer)]["weight_zero"].append(statistics.fmean(v == 0 for v in vs))
    table = []
    for (method, receiver, peer), cols in sorted(per.items(), key=lambda kv: (method_order(kv[0][0]), kv[0][1:])):
        row = {"method": method, "participant": receiver, "peer": peer, "seeds": len(cols.get("weight", []))}
        for col in ("kept", "weight", "weight_zero", "cos", "own_cos"):
            vs = cols.get(col, [])
            row[col] = statistics.fmean(vs) if vs else math.nan
            if col in ("kept", "weight"):
                row[col + "_min"], row[col + "_max"] = (min(vs), max(vs)) if vs else (math.nan, math.nan)
        table.append(row)
    return table


def guard_score_table(cells: Sequence[Cell], out: Path) -> list[dict]:
    """Per method × receiver × validation group, from the cells whose rows carry the guard's two
    candidate scores (``guard/val_with`` / ``guard/val_without``; other cells give no row): per cell
    over its training rounds, the mean (``d``) and standard deviation (``d_sd``) of the per-round
    score difference d = with − without, for the whole validation batch (group "all") and, with
    ``source-adapt-val-group = family``, for each group (``guard/val/<group>/diff``); and ``drop``, the
    share of rounds in which the group voted to drop the peers (its window's mean, ``.../diff_mean``,
    or with a window of 1 this round's d, below 0; "all": the share of rounds whose update dropped
    them); then the mean over the seeds, ``d`` with its per-seed range."""
    per: dict[tuple[str, str, str], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for c in cells:
        if not (out / "cells" / c.name / "done.json").exists():
            continue
        rows = [r for r in participant_rows(cell_rows(out / "cells" / c.name), "train") if "guard/val_without" in r]
        for receiver in sorted({r["participant"] for r in rows}):
            mine = [r for r in rows if r["participant"] == receiver]
            groups = sorted({k.split("/")[2] for r in mine for k in r
                             if k.startswith("guard/val/") and k.endswith("/diff") and k.count("/") == 3})
            series = {"all": ([num(r["guard/val_with"]) - num(r["guard/val_without"]) for r in mine],
                              [1.0 - num(r.get("guard/kept_peers")) for r in mine])}
            for g in groups:
                d = [num(r.get(f"guard/val/{g}/diff")) for r in mine]
                mean = [num(r.get(f"guard/val/{g}/diff_mean", r.get(f"guard/val/{g}/diff"))) for r in mine]
                series[g] = (d, [float(m < 0) if math.isfinite(m) else math.nan for m in mean])
            for g, (d, drop) in series.items():
                d, drop = [x for x in d if math.isfinite(x)], [x for x in drop if math.isfinite(x)]
                if d:
                    cols = per[(c.method, receiver, g)]
                    cols["d"].append(statistics.fmean(d))
                    cols["d_sd"].append(statistics.pstdev(d))
                    cols["drop"].append(statistics.fmean(drop) if drop else math.nan)
    table = []
    for (method, receiver, group), cols in sorted(per.items(), key=lambda kv: (method_order(kv[0][0]), kv[0][1],
                                                                              kv[0][2] != "all", kv[0][2])):
        row = {"method": method, "participant": receiver, "group": group, "seeds": len(cols["d"])}
        row.update({k: statistics.fmean(cols[k]) for k in ("d", "d_sd", "drop")})
        row["d_min"], row["d_max"] = min(cols["d"]), max(cols["d"])
        table.append(row)
    return table


def unchosen_table(cells: Sequence[Cell], out: Path, metric: Metric = GREEDY) -> list[dict]:
    """Per cell × receiver of ``source-adapt = shadow`` whose final evaluation also scored the model its
    last check did not choose (``unchosen_eval_prompts.jsonl.gz``; cells run before it give no row):
    the last check (``kept``: 1 where the model stayed, ``val_d`` / ``val_se``: d̄ and se of its paired
    sampled pass@1 on the validation batch, model − shadow), the two ends' final held-out ID accuracy
    in ``metric`` (``with_peers``: the model as it learned with its peers, ``shadow``: its alone-
    trained copy), their per-prompt paired difference with − shadow (``heldout_d`` and its standard
    error ``heldout_se``: the same prompts and sampling seeds), ``right`` (1 where the check chose the
    end that holds out better, 0 where it chose the worse one; NaN where both tie), and the
    alone cell's of the same seed (``alone``; NaN without one)."""
    other = _final_vectors(cells, out, metric, "unchosen_eval_prompts.jsonl.gz")
    ran = {(m, s) for m, _, s in other}
    shadowed = [c for c in cells if (c.method, c.seed) in ran]
    chosen = _final_vectors([*shadowed, *(c for c in cells if c.method == BASELINE)], out, metric)
    table = []
    for c in shadowed:
        rows = [r for r in participant_rows(cell_rows(out / "cells" / c.name), "train") if "guard/kept_peers" in r]
        for p in sorted(p for m, p, s in other if (m, s) == (c.method, c.seed)):
            last = max((r for r in rows if r["participant"] == p), key=lambda r: int(r["round"]))
            kept = num(last["guard/kept_peers"]) == 1.0
            model, unchosen = chosen[(c.method, p, c.seed)]["id"], other[(c.method, p, c.seed)]["id"]
            if list(model[0]) != list(unchosen[0]):
                raise ValueError(f"cell {c.name}: {p}'s two final evaluations scored other prompts")
            with_peers, shadow = (model[1], unchosen[1]) if kept else (unchosen[1], model[1])
            d = np.asarray(with_peers, float) - np.asarray(shadow, float)
            base = chosen.get((BASELINE, p, c.seed), {}).get("id")
            table.append({"method": c.method, "participant": p, "seed": c.seed, "kept": float(kept),
                          "val_d": num(last.get("guard/diff_mean")), "val_se": num(last.get("guard/diff_se")),
                          "with_peers": float(np.mean(with_peers)), "shadow": float(np.mean(shadow)),
                          "heldout_d": float(d.mean()),
                          "heldout_se": float(d.std(ddof=1) / math.sqrt(len(d))) if len(d) > 1 else math.nan,
                          "right": math.nan if abs(d.mean()) < 1e-12 else float((d.mean() > 0) == kept),
                          "alone": float(np.mean(base[1])) if base is not None else math.nan})
    return sorted(table, key=lambda r: (method_order(r["method"]), r["participant"], r["seed"]))


def _final_vectors(cells: Sequence[Cell], out: Path, metric: Metric = GREEDY,
                   records: str = "eval_prompts.jsonl.gz") -> dict[tuple[str, str, int], dict]:
    """(method, participant, seed) -> set key -> (ids, per-prompt values of ``metric``) of every
    finished cell (from its ``records``: ``prompt_records``'s ``name``; a cell without them gives none)."""
    got = {}
    for c in cells:
        if (out / "cells" / c.name / "done.json").exists():
            try:
                vectors = prompt_vectors(prompt_records(out / "cells" / c.name, records), metric=metric)
            except MissingMetric as e:
                raise MissingMetric(f"cell {c.name}: {e}") from None
            for p, sets in vectors.items():
                got[(c.method, p, c.seed)] = sets
    return got


def comparisons(methods: Sequence[str]) -> list[tuple[str, str]]:
    """(A, B) pairs read as A − B: the reference F-TIS against every other method of its grouping,
    every other method against training alone, and the horizontal F-TIS against the vertical one."""
    have, pairs = set(methods), []
    for suffix in ("", "/h"):
        ref, base = REFERENCE + suffix, BASELINE + suffix
        for m in methods:
            if m.endswith("/h") == bool(suffix) and m != ref and ref in have:
                pairs.append((ref, m))
        for m in methods:
            if m.endswith("/h") == bool(suffix) and m not in (ref, base) and base in have:
                pairs.append((m, base))
    if REFERENCE in have and REFERENCE + "/h" in have:
        pairs.append((REFERENCE + "/h", REFERENCE))
    return list(dict.fromkeys(pairs))


def _paired_sets(a: dict[int, dict], b: dict[int, dict], name: str) -> list[tuple[str, np.ndarray, np.ndarray, dict]]:
    """The paired per-prompt comparison of two sides given per seed as set key -> (ids, values): for each
    set key both sides have in every seed they share (``id`` and ``ood`` first), when every seed of both
    sides holds the same prompts, (key, A (S,N), B (S,N), ``paired_interval(A - B, name|key)``)."""
    from ftis_fed.grid.stats import paired_interval

    seeds = sorted(set(a) & set(b))
    if not seeds:
        return []
    keys = sorted(set.intersection(*[set(a[s]) & set(b[s]) for s in seeds]), key=lambda k: (k not in ("id", "ood"), k))
    out = []
    for key in keys:
        ids = a[seeds[0]][key][0]
        if any(side[s][key][0] != ids for side in (a, b) for s in seeds):
            continue                                   # not the same prompts: not paired
        A = np.stack([a[s][key][1] for s in seeds])                                           # (S,N)
        B = np.stack([b[s][key][1] for s in seeds])                                           # (S,N)
        out.append((key, A, B, paired_interval(A - B, f"{name}|{key}")))
    return out


def _by_seed(vec: dict[tuple[str, str, int], dict], method: str, participant: str) -> dict[int, dict]:
    return {s: sets for (m, p, s), sets in vec.items() if m == method and p == participant}


def paired_prompt_table(cells: Sequence[Cell], out: Path, metric: Metric = GREEDY,
                        pairs: Sequence[tuple[str, str]] | None = None) -> list[dict]:
    """One row per comparison (``pairs``, default ``comparisons``) × participant × set key: the paired per-prompt
    difference A − B of ``metric``'s values over the seeds both finished, with the pigeonhole-bootstrap
    and paired-t 95 % intervals (``grid.stats.paired_interval``). Prompts are aligned by task id."""
    vec = _final_vectors(cells, out, metric)
    methods = sorted({m for m, _, _ in vec}, key=method_order)
    participants = sorted({p for _, p, _ in vec})
    rows = []
    for a, b in (comparisons(methods) if pairs is None else pairs):
        for p in participants:
            for key, A, B, st in _paired_sets(_by_seed(vec, a, p), _by_seed(vec, b, p), f"{a}|{b}|{p}"):
                rows.append({"a": a, "b": b, "participant": p, "set": key, "a_acc": float(A.mean()),
                             "b_acc": float(B.mean()), **st,
                             "a_wins": int(((A - B).mean(axis=1) > 0).sum()),
                             "b_wins": int(((A - B).mean(axis=1) < 0).sum())})
    return rows


def gain_table(cells: Sequence[Cell], out: Path, metric: Metric = GREEDY) -> list[dict]:
    """One row per method × participant × set key (``id``, ``ood``, ``id:<family>``): what training did,
    final − before training, as the paired per-prompt difference of ``metric``'s values between a cell's
    last evaluation and its own evaluation before round 1 (a cell without one: the grid's shared one,
    ``records.shared_start``: the same models before training; same prompts),
    over the seeds with both, with the pigeonhole-bootstrap and t 95 % intervals
    (``grid.stats.paired_interval``). The calibration's table: a method learns where the lower bound of
    its ID gain is above 0."""
    final = _final_vectors(cells, out, metric)

    def starts(name: str) -> dict[str, dict]:                     # OOD: pooled only
        return {p: {k: v for k, v in sets.items() if not k.startswith("ood:")}
                for p, sets in prompt_vectors(prompt_records(out / "cells" / name), 0, metric=metric).items()}

    own = {c: starts(c.name) for c in sorted(cells, key=lambda c: c.name)
           if (out / "cells" / c.name / "done.json").exists()}
    start = {(c.method, p, c.seed): sets for c, by_p in own.items() for p, sets in by_p.items()}
    first = shared_start(out, [c.name for c in cells])
    shared = next((by_p for c, by_p in own.items() if c.name == first), {})
    for m, p, s in final:
        if (m, p, s) not in start and p in shared:
            start[(m, p, s)] = shared[p]
    rows = []
    for m in sorted({k[0] for k in final}, key=method_order):
        for p in sorted({k[1] for k in final if k[0] == m}):
            for key, F, B, st in _paired_sets(_by_seed(final, m, p), _by_seed(start, m, p), f"gain|{m}|{p}"):
                rows.append({"method": m, "participant": p, "set": key, "start": float(B.mean()),
                             "final": float(F.mean()), **st, "gained": int(((F - B).mean(axis=1) > 0).sum())})
    return rows


def start_table(cells: Sequence[Cell], out: Path) -> list[dict]:
    """Before training (the grid's shared evaluation before round 1, ``records.shared_start``), per
    participant × set (``id``, ``id:<family>``, ``ood``, ``ood:<family>``): prompts, greedy pass@1, and
    where the records carry ``k`` sampled completions per prompt, sampled pass@1 (solved / k) and pass@k
    (the share of prompts with a solved sample). RL can sharpen pass@k into pass@1 only where pass@k is
    well above pass@1: the calibration's headroom."""
    from ftis_fed.grid.metric import SAMPLED

    name = shared_start(out, [c.name for c in cells])
    recs = [r for r in prompt_records(out / "cells" / name) if int(r["round"]) == 0] if name else []
    if not recs:
        return []
    greedy = prompt_vectors(recs, 0, GREEDY)
    sampled = prompt_vectors(recs, 0, SAMPLED) if all(r.get("k") and r.get("sampled") is not None
                                                    for r in recs) else {}
    ks = {int(r["k"]) for r in recs if r.get("k")}
    rows = []
    for p, sets in greedy.items():
        for key, (ids, ok) in sets.items():
            row = {"participant": p, "set": key, "prompts": len(ids), "greedy": float(ok.mean()),
                   "sampled": math.nan, "pass_at_k": math.nan, "k": max(ks) if len(ks) == 1 else math.nan}
            if p in sampled and key in sampled[p]:
                v = sampled[p][key][1]
                row.update(sampled=float(v.mean()), pass_at_k=float((v > 0).mean()))
            rows.append(row)
    return rows


def family_table(cells: Sequence[Cell], out: Path, metric: Metric = GREEDY) -> list[dict]:
    """Final accuracy (``metric``) per method × participant × ID / OOD family: mean ± sd over seeds
    (from the per-prompt records)."""
    vec = _final_vectors(cells, out, metric)
    acc: dict[tuple[str, str, str], list[float]] = defaultdict(list)
    for (m, p, _), sets in sorted(vec.items()):
        for key, (_, ok) in sets.items():
            if ":" in key:
                acc[(m, p, key)].append(float(ok.mean()))
    rows = []
    for (m, p, key), vs in sorted(acc.items(), key=lambda kv: (method_order(kv[0][0]), kv[0][1], kv[0][2])):
        mean, sd = _mean_sd(vs)
        rows.append({"method": m, "participant": p, "set": key, "seeds": len(vs), "mean": mean, "sd": sd})
    return rows


def stronger_participant(initial: dict[str, dict], metric: Metric = GREEDY) -> str | None:
    """The participant with the highest ID accuracy (``metric``) before training; None when none was
    measured or the best two tie (no stronger partner)."""
    key = metric.key("id")
    scored = sorted(((-num(r.get(key)), p) for p, r in initial.items() if math.isfinite(num(r.get(key)))))
    if not scored or (len(scored) > 1 and scored[0][0] == scored[1][0]):
        return None
    return scored[0][1]


