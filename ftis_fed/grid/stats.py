"""Paired statistics of ``ftis-fed grid``: pure functions, numpy only.

The design they serve: every cell of a grid is evaluated on the **same** held-out prompts
(``eval-seed`` fixed) and each seed trains on **other** prompts with other sampling (``task-seed``
and ``seed`` = the seed). A comparison of method A with method B for one participant therefore has
a matrix of paired per-prompt differences

    d[s, i] = v_A(seed s, prompt i) - v_B(seed s, prompt i),      shape (S, N)

with v the per-prompt value of the grid's metric (``grid.metric``): the greedy solved flag (d in
{-1, 0, 1}) or the sampled pass@1 estimate solved/k (d in [-1, 1], multiples of 1/k). Its mean over
seeds and prompts is the paired pass@1 difference. Nothing below needs d to be 0/1. Its uncertainty has two
sources that are *crossed*, not nested: seeds (training randomness: prompts trained on, sampling)
and prompts (which held-out items were drawn) — the same prompts appear in every seed.

**Interval (``paired_interval``): the pigeonhole bootstrap** for crossed designs (Owen 2007, "The
pigeonhole bootstrap", Ann. Appl. Stat.; also used for LLM evaluation with seeds x items): each of
``draws`` replicates resamples S seeds with replacement and, independently, N prompts with
replacement (the same prompt draw for every seed), and takes the mean of the resampled matrix; the
95 % interval is the 2.5 / 97.5 percentiles of the replicate means. It carries both variance
components (Owen shows it is mildly conservative). With S = 5 seeds the seed component is
resampled from only 5 values, so the interval is also reported next to the **paired t interval over
seeds** (``t_interval`` of the S per-seed mean differences, t with S - 1 degrees of freedom), which
treats the prompts as fixed. The replicates use a generator seeded from the comparison's name
(``stable_seed``), so a summary is reproduced byte for byte.

**Eval-set size (``paired_eval_size``).** For one seed the paired difference of n prompts has
variance (q - delta^2) / n ~ q / n, q = mean(d^2) the mean squared per-prompt difference: for 0/1
flags the share of prompts where the two models disagree (the discordance rate), for sampled values
the discordance weighted by how far apart the two estimates are (q <= the share of nonzero d).
Averaged over S seeds with independent training the prompt part of the variance is q / (n S) (the
seed part, sigma_seed^2 / S, does not shrink with n). A 95 % half-width of delta from the prompt
part alone needs n >= z^2 q / (delta^2 S). This treats one prompt's differences in different seeds
as independent: a prompt that favours one method in every seed adds a share that the pigeonhole
interval carries and this size does not.
"""

from __future__ import annotations

import hashlib
import math
import operator
from dataclasses import dataclass
from typing import Sequence

import numpy as np

#: two-sided 95 % Student t quantiles t_{0.975, df}, df = 1..30 (standard tables; beyond 30 the
#: normal 1.96 is within 2 %).
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
        2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
        2.045, 2.042)
Z975 = 1.959964


def stable_seed(*parts: object) -> int:
    """A 63-bit seed from ``parts`` (identical on every machine and Python run)."""
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "big") >> 1


def t975(df: int) -> float:
    if df < 1:
        raise ValueError(f"df={df}: need >= 1")
    return T975[df - 1] if df <= len(T975) else Z975


def t_interval(values: Sequence[float]) -> tuple[float, float, float]:
    """(mean, lo, hi): the 95 % t interval of the mean of ``values`` (nan bounds with one value)."""
    x = np.asarray(values, dtype=np.float64)
    if x.size == 0:
        return math.nan, math.nan, math.nan
    m = float(x.mean())
    if x.size == 1:
        return m, math.nan, math.nan
    half = t975(x.size - 1) * float(x.std(ddof=1)) / math.sqrt(x.size)
    return m, m - half, m + half


