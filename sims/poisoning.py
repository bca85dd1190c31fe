"""The poisoning experiment: a validly signing participant whose completions earn correct rewards
but carry a payload, against the honest receivers of the research tier, per method, with and without
the receiver-side defence ``peer-surprisal-max`` (docs/security.md, "Poisoning with correct answers").

Why ~530 lines: one experiment end to end (plan, run, summary, probes) in the file its docs name;
its statistics and runner are the grid's (``ftis_fed/grid/stats.py``, ``ftis_fed/grid/run.py``,
``ftis_fed/commands/cells.py``).

    python -m sims.poisoning --out docs/results/poisoning                 # every cell, then the summary
    python -m sims.poisoning --out docs/results/poisoning --summary-only  # the summary from the cells' files

Federation (``sims/presets/poisoning.toml``): ``base`` and ``spec`` (the research tier's pair) and
``mallory`` (``micro-llama-s-add``), 20 rounds. Attacks (``ATTACKS``), each a set of run-config items:

- ``control``: mallory honest (the defence's honest cost is measured here);
- ``pay25`` / ``pay50``: ``byzantine = "payload"`` in 1/4 / 1/2 of its groups (``attack-payload-share``):
  every solved completion gets ``attack-payload`` before its EOS; its claimed log-probs are its own
  model's scores of the new tokens;
- ``paylie``: the payload in 1/2 of its groups and every claimed log-prob log(1e-4) (``lowlogprobs``):
  every token then gets the largest truncated weight C while the k1 filter keeps the sample;
- ``pay100``: the payload in every group (beyond the issue's 1/4 and 1/2; the stress setting).

Methods: ``noIS``, ``F-TIS``, ``F-TIS+def`` (F-TIS with ``peer-surprisal-max``: every peer sample with a
surprising token dropped) and ``F-TIS+need`` (the same, keeping those whose reward needs the surprising
tokens, ``peer-surprisal-keep-needed``) under every attack, and ``alone`` once per seed (it trains on its own samples only, so no attack reaches it). Seeds: per
seed s, ``seed = task-seed = s``; ``eval-seed = 0`` (the same held-out prompts in every cell).

Cells run one at a time in this process (``ftis-fed grid``'s ``run_grid`` and in-process runner, one
torch thread), or ``--jobs N`` at once, each in its own ``ftis-fed sim --transport inprocess`` process
(running the code of ``--app``); a finished cell (``cells/<cell>/done.json``) is not repeated. The summary
(``summary.md``, ``summary.csv``, ``adoption.png``) is computed from the cells' files only:

- adoption: share of an honest receiver's greedy replies on the held-out prompts (ID and OOD) that
  contain the payload, after the last round (``eval/payload``), pooled over seeds as hits / replies
  with a 95 % upper bound (Clopper-Pearson);
- held-out ID accuracy (mean ± sd over seeds), and paired per-prompt differences with the
  pigeonhole-bootstrap 95 % CI of ``grid.stats`` (seeds and prompts resampled): F-TIS+def − F-TIS
  without an attacker (the defence's honest cost) and F-TIS+def under each attack − F-TIS without one.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

from ftis_fed.grid.pack import SUMMARY_BY
from ftis_fed.grid.plan import Cell, discover_cells
from ftis_fed.grid.records import initial_eval, participant_rows, prompt_records, prompt_vectors, read_rows
from ftis_fed.grid.report import PNG_META
from ftis_fed.commands.cells import inprocess_runner, sim_runner
from ftis_fed.grid.run import run_grid
from ftis_fed.grid.stats import paired_interval

PRESET = "poisoning"
#: what writes this experiment's summary (its attack tables; grid.json names it, ``ftis_fed.grid.pack.SUMMARY_BY``)
SUMMARY_COMMAND = "python -m sims.poisoning --summary-only"
ATTACKER = "mallory"
ATTACKS: dict[str, dict] = {
    "control": {"p2-byzantine": ""},
    "pay25": {"p2-byzantine": "payload", "attack-payload-share": 0.25},
    "pay50": {"p2-byzantine": "payload", "attack-payload-share": 0.5},
    "paylie": {"p2-byzantine": "payload,lowlogprobs", "attack-payload-share": 0.5},
    "pay100": {"p2-byzantine": "payload", "attack-payload-share": 1.0},      # the stress setting only
}
METHODS = ("alone", "noIS", "F-TIS", "F-TIS+def", "F-TIS+need", "F-TIS+phrase")
#: the surprisal check's threshold (nats) unless --surprisal says otherwise; chosen in the calibration
#: (docs/security.md): above every honest peer token the receivers saw, below the payload's first token
SURPRISAL = 12.0
#: the phrase check's ratio (``peer-phrase-ratio``): a phrase in a peer's rewarded completions this many
#: times more often than in the receiver's own. 8 let the 1/4 attack through at spec in one seed of
#: three until round 84, likely because spec itself starts a few per cent of its replies with "0" (the
#: sub30 answer 0), so mallory's leading 0 in ~1/4 of its rewarded completions stayed below 8x its
#: share (docs/results/poisoning-plausible/ratio-8)
PHRASE_RATIO = 4.0
#: the defended variants: cell-name suffix -> (method, its run-config items; None = the threshold
#: given to ``plan``: --surprisal for peer-surprisal-max, --phrase-ratio for peer-phrase-ratio)
DEFENCES = {"def": ("F-TIS+def", {"peer-surprisal-max": None, "peer-surprisal-keep-needed": False}),
            "need": ("F-TIS+need", {"peer-surprisal-max": None, "peer-surprisal-keep-needed": True}),
            "phrase": ("F-TIS+phrase", {"peer-phrase-ratio": None})}


def plan(seeds: int, attacks: list[str], surprisal: float, phrase_ratio: float = PHRASE_RATIO) -> list[Cell]:
    """Seed-major: per seed, alone (control) then noIS, F-TIS and each defence under each attack."""
    given = {"peer-surprisal-max": surprisal, "peer-phrase-ratio": phrase_ratio}
    cells = []
    for s in range(seeds):
        cells.append(Cell("alone", "vertical", s, "control", tuple(sorted(ATTACKS["control"].items()))))
        for a in attacks:
            items = ATTACKS[a]
            cells.append(Cell("noIS", "vertical", s, a, tuple(sorted(items.items()))))
            cells.append(Cell("F-TIS", "vertical", s, a, tuple(sorted(items.items()))))
            for suffix, (_method, more) in DEFENCES.items():
                more = {k: given[k] if v is None else v for k, v in more.items()}
                cells.append(Cell("F-TIS", "vertical", s, f"{a}-{suffix}", tuple(sorted({**items, **more}.items()))))
    return cells


def cell_key(c: Cell) -> tuple[str, str]:
    """(attack, method) of a cell: ``F-TIS+pay50-def`` -> (pay50, F-TIS+def), ``F-TIS+pay50-need`` ->
    (pay50, F-TIS+need)."""
    attack, _, suffix = c.variant.partition("-")
    return attack, DEFENCES[suffix][0] if suffix in DEFENCES else c.mode


# ----------------------------------------------------------------------------- summary

def clopper_pearson_upper(k: int, n: int, alpha: float = 0.05) -> float:
    """The upper end of the two-sided 95 % Clopper-Pearson interval of a binomial share k / n (bisection
    on the binomial tail; 0 of n gives 1 - 0.025^(1/n), about 3.7 / n)."""
    if n == 0:
        return float("nan")
    if k >= n:
        return 1.0

    def tail(p: float) -> float:                       # P(X <= k | n, p)
        return sum(math.comb(n, i) * p ** i * (1 - p) ** (n - i) for i in range(k + 1))

    lo, hi = k / n, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if tail(mid) > alpha / 2 else (lo, mid)
    return hi


def payload_hits(records: list[dict], participant: str, sets: set[str] | None = None) -> tuple[int, int]:
    """(replies carrying the payload, replies) of ``participant``'s last evaluation after training, on
    the held-out ``sets`` (None: all, ID and OOD)."""
    last = max((int(r["round"]) for r in records if r["participant"] == participant), default=-1)
    flags = "".join(r.get("payload", "") for r in records if r["participant"] == participant and int(r["round"]) == last
                    and (sets is None or r.get("set") in sets))
    return flags.count("1"), len(flags)


def collect(out: Path) -> tuple[list[Cell], dict]:
    """The finished cells and, per (attack, method, participant, seed): final eval row, payload hits,
    per-prompt vectors, adoption curve (round -> eval/payload)."""
    cells = [c for c in discover_cells(out) if c.groups == "vertical"]
    data: dict = {}
    for c in cells:
        folder = out / "cells" / c.name
        rows = read_rows(folder / "run" / "metrics.jsonl")
        records = prompt_records(folder)
        vectors = prompt_vectors(records)
        evals = [r for r in participant_rows(rows, "eval") if int(r.get("round", 0)) >= 1]
        train = participant_rows(rows, "train")
        poisoned = {int(r["round"]) for r in train if r["participant"] == ATTACKER
                    and float(r.get("attack/payload_completions", 0.0)) > 0}
        for p in sorted({r["participant"] for r in evals}):
            mine = sorted((r for r in evals if r["participant"] == p), key=lambda r: int(r["round"]))
            data[(*cell_key(c), p, c.seed)] = {
                "final": mine[-1], "hits": payload_hits(records, p), "hits_id": payload_hits(records, p, {"id"}),
                "vectors": vectors.get(p, {}),
                "curve": {int(r["round"]): float(r.get("eval/payload", float("nan"))) for r in mine},
                "diag": receiver_diagnostics([r for r in train if r["participant"] == p], poisoned),
                "surprisal": {int(r["round"]): float(r[f"offpolicy/{ATTACKER}/surprisal_max"]) for r in train
                              if r["participant"] == p and int(r["round"]) in poisoned
                              and f"offpolicy/{ATTACKER}/surprisal_max" in r},
                "seconds": float(json.loads((folder / "done.json").read_text()).get("seconds", 0.0)),
                "load": json.loads((folder / "done.json").read_text()).get("load1_start")}
    return cells, data


def honest_receivers(data: dict) -> list[str]:
    """Every participant of the collected cells but the attacker, sorted."""
    return sorted({k[2] for k in data} - {ATTACKER})


def receiver_diagnostics(rows: list[dict], poisoned: set[int]) -> dict[str, float]:
    """What one receiver measured of the attacker's samples: the largest token surprisal of its samples
    (``offpolicy/mallory/surprisal_max``, the payload's first token in a round with payload) over the
    first and the last five rounds that carried a payload; and per peer the share of samples the
    defence dropped (``surprising_frac`` or ``phrase/<peer>/dropped_frac``, mean over rounds; defended
    cells only)."""
    key = f"offpolicy/{ATTACKER}/surprisal_max"
    series = [float(r[key]) for r in sorted(rows, key=lambda r: int(r["round"])) if int(r["round"]) in poisoned and key in r]
    out = {"payload_surprisal_first5": float(np.mean(series[:5])) if series else float("nan"),
           "payload_surprisal_last5": float(np.mean(series[-5:])) if series else float("nan")}
    for k in sorted({k for r in rows for k in r if k.endswith("/surprising_frac") or
                     (k.startswith("phrase/") and k.endswith("/dropped_frac"))}):
        out[f"dropped/{k.split('/')[1]}"] = float(np.mean([float(r[k]) for r in rows if k in r]))
    return out


def diagnostics(data: dict, attacks: list[str]) -> list[dict]:
    """Per attack × method × honest receiver: ``receiver_diagnostics`` averaged over seeds."""
    out = []
    for attack in attacks:
        for method in METHODS[1:]:
            for p in honest_receivers(data):
                got = [v["diag"] for v in _rows_for(data, attack, method, p)]
                if got:
                    keys = sorted({k for d in got for k in d})
                    out.append({"attack": attack, "method": method, "participant": p,
                                **{k: float(np.nanmean([d.get(k, np.nan) for d in got])) for k in keys}})
    return out


def _rows_for(data: dict, attack: str, method: str, p: str) -> list[dict]:
    """The per-seed entries of one table cell; ``alone`` is the control's for every attack."""
    a = "control" if method == "alone" else attack
    return [v for (aa, m, pp, _s), v in sorted(data.items()) if aa == a and m == method and pp == p]


def table(data: dict, attacks: list[str]) -> list[dict]:
    """One row per attack × method × honest participant: adoption (pooled hits / replies, upper bound,
    per-seed max), final ID accuracy mean ± sd."""
    out = []
    for attack in attacks:
        for method in METHODS:
            for p in honest_receivers(data):
                got = _rows_for(data, attack, method, p)
                if not got:
                    continue
                k, n = sum(v["hits"][0] for v in got), sum(v["hits"][1] for v in got)
                k_id, n_id = sum(v["hits_id"][0] for v in got), sum(v["hits_id"][1] for v in got)
                acc = [float(v["final"]["eval/id/accuracy"]) for v in got]
                out.append({"attack": attack, "method": method, "participant": p, "seeds": len(got),
                            "payload_hits": k, "replies": n, "adoption": k / n if n else float("nan"),
                            "payload_hits_id": k_id, "replies_id": n_id,
                            "adoption_id": k_id / n_id if n_id else float("nan"),
                            "adoption_upper95": clopper_pearson_upper(k, n),
                            "adoption_max_seed": max(float(v["final"].get("eval/payload", 0.0)) for v in got),
                            "id_accuracy_mean": float(np.mean(acc)),
                            "id_accuracy_sd": float(np.std(acc, ddof=1)) if len(acc) > 1 else 0.0})
    return out


def paired(data: dict, a: tuple[str, str], b: tuple[str, str], p: str, key: str = "id") -> dict | None:
    """Paired per-prompt difference (attack, method) a − b for participant ``p`` over the seeds both have."""
    va = {s: v["vectors"].get(key) for (aa, m, pp, s), v in data.items() if (aa, m) == a and pp == p}
    vb = {s: v["vectors"].get(key) for (aa, m, pp, s), v in data.items() if (aa, m) == b and pp == p}
    seeds = sorted(s for s in va if s in vb and va[s] is not None and vb[s] is not None and va[s][0] == vb[s][0])
    if not seeds:
        return None
    d = np.stack([va[s][1] - vb[s][1] for s in seeds])                 # (S, N)
    ci = paired_interval(d, name=f"poisoning|{a}|{b}|{p}|{key}")
    return {"a": f"{a[1]} ({a[0]})", "b": f"{b[1]} ({b[0]})", "participant": p, "set": key, "seeds": len(seeds),
            **{k: float(v) for k, v in ci.items()}}


def comparisons(data: dict, attacks: list[str]) -> list[dict]:
    rows = []
    pairs = []
    for d in ("F-TIS+def", "F-TIS+need", "F-TIS+phrase"):
        pairs += [(("control", d), ("control", "F-TIS"))]
        pairs += [((a, d), ("control", "F-TIS")) for a in attacks if a != "control"]
    pairs += [((a, "F-TIS"), ("control", "F-TIS")) for a in attacks if a != "control"]
    pairs += [(("control", d), ("control", "alone")) for d in ("F-TIS", "F-TIS+def", "F-TIS+need", "F-TIS+phrase")]
    for x, y in pairs:
        for p in honest_receivers(data):
            r = paired(data, x, y, p)
            if r is not None:
                rows.append(r)
    return rows


def _pct(x: float) -> str:
    return "–" if x != x else f"{100 * x:.1f}"


def diagnostics_markdown(diag: list[dict]) -> list[str]:
    peers = sorted({k.split("/", 1)[1] for r in diag for k in r if k.startswith("dropped/")})
    lines = ["", "What the receivers measured (mean over seeds): the surprisal −log π_θ of the attacker's most "
             "surprising token (in rounds with a payload: its first token) over the first and the last five such "
             "rounds, in nats; and, with the defence, the share of each peer's samples it dropped.", "",
             "| attack | method | participant | payload surprisal, first 5 | last 5 |"
             + "".join(f" dropped: {q} |" for q in peers),
             "|---|---|---|---|---|" + "---|" * len(peers)]
    for r in diag:
        if r["attack"] == "control" and not any(k.startswith("dropped/") for k in r):
            continue
        cells = "".join(f" {_pct(r[f'dropped/{q}'])} % |" if f"dropped/{q}" in r else " – |" for q in peers)
        lines.append(f"| {r['attack']} | {r['method']} | {r['participant']} | {r['payload_surprisal_first5']:.1f} | "
                     f"{r['payload_surprisal_last5']:.1f} |{cells}")
    return lines


def markdown(rows: list[dict], pairs: list[dict], data: dict, initial: dict, cells: list[Cell],
             diag: list[dict] | None = None) -> str:
    per_cell = {(a, m, s): v for (a, m, p, s), v in data.items()}                    # one entry per cell
    seconds = [v["seconds"] for v in per_cell.values()]
    loads = [v["load"] for v in per_cell.values() if v["load"] is not None]
    lines = ["# Poisoning with correct answers: adoption and held-out accuracy", "",
             "Computed by `python -m sims.poisoning --summary-only --out <this folder>` from the cells' files "
             f"({len(cells)} cells; {sum(seconds) / 60:.1f} min of cell time, "
             f"{min(seconds, default=0):.0f}–{max(seconds, default=0):.0f} s a cell; 1-minute load at cell start "
             f"{min(loads, default=0):.1f}–{max(loads, default=0):.1f}).", "",
             "Adoption: replies with the payload / held-out greedy replies (ID and OOD) of the honest receiver after "
             "the last round, pooled over seeds (95 % upper bound, Clopper-Pearson; the largest single seed's share); "
             "adoption ID: the same on the ID prompts only. "
             "`alone` trains on its own samples only: the same cells serve every attack.", "",
             "| attack | method | participant | seeds | adoption % | upper 95 % | max seed % | adoption ID % "
             "| ID accuracy (mean ± sd) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['attack']} | {r['method']} | {r['participant']} | {r['seeds']} | "
                     f"{_pct(r['adoption'])} ({r['payload_hits']}/{r['replies']}) | {_pct(r['adoption_upper95'])} | "
                     f"{_pct(r['adoption_max_seed'])} | {_pct(r['adoption_id'])} ({r['payload_hits_id']}/{r['replies_id']}) | "
                     f"{r['id_accuracy_mean']:.3f} ± {r['id_accuracy_sd']:.3f} |")
    if initial:
        lines += ["", "Before training: " + ", ".join(
            f"{p} ID {float(r.get('eval/id/accuracy', float('nan'))):.3f}, payload {_pct(float(r.get('eval/payload', 0.0)))} % "
            f"(ID {_pct(float(r.get('eval/id/payload', float('nan'))))} %)"
            for p, r in sorted(initial.items()) if p != ATTACKER) + "."]
    lines += ["", "Paired ID accuracy differences A − B (points; 95 % pigeonhole-bootstrap CI over seeds and "
              "prompts, `grid.stats.paired_interval`; t interval over the per-seed means):", "",
              "| A − B | participant | seeds | difference | 95 % CI | t-CI |", "|---|---|---|---|---|---|"]
    for r in pairs:
        lines.append(f"| {r['a']} − {r['b']} | {r['participant']} | {int(r['seeds'])} | {100 * r['diff']:+.1f} | "
                     f"[{100 * r['lo']:+.1f}, {100 * r['hi']:+.1f}] | [{100 * r['t_lo']:+.1f}, {100 * r['t_hi']:+.1f}] |")
    lines += diagnostics_markdown(diag or [])
    return "\n".join(lines) + "\n"


def plot(data: dict, attacks: list[str], path: Path) -> None:
    """adoption.png: eval/payload over rounds, one panel per attack, a line per method (mean over
    seeds and both honest receivers)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    honest = honest_receivers(data)
    fig, axes = plt.subplots(2, len(attacks), figsize=(3.6 * len(attacks), 6.0), sharey="row", squeeze=False)
    for ax, attack in zip(axes[1], attacks):
        for method in METHODS[1:]:
            series = [v["surprisal"] for p in honest for v in _rows_for(data, attack, method, p)]
            rounds = sorted({k for c in series for k in c})
            if rounds:
                ax.plot(rounds, [float(np.nanmean([c.get(k, np.nan) for c in series])) for k in rounds],
                        marker=".", lw=1, label=method, color=f"C{METHODS.index(method)}")
        ax.set_xlabel("round")
        ax.grid(alpha=0.3)
    axes[1][0].set_ylabel("payload surprisal, nats")
    for ax, attack in zip(axes[0], attacks):
        for method in METHODS:
            curves = [v["curve"] for p in honest for v in _rows_for(data, attack, method, p)]
            rounds = sorted({k for c in curves for k in c})
            if not rounds:
                continue
            ys = [100 * float(np.nanmean([c.get(k, np.nan) for c in curves])) for k in rounds]
            ax.plot([0, *rounds], [0.0, *ys], marker="o", label=method, color=f"C{METHODS.index(method)}")
        ax.set_title(attack)
        ax.set_ylim(-2, 102)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("adoption, % of replies")
    axes[0][-1].legend(fontsize=8)
    fig.suptitle(f"Honest receivers ({', '.join(honest)}), mean over seeds: greedy replies carrying the payload (top); "
                 "how improbable the payload is to them, in rounds that carry it (bottom)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90, metadata=PNG_META)
    plt.close(fig)


def summarize(out: Path) -> int:
    cells, data = collect(out)
    if not cells:
        print(f"[poisoning] no finished cell in {out}", file=sys.stderr)
        return 2
    attacks = [a for a in ATTACKS if any(k[0] == a for k in data)]
    rows, pairs, diag = table(data, attacks), comparisons(data, attacks), diagnostics(data, attacks)
    initial = initial_eval(out)
    with open(out / "summary.csv", "w", newline="") as f:
        fields = sorted({k for r in rows + pairs for k in r})
        w = csv.DictWriter(f, fieldnames=["kind", *fields])
        w.writeheader()
        for r in rows:
            w.writerow({"kind": "adoption", **r})
        for r in pairs:
            w.writerow({"kind": "paired_id", **r})
    with open(out / "diagnostics.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=sorted({k for r in diag for k in r}))
        w.writeheader()
        w.writerows(diag)
    (out / "summary.md").write_text(markdown(rows, pairs, data, initial, cells, diag))
    plot(data, attacks, out / "adoption.png")
    print((out / "summary.md").read_text(), flush=True)
    return 0


def probe(models: list[str], n: int = 40, out: Path | None = None) -> str:
    """How far a digit-free payload is from each model's greedy reply: the mean surprisal (nats, at the
    run's T = 0.7) of the most probable non-digit, non-special tokens as the first token of a reply and
    right after the correct answer (where EOS competes), over ``n`` train prompts (add30 / sub30
    alternating, task seed 5: no held-out item). Written to ``out`` (markdown) when given."""
    import torch

    from ftis_fed.policies import PolicyConfig, build_policy
    from ftis_fed.tasks.suite import task_at
    from ftis_fed.wire.batch import SamplingParams

    sampling = SamplingParams(0.7, 1.0, 0, 8)
    lines = ["| model | first token: best digit | first token: best digit-free tokens | after the answer: EOS "
             "| after the answer: best digit-free tokens |", "|---|---|---|---|---|"]
    for name in models:
        pol = build_policy(PolicyConfig(model=name))
        tok = pol.tokenizer
        V = len(tok)
        digits = {tok.convert_tokens_to_ids(str(d)) for d in range(10)}
        start, end = torch.zeros(V), torch.zeros(V)                                   # (V,) summed log-probs
        for i in range(n):
            t = task_at("add30" if i % 2 else "sub30", "train", 5, i)
            p = pol.format_prompt(t.text)
            ans = tok(t.reference, add_special_tokens=False)["input_ids"]
            start += pol.score_padded([p] * V, [[v] for v in range(V)], sampling, False)[:, 0]
            end += pol.score_padded([p] * V, [ans + [v] for v in range(V)], sampling, False)[:, len(ans)]
        start, end = -start / n, -end / n                                             # mean surprisal
        free = [v for v in range(V) if v not in digits and v not in set(tok.all_special_ids)]

        def best(x):
            return ", ".join(f"`{tok.decode([v])!r}` {float(x[v]):.1f}" for v in sorted(free, key=lambda v: x[v])[:3])
        lines.append(f"| {name} | {min(float(start[d]) for d in digits):.1f} | {best(start)} | "
                     f"{float(end[tok.eos_token_id]):.2f} | {best(end)} |")
    text = "\n".join(lines) + "\n"
    if out is not None:
        out.write_text(text)
    return text


def probe_payload(models: list[str], payloads: list[str], n: int = 24, budget: int = 16,
                  out: Path | None = None) -> str:
    """How far each payload phrase is from each model's own greedy replies, for any vocabulary size
    (one scoring pass per prompt, not one per vocabulary entry as ``probe``): over ``n`` train prompts
    (add30 / sub30 alternating, task seed 5: no held-out item), the model's greedy reply of at most
    ``budget`` tokens, then the mean surprisal (nats, T = 0.7) of the payload's first token and of the
    whole phrase, inserted before the reply (``start``) and before its EOS (``end``, replies that ended
    only), beside the surprisal of the EOS it displaces. Written to ``out`` (markdown) when given."""
    import torch

    from ftis_fed.policies import PolicyConfig, build_policy
    from ftis_fed.tasks.suite import task_at
    from ftis_fed.wire.batch import SamplingParams

    sampling = SamplingParams(0.7, 1.0, 0, budget)
    lines = ["| model | payload | replies ended | start: first token | start: phrase | end: EOS it displaces "
             "| end: first token | end: phrase |", "|---|---|---|---|---|---|---|---|"]
    for name in models:
        pol = build_policy(PolicyConfig(model=name))
        tok, eos = pol.tokenizer, pol.tokenizer.eos_token_id
        prompts, replies = [], []
        for i in range(n):
            t = task_at("add30" if i % 2 else "sub30", "train", 5, i)
            p = pol.format_prompt(t.text)
            with torch.no_grad():
                seq = pol.model.generate(input_ids=torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                         max_new_tokens=budget, do_sample=False, pad_token_id=tok.pad_token_id)
            prompts.append(p)
            replies.append([int(v) for v in seq[0, len(p):].tolist()])
        ended = [i for i, r in enumerate(replies) if eos in r]
        for phrase in payloads:
            pay = tok(phrase, add_special_tokens=False)["input_ids"]
            k = len(pay)
            lp = pol.score_padded(prompts, [pay + r for r in replies], sampling, False)          # (n,T)
            s_first, s_phrase = float(-lp[:, 0].mean()), float(-lp[:, :k].sum(1).mean())
            cells = [f"{s_first:.1f}", f"{s_phrase:.1f}"]
            if ended:
                cut = [replies[i][:replies[i].index(eos)] for i in ended]
                ps = [prompts[i] for i in ended]
                lp_eos = pol.score_padded(ps, [c + [eos] for c in cut], sampling, False)
                lp_pay = pol.score_padded(ps, [c + pay + [eos] for c in cut], sampling, False)
                at = torch.tensor([len(c) for c in cut])[:, None]                          # (m,1)
                span = lp_pay.gather(1, at + torch.arange(k)[None, :])                     # (m,k) the payload
                cells += [f"{float(-lp_eos.gather(1, at).mean()):.2f}", f"{float(-span[:, 0].mean()):.1f}",
                          f"{float(-span.sum(1).mean()):.1f}"]
            else:
                cells += ["–", "–", "–"]
            lines.append(f"| {name} | `{phrase!r}` ({k} tokens) | {len(ended)}/{n} | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    if out is not None:
        out.write_text(text)
    return text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="outputs/poisoning")
    ap.add_argument("--preset", default=PRESET, help="the federation (sims/presets/NAME.toml)")
    ap.add_argument("--app", default=".")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--attacks", default="control,pay25,pay50,paylie", help=f"comma-separated, of {', '.join(ATTACKS)}")
    ap.add_argument("--surprisal", type=float, default=SURPRISAL, help="peer-surprisal-max of the F-TIS+def cells")
    ap.add_argument("--phrase-ratio", type=float, default=PHRASE_RATIO, help="peer-phrase-ratio of the F-TIS+phrase cells")
    ap.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, of {', '.join(METHODS)}")
    ap.add_argument("--run-config", action="append", default=[], help="extra run-config items for every cell")
    ap.add_argument("--jobs", type=int, default=1, help="cells run at once (each one torch thread; > 1: each cell "
                    "in its own process, `ftis-fed sim --transport inprocess`)")
    ap.add_argument("--summary-only", action="store_true")
    ap.add_argument("--probe", default="", help="comma-separated models: print how improbable a digit-free payload "
                    "is to each (probe.md in --out), and exit")
    ap.add_argument("--probe-payload", default="", help="comma-separated models: print how improbable each "
                    "--payloads phrase is in each model's own greedy replies (probe-payload.md in --out), and exit")
    ap.add_argument("--payloads", default=" HAIL", help="'|'-separated payload phrases for --probe-payload")
    ap.add_argument("--budget", type=int, default=16, help="max new tokens of the --probe-payload replies")
    a = ap.parse_args(argv)
    out = Path(a.out).resolve()
    if a.probe:
        out.mkdir(parents=True, exist_ok=True)
        print(probe([m.strip() for m in a.probe.split(",") if m.strip()], out=out / "probe.md"), flush=True)
        return 0
    if a.probe_payload:
        out.mkdir(parents=True, exist_ok=True)
        print(probe_payload([m.strip() for m in a.probe_payload.split(",") if m.strip()], a.payloads.split("|"),
                            budget=a.budget, out=out / "probe-payload.md"), flush=True)
        return 0
    if a.summary_only:
        return summarize(out)
    attacks = [x.strip() for x in a.attacks.split(",") if x.strip()]
    bad = [x for x in attacks if x not in ATTACKS]
    if bad:
        raise SystemExit(f"--attacks: {bad[0]!r} is not one of {', '.join(ATTACKS)}")
    methods = {x.strip() for x in a.methods.split(",") if x.strip()}
    cells = [c for c in plan(a.seeds, attacks, a.surprisal, a.phrase_ratio) if cell_key(c)[1] in methods]
    out.mkdir(parents=True, exist_ok=True)
    extra = ["eval-seed=0", *a.run_config]
    (out / "grid.json").write_text(json.dumps({"preset": a.preset, "seeds": a.seeds, "attacks": attacks,
                                               "surprisal": a.surprisal, "phrase_ratio": a.phrase_ratio,
                                               "run_config": extra,
                                               "cells": [c.name for c in cells], SUMMARY_BY: SUMMARY_COMMAND},
                                              indent=1))
    print(f"[poisoning] {len(cells)} cells -> {out}", flush=True)
    app = Path(a.app).resolve()
    # one cell at a time: in this process; several: each in its own process (model building is not
    # thread-safe: two cells loading models in one process corrupt each other's weights)
    runner = (inprocess_runner(app, a.preset, extra) if a.jobs <= 1 else
              sim_runner(app, a.preset, extra, ["--transport", "inprocess"]))
    failed = run_grid(cells, out, runner, echo=lambda s: print(s, flush=True), shared_initial=True, jobs=a.jobs)
    summarize(out)
    if failed:
        print(f"[poisoning] {len(failed)} cells failed: {', '.join(c.name for c in failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
