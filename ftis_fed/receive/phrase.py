"""``peer-phrase-ratio``: a rewarded peer sample that carries a phrase the receiver itself never says,
and whose reward does not need it, is dropped (``learn/phrases.py``: the counting and the rules,
docs/security.md). Knobs: ``PhraseKnobs`` (``peer-phrase-ratio``, ``peer-phrase-min-share``,
``peer-phrase-min-count``). State: the counters and flags (``PhraseMonitor.to_json``).

Per update, in the batches' order: the receiver's own completions are counted, then each peer's
rewarded ones: reward above the mean of the group its advantage is computed in (vertical: the
sender's G completions of the prompt; horizontal: the mixed group of every sender's completions of
the task, the receiver's own included, so a peer whose whole share is correct is counted too); then,
per peer batch, every rewarded sample still weighted that holds a phrase flagged for its sender and
``unearned`` is dropped (reason ``phrase``).

The re-scoring is bounded per frame: at most ``CALLS_PER_COMPLETION`` verifier calls per completion of
the frame in all, and only within what is left of the frame's time budget
(``reverify-time-budget-s``, less what ``frames.receive`` spent on that frame). A rewarded sample
holding a flagged phrase that the budget leaves unchecked is dropped (reason ``phrase_budget``): the
cost of a frame built to be expensive falls on its sender's samples only.
Metrics: ``phrase/<sender>/flagged`` (phrases), ``.../dropped`` (completions, both reasons),
``.../dropped_frac``, ``.../unchecked`` (dropped for the budget; only when any).
Off in a local-only mode (nothing of a peer is trained on).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ftis_fed.knobs import knob, need
from ftis_fed.learn.modes import MODES
from ftis_fed.learn.phrases import PhraseMonitor, contains, unearned
from ftis_fed.receive.checks import Check, Receiver, Update, groups_of, register_check

if TYPE_CHECKING:
    from ftis_fed.learn.training import TrainSample

#: verifier calls the phrase check may spend per completion of a peer frame, over the whole frame
#: (``unearned`` tries up to 16 phrases for one completion; an honest frame needs about one call per
#: rewarded completion that holds a flagged phrase)
CALLS_PER_COMPLETION = 4


@dataclass(frozen=True)
class PhraseKnobs:
    """Receiver check `phrase`: phrases a peer's rewarded samples carry and the receiver never says.

    Each field is a run-config key (``knob``)."""

    ratio: float = knob("peer-phrase-ratio", 0.0, """
        > 0: the phrase check (``learn/phrases.py``): a peer's rewarded sample (reward above its group's
        mean) is dropped from the update when it carries a character n-gram that is in at least
        ``peer-phrase-min-share`` of that peer's rewarded completions so far and this many times more
        often than in the receiver's *own* completions, and that its reward does not need (deleted,
        the receiver's own verifier scores the text as high). It bounds a payload made of tokens the
        receiver already finds likely, which ``peer-surprisal-max`` cannot see (docs/security.md).
        0 (default) = off, else >= 1.""")
    min_share: float = knob("peer-phrase-min-share", 0.05, """
        with ``peer-phrase-ratio``: the least share of a peer's rewarded completions a phrase must be in
        to be flagged, in (0, 1); also sets the counters' memory (lossy counting, error half of this).""")
    min_count: int = knob("peer-phrase-min-count", 8, """
        with ``peer-phrase-ratio``: the least number of a peer's rewarded completions a phrase must be in
        to be flagged, >= 1 (no verdict from a handful of samples).""")

    def __post_init__(self) -> None:
        need(self, self.ratio == 0 or self.ratio >= 1, "ratio", "must be 0 (off) or >= 1")
        need(self, 0 < self.min_share < 1, "min_share", "must be in (0, 1)")
        need(self, self.min_count >= 1, "min_count", "must be >= 1")