def pigeonhole_bootstrap(d: np.ndarray, draws: int = 4000, seed: int = 0) -> np.ndarray:
    """Replicate means of the (S, N) matrix ``d`` with seeds and prompts resampled independently
    (see the module docstring). Returns (draws,)."""
    d = np.asarray(d, dtype=np.float64)
    if d.ndim != 2 or d.size == 0:
        raise ValueError(f"d: need a non-empty (seeds, prompts) matrix, got shape {d.shape}")
    S, N = d.shape
    rng = np.random.default_rng(seed)
    si = rng.integers(0, S, size=(draws, S))                                         # (draws,S)
    pi = rng.integers(0, N, size=(draws, N))                                         # (draws,N)
    # mean over (s, i) of d[si, pi] = mean over i of (seed-mean of d[si])[pi]
    by_prompt = d[si].mean(axis=1)                                                   # (draws,N)
    return np.take_along_axis(by_prompt, pi, axis=1).mean(axis=1)                    # (draws,)


def paired_interval(d: np.ndarray, name: str = "", draws: int = 4000) -> dict[str, float]:
    """The paired difference of an (S, N) matrix: ``diff`` (the mean), ``lo`` / ``hi`` (pigeonhole
    bootstrap 95 %), ``t_lo`` / ``t_hi`` (paired t over the S per-seed means), ``seeds``, ``prompts``,
    ``discord`` (q = mean(d^2): for 0/1 values the share of nonzero entries, module docstring) and
    ``se_prompt`` (sqrt(q / (N S)): the prompt part)."""
    d = np.asarray(d, dtype=np.float64)
    S, N = d.shape
    reps = pigeonhole_bootstrap(d, draws, stable_seed("pigeonhole", name, S, N))
    lo, hi = np.percentile(reps, [2.5, 97.5])
    _, t_lo, t_hi = t_interval(d.mean(axis=1))
    q = float((d * d).mean())
    return {"diff": float(d.mean()), "lo": float(lo), "hi": float(hi), "t_lo": t_lo, "t_hi": t_hi,
            "seeds": S, "prompts": N, "discord": q, "se_prompt": math.sqrt(q / (N * S))}


def paired_eval_size(delta: float, discord: float, seeds: int, z: float = Z975) -> int:
    """Prompts per held-out set so that the prompt part of a paired difference over ``seeds`` seeds has
    a 95 % half-width of at most ``delta``: n = ceil(z^2 q / (delta^2 S)), ``discord`` = q = mean(d^2)
    (module docstring)."""
    if not 0 < delta < 1 or not 0 < discord <= 1 or seeds < 1:
        raise ValueError(f"delta={delta}, discord={discord}, seeds={seeds}: need 0<delta<1, 0<q<=1, S>=1")
    return math.ceil(z * z * discord / (delta * delta * seeds))


# ----------------------------------------------------------------------------- verdicts

HELD, NOT_HELD, INCONCLUSIVE, MISSING = "held", "not held", "inconclusive", "no data"


def verdict_bounds(row: dict) -> tuple[float, float]:
    """The 95 % interval a verdict reads, stated once: for a paired difference, the **union** of the
    pigeonhole-bootstrap interval (``lo``, ``hi``: seeds and prompts resampled) and the paired t
    interval over the seeds (``t_lo``, ``t_hi``: t tails with S − 1 degrees of freedom), so that a
    verdict carries the seed component with t tails even where a percentile bootstrap over 3–5 seeds
    understates it, and the prompt component where the seeds agree; with one seed (no t interval), the
    pigeonhole interval alone. A row without t bounds (an update ratio: already a t interval) is read
    as it is."""
    lo, hi = row["lo"], row["hi"]
    t_lo, t_hi = row.get("t_lo", math.nan), row.get("t_hi", math.nan)
    if math.isfinite(t_lo) and math.isfinite(t_hi):
        return min(lo, t_lo), max(hi, t_hi)
    return lo, hi

#: The comparison of an interval bound with a claim's margin, by the sign the rules are written with.
OPS = {"≥": operator.ge, ">": operator.gt, "<": operator.lt, "≤": operator.le}


