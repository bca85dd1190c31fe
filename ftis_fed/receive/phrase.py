"""``peer-phrase-ratio``: a rewarded peer sample that carries a phrase the receiver itself never says,
and whose reward does not need it, is dropped (``learn/phrases.py``: the counting and the rules,
docs/security.md). Knobs: ``peer-phrase-ratio``, ``peer-phrase-min-share``, ``peer-phrase-min-count``
(``ObjectiveConfig``). State: the counters and flags (``PhraseMonitor.to_json``).

Per update, in the batches' order: the receiver's own completions are counted, then each peer's
rewarded ones (reward above its group's mean); then, per peer batch, every rewarded sample still
weighted that holds a phrase flagged for its sender and ``unearned`` is dropped (reason ``phrase``).
Metrics: ``phrase/<sender>/flagged`` (phrases), ``.../dropped`` (completions), ``.../dropped_frac``.
Off in a local-only mode (nothing of a peer is trained on).
"""

from __future__ import annotations

from ftis_fed.learn.modes import MODES
from ftis_fed.learn.phrases import PhraseMonitor, rewarded, unearned
from ftis_fed.learn.training import TrainSample
from ftis_fed.receive.checks import Check, Receiver, Update, groups_of, register_check


@register_check("phrase")
class PhraseCheck(Check):
    order = 10

    def __init__(self, receiver: Receiver, monitor: PhraseMonitor):
        self.receiver, self.monitor = receiver, monitor

    @classmethod
    def build(cls, receiver: Receiver) -> "PhraseCheck | None":
        obj = receiver.fed.objective
        monitor = PhraseMonitor.from_config(obj)
        return None if monitor is None or MODES[obj.mode].local_only else cls(receiver, monitor)

    def __call__(self, samples: list[TrainSample], update: Update) -> dict[str, float]:
        rec, mon = self.receiver, self.monitor
        groups = groups_of(samples)
        read = {}
        for batch, gi, rows in groups:
            g = batch.groups[gi]
            if rows[0].local:
                mon.observe_own(rec.texts(g))
            else:
                read[(id(batch), gi)] = (rec.texts(g), rewarded(g.rewards.tolist()))
        for batch, gi, rows in groups:
            if not rows[0].local:
                texts, up = read[(id(batch), gi)]
                mon.observe_peer(batch.sender, [t for t, u in zip(texts, up) if u])
        metrics: dict[str, float] = {}
        peers: dict[int, tuple] = {}
        for batch, gi, rows in groups:
            if not rows[0].local:
                peers.setdefault(id(batch), (batch, []))[1].append((gi, rows))
        for batch, batch_groups in peers.values():
            flagged, dropped = mon.flagged(batch.sender), 0
            for gi, rows in batch_groups if flagged else ():
                g = batch.groups[gi]
                texts, up = read[(id(batch), gi)]
                for s in rows:
                    if up[s.index] and s.weight != 0 and unearned(texts[s.index], flagged, float(g.rewards[s.index]),
                                                                  lambda t, g=g: rec.reward(g, t)) is not None:
                        s.drop("phrase")
                        dropped += 1
            metrics[f"phrase/{batch.sender}/flagged"] = float(len(flagged))
            metrics[f"phrase/{batch.sender}/dropped"] = float(dropped)
            metrics[f"phrase/{batch.sender}/dropped_frac"] = dropped / max(1, batch.num_completions)
        return metrics

    def state(self) -> dict:
        return self.monitor.to_json()

    def restore(self, state: dict) -> None:
        self.monitor = PhraseMonitor.from_json(self.receiver.fed.objective, state)