def rewarded_in_advantage_groups(samples: list[TrainSample]) -> dict[int, bool]:
    """Per sample (by ``id``): its reward is above the mean of its advantage group (``TrainSample.group``),
    the rewards being the receiver's own (the batches' after re-scoring)."""
    rewards: dict[str, list[float]] = {}
    for s in samples:
        rewards.setdefault(s.group, []).append(float(s.batch.groups[s.group_index].rewards[s.index]))
    mean = {k: sum(v) / len(v) for k, v in rewards.items()}
    return {id(s): float(s.batch.groups[s.group_index].rewards[s.index]) > mean[s.group] + 1e-9 for s in samples}


@register_check("phrase")
class PhraseCheck(Check):
    order = 10
    knobs = PhraseKnobs

    def __init__(self, receiver: Receiver, monitor: PhraseMonitor):
        self.receiver, self.monitor = receiver, monitor

    @classmethod
    def build(cls, receiver: Receiver) -> "PhraseCheck | None":
        monitor = PhraseMonitor.from_config(cls.knobs_of(receiver))
        return None if monitor is None or MODES[receiver.fed.objective.mode].local_only else cls(receiver, monitor)

    def __call__(self, samples: list[TrainSample], update: Update) -> dict[str, float]:
        rec, mon = self.receiver, self.monitor
        groups = groups_of(samples)
        up = rewarded_in_advantage_groups(samples)
        texts = {}
        for batch, gi, rows in groups:
            texts[(id(batch), gi)] = rec.texts(batch.groups[gi])
            if rows[0].local:
                mon.observe_own(texts[(id(batch), gi)])
        for batch, gi, rows in groups:
            if not rows[0].local:
                mon.observe_peer(batch.sender, [texts[(id(batch), gi)][s.index] for s in rows if up[id(s)]])
        peers: dict[int, tuple] = {}
        for batch, gi, rows in groups:
            if not rows[0].local:
                peers.setdefault(id(batch), (batch, []))[1].append((gi, rows))
        metrics: dict[str, float] = {}
        budget_s = rec.fed.reverify.time_budget_s
        for batch, batch_groups in peers.values():
            flagged, dropped, unchecked = mon.flagged(batch.sender), 0, 0
            calls, max_calls = [0], CALLS_PER_COMPLETION * batch.num_completions
            spent = update.received.seconds_of(batch) if update.received is not None else 0.0
            deadline = time.monotonic() + max(0.0, budget_s - spent)

            def score(text, g):
                calls[0] += 1
                return rec.reward(g, text)

            for gi, rows in batch_groups if flagged else ():
                g = batch.groups[gi]
                for s in rows:
                    text = texts[(id(batch), gi)][s.index]
                    if not (up[id(s)] and s.weight != 0):
                        continue
                    held = contains(text, flagged)
                    if not held:
                        continue
                    left = max_calls - calls[0]
                    if left <= 0 or time.monotonic() > deadline:
                        s.drop("phrase_budget")
                        dropped, unchecked = dropped + 1, unchecked + 1
                        continue
                    tries = min(16, left)
                    if unearned(text, flagged, float(g.rewards[s.index]), lambda t, g=g: score(t, g),
                                max_tries=tries) is not None:
                        s.drop("phrase")
                        dropped += 1
                    elif tries < 16 and len(held) > tries:   # the budget cut the phrases tried short
                        s.drop("phrase_budget")
                        dropped, unchecked = dropped + 1, unchecked + 1
            metrics[f"phrase/{batch.sender}/flagged"] = float(len(flagged))
            metrics[f"phrase/{batch.sender}/dropped"] = float(dropped)
            metrics[f"phrase/{batch.sender}/dropped_frac"] = dropped / max(1, batch.num_completions)
            if unchecked:
                metrics[f"phrase/{batch.sender}/unchecked"] = float(unchecked)
        return metrics

    def state(self) -> dict:
        return self.monitor.to_json()

    def restore(self, state: dict) -> None:
        self.monitor = PhraseMonitor.from_json(self.knobs_of(self.receiver), state)
