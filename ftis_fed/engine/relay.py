"""Pure helpers of the engine (no Flower, no I/O): which frames go to whom, when to evaluate."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ftis_fed.wire.batch import CompletionBatch
from ftis_fed.wire.codec import WireHeader


@dataclass(frozen=True)
class VerifiedFrame:
    """A signed batch the server has verified, with its header as parsed then (who signed it, for
    which round, how big): nothing downstream parses the frame again."""

    header: WireHeader
    frame: bytes
    frame_texts: bytes | None = None    # the same batch signed with its texts (for other tokenizers)

    # who signed it, for which round, how many completions and completion tokens: read from the header
    sender = property(lambda self: self.header.sender)
    round = property(lambda self: self.header.round)
    completions = property(lambda self: self.header.n_completions)
    tokens = property(lambda self: self.header.n_completion_tokens)

    def for_receiver(self, texts: bool) -> tuple[bytes, bool]:
        """(the variant a receiver gets, whether it carries texts): with texts when it needs them
        and the sender made one."""
        if texts and self.frame_texts is not None:
            return self.frame_texts, True
        return self.frame, self.header.has_texts


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


def receiver_needs_texts(mode: str, sender_fp: str, receiver_fp: str) -> bool:
    """Whether ``receiver`` must get a sender's completion texts (``wire-texts``): always / never /
    auto = only when its tokenizer differs from the sender's."""
    if mode == "always":
        return True
    if mode == "never":
        return False
    return sender_fp != receiver_fp


def text_variants(mode: str, sender_fp: str, receiver_fps: Sequence[str]) -> tuple[bool, ...]:
    """The frame variants a sender signs each round, in this order: ``(False,)`` (no texts),
    ``(True,)`` (texts only: every receiver needs them) or ``(False, True)`` (both: the receivers
    with the sender's tokenizer get the frame without texts, the others the one with texts).
    ``receiver_fps``: the tokenizers of the sender's receivers (everyone else)."""
    needs = {receiver_needs_texts(mode, sender_fp, fp) for fp in receiver_fps}
    return tuple(sorted(needs)) or (False,)


def texts_differ(a: CompletionBatch, b: CompletionBatch) -> str:
    """'' when two batches are the same apart from their texts (prompt_text, completion_texts),
    else the first field that differs (e.g. ``groups[2].logprobs``)."""
    for f in ("sender", "run_id", "round", "seq", "model_id", "tokenizer_fp", "vocab_size", "sampling",
              "prompt_digest"):
        if getattr(a, f) != getattr(b, f):
            return f
    if len(a.groups) != len(b.groups):
        return "groups"
    for i, (g, h) in enumerate(zip(a.groups, b.groups)):
        if g.task_id != h.task_id or g.reference != h.reference:
            return f"groups[{i}].task_id/reference"
        if not np.array_equal(g.prompt_ids, h.prompt_ids):
            return f"groups[{i}].prompt_ids"
        if not np.array_equal(np.asarray(g.rewards), np.asarray(h.rewards), equal_nan=True):
            return f"groups[{i}].rewards"
        for f in ("completion_ids", "logprobs"):
            x, y = getattr(g, f), getattr(h, f)
            if len(x) != len(y) or not all(np.array_equal(u, v) for u, v in zip(x, y)):
                return f"groups[{i}].{f}"
    return ""


def is_eval_round(round: int, num_rounds: int, every: int) -> bool:
    """Evaluate before training (round 0), every ``every`` rounds, and after the last round."""
    if every <= 0:
        return False
    return round == 0 or round % every == 0 or round == num_rounds
