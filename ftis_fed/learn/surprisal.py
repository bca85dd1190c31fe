"""Which of a peer's surprising tokens the reward needs: the refinement of ``peer-surprisal-max``.

``peer-surprisal-max`` (``objective.surprising_rows``) drops a peer's sample with any token the receiver
finds more than S nats improbable. That also drops what a federation is for: a correct answer from a
peer that knows more (a specialist's digits, improbable to a receiver that cannot yet solve the task).
The receiver can tell the two apart with its own verifier: delete the surprising tokens and score what
is left. If the reward drops, the surprising tokens carry the answer (``needed``): the sample is kept.
If it does not, they earned nothing — a payload riding on a correct answer — and the sample is
dropped as before. Nothing the sender claims is used: the receiver's own log-probs, its own decoding
and its own verifier (``peer-surprisal-keep-needed``, on by default when the check is on).

Pure: ``needed_rows`` takes the receiver's log-probs of each completion, the completions, their
receiver-recomputed rewards and a ``reward(ids) -> float`` of the group's task.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np


def ablate(ids: Sequence[int], logp: Sequence[float], s_max: float) -> list[int]:
    """``ids`` without the tokens of surprisal -logp above ``s_max``."""
    return [int(t) for t, lp in zip(ids, logp) if -float(lp) <= s_max]


def needed_rows(completions: Sequence[Sequence[int]], logps: Sequence[Sequence[float]], rewards: Sequence[float],
                s_max: float, reward: Callable[[Sequence[int]], float]) -> list[bool]:
    """Per completion: it has a token above ``s_max`` nats and its reward without those tokens is lower
    than its reward (the surprising tokens carry the answer). False for a completion without such a
    token (nothing to exempt) and for one whose reward the deletion leaves as it is, or raises."""
    out = []
    for ids, lp, r in zip(completions, logps, rewards):
        lp = np.asarray(lp, dtype=np.float64)[:len(ids)]
        if s_max <= 0 or not bool((-lp > s_max).any()) or not np.isfinite(r):
            out.append(False)
            continue
        out.append(float(reward(ablate(ids, lp, s_max))) < float(r))
    return out
