"""``peer-surprisal-keep-needed``: which peer samples ``peer-surprisal-max`` keeps although surprising.

The drop itself is the objective's (``objective.surprising_rows``: a peer's row with a token above
``peer-surprisal-max`` nats under the receiver's policy of the step). This check scores each peer
group of the receiver's tokenizer under the receiver's current policy, deletes each completion's
surprising tokens and re-scores the rest with its own verifier (``learn/surprisal.needed_rows``): where
the reward drops, the surprising tokens carry the answer and the sample is exempt
(``TrainSample.surprisal_exempt``). Knobs: ``peer-surprisal-max``, ``peer-surprisal-keep-needed``
(``ObjectiveConfig``). Metric: ``train/surprisal_exempt``.
"""

from __future__ import annotations

from ftis_fed.learn.surprisal import needed_rows
from ftis_fed.learn.training import TrainSample
from ftis_fed.receive.checks import Check, Receiver, Update, groups_of, register_check


@register_check("surprisal-keep-needed")
class KeepNeeded(Check):
    order = 20

    def __init__(self, receiver: Receiver):
        self.receiver = receiver

    @classmethod
    def build(cls, receiver: Receiver) -> "KeepNeeded | None":
        obj = receiver.fed.objective
        return cls(receiver) if obj.peer_surprisal_max > 0 and obj.peer_surprisal_keep_needed else None

    def __call__(self, samples: list[TrainSample], update: Update) -> dict[str, float]:
        rec, n = self.receiver, 0
        s_max = rec.fed.objective.peer_surprisal_max
        for batch, gi, rows in groups_of(samples):
            if rows[0].local or rows[0].seq_level:          # own samples; another tokenizer: no token-level check
                continue
            g = batch.groups[gi]
            comps = [c.tolist() for c in g.completion_ids]
            lp = rec.policy.score_padded([g.prompt_ids.tolist()] * len(comps), comps, rec.fed.sampling, False)
            needed = needed_rows(comps, lp.tolist(), g.rewards.tolist(), s_max,
                                 lambda ids, g=g: rec.reward(g, rec.decode(ids)))
            for s in rows:
                s.surprisal_exempt = bool(needed[s.index])
            n += sum(needed)
        return {"train/surprisal_exempt": float(n)}
