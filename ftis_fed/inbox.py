"""What a receiver (or the relaying server) does with incoming signed frames.

    frame -> verify (sender's key) -> run / round / replay check -> decode -> validate
          -> tokenizer classification -> commit to the replay guard -> Accepted

Each step raises :class:`BatchValidationError` with a stable reason; the inbox counts every
rejection per reason and ``accept_many`` never lets one bad frame stop a round or discard the good
frames beside it. The replay check runs before decoding (cheap) but is committed only once the
batch is accepted, so a rejected batch does not use up its sequence number.

Reasons (``REASONS``): from the header and signature ``missing_field`` (no frame), ``undecodable``,
``unsupported_version``, ``too_large``, ``unknown_sender``, ``bad_signature``; from the run state
``wrong_run``, ``wrong_round``, ``replay``; from the content (``CompletionBatch.validate``)
``missing_field``, ``bad_header``, ``bad_sampling``, ``bad_ids``, ``id_out_of_range``,
``length_mismatch``, ``bad_reward``, ``nonfinite_logprob``, ``positive_logprob``, ``too_large``;
and ``wrong_tokenizer`` (a different tokenizer and no texts to re-tokenize).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from .batch import DEFAULT_MAX_TOKENS, BatchValidationError, CompletionBatch
from .signing import ReplayGuard, verify_frame
from .wire import WireLimits, decode_payload

REASONS = (
    "missing_field", "undecodable", "unsupported_version", "too_large", "unknown_sender",
    "bad_signature", "wrong_run", "wrong_round", "replay", "bad_header", "bad_sampling", "bad_ids",
    "id_out_of_range", "length_mismatch", "bad_reward", "nonfinite_logprob", "positive_logprob",
    "wrong_tokenizer",
)


@dataclass(frozen=True)
class InboxConfig:
    """What this receiver accepts.

    run_id: the run's id; frames of any other run are rejected (``wrong_run``). None accepts any.
    max_tokens: completion tokens per batch (``too_large`` above), also checked before decoding.
    limits: wire-format bounds for decoding (frame / payload bytes, counts).
    tokenizer_fp: the receiver's tokenizer fingerprint; None (the server) skips classification.
    """

    run_id: str | None = None
    max_tokens: int = DEFAULT_MAX_TOKENS
    limits: WireLimits = field(default_factory=WireLimits)
    tokenizer_fp: str | None = None


@dataclass(frozen=True)
class Accepted:
    """A verified, decoded, valid batch.

    frame: the exact signed bytes (what a server relays on, unchanged).
    token_level: True when the receiver can score the sender's token ids (same tokenizer, or no
        receiver tokenizer given); False means sequence level only (re-tokenize the texts).
    """

    batch: CompletionBatch
    frame: bytes
    token_level: bool

    @property
    def sender(self) -> str:
        return self.batch.sender


def token_level_usable(batch: CompletionBatch, receiver_fp: str | None) -> bool:
    """Same tokenizer -> True; different with texts for every group -> False; else wrong_tokenizer."""
    if receiver_fp is None or batch.tokenizer_fp == receiver_fp:
        return True
    if all(g.prompt_text and len(g.completion_texts) == g.size for g in batch.groups):
        return False
    raise BatchValidationError(
        "wrong_tokenizer", f"tokenizer_fp={batch.tokenizer_fp!r} differs from this receiver's "
                           f"{receiver_fp!r} and the batch carries no prompt/completion texts")


class Inbox:
    """Verify, check and decode frames from the run's participants, counting rejections."""

    def __init__(self, keys: Mapping[str, Ed25519PublicKey], config: InboxConfig = InboxConfig(),
                 guard: ReplayGuard | None = None):
        self.keys = keys
        self.config = config
        self.guard = guard if guard is not None else ReplayGuard()
        self.counts: Counter[str] = Counter()        # cumulative: "accepted", "rejected/<reason>"

    def accept(self, frame: bytes | None, expected_round: int | None = None) -> Accepted:
        """One frame -> Accepted, or BatchValidationError (counted under its reason)."""
        try:
            out = self._accept(frame, expected_round)
        except BatchValidationError as e:
            self.counts[f"rejected/{e.reason}"] += 1
            raise
        self.counts["accepted"] += 1
        if not out.token_level:
            self.counts["accepted_sequence_level"] += 1
        return out

    def accept_many(self, frames: Iterable[bytes | None],
                    expected_round: int | None = None) -> tuple[list[Accepted], dict[str, int]]:
        """Every frame on its own: -> (accepted, {reason: number rejected}) for this call."""
        accepted, rejected = [], Counter()
        for frame in frames:
            try:
                accepted.append(self.accept(frame, expected_round))
            except BatchValidationError as e:
                rejected[e.reason] += 1
        return accepted, dict(rejected)

    def metrics(self, prefix: str = "offpolicy/") -> dict[str, int]:
        """Cumulative counters as namespaced metrics, e.g. ``offpolicy/rejected/replay``."""
        return {prefix + k: v for k, v in sorted(self.counts.items())}

    def _accept(self, frame, expected_round):
        cfg = self.config
        if frame is None:
            raise BatchValidationError("missing_field", "frame: no batch bytes in the message")
        h, body = verify_frame(frame, self.keys, cfg.limits)
        if cfg.run_id is not None and h.run_id != cfg.run_id:
            raise BatchValidationError("wrong_run", f"run_id={h.run_id!r}: this run is {cfg.run_id!r}")
        if h.n_completion_tokens > cfg.max_tokens:
            raise BatchValidationError("too_large", f"batch has {h.n_completion_tokens} completion tokens: "
                                                    f"limit {cfg.max_tokens}")
        self.guard.check(h.run_id, h.sender, h.round, h.seq, expected_round)
        batch = decode_payload(h, body).validate(cfg.max_tokens)
        token_level = token_level_usable(batch, cfg.tokenizer_fp)
        self.guard.commit(h.run_id, h.sender, h.round, h.seq)
        return Accepted(batch=batch, frame=bytes(frame), token_level=token_level)
