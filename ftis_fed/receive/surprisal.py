"""``peer-surprisal-max``: a peer's sample with a token the receiver finds more than S nats improbable is
dropped from the update, unless its reward needs those tokens (``peer-surprisal-keep-needed``).

The check sets each sample's ``surprisal_limit`` (S; ``inf`` for an exempt one); the drop itself is the
objective's, under the policy of the optimizer step (``objective.surprising_rows``: a peer's row with a
token above its limit; the receiver's own rows never). With ``peer-surprisal-keep-needed`` it first
scores each peer group of the receiver's tokenizer under the receiver's current policy, deletes each
completion's surprising tokens and re-scores the rest with its own verifier
(``learn/surprisal.needed_rows``): where the reward drops, the surprising tokens carry the answer and
the sample is exempt. Knobs: ``SurprisalKnobs``. Metric: ``train/surprisal_exempt`` (with keep-needed);
the objective's ``offpolicy/<source>/surprising_frac``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ftis_fed.knobs import knob, need
from ftis_fed.learn.surprisal import needed_rows
from ftis_fed.receive.checks import Check, Receiver, Update, groups_of, register_check

if TYPE_CHECKING:
    from ftis_fed.learn.training import TrainSample


@dataclass(frozen=True)
class SurprisalKnobs:
    """Receiver check `surprisal`: a peer's tokens the receiver itself finds improbable.

    Each field is a run-config key (``knob``)."""

    max_nats: float = knob("peer-surprisal-max", 0.0, """
        > 0: a peer's sample is dropped from the update (advantage 0, whatever its sign and whatever the
        sender claims) when any of its tokens has a surprisal -log pi_theta(token | prefix) above this
        many nats under the *receiver's own* current policy and sampling distribution
        (``surprising_rows``): the receiver cannot check a peer's claimed log-probs, but it computes its
        own likelihood of every token it trains on. It bounds poisoning with correct answers (a payload
        the receiver would never produce rides on a positive advantage, which the F filter always keeps;
        docs/security.md). The receiver's own samples are never dropped. 0 (default) = off, >= 0.""")
    keep_needed: bool = knob("peer-surprisal-keep-needed", True, """
        with ``peer-surprisal-max``: keep a peer's sample whose surprising tokens its reward needs
        (``learn/surprisal.py``: deleted, the receiver's own verifier scores the rest lower: a
        specialist's correct answer the receiver cannot yet give), drop the others (a payload on a
        correct answer earns nothing); false: drop every such sample.""")

    def __post_init__(self) -> None:
        need(self, self.max_nats >= 0 and not math.isnan(self.max_nats), "max_nats", "must be >= 0 (0 = off)")


@register_check("surprisal")
class Surprisal(Check):
    order = 20
    knobs = SurprisalKnobs

    def __init__(self, receiver: Receiver, cfg: SurprisalKnobs):
        self.receiver, self.cfg = receiver, cfg

    @classmethod
    def build(cls, receiver: Receiver) -> "Surprisal | None":
        cfg = cls.knobs_of(receiver)
        return cls(receiver, cfg) if cfg.max_nats > 0 else None

    def __call__(self, samples: list[TrainSample], update: Update) -> dict[str, float]:
        s_max = self.cfg.max_nats
        for s in samples:
            s.surprisal_limit = s_max
        if not self.cfg.keep_needed:
            return {}
        rec, n = self.receiver, 0
        for batch, gi, rows in groups_of(samples):
            if rows[0].local or rows[0].seq_level:          # own samples; another tokenizer: no token-level check
                continue
            g = batch.groups[gi]
            comps = [c.tolist() for c in g.completion_ids]
            lp = rec.policy.score_padded([g.prompt_ids.tolist()] * len(comps), comps, rec.fed.sampling, False)
            needed = needed_rows(comps, lp.tolist(), g.rewards.tolist(), s_max,
                                 lambda ids, g=g: rec.reward(g, rec.decode(ids)))
            for s in rows:
                if needed[s.index]:
                    s.surprisal_limit = math.inf
            n += sum(needed)
        return {"train/surprisal_exempt": float(n)}
