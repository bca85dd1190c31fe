"""The grid's report: ``summary.md`` (verdicts, accuracies, paired differences, diagnostics),
``summary.csv`` / ``cells.csv``, and the figures, written from the finished cells' files alone, for
the grid's metric (``grid.metric``). A greedy summary is what it was before there was a choice, byte
for byte; a sampled one says so in a line under the title, in every CSV row (``metric``) and on the
figures' axes."""

from __future__ import annotations

import csv
import json
import math
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Sequence

import numpy as np

from ftis_fed.grid.claims import BEYOND, REFERENCE, verdicts, with_shadow_variants
from ftis_fed.grid.efficiency import efficiency_table
from ftis_fed.grid.metric import GREEDY, Metric
from ftis_fed.grid.plan import Cell, method_order
from ftis_fed.grid.records import cell_rows, check_starts, check_weights, forget_cell_rows, initial_eval, num
from ftis_fed.grid.tables import (DIAGNOSTICS, _mean_sd, cell_results, check_metric, family_table, filter_table, gain_table,
                                  guard_score_table, guard_table, paired_prompt_table, start_table, stronger_participant,
                                  summarize, train_diagnostics, unchosen_table)
from ftis_fed.knobs import knobs
from ftis_fed.learn.source_weights import SourceAdaptConfig


def _write_csv(path: Path, rows: Sequence[dict]) -> None:
    cols = list(dict.fromkeys(k for r in rows for k in r))
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        w.writerows(rows)


def _pm(mean: float, sd: float) -> str:
    return "–" if not math.isfinite(mean) else f"{mean:.3f} ± {sd:.3f}"


def _ci(r: dict) -> str:
    return f"{100 * r['diff']:+.1f} [{100 * r['lo']:+.1f}, {100 * r['hi']:+.1f}]"


def _k(ks: Sequence[int]) -> str:
    """``k = 8``, or ``k = 4, 8 (per cell)`` when the cells sampled different numbers."""
    return f"k = {ks[0]}" if len(ks) == 1 else f"k = {', '.join(map(str, ks))} (per cell)" if ks else "k = ?"


def metric_line(metric: Metric, ks: Sequence[int]) -> str:
    """The summary's line under the title that says which metric it shows (none for greedy: its first
    line says "greedy pass@1", as before there was a choice)."""
    return (f"Metric (`--metric {metric.name}`, recorded in grid.json): pass@1 at the sampling temperature "
            f"estimated from {_k(ks)} sampled completions per held-out prompt (`eval-samples`): the tables, "
            f"curves, sample efficiency and verdicts read `{metric.key('<set>')}`, and each prompt's value in the "
            "paired differences is its solved completions / k (a value in [0, 1]), so the verdicts apply their "
            "rule to this metric; greedy pass@1 is not shown.")


def _axis(metric: Metric, key: str, ks: Sequence[int]) -> str:
    """A figure's axis label for the metric key ``eval/<set>/<field>``."""
    if metric == GREEDY:
        return key.replace("eval/", "").replace("/accuracy", " pass@1")
    return f"{key.split('/')[1].upper()} {metric.words} ({_k(ks)})"


#: the numeric columns of a ``guard_table`` row (summary.csv's "guard" rows, read back as floats)
GUARD_FIGURES = ("kept", "kept_min", "kept_max", "weight", "weight_min", "weight_max", "weight_zero", "cos", "own_cos")


def guard_figures(r: dict) -> str:
    """A guard row's figures as table cells: kept peers [per-seed range] | weight [range] | weight 0 |
    cos peer | cos own (the summary's guard section and docs/RESULTS.md's guard table); a cosine the
    guard did not measure (``source-adapt-align = false``) reads –."""
    def cos(v: float) -> str:
        return f"{v:+.3f}" if math.isfinite(v) else "–"

    return (f"{100 * r['kept']:.0f} % [{100 * r['kept_min']:.0f}, {100 * r['kept_max']:.0f}] | "
            f"{r['weight']:.2f} [{r['weight_min']:.2f}, {r['weight_max']:.2f}] | "
            f"{100 * r['weight_zero']:.0f} % | {cos(r['cos'])} | {cos(r['own_cos'])}")


#: the numeric columns of a ``guard_score_table`` row (summary.csv's "guard_score" rows)
GUARD_SCORE_FIGURES = ("d", "d_min", "d_max", "d_sd", "drop")
#: their column names, in both tables
GUARD_SCORE_HEADERS = ("mean d ×10⁻³ [per seed]", "sd d ×10⁻³", "drops")


