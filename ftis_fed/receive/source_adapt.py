"""``source-adapt = kl``: each peer's negative advantages times exp(-m_s / tau), m_s the running mean
of the sample KL the receiver measured on that peer's samples (``learn/source_weights.py``: the rule,
its knobs ``SourceAdaptConfig`` and the state). On in every run: it observes the KL after every step
and reports ``adapt/<peer>/{weight, kl_ema}`` (weight 1 unless ``kl``), and weights only under ``kl``.
Its knobs also say ``guard`` (``source-adapt = guard``, ``source-adapt-val-size``,
``source-adapt-val-families``, ``source-adapt-val-score``, ``source-adapt-align``,
``source-adapt-window``), which replaces the optimizer step (``Participant``: ``learn/guard.py``), and
``shadow`` (``source-adapt-period``, ``-val-samples``, ``-z``), which trains a copy alone beside it
(``learn/shadow.py``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ftis_fed.learn.source_weights import SourceAdaptConfig, SourceAdapter
from ftis_fed.receive.checks import Check, Receiver, Update, register_check

if TYPE_CHECKING:
    from ftis_fed.learn.training import TrainSample


@register_check("source-adapt")
class SourceAdapt(Check):
    order = 40
    knobs = SourceAdaptConfig

    def __init__(self, receiver: Receiver):
        self.receiver = receiver
        self.adapter = SourceAdapter(self.knobs_of(receiver), receiver.name)

    @classmethod
    def build(cls, receiver: Receiver) -> "SourceAdapt":
        return cls(receiver)

    def __call__(self, samples: list[TrainSample], update: Update) -> dict[str, float]:
        if self.adapter.cfg.mode == "kl":
            for s in samples:
                w = 1.0 if s.local or s.advantage >= 0 else self.adapter.weight(s.source)
                if w != 1.0:
                    s.reweight(w)
        return {}

    def after_step(self, trainer) -> dict[str, float]:
        self.adapter.observe(trainer.source_kl)
        return self.adapter.metrics()

    def state(self) -> dict:
        return self.adapter.to_json()

    def restore(self, state: dict) -> None:
        self.adapter = SourceAdapter.from_json(self.knobs_of(self.receiver), self.receiver.name, state)
