"""Receivers re-verify a sender's claimed rewards with their own ``Verifier``.

A signature proves who sent a batch, not that its rewards are true. A receiver recomputes every
completion's reward from the completion text and the reference of the batch it is given (the
receiver's OWN copy: ``receive.py`` replaces each group's reference, prompt and texts with the
receiver's own before calling ``reverify``; a sender's reference is never trusted), counts
disagreements (``|claimed - recomputed| > tol``) and, by configuration:

- ``replace`` (default): train on the recomputed rewards (the claimed ones are never used);
- ``downweight``: keep the batch, return per-completion weights (1 where the rewards agree,
  ``disagree_weight`` where they do not) for the caller to multiply into the loss;
- ``drop``: discard the whole batch when the share of disagreements exceeds ``max_disagreement``;
- ``off``: only count.

Texts come from ``PromptGroup.completion_texts``; when a batch carries none, a ``decode(ids) -> str``
callback is used, which is only valid when the receiver's tokenizer is the sender's (pass
``tokenizer_fp`` to have that checked). A completion that cannot be checked (no text, no decoder, a
tokenizer mismatch, or a task family the receiver has no rule for) is *unverifiable*: counted, and
handled as ``on_unverifiable`` says (``reject``: treated as a disagreement; ``trust``: claim kept).

``replace`` and ``downweight`` recompute rewards from the same function the sender should have used;
a replaced batch is the receiver's local copy (its signature covered the original).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ftis_fed.wire.batch import BatchValidationError, CompletionBatch, PromptGroup
from ftis_fed.knobs import knob
from ftis_fed.tasks.rewards import Verifier

REVERIFY_ACTIONS = ("replace", "downweight", "drop", "off")


@dataclass(frozen=True)
class ReverifyConfig:
    """How a receiver treats claimed rewards; each field is a Flower run-config key (``knob``)."""

    action: str = knob("reverify-action", "replace", "one of ``REVERIFY_ACTIONS``: replace, downweight, drop, off.")
    tol: float = knob("reverify-tol", 1e-4,
                      "a claim disagrees when it differs from the recomputed reward by more, >= 0.")
    max_disagreement: float = knob("reverify-max-disagreement", 0.0, """
        ``drop`` only: the batch is dropped when the share of disagreeing checked completions exceeds
        this, in [0, 1) (0.0: any disagreement drops it).""")
    disagree_weight: float = knob("reverify-disagree-weight", 0.0,
                                  "``downweight`` only: weight of a disagreeing completion, in [0, 1].")
    on_unverifiable: str = knob("reverify-on-unverifiable", "reject", """
        ``reject`` (default: count as a disagreement; under ``replace`` its reward becomes 0) or
        ``trust`` (keep the claim).""")
    quarantine_after: int = knob("reverify-quarantine-after", 0, """
        a receiver ignores a sender for the rest of the run once this many of its signed batches
        disagreed (a claimed reward or reference differed from the receiver's own, or the batch was
        refused for its content), >= 0 (0: never quarantine).""")
    time_budget_s: float = knob("reverify-time-budget-s", 10.0, """
        seconds, > 0: wall-clock budget of a receiver's content checks and re-scoring of one peer batch
        (the receiver's reward functions included, and the phrase check's re-scoring of that batch); a
        batch past it is dropped (``offpolicy/rejected/time_budget``, shown on the console), never the
        round. Raise it for slow reward functions.""")

    def __post_init__(self) -> None:
        if self.action not in REVERIFY_ACTIONS:
            raise ValueError(f"reverify.action={self.action!r}: must be one of {REVERIFY_ACTIONS}")
        if not (math.isfinite(self.tol) and self.tol >= 0):
            raise ValueError(f"reverify.tol={self.tol!r}: must be finite and >= 0")
        if not 0.0 <= self.max_disagreement < 1.0:
            raise ValueError(f"reverify.max_disagreement={self.max_disagreement!r}: must be in [0, 1)")
        if not 0.0 <= self.disagree_weight <= 1.0:
            raise ValueError(f"reverify.disagree_weight={self.disagree_weight!r}: must be in [0, 1]")
        if self.on_unverifiable not in ("reject", "trust"):
            raise ValueError(f"reverify.on_unverifiable={self.on_unverifiable!r}: must be 'reject' or 'trust'")
        if not (isinstance(self.time_budget_s, (int, float)) and not isinstance(self.time_budget_s, bool)
                and math.isfinite(self.time_budget_s) and self.time_budget_s > 0):
            raise ValueError(f"reverify-time-budget-s={self.time_budget_s!r}: must be a finite number of seconds > 0")
        if isinstance(self.quarantine_after, bool) or int(self.quarantine_after) != self.quarantine_after \
                or self.quarantine_after < 0:
            raise ValueError(f"reverify.quarantine_after={self.quarantine_after!r}: must be an integer >= 0")


@dataclass(frozen=True)
class ReverifyResult:
    """What a receiver learns from re-verifying one batch.

    batch: the batch to train on: the original (``downweight`` / ``off``), one with recomputed rewards
        (``replace``), or None when dropped.
    weights: ``downweight`` only: per group, (G,) float32 completion weights; else None.
    recomputed: per group, (G,) float32 recomputed rewards (NaN where unverifiable).
    agree: per group, (G,) bool, True where the claim was checked and agrees.
    metrics: counters under ``reward/`` (see ``reverify``).
    """

    batch: CompletionBatch | None
    weights: tuple[np.ndarray, ...] | None
    recomputed: tuple[np.ndarray, ...]
    agree: tuple[np.ndarray, ...]
    metrics: dict[str, float]


def group_texts(group: PromptGroup, decode: Callable[[Sequence[int]], str] | None) -> list[str] | None:
    """The G completion texts of ``group``: carried texts, else ``decode`` of the ids, else None."""
    if group.completion_texts:
        return list(group.completion_texts)
    if decode is None:
        return None
    return [decode([int(t) for t in ids]) for ids in group.completion_ids]


def checkable(batch: CompletionBatch, verifier: Verifier,
              decode: Callable[[Sequence[int]], str] | None = None) -> tuple[bool, ...]:
    """Per group: can this receiver recompute its rewards (texts or a decoder, and a rule)?"""
    return tuple((bool(g.completion_texts) or decode is not None) and verifier.knows(g.task_id)
                 for g in batch.groups)


def recompute_rewards(batch: CompletionBatch, verifier: Verifier,
                      decode: Callable[[Sequence[int]], str] | None = None,
                      deadline: float | None = None, own_ids: Sequence | None = None) -> tuple[np.ndarray, ...]:
    """Per group, (G,) float32 rewards by ``verifier``; NaN where a completion cannot be checked
    (``checkable``) or where the task's reward functions gave it no reward (TRL's None).

    deadline: a ``time.monotonic()`` value; past it, BatchValidationError ``time_budget`` (checked
    after every group, so one batch's scoring can never hold a round for long).
    own_ids: per group, None or the completions' ids in the receiver's tokenizer (another tokenizer's
        batch), given to the reward functions as ``completion_ids`` instead of the sender's.
    """
    out = []
    for gi, (g, ok) in enumerate(zip(batch.groups, checkable(batch, verifier, decode))):
        if not ok:
            out.append(np.full(g.size, np.nan, dtype=np.float32))
            continue
        ids = own_ids[gi] if own_ids is not None and own_ids[gi] is not None else g.completion_ids
        rewards = verifier.group_rewards(g.task_id, group_texts(g, decode), g.reference, g.prompt_text, ids)
        if deadline is not None and time.monotonic() > deadline:
            raise BatchValidationError("time_budget", f"groups[{gi}]: re-scoring the batch ran past its "
                                                      "time budget")
        out.append(np.array(rewards, dtype=np.float32))
    return tuple(out)


def reverify(batch: CompletionBatch, verifier: Verifier, config: ReverifyConfig = ReverifyConfig(),
             decode: Callable[[Sequence[int]], str] | None = None,
             tokenizer_fp: str | None = None, deadline: float | None = None,
             own_ids: Sequence | None = None) -> ReverifyResult:
    """Recompute ``batch``'s rewards with ``verifier`` and apply ``config.action``.

    decode: ids -> text, used for groups without ``completion_texts``.
    tokenizer_fp: the receiver's tokenizer fingerprint; when given and different from the batch's,
        ``decode`` is not used (it would decode someone else's ids) and such groups are unverifiable.
    deadline, own_ids: see ``recompute_rewards``.

    The reference and texts scored are the batch's: a receiver passes its own copy, with its own
    reference and prompt for each task id and the texts it will train on (``receive/frames.py``), so
    nothing a sender claims about the truth is used.

    Metrics: ``reward/checked`` (completions recomputed), ``reward/disagreements``,
    ``reward/inflated`` / ``reward/deflated`` (claimed above / below recomputed),
    ``reward/unverifiable``, ``reward/disagreement_rate`` (disagreements / checked, 0 when none),
    ``reward/claimed_mean`` / ``reward/recomputed_mean`` (over checked), ``reward/dropped`` (0/1),
    ``reward/replaced`` (completions whose reward changed).
    """
    if decode is not None and tokenizer_fp is not None and tokenizer_fp != batch.tokenizer_fp:
        decode = None
    recomputed = recompute_rewards(batch, verifier, decode, deadline, own_ids)
    claimed = tuple(np.asarray(g.rewards, dtype=np.float32) for g in batch.groups)

    checked_mask = tuple(np.full(g.size, ok) for g, ok in zip(batch.groups, checkable(batch, verifier, decode)))
    agree = tuple(m & _same(c, r, config.tol) for c, r, m in zip(claimed, recomputed, checked_mask))
    n_checked = int(sum(m.sum() for m in checked_mask))
    n_unverifiable = int(sum((~m).sum() for m in checked_mask))
    disagree_checked = tuple(m & ~a for m, a in zip(checked_mask, agree))
    n_dis = int(sum(d.sum() for d in disagree_checked))
    inflated = int(sum(((c > np.nan_to_num(r) + config.tol) & m).sum()
                       for c, r, m in zip(claimed, recomputed, checked_mask)))
    reject_unverifiable = config.on_unverifiable == "reject"
    n_bad = n_dis + (n_unverifiable if reject_unverifiable else 0)
    n_judged = n_checked + (n_unverifiable if reject_unverifiable else 0)

    metrics = {
        "reward/checked": float(n_checked),
        "reward/disagreements": float(n_dis),
        "reward/inflated": float(inflated),
        "reward/deflated": float(n_dis - inflated),
        "reward/unverifiable": float(n_unverifiable),
        "reward/disagreement_rate": n_bad / n_judged if n_judged else 0.0,
        "reward/claimed_mean": _masked_mean(claimed, checked_mask),
        "reward/recomputed_mean": _masked_mean(recomputed, checked_mask),
        "reward/dropped": 0.0,
        "reward/replaced": 0.0,
    }

    # "ok" per completion: agrees, or unverifiable and trusted.
    ok = tuple(a | (~m if not reject_unverifiable else np.zeros_like(m)) for a, m in zip(agree, checked_mask))

    if config.action == "drop" and n_judged and n_bad / n_judged > config.max_disagreement:
        metrics["reward/dropped"] = 1.0
        return ReverifyResult(None, None, recomputed, agree, metrics)
    if config.action == "downweight":
        weights = tuple(np.where(o, 1.0, config.disagree_weight).astype(np.float32) for o in ok)
        return ReverifyResult(batch, weights, recomputed, agree, metrics)
    if config.action == "replace":
        new_groups, changed = [], 0
        for g, c, r, m in zip(batch.groups, claimed, recomputed, checked_mask):
            fill = c if not reject_unverifiable else np.zeros_like(c)
            new = np.where(m, r, fill).astype(np.float32)          # NaN stays NaN: no reward
            changed += int((~_same(new, c, config.tol)).sum())
            new_groups.append(dataclasses.replace(g, rewards=new))
        metrics["reward/replaced"] = float(changed)
        return ReverifyResult(dataclasses.replace(batch, groups=tuple(new_groups)), None, recomputed, agree, metrics)
    return ReverifyResult(batch, None, recomputed, agree, metrics)


def _same(a: np.ndarray, b: np.ndarray, tol: float) -> np.ndarray:
    """Elementwise: within ``tol``, or both NaN (both say "no reward")."""
    with np.errstate(invalid="ignore"):
        return (np.abs(a - b) <= tol) | (np.isnan(a) & np.isnan(b))


def _masked_mean(arrays: tuple[np.ndarray, ...], masks: tuple[np.ndarray, ...]) -> float:
    vals = np.concatenate([a[m] for a, m in zip(arrays, masks) if m.any()] or [np.zeros(0)])
    vals = vals[~np.isnan(vals)]
    return float(np.mean(vals)) if vals.size else 0.0