#: how the shadow relates to the alone cell of its seed, by ``source-adapt-shadow-loss``
SHADOW_IS = {"alone": "its shadow is that run, `source-adapt-shadow-loss = alone`",
             "run": "`source-adapt-shadow-loss = run`: its shadow trained with the run's loss on draws of its own, "
                    "not the alone run"}


def _choices(rows: Sequence[dict], losses: dict[str, str] | None = None) -> str:
    """Per method (its variant's knobs change the checks): how often the last check chose the end that
    holds out better, and how far the shadow ends from the alone cell of its seed (``losses``: each
    method's ``source-adapt-shadow-loss``, ``_shadow_losses``; ``unchosen_lines``)."""
    parts = []
    for method in dict.fromkeys(r["method"] for r in rows):
        mine = [r for r in rows if r["method"] == method]
        scored = [r for r in mine if math.isfinite(r["right"])]
        gaps = [100 * (r["shadow"] - r["alone"]) for r in mine if math.isfinite(r["alone"])]
        text = (f"{method}: it chose the better one in {sum(r['right'] == 1.0 for r in scored)} of {len(scored)} "
                f"(ties on the held-out set: {len(mine) - len(scored)})")
        if gaps:
            spread = f", sd {statistics.stdev(gaps):.1f}" if len(gaps) > 1 else ""
            how = SHADOW_IS.get((losses or {}).get(method, ""))
            text += (f"; the shadow − the alone cell of its seed{f' ({how})' if how else ''} "
                     f"{statistics.fmean(gaps):+.1f} points on average{spread}, over {len(gaps)}")
        parts.append(text + ".")
    return " ".join(parts)


