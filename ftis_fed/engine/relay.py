"""Pure helpers of the engine (no Flower, no I/O): which frames go to whom, when to evaluate."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class VerifiedFrame:
    """A signed batch the server has verified: who signed it, for which round, how big."""

    sender: str
    round: int
    completions: int
    tokens: int
    frame: bytes


def select_for_receiver(frames: Sequence[VerifiedFrame], receiver: str, budget: int, rotation: int) -> list[VerifiedFrame]:
    """Peers' frames for ``receiver``: everyone's but its own, whole frames while the total number
    of completions stays within ``budget`` (0 = no limit). The starting peer rotates with
    ``rotation`` (e.g. the round) so a tight budget is shared fairly across rounds."""
    peers = sorted((f for f in frames if f.sender != receiver), key=lambda f: f.sender)
    if not peers:
        return []
    k = rotation % len(peers)
    peers = peers[k:] + peers[:k]
    if budget <= 0:
        return peers
    out, used = [], 0
    for f in peers:
        if used + f.completions <= budget:
            out.append(f)
            used += f.completions
    return out


def texts_needed(mode: str, tokenizer_fps: Sequence[str]) -> bool:
    """Whether batches must carry completion texts (``wire-texts``): always / never / auto =
    only when the participants do not all share one tokenizer."""
    if mode == "always":
        return True
    if mode == "never":
        return False
    return len(set(tokenizer_fps)) > 1


def is_eval_round(round: int, num_rounds: int, every: int) -> bool:
    """Evaluate before training (round 0), every ``every`` rounds, and after the last round."""
    if every <= 0:
        return False
    return round == 0 or round % every == 0 or round == num_rounds
