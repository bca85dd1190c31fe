"""Sample efficiency: how many updates a method needs to reach what training alone reached at its end.
Accuracy here is the grid's metric (``grid.metric``; greedy ID pass@1 by default).

For one participant and seed, alone's *target* is its final held-out ID accuracy ``a_T`` after its
``T`` updates (the last evaluated round). A method *reaches* it at the first evaluated round ``r``
(1 <= r <= T) whose ID accuracy is >= ``a_T``; its **update ratio** is ``r / T`` (a round is one update
per participant). A method that never reaches it within alone's budget gets ratio 1 (reached at the
end at best): that is the conservative value for the claim "reaches alone's final accuracy in <= 60 %
of alone's updates", which holds for a participant when the 95 % t interval of its ratios over the
seeds lies at or below 0.6. The ratio means something only where alone learned: a seed counts only
when alone's final accuracy is above the participant's accuracy before training (the grid's shared
evaluation before round 1); with no such seed there is no row. The resolution is the evaluation grid (``eval-every``): with an evaluation
every ``k`` rounds a ratio is a multiple of ``k / T``.

**The same on the training reward** (set ``updates:reward``), at the resolution of one round: a
participant's ``reward/mean`` of a round is the on-policy sampled pass@1 of that round's fresh training
prompts (its own samples, scored before it trains on them; the training split of its own task
partition, so for an ``iid`` partition the ID families' mix, for ``expertise`` its own family only).
Its curve is the trailing mean over ``REWARD_WINDOW`` rounds (from round ``REWARD_WINDOW`` on);
alone's target is its last point (the mean of its last ``REWARD_WINDOW`` rounds) and a seed counts
when that is above alone's first point (it learned); the ratio is the first round r at which the
method's trailing mean is ≥ the target, over alone's rounds (the same lag on both sides).
"""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path
from typing import Sequence

from ftis_fed.grid.metric import GREEDY, Metric
from ftis_fed.grid.plan import Cell, method_order
from ftis_fed.grid.records import cell_rows, num, participant_rows
from ftis_fed.grid.stats import t_interval

#: the efficiency rows' sets: on the held-out ID evaluations, and on the training reward
UPDATE_SETS = ("updates", "updates:reward")
#: rounds in the training reward's trailing mean (``updates:reward``)
REWARD_WINDOW = 10


def id_curves(rows: Sequence[dict], metric: Metric = GREEDY) -> dict[str, list[tuple[int, float]]]:
    """participant -> [(round, ID accuracy)] of its evaluations after training (round >= 1), by round."""
    out: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for r in participant_rows(rows, "eval"):
        v = num(r.get(metric.key("id")))
        if int(r.get("round", 0)) >= 1 and math.isfinite(v):
            out[r["participant"]].append((int(r["round"]), v))
    return {p: sorted(c) for p, c in out.items()}


def reward_curves(rows: Sequence[dict], window: int = REWARD_WINDOW) -> dict[str, list[tuple[int, float]]]:
    """participant -> [(round, mean of ``reward/mean`` over rounds round − window + 1 .. round)] from
    round ``window`` on (rounds in order; a participant with fewer rounds has no curve)."""
    by: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for r in participant_rows(rows, "train"):
        v = num(r.get("reward/mean"))
        if math.isfinite(v):
            by[r["participant"]].append((int(r["round"]), v))
    out = {}
    for p, pts in by.items():
        pts.sort()
        vals = [v for _, v in pts]
        if len(vals) >= window:
            out[p] = [(pts[i][0], sum(vals[i - window + 1:i + 1]) / window) for i in range(window - 1, len(vals))]
    return out


def update_ratio(curve: Sequence[tuple[int, float]], target: float, budget: int) -> tuple[float, bool]:
    """(r / budget, reached) for the first evaluated round r <= budget with accuracy >= target;
    (1.0, False) when no evaluation within the budget reaches it."""
    for rnd, acc in curve:
        if rnd <= budget and acc >= target:
            return rnd / budget, True
    return 1.0, False


def efficiency_table(cells: Sequence[Cell], out: Path, initial: dict[str, dict], baseline: str = "alone",
                     metric: Metric = GREEDY) -> list[dict]:
    """One row per method (other than ``baseline``, same grouping) × participant: per seed the update
    ratio against the baseline's own final accuracy of that seed (module docstring), their mean and
    95 % t interval over the seeds both finished in which the baseline gained over ``initial`` (the
    evaluation rows before training, by participant), and how many of them reached the target; ID
    accuracy is ``metric``'s."""
    held_out: dict[tuple[str, str, int], list[tuple[int, float]]] = {}
    reward: dict[tuple[str, str, int], list[tuple[int, float]]] = {}
    for c in cells:
        if (out / "cells" / c.name / "done.json").exists():
            rows = cell_rows(out / "cells" / c.name)
            for p, curve in id_curves(rows, metric).items():
                held_out[(c.method, p, c.seed)] = curve
            for p, curve in reward_curves(rows).items():
                reward[(c.method, p, c.seed)] = curve
    starts = {p: num(r.get(metric.key("id"))) for p, r in initial.items()}
    return (_ratios(held_out, "updates", baseline, lambda b, p, s: starts.get(p, math.nan))
            + _ratios(reward, "updates:reward", baseline, lambda b, p, s: reward[(b, p, s)][0][1]))


def _ratios(curves: dict[tuple[str, str, int], list[tuple[int, float]]], name: str, baseline: str,
            start) -> list[dict]:
    """``efficiency_table``'s rows of one kind of curve (``name``: its set); ``start(base, participant,
    seed)``: the baseline's level before it learned (a seed counts where its final point is above it)."""
    rows = []
    methods = sorted({m for m, _, _ in curves}, key=method_order)
    for m in methods:
        base = baseline + ("/h" if m.endswith("/h") else "")
        if m == base:
            continue
        for p in sorted({q for _, q, _ in curves}):
            seeds = sorted(s for (mm, q, s) in curves if mm == m and q == p and (base, p, s) in curves
                           and math.isfinite(start(base, p, s)) and curves[(base, p, s)][-1][1] > start(base, p, s))
            if not seeds:
                continue
            ratios, reached = [], 0
            for s in seeds:
                budget, target = curves[(base, p, s)][-1]
                ratio, ok = update_ratio(curves[(m, p, s)], target, budget)
                ratios.append(ratio)
                reached += ok
            mean, lo, hi = t_interval(ratios)
            rows.append({"a": m, "b": base, "participant": p, "set": name, "seeds": len(seeds),
                         "reached": reached, "diff": mean, "lo": lo, "hi": hi,
                         "ratios": " ".join(f"{x:.2f}" for x in ratios)})
    return rows
