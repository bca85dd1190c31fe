"""``reverify-action = downweight``: each peer completion whose claimed reward disagrees with the
receiver's own gets the weight ``frames.receive`` gave it (``reverify-downweight``; knobs:
``ReverifyConfig``, ``trust/reverify.py``). The other actions decide per batch in ``frames.receive``
(replace the rewards, drop the batch, or leave it)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ftis_fed.receive.checks import Check, Receiver, Update, register_check

if TYPE_CHECKING:
    from ftis_fed.learn.training import TrainSample


@register_check("reverify")
class Reverified(Check):
    order = 0

    @classmethod
    def build(cls, receiver: Receiver) -> "Reverified | None":
        return cls() if receiver.fed.reverify.action == "downweight" else None

    def __call__(self, samples: list[TrainSample], update: Update) -> dict[str, float]:
        for s in samples:
            weights = update.received.weights_of(s.batch) if update.received is not None else None
            if weights is not None:
                s.reweight(float(weights[s.group_index][s.index]))
        return {}
