"""What scoring one prompt's completions gives: the rewards a batch carries, which completions
solve the task, and each reward function's own rewards (``rewards/<name>/mean|std``, TRL's metric).

``solved`` follows one rule on every path (training metrics, evaluation, the poisoning attack):
the task's verifier rule for built-in tasks (a correct answer; a rule's format bonus never counts),
the function named by ``task-solved-reward`` reaching ``task-solved-threshold`` for a user task.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class GroupScores:
    """One prompt group: ``rewards`` (combined, NaN = unscorable), ``solved`` (one flag per
    completion), ``per_function`` (function name -> its own unweighted rewards; empty for built-in
    tasks, whose verifier is one rule)."""

    rewards: tuple[float, ...]
    solved: tuple[bool, ...]
    per_function: Mapping[str, tuple[float, ...]] = field(default_factory=dict)


def per_function_metrics(scores: Sequence[GroupScores]) -> dict[str, float]:
    """TRL's ``rewards/<name>/mean`` and ``rewards/<name>/std`` over every completion of a batch:
    NaN (None) left out, the std with Bessel's correction, as TRL's ``nanmean`` / ``nanstd``. Where
    TRL would log NaN (one scored value: std; none: both) this gives 0.0 for the std and no entry at
    all for a function that scored nothing, since a row's metrics must be finite."""
    values: dict[str, list[float]] = {}
    for s in scores:
        for name, rs in s.per_function.items():
            values.setdefault(name, []).extend(r for r in rs if not math.isnan(r))
    out: dict[str, float] = {}
    for name, vs in values.items():
        if not vs:
            continue
        mean = math.fsum(vs) / len(vs)
        var = math.fsum((v - mean) ** 2 for v in vs) / (len(vs) - 1) if len(vs) > 1 else 0.0
        out[f"rewards/{name}/mean"], out[f"rewards/{name}/std"] = mean, math.sqrt(var)
    return out
