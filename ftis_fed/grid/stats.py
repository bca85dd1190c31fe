"""Paired statistics of ``ftis-fed grid``: pure functions, numpy only.

The design they serve: every cell of a grid is evaluated on the **same** held-out prompts
(``eval-seed`` fixed) and each seed trains on **other** prompts with other sampling (``task-seed``
and ``seed`` = the seed). A comparison of method A with method B for one participant therefore has
a matrix of paired per-prompt differences

    d[s, i] = solved_A(seed s, prompt i) - solved_B(seed s, prompt i)      in {-1, 0, 1}, shape (S, N)

whose mean over seeds and prompts is the paired accuracy difference. Its uncertainty has two
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
variance (q - delta^2) / n ~ q / n, q the share of prompts where the two models disagree (the
discordance rate). Averaged over S seeds with independent training the prompt part of the variance
is q / (n S) (the seed part, sigma_seed^2 / S, does not shrink with n). A 95 % half-width of delta
from the prompt part alone needs n >= z^2 q / (delta^2 S).
"""

from __future__ import annotations

import hashlib
import math
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
    ``discord`` (share of nonzero entries) and ``se_prompt`` (sqrt(q / (N S)): the prompt part)."""
    d = np.asarray(d, dtype=np.float64)
    S, N = d.shape
    reps = pigeonhole_bootstrap(d, draws, stable_seed("pigeonhole", name, S, N))
    lo, hi = np.percentile(reps, [2.5, 97.5])
    _, t_lo, t_hi = t_interval(d.mean(axis=1))
    q = float((d != 0).mean())
    return {"diff": float(d.mean()), "lo": float(lo), "hi": float(hi), "t_lo": t_lo, "t_hi": t_hi,
            "seeds": S, "prompts": N, "discord": q, "se_prompt": math.sqrt(q / (N * S))}


def paired_eval_size(delta: float, discord: float, seeds: int, z: float = Z975) -> int:
    """Prompts per held-out set so that the prompt part of a paired difference over ``seeds`` seeds has
    a 95 % half-width of at most ``delta``: n = ceil(z^2 q / (delta^2 S)) (module docstring)."""
    if not 0 < delta < 1 or not 0 < discord <= 1 or seeds < 1:
        raise ValueError(f"delta={delta}, discord={discord}, seeds={seeds}: need 0<delta<1, 0<q<=1, S>=1")
    return math.ceil(z * z * discord / (delta * delta * seeds))


# ----------------------------------------------------------------------------- verdicts

HELD, NOT_HELD, INCONCLUSIVE, MISSING = "held", "not held", "inconclusive", "no data"


def at_least(lo: float, hi: float, bound: float) -> str:
    """Claim "difference >= bound": held if the interval lies at or above it, not held if it lies
    below, else inconclusive."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return MISSING
    return HELD if lo >= bound else NOT_HELD if hi < bound else INCONCLUSIVE


def greater_than(lo: float, hi: float, bound: float = 0.0) -> str:
    """Claim "difference > bound": held if the interval lies above it, not held if it lies at or
    below it, else inconclusive."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return MISSING
    return HELD if lo > bound else NOT_HELD if hi <= bound else INCONCLUSIVE


def less_than(lo: float, hi: float, bound: float = 0.0) -> str:
    """Claim "difference < bound": ``greater_than`` of the negated difference (interval [-hi, -lo])."""
    return greater_than(-hi, -lo, -bound)


def _combine(verdicts: Sequence[str], decisive: str, other: str) -> str:
    """``decisive`` if any part is it, ``other`` if every part is, else inconclusive (no data wins)."""
    if not verdicts or MISSING in verdicts:
        return MISSING
    if decisive in verdicts:
        return decisive
    return other if all(v == other for v in verdicts) else INCONCLUSIVE


def all_of(verdicts: Sequence[str]) -> str:
    """A claim about every participant: held if every part holds, not held if any part fails."""
    return _combine(verdicts, NOT_HELD, HELD)


def any_of(verdicts: Sequence[str]) -> str:
    """A claim about some participant: held if any part holds, not held if every part fails."""
    return _combine(verdicts, HELD, NOT_HELD)