@dataclass(frozen=True)
class Rule:
    """The verdict rule of a claim about one 95 % interval [lo, hi] of a difference (or ratio) and a
    margin m, whatever metric the interval is of: **held** when ``held`` = (bound, sign) is true of
    the interval's bound (``lower`` = lo, ``upper`` = hi) against m; **not held** when ``not_held`` is;
    else **inconclusive**; no data when a bound is not finite. Its words (``words``) come from the
    same two pairs, so the summary's rule column is the rule the code applies."""

    held: tuple[str, str]
    not_held: tuple[str, str]

    def decide(self, lo: float, hi: float, margin: float) -> str:
        if not (math.isfinite(lo) and math.isfinite(hi)):
            return MISSING
        bound = {"lower": lo, "upper": hi}
        (b1, s1), (b2, s2) = self.held, self.not_held
        return HELD if OPS[s1](bound[b1], margin) else NOT_HELD if OPS[s2](bound[b2], margin) else INCONCLUSIVE

    def words(self, margin: str, quantifiers: tuple[str, str] = ("", ""),
              bound_name: tuple[str, str] = ("", "")) -> str:
        """``held: <q> <bound> bound <sign> <margin>; not held: ...`` (quantifiers: the held and not-held
        sides' ``every`` / ``some``, or none for one participant; ``bound_name``: words before and after
        ``bound`` on the held side, e.g. ``("t ", " of the update ratio")``)."""
        (b1, s1), (b2, s2) = self.held, self.not_held
        held = " ".join(filter(None, [quantifiers[0], f"{bound_name[0]}{b1} bound{bound_name[1]}", s1, margin]))
        not_held = " ".join(filter(None, [quantifiers[1], f"{b2} bound", s2, margin]))
        return f"held: {held}; not held: {not_held}"


#: The claims' rules by name: "difference >= m" (``at_least``), "> m" (``greater``), "< m" (``less``),
#: "<= m" (``at_most``).
RULES = {"at_least": Rule(("lower", "≥"), ("upper", "<")), "greater": Rule(("lower", ">"), ("upper", "≤")),
         "less": Rule(("upper", "<"), ("lower", "≥")), "at_most": Rule(("upper", "≤"), ("lower", ">"))}


def at_least(lo: float, hi: float, bound: float) -> str:
    """Claim "difference >= bound": held if the interval lies at or above it, not held if it lies
    below, else inconclusive (``RULES["at_least"]``)."""
    return RULES["at_least"].decide(lo, hi, bound)


def greater_than(lo: float, hi: float, bound: float = 0.0) -> str:
    """Claim "difference > bound": held if the interval lies above it, not held if it lies at or
    below it, else inconclusive (``RULES["greater"]``)."""
    return RULES["greater"].decide(lo, hi, bound)


def less_than(lo: float, hi: float, bound: float = 0.0) -> str:
    """Claim "difference < bound": held if the interval lies below it, not held if it lies at or above
    it, else inconclusive (``RULES["less"]``)."""
    return RULES["less"].decide(lo, hi, bound)


def _combine(verdicts: Sequence[str], decisive: str, other: str) -> str:
    """``decisive`` if any part is it (a part without data cannot undo it: "some participant" holds
    once one does), else no data if a part has none, else ``other`` if every part is, else
    inconclusive."""
    if decisive in verdicts:
        return decisive
    if not verdicts or MISSING in verdicts:
        return MISSING
    return other if all(v == other for v in verdicts) else INCONCLUSIVE


def all_of(verdicts: Sequence[str]) -> str:
    """A claim about every participant: held if every part holds, not held if any part fails."""
    return _combine(verdicts, NOT_HELD, HELD)


def any_of(verdicts: Sequence[str]) -> str:
    """A claim about some participant: held if any part holds, not held if every part fails."""
    return _combine(verdicts, HELD, NOT_HELD)