def unchosen_lines(rows: Sequence[dict], metric: Metric, losses: dict[str, str] | None = None) -> list[str]:
    """The summary's section on the shadow's last choice, held out (``tables.unchosen_table``; ``losses``:
    ``_choices``)."""
    lines = ["## The shadow's last choice, held out", "",
             "`source-adapt = shadow`: at the last round the check chooses between the model as it learned "
             "with its peers and its alone-trained shadow; the final evaluation scores both (the same "
             f"held-out ID prompts and sampling seeds, {metric.words}). val d: the check's paired difference "
             "with − shadow on the validation batch (± its se, ×10⁻³); held out: the same difference on the "
             "held-out ID set (± se, points); chose: the end the check kept; better: whether it is the one "
             "that holds out better. " + _choices(rows, losses), "",
             "| method | receiver | seed | val d ×10⁻³ | chose | with peers | shadow | held out with − shadow | "
             "better | alone |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        better = "tie" if not math.isfinite(r["right"]) else ("yes" if r["right"] == 1.0 else "no")
        alone = f"{100 * r['alone']:.1f}" if math.isfinite(r["alone"]) else "–"
        lines.append(f"| {r['method']} | {r['participant']} | {r['seed']} | {1e3 * r['val_d']:+.0f} ± "
                     f"{1e3 * r['val_se']:.0f} | {'with peers' if r['kept'] == 1.0 else 'shadow'} | "
                     f"{100 * r['with_peers']:.1f} | {100 * r['shadow']:.1f} | {100 * r['heldout_d']:+.1f} ± "
                     f"{100 * r['heldout_se']:.1f} | {better} | {alone} |")
    return lines + [""]


def guard_score_figures(r: dict) -> str:
    """A guard score row's figures as table cells: mean d [per-seed range] | sd of d (both ×10⁻³: a
    log-likelihood difference per token, or a pass@1 difference) | the share of rounds it dropped the
    peers (– where it cast no vote)."""
    drop = f"{100 * r['drop']:.0f} %" if math.isfinite(r["drop"]) else "–"
    return (f"{1e3 * r['d']:+.2f} [{1e3 * r['d_min']:+.2f}, {1e3 * r['d_max']:+.2f}] | {1e3 * r['d_sd']:.2f} | "
            f"{drop}")


#: the numeric columns of a ``filter_table`` row (summary.csv's "filter" rows, read back as floats)
FILTER_FIGURES = ("kl_p50", "kl_p90", "kl_p99", "kl_max", "kl_ge_g_frac", "filtered_frac")
#: their column names, in both tables
FILTER_HEADERS = ("KL p50", "KL p90", "KL p99", "largest KL", "KL ≥ g", "dropped")


def filter_figures(r: dict) -> str:
    """A filter row's figures as table cells: KL p50 | p90 | p99 | largest KL | KL ≥ g | dropped (the
    summary's filter section and docs/RESULTS.md's filter table)."""
    return (f"{r['kl_p50']:.2f} | {r['kl_p90']:.2f} | {r['kl_p99']:.2f} | {r['kl_max']:.2f} | "
            f"{100 * r['kl_ge_g_frac']:.1f} % | {100 * r['filtered_frac']:.1f} %")


#: the numeric columns of an efficiency row (summary.csv's "efficiency" rows; ``lo``/``hi`` may be NaN)
EFFICIENCY_FIGURES = ("diff", "lo", "hi")


def efficiency_figures(r: dict) -> str:
    """An efficiency row's mean ratio with its 95 % t interval where it has one (one seed: none)."""
    return f"{r['diff']:.2f} [{r['lo']:.2f}, {r['hi']:.2f}]" if math.isfinite(r["lo"]) else f"{r['diff']:.2f}"


def _shadow_losses(configs: dict[Cell, dict]) -> dict[str, str]:
    """Per method whose cells ran ``source-adapt = shadow`` (``learn/shadow.py``; the ``checks`` of their
    config.json, ``_configs``), the loss its shadow trained with (``source-adapt-shadow-loss``; a cell
    recorded before the key: what the code did, its knob's ``before``)."""
    before = next(k.before for k in knobs(SourceAdaptConfig) if k.field == "shadow_loss")
    out: dict[str, set] = {}
    for c, cfg in configs.items():
        adapt = cfg.get("checks", {}).get("source-adapt", {})
        if adapt.get("mode") == "shadow":
            out.setdefault(c.method, set()).add(adapt.get("shadow_loss", before))
    return {m: " and ".join(sorted(out[m])) for m in sorted(out)}


def _shadow_note(shadow: dict[str, str], what: str) -> str:
    """A guard section's sentence on the ``shadow`` methods (``_shadow_losses``' keys), whose rows are per
    check, not per round (nothing without them: the summaries of grids without such cells are as before)."""
    return f" For {', '.join(shadow)} (`source-adapt = shadow`, `learn/shadow.py`) the rows are over {what}." \
        if shadow else ""


def summary_markdown(summary: Sequence[dict], paired: Sequence[dict], results: Sequence[dict],
                     title: str, initial: dict[str, dict] | None = None,
                     diagnostics: Sequence[dict] = (), prompt_paired: Sequence[dict] = (),
                     families: Sequence[dict] = (), verdict_rows: Sequence[dict] = (),
                     efficiency: Sequence[dict] = (), metric: Metric = GREEDY, ks: Sequence[int] = (),
                     gains: Sequence[dict] = (), filters: Sequence[dict] = (), filter_g: float | None = None,
                     starts: Sequence[dict] = (), any_sign: Sequence[str] = (),
                     guards: Sequence[dict] = (), guard_scores: Sequence[dict] = (),
                     shadow: dict[str, str] | None = None, unchosen: Sequence[dict] = ()) -> str:
    from ftis_fed.grid.stats import paired_eval_size

    initial = initial or {}
    ns = sorted({int(r["eval/id/n"]) for r in results if math.isfinite(r["eval/id/n"])})
    secs = {r["cell"]: r.get("cell_seconds", float("nan")) for r in results}
    secs_ok = [v for v in secs.values() if math.isfinite(v)]
    seeds = sorted({r["seed"] for r in results})
    lines = [f"# {title}", "", f"{len({r['cell'] for r in results})} finished cells, seeds {seeds}"
             + (f" ({statistics.fmean(secs_ok) / 60:.1f} min wall per cell on average, "
                f"{sum(secs_ok) / 3600:.2f} h of cell time in all)" if secs_ok else "")
             + f"; final held-out {metric.words}"
             + ("; *before training*: the shared evaluation before round 1 (the same models in every cell)."
                if initial else "."), ""]
    if metric != GREEDY:
        lines += [metric_line(metric, ks), ""]
    if prompt_paired:
        lines += ["Intervals: paired per-prompt differences A − B (points) over the seeds both methods finished "
                  "(same held-out prompts in every cell, other training prompts and sampling per seed), 95 % "
                  "pigeonhole bootstrap (seeds and prompts resampled independently, 4000 replicates, "
                  "`ftis_fed/grid/stats.py`); *t*: the paired t interval over the per-seed means.", ""]
    if starts and any(math.isfinite(r["pass_at_k"]) for r in starts):
        k = next((int(r["k"]) for r in starts if math.isfinite(r["k"])), "k")
        lines += [f"## Before training: greedy pass@1, sampled pass@1 and pass@{k} (the headroom RL can sharpen)", "",
                  f"The grid's shared evaluation before round 1; pass@{k}: the share of prompts with at least one of "
                  f"the {k} sampled completions solved.", "",
                  f"| participant | set | prompts | greedy pass@1 | sampled pass@1 | pass@{k} |", "|---|---|---|---|---|---|"]
        for r in starts:
            lines.append(f"| {r['participant']} | {r['set']} | {r['prompts']} | {r['greedy']:.3f} | "
                         f"{r['sampled']:.3f} | {r['pass_at_k']:.3f} |")
        lines.append("")
    if gains:
        fams = sorted({r["set"] for r in gains if r["set"].startswith("id:")})
        by = {(r["method"], r["participant"], r["set"]): r for r in gains}
        lines += ["## Learning: final − before training (points; per seed, each cell's last evaluation minus its own "
                  "before round 1 on the same prompts; 95 % pigeonhole-bootstrap CI; t interval; seeds gained)", "",
                  "| method | participant | seeds | ID before → after | ID gain [95 % CI] | ID t-CI | seeds gained | "
                  + " | ".join(fams) + " |", "|---|---|---|---|---|---|---|" + "---|" * len(fams)]
        for m, p in dict.fromkeys((r["method"], r["participant"]) for r in gains):
            r = by.get((m, p, "id"))
            if r is None:
                continue
            t = f"[{100 * r['t_lo']:+.1f}, {100 * r['t_hi']:+.1f}]" if math.isfinite(r["t_lo"]) else "–"
            lines.append(f"| {m} | {p} | {r['seeds']} | {r['start']:.3f} → {r['final']:.3f} | {_ci(r)} | {t} | "
                         f"{r['gained']}/{r['seeds']} | "
                         + " | ".join(_ci(by[(m, p, k)]) if (m, p, k) in by else "–" for k in fams) + " |")
        lines.append("")
    if verdict_rows:
        lines += ["## Verdicts", "", "Each interval below is the one the rule reads (`grid.stats.verdict_bounds`): "
                  "the union of the pigeonhole-bootstrap and the paired-t-over-seeds 95 % intervals, so the seed "
                  "component carries t tails; update ratios: their t interval over the seeds.", "",
                  "| claim | statement | comparison | verdict | difference [95 % CI], points | rule |",
                  "|---|---|---|---|---|---|"]
        for v in verdict_rows:
            lines.append(f"| {v['claim']} | {v['statement']} | {v['comparison']} | **{v['verdict']}** | "
                         f"{v['interval']} | {v['rule']} |")
        lines.append("")
    if ns:
        qs = [r["discord"] for r in prompt_paired if r["set"] == "id" and math.isfinite(r["discord"])]
        q = max(qs) if qs else 0.3
        S = max(len(seeds), 1)
        what = "largest measured discordance" if metric == GREEDY else \
            "largest measured mean squared per-prompt difference" if qs else "assumed (none measured)"
        lines += [f"ID evaluation set: {', '.join(map(str, ns))} prompts. The prompt part of a paired difference's "
                  f"95 % half-width is 1.96 sqrt(q / (n S)); at the {what} q = {q:.2f} and "
                  f"S = {S} seeds a 3-point half-width needs n ≥ {paired_eval_size(0.03, max(q, 1e-3), S)} "
                  "(`grid.stats.paired_eval_size`); the seed part does not shrink with n.", ""]
    participants = sorted({r["participant"] for r in summary})
    methods = list(dict.fromkeys(r["method"] for r in sorted(summary, key=lambda r: method_order(r["method"]))))
    for m in metric.keys:
        lines += [f"## {m} (mean ± sd over seeds)", "", "| method | " + " | ".join(participants) + " |",
                  "|---|" + "---|" * len(participants)]
        cell = {(r["method"], r["participant"]): r for r in summary}
        if initial:
            lines.append("| *before training* | " + " | ".join(
                f"{num(initial[p].get(m)):.3f}" if p in initial else "–" for p in participants) + " |")
        for meth in methods:
            vals = [_pm(cell[(meth, p)][m + ":mean"], cell[(meth, p)][m + ":sd"]) if (meth, p) in cell else "–"
                    for p in participants]
            lines.append(f"| {meth} | " + " | ".join(vals) + " |")
        lines.append("")
    if families:
        keys = sorted({r["set"] for r in families}, key=lambda k: (not k.startswith("id:"), k))
        fam = {(r["method"], r["participant"], r["set"]): r for r in families}
        lines += [f"## {'Accuracy' if metric == GREEDY else metric.words.capitalize()} per task family "
                  "(mean ± sd over seeds)", "",
                  "| method | participant | " + " | ".join(keys) + " |", "|---|---|" + "---|" * len(keys)]
        for meth in methods:
            for p in participants:
                if any((meth, p, k) in fam for k in keys):
                    lines.append(f"| {meth} | {p} | " + " | ".join(
                        _pm(fam[(meth, p, k)]["mean"], fam[(meth, p, k)]["sd"]) if (meth, p, k) in fam else "–"
                        for k in keys) + " |")
        lines.append("")
    if prompt_paired:
        keys = [k for k in ("id", "ood") if any(r["set"] == k for r in prompt_paired)]
        fams = sorted({r["set"] for r in prompt_paired if r["set"].startswith("id:")})
        lines += ["## Paired differences A − B (points, 95 % pigeonhole-bootstrap CI; t interval; seeds won by A/B)", "",
                  "| A − B | participant | seeds | " + " | ".join(k.upper() for k in keys) + " | ID t-CI | "
                  + " | ".join(fams) + " |", "|---|---|---|" + "---|" * (len(keys) + 1 + len(fams))]
        by = {(r["a"], r["b"], r["participant"], r["set"]): r for r in prompt_paired}
        for a, b, p in dict.fromkeys((r["a"], r["b"], r["participant"]) for r in prompt_paired):
            row = [f"{a} − {b}", p, str(by.get((a, b, p, "id"), {}).get("seeds", "–"))]
            for k in keys:
                r = by.get((a, b, p, k))
                row.append(f"{_ci(r)} {r['a_wins']}/{r['b_wins']}" if r else "–")
            r = by.get((a, b, p, "id"))
            row.append(f"[{100 * r['t_lo']:+.1f}, {100 * r['t_hi']:+.1f}]" if r and math.isfinite(r["t_lo"]) else "–")
            row += [_ci(by[(a, b, p, k)]) if (a, b, p, k) in by else "–" for k in fams]
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")
    if efficiency:
        lines += ["## Sample efficiency: updates to reach Alone's final ID accuracy (`grid/efficiency.py`)", "",
                  "Per seed in which Alone gained over the accuracy before training (only those): the first evaluated "
                  "round at which the method's ID accuracy is ≥ Alone's final ID accuracy of that seed, over Alone's updates (1.00: not reached within Alone's budget, counted "
                  "as 1); mean and 95 % t interval over the seeds; resolution: the evaluation rounds."
                  + (" *Training reward*: the same on each round's on-policy sampled pass@1 of the participant's own "
                     "training prompts, as a 10-round trailing mean (target: Alone's last 10 rounds; a seed counts where "
                     "that is above Alone's first 10), at the resolution of one round."
                     if any(r["set"] == "updates:reward" for r in efficiency) else ""), "",
                  "| method | participant | measure | seeds | reached | mean ratio [95 % t] | per seed |",
                  "|---|---|---|---|---|---|---|"]
        for r in efficiency:
            what = "training reward" if r["set"] == "updates:reward" else "held-out ID"
            lines.append(f"| {r['a']} | {r['participant']} | {what} | {r['seeds']} | {r['reached']} | "
                         f"{efficiency_figures(r)} | {r['ratios']} |")
        lines.append("")
    if filters:
        g = f"g = {filter_g:g}" if filter_g is not None else "g"
        lines += [f"## The filter: per-sample KL of the peers' samples at each receiver ({g})", "",
                  "Each training round's first update, over the peer's samples in it: the KL estimate of the median, "
                  "90th and 99th percentile sample (summed over the completion's tokens, nats), averaged over the "
                  f"rounds and seeds; the largest sample KL of any round and seed; the share of samples with KL ≥ {g} "
                  "whatever their advantage; the share the filter dropped (negative advantage and KL ≥ g: F- modes "
                  "only, 0 elsewhere)." + (f" {', '.join(any_sign)}: `filter-sign = any`, a variant, not the paper: "
                                           "it drops every sample with a nonzero advantage and KL ≥ g."
                                           if any_sign else ""), "",
                  "| method | receiver | peer | seeds | " + " | ".join(FILTER_HEADERS) + " |",
                  "|---|---|---|---|" + "---|" * len(FILTER_HEADERS)]
        for r in filters:
            lines.append(f"| {r['method']} | {r['participant']} | {r['peer']} | {r['seeds']} | {filter_figures(r)} |")
        lines.append("")
    if guards:
        lines += ["## The guard: what `source-adapt = guard` did to each peer's samples (`learn/guard.py`)", "",
                  "Per cell over its training rounds, then the mean over the seeds [per-seed range]: the share of "
                  "rounds whose update kept the peers (the update with the weighted peer samples scored no worse "
                  "on the receiver's validation batch than the update without them); the peer samples' mean "
                  "alignment weight (their advantages' factor: clip(cos_peer / cos_own, 0, 1), or 1[cos_peer > 0] "
                  "where cos_own ≤ 0) and the share of "
                  "rounds it was 0; the mean cosines of the peer's and the own samples' gradients with the "
                  "validation gradient." + _shadow_note(shadow, "its checks: kept peers is the share of them that "
                                                                "kept the model, not reset to its shadow"), "",
                  "| method | receiver | peer | seeds | kept peers | weight | weight 0 | cos peer | cos own |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in guards:
            lines.append(f"| {r['method']} | {r['participant']} | {r['peer']} | {r['seeds']} | {guard_figures(r)} |")
        lines.append("")
    if guard_scores:
        lines += ["## The guard's scores: what decided between its two candidate updates", "",
                  "Per cell over its training rounds, then the mean over the seeds: the mean [per-seed range] and "
                  "the standard deviation of the per-round difference d = score of the update with the peers − "
                  "score of the update without them (`loglik`: the mean per-token log-likelihood of the validation "
                  "replies; `reward`: greedy pass@1), for the whole validation batch (all) and, with "
                  "`source-adapt-val-group = family`, for each of its groups; and the share of rounds in which that "
                  "group's mean over its window was below 0 (all: the rounds whose update dropped the peers)."
                  + _shadow_note(shadow, "its checks: d is the model's sampled pass@1 on the validation batch − "
                                         "its shadow's, and drops the share of checks that reset the model"), "",
                  "| method | receiver | group | seeds | " + " | ".join(GUARD_SCORE_HEADERS) + " |",
                  "|---|---|---|---|" + "---|" * len(GUARD_SCORE_HEADERS)]
        for r in guard_scores:
            lines.append(f"| {r['method']} | {r['participant']} | {r['group']} | {r['seeds']} | "
                         f"{guard_score_figures(r)} |")
        lines.append("")
    if unchosen:
        lines += unchosen_lines(unchosen, metric, shadow)
    if diagnostics:
        lines += ["## Training diagnostics (per round, mean ± sd over seeds; offpolicy/*: the peers' samples at "
                  "this receiver)", "",
                  "| method | participant | " + " | ".join(DIAGNOSTICS) + " |",
                  "|---|---|" + "---|" * len(DIAGNOSTICS)]
        for r in diagnostics:
            lines.append(f"| {r['method']} | {r['participant']} | "
                         + " | ".join(_pm(r[k + ':mean'], r[k + ':sd']) for k in DIAGNOSTICS) + " |")
        lines.append("")
    return "\n".join(lines)


#: PNG metadata: none (no software version in the files: the figures depend only on the metrics).
PNG_META = {"Software": None}


def _finish(plt, fig, axes, legend_size: int, title: str, path: Path, dpi: int) -> Path:
    """Legend on the first panel, title, layout; saved without metadata (reproducible bytes); closed."""
    axes[0][0].legend(fontsize=legend_size, ncol=2)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi, metadata=PNG_META)
    plt.close(fig)
    return path


def plot(summary: Sequence[dict], cells: Sequence[Cell], out: Path, metric: Metric = GREEDY,
         ks: Sequence[int] = ()) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    participants = sorted({r["participant"] for r in summary})
    methods = list(dict.fromkeys(r["method"] for r in sorted(summary, key=lambda r: method_order(r["method"]))))
    colors = {m: plt.get_cmap("tab20")(i % 20) for i, m in enumerate(methods)}
    if participants:
        fig, axes = plt.subplots(1, len(metric.keys), figsize=(6 * len(metric.keys), 3.8), squeeze=False)
        cell = {(r["method"], r["participant"]): r for r in summary}
        width = 0.8 / max(1, len(methods))
        for ax, m in zip(axes[0], metric.keys):
            for j, meth in enumerate(methods):
                xs = [i + j * width for i in range(len(participants))]
                ys = [cell.get((meth, p), {}).get(m + ":mean", float("nan")) for p in participants]
                es = [cell.get((meth, p), {}).get(m + ":sd", 0.0) for p in participants]
                ax.bar(xs, ys, width, yerr=es, capsize=2, label=meth, color=colors[meth])
            ax.set_xticks([i + 0.4 - width / 2 for i in range(len(participants))], participants, fontsize=8)
            ax.set_ylabel(_axis(metric, m, ks))
            ax.grid(alpha=0.3, axis="y")
        what = "accuracy (" if metric == GREEDY else f"{metric.words} ({_k(ks)}; "
        written.append(_finish(plt, fig, axes, 7, f"Final held-out {what}mean ± sd over seeds)",
                               out / "final_accuracy.png", 110))
    keys = (*metric.keys, "reward/mean")
    curves = _curves(cells, out, keys)
    if curves:
        fig, axes = plt.subplots(len(keys), len(participants) or 1, figsize=(5 * max(1, len(participants)), 9),
                                 squeeze=False)
        for i, key in enumerate(keys):
            for j, p in enumerate(participants):
                ax = axes[i][j]
                for meth in methods:
                    pts = curves.get((meth, p, key))
                    if pts:
                        xs = [x for x, _, _, _ in pts]
                        mu = np.array([y for _, y, _, _ in pts])
                        sd = np.array([e for _, _, e, _ in pts])
                        ax.plot(xs, mu, marker="o" if len(xs) < 12 else None, ms=3, label=meth, color=colors.get(meth))
                        if any(n > 1 for _, _, _, n in pts):
                            ax.fill_between(xs, mu - sd, mu + sd, alpha=0.15, color=colors.get(meth), lw=0)
                ax.set_title(p, fontsize=9)
                ax.set_xlabel("round")
                ax.set_ylabel(key if metric == GREEDY or key not in metric.keys else _axis(metric, key, ks))
                ax.grid(alpha=0.3)
        what = "" if metric == GREEDY else f" ({metric.words}, {_k(ks)})"
        written.append(_finish(plt, fig, axes, 6, f"Learning curves{what}: mean over seeds, band ± 1 sd over seeds",
                               out / "curves.png", 100))
    return written


Curves = dict[tuple[str, str, str], list[tuple[int, float, float, int]]]


def _curves(cells: Sequence[Cell], out: Path, keys: Sequence[str] = (*GREEDY.keys, "reward/mean")) -> Curves:
    """(method, participant, key) -> [(round, mean over seeds, sd over seeds, seeds)] of each of ``keys``;
    a cell without its own evaluation before round 1 gets the grid's shared one (``initial_eval``) as
    its round-0 point."""
    acc: dict[tuple[str, str, str, int], list[float]] = defaultdict(list)
    initial = list(initial_eval(out).values())
    for c in cells:
        if not (out / "cells" / c.name / "done.json").exists():
            continue
        rows = cell_rows(out / "cells" / c.name)
        if not any(r.get("phase") == "eval" and int(r.get("round", -1)) == 0 for r in rows):
            rows = initial + rows
        for r in rows:
            if str(r.get("participant", "")).startswith("_"):
                continue
            for key in keys:
                v = num(r.get(key))
                if math.isfinite(v):
                    acc[(c.method, r["participant"], key, int(r["round"]))].append(v)
    curves: Curves = defaultdict(list)
    for (meth, p, key, rnd), vs in sorted(acc.items()):
        mean, sd = _mean_sd(vs)
        curves[(meth, p, key)].append((rnd, mean, sd, len(vs)))
    return curves


def write_summary(cells: Sequence[Cell], out: Path, title: str, metric: Metric = GREEDY) -> dict:
    """cells.csv, summary.csv, summary.md and the figures, all from the cells' metrics files, for
    ``metric`` (``MissingMetric``, naming the cells, when a finished cell lacks it; ``MixedWeights``
    when cells' participants started from different model weights: their fingerprints or, without
    one, their first samples, ``MixedStarts``)."""
    try:
        return _write_summary(cells, out, title, metric)
    finally:
        forget_cell_rows()                                 # the cells' rows were parsed once for all tables


def _write_summary(cells: Sequence[Cell], out: Path, title: str, metric: Metric) -> dict:
    check_weights([c.name for c in cells], out)
    check_starts([c for c in cells if (out / "cells" / c.name / "done.json").exists()], out)
    ks = check_metric(cells, out, metric)
    results = cell_results(cells, out, metric)
    summary, paired = summarize(results, metrics=metric.keys)
    initial = initial_eval(out)
    diagnostics = train_diagnostics(cells, out)
    prompt_paired = paired_prompt_table(cells, out, metric)
    families = family_table(cells, out, metric)
    gains = gain_table(cells, out, metric)
    filters = filter_table(cells, out)
    guards = guard_table(cells, out)
    guard_scores = guard_score_table(cells, out)
    unchosen = unchosen_table(cells, out, metric)
    starts = start_table(cells, out)
    methods = {c.method for c in cells}
    configs = _configs(cells, out)
    shadow = _shadow_losses(configs)
    beyond = BEYOND if BEYOND in methods else next((m for m in sorted(methods) if m.startswith(REFERENCE + "+")), None)
    participants = sorted({r["participant"] for r in summary})
    efficiency = efficiency_table(cells, out, initial, metric=metric)
    verdict_rows = verdicts([*prompt_paired, *efficiency], participants, stronger_participant(initial, metric),
                            beyond, with_shadow_variants(shadow)) if prompt_paired else []
    tag = {} if metric == GREEDY else {"metric": metric.name}          # greedy: the columns as before
    _write_csv(out / "cells.csv", [{**r, **tag} for r in results])
    _write_csv(out / "summary.csv", [{**r, "kind": "mean_sd", **tag} for r in summary] +
               [{**r, "kind": "paired_diff", **tag} for r in paired] +
               [{"method": "before-training", "participant": p, "seeds": 1, "kind": "initial",
                 **{m + ":mean": num(r.get(m)) for m in metric.keys}, **tag} for p, r in sorted(initial.items())] +
               [{**r, "kind": "train_diagnostics", **tag} for r in diagnostics] +
               [{**r, "kind": "paired_prompts", **tag} for r in prompt_paired] +
               [{**r, "kind": "family", **tag} for r in families] +
               [{**r, "kind": "efficiency", **tag} for r in efficiency] +
               [{**r, "kind": "verdict", **tag} for r in verdict_rows] +
               [{**r, "kind": "gain", **tag} for r in gains] +
               [{**r, "kind": "filter", **tag} for r in filters] +
               [{**r, "kind": "start", **tag} for r in starts] +
               [{**r, "kind": "guard", **tag} for r in guards] +
               [{**r, "kind": "guard_score", **tag} for r in guard_scores] +
               [{**r, "kind": "unchosen", **tag} for r in unchosen])
    objectives = _objectives(configs)
    (out / "summary.md").write_text(summary_markdown(summary, paired, results, title, initial, diagnostics,
                                                     prompt_paired, families, verdict_rows, efficiency, metric, ks,
                                                     gains, filters, _filter_g(objectives) if filters else None,
                                                     starts, _any_sign_methods(objectives), guards,
                                                     guard_scores, shadow, unchosen))
    plot(summary, cells, out, metric, ks)
    return {"results": results, "summary": summary, "paired": paired, "initial": initial,
            "diagnostics": diagnostics, "prompt_paired": prompt_paired, "families": families,
            "verdicts": verdict_rows, "efficiency": efficiency, "gains": gains, "filters": filters, "starts": starts,
            "guards": guards, "guard_scores": guard_scores, "unchosen": unchosen, "metric": metric.name, "ks": ks}


def _configs(cells: Sequence[Cell], out: Path) -> dict[Cell, dict]:
    """Each finished cell's run configuration (its config.json, read once for every reader below)."""
    found = {}
    for c in cells:
        cfg = out / "cells" / c.name / "run" / "config.json"
        if (out / "cells" / c.name / "done.json").exists() and cfg.exists():
            found[c] = json.loads(cfg.read_text())
    return found


def _objectives(configs: dict[Cell, dict]) -> dict[Cell, dict]:
    """Each cell's objective config (``objective`` of its config.json; {} where absent)."""
    return {c: cfg.get("objective", {}) for c, cfg in configs.items()}


def _filter_g(objectives: dict[Cell, dict]) -> float | None:
    """The cells' filter threshold g (``filter_g`` of their objectives), when they all share one."""
    gs = {float(o["filter_g"]) for o in objectives.values() if o.get("filter_g") is not None}
    return gs.pop() if len(gs) == 1 else None


def _any_sign_methods(objectives: dict[Cell, dict]) -> list[str]:
    """The methods (sorted) whose cells ran the filter's ``filter-sign = any`` variant."""
    return sorted({c.method for c, o in objectives.items() if o.get("filter_sign") == "any"})
