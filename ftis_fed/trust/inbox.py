"""What a receiver (or the relaying server) does with incoming signed frames.

    frame -> header (sizes vs the frame limit) -> verify (sender's key) -> quarantine -> run
          -> replay / round check -> frames-per-sender-per-round budget -> COMMIT the sequence number
          -> declared sizes vs the receiver's bounds (before decompressing) -> decode -> validate
          (receiver's max-new-tokens, text lengths, group size) -> sampling == the run's
          -> tokenizer classification -> ids < the receiver's vocabulary (token level) -> Accepted

Each step raises :class:`BatchValidationError` with a stable reason; the inbox counts every
rejection per reason and ``accept_many`` never lets one bad frame stop a round or discard the good
frames beside it. From the signature on, a rejection names its (authenticated) sender
(``BatchValidationError.sender``) and the frame has used up its sequence number and its sender's
frame budget for the round: a rejected frame cannot be resent, and a sender cannot make a receiver
decode more than ``max_frames_per_sender`` frames per round.

Bounds come from ``ReceiveBounds`` (the receiver's own run config and vocabulary) when given, in
``InboxConfig.bounds`` or per ``accept`` call; without them (the relaying server) only the wire
format's own limits and ``max_tokens`` apply.

Reasons (``REASONS``): from the header and signature ``missing_field`` (no frame), ``undecodable``,
``unsupported_version``, ``too_large``, ``unknown_sender``, ``bad_signature``; from the run state
``quarantined``, ``wrong_run``, ``task_mismatch`` (the same run, signed for another task digest:
``trust.run_id``), ``wrong_round``, ``replay``, ``too_many_frames``; from the content
(``CompletionBatch.validate``) ``missing_field``, ``bad_header``, ``bad_sampling``, ``bad_ids``,
``id_out_of_range``, ``length_mismatch``, ``bad_reward``, ``nonfinite_logprob``,
``positive_logprob``, ``too_large``, ``text_too_long`` (also: more than ``CHARS_PER_TOKEN`` characters
per id, a text that is not the decoding of its ids); ``wrong_sampling`` (not the run's sampling
distribution); and ``wrong_tokenizer`` (a different tokenizer and no texts to re-tokenize, or, at
the server, not the tokenizer or vocabulary its sender said hello with: ``InboxConfig.tokenizers``).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from ftis_fed.trust.run_id import task_mismatch
from ftis_fed.wire.batch import DEFAULT_MAX_TOKENS, BatchValidationError, CompletionBatch
from ftis_fed.trust.bounds import CHARS_PER_TOKEN, ReceiveBounds
from ftis_fed.trust.signing import ReplayGuard, verify_frame
from ftis_fed.wire.codec import WireHeader, WireLimits, check_header_limits, decode_payload_flat

REASONS = (
    "missing_field", "undecodable", "unsupported_version", "too_large", "unknown_sender",
    "bad_signature", "revoked_key", "quarantined", "wrong_run", "wrong_round", "replay", "too_many_frames", "bad_header",
    "bad_sampling", "bad_ids", "id_out_of_range", "length_mismatch", "bad_reward", "nonfinite_logprob",
    "positive_logprob", "text_too_long", "wrong_sampling", "wrong_tokenizer", "task_mismatch",
)

#: Rejections that do not count against a sender (``Inbox.charge``): the relay (not the sender) may
#: cause them, or the receiver itself (its code), or they follow from an earlier refusal.
NOT_THE_SENDERS_FAULT = frozenset({"replay", "wrong_round", "wrong_run", "quarantined", "internal_error",
                                   "own_batch_relayed"})


@dataclass(frozen=True)
class InboxConfig:
    """What this receiver accepts.

    run_id: the run's id; frames of any other run are rejected (``wrong_run``). None accepts any.
    max_tokens: completion tokens per batch (``too_large`` above), also checked before decoding.
    limits: wire-format bounds for decoding (frame / payload bytes, counts).
    tokenizer_fp: the receiver's tokenizer fingerprint; None (the server) skips classification.
    bounds: the receiver's own bounds (``ReceiveBounds.from_run``); None: only ``limits`` / ``max_tokens``.
    tokenizers: the server's: sender -> (tokenizer_fp, vocab_size or None) it said hello with; a frame
        declaring another is refused (``wrong_tokenizer``) before it is decompressed. None: not checked.
    """

    run_id: str | None = None
    max_tokens: int = DEFAULT_MAX_TOKENS
    limits: WireLimits = field(default_factory=WireLimits)
    tokenizer_fp: str | None = None
    bounds: ReceiveBounds | None = None
    tokenizers: Mapping[str, tuple[str, int | None]] | None = None


@dataclass(frozen=True)
class Accepted:
    """A verified, decoded, valid batch.

    frame: the exact signed bytes (what a server relays on, unchanged); header: its header, parsed
        once here (so the server need not parse it again).
    token_level: True when the receiver can score the sender's token ids (same tokenizer, or no
        receiver tokenizer given); False means sequence level only (re-tokenize the texts).
    """

    batch: CompletionBatch
    frame: bytes
    token_level: bool
    header: WireHeader

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
    """Verify, check and decode frames from the run's participants, counting rejections.

    State beyond the replay guard: ``frames_seen`` (signed, fresh frames per (sender, round), for the
    per-round budget), ``strikes`` (per sender, signed batches that disagreed) and ``quarantined``
    (senders whose frames are refused for the rest of the run; ``receive.py`` decides who).
    """

    def __init__(self, keys: Mapping[str, Ed25519PublicKey], config: InboxConfig = InboxConfig(),
                 guard: ReplayGuard | None = None):
        self.keys = keys
        self.config = config
        self.guard = guard if guard is not None else ReplayGuard()
        self.counts: Counter[str] = Counter()        # cumulative: "accepted", "rejected/<reason>"
        self.frames_seen: Counter[tuple[str, int]] = Counter()
        self._floor: int | None = None               # frames_seen holds no entry of a round below it ...
        self._late: set[tuple[str, int]] = set()     # ... but these, counted after it rose
        self.quarantined: set[str] = set()
        self.strikes: Counter[str] = Counter()       # signed batches per sender that disagreed (receive.py)
        self._limits_for: tuple | None = None         # (key, limits) of _frame_limits

    def accept(self, frame: bytes | None, expected_round: int | None = None,
               bounds: ReceiveBounds | None = None, expected_sender: str | None = None) -> Accepted:
        """One frame -> Accepted, or BatchValidationError (counted under its reason).

        bounds: this call's receiver bounds (default ``config.bounds``). expected_sender: the
        sender the frame must name (``sender_mismatch`` otherwise, before the replay guard sees it).
        """
        try:
            out = self._accept(frame, expected_round, bounds if bounds is not None else self.config.bounds,
                               expected_sender)
        except BatchValidationError as e:
            self.counts[f"rejected/{e.reason}"] += 1
            raise
        self.counts["accepted"] += 1
        if not out.token_level:
            self.counts["accepted_sequence_level"] += 1
        return out

    def accept_many(self, frames: Iterable[bytes | None], expected_round: int | None = None,
                    bounds: ReceiveBounds | None = None) -> tuple[list[Accepted], dict[str, int]]:
        """Every frame on its own: -> (accepted, {reason: number rejected}) for this call."""
        accepted, rejected = [], Counter()
        for frame in frames:
            try:
                accepted.append(self.accept(frame, expected_round, bounds))
            except BatchValidationError as e:
                rejected[e.reason] += 1
        return accepted, dict(rejected)

    def metrics(self, prefix: str = "offpolicy/") -> dict[str, int]:
        """Cumulative counters as namespaced metrics, e.g. ``offpolicy/rejected/replay``."""
        return {prefix + k: v for k, v in sorted(self.counts.items())}

    def _accept(self, frame, expected_round, bounds: ReceiveBounds | None, expected_sender=None) -> Accepted:
        cfg = self.config
        if frame is None:
            raise BatchValidationError("missing_field", "frame: no batch bytes in the message")
        limits = cfg.limits
        if bounds is not None:                         # only the frame size before the signature holds
            limits = self._frame_limits(limits, bounds.max_frame_bytes)
        h, body = verify_frame(frame, self.keys, limits, expected_sender)
        try:
            return self._authenticated(h, body, bytes(frame), expected_round, bounds)
        except BatchValidationError as e:
            e.sender = h.sender
            raise

    def _frame_limits(self, limits: WireLimits, max_frame_bytes: int) -> WireLimits:
        """``limits`` with at most ``max_frame_bytes`` per frame (the last answer kept: it is the same
        for every frame of a run)."""
        key = (limits, max_frame_bytes)
        if self._limits_for is None or self._limits_for[0] != key:
            self._limits_for = (key, dataclasses.replace(limits, max_frame_bytes=min(limits.max_frame_bytes,
                                                                                    max_frame_bytes)))
        return self._limits_for[1]

    def _authenticated(self, h: WireHeader, body: bytes, frame: bytes, expected_round,
                       bounds: ReceiveBounds | None) -> Accepted:
        cfg = self.config
        if h.sender in self.quarantined:
            raise BatchValidationError("quarantined", f"sender {h.sender!r} is quarantined by this receiver "
                                                      "for the rest of the run")
        if cfg.run_id is not None and h.run_id != cfg.run_id:
            other_task = task_mismatch(h.run_id, cfg.run_id)
            if other_task:
                raise BatchValidationError("task_mismatch", f"sender {h.sender!r} trains on {other_task}")
            raise BatchValidationError("wrong_run", f"run_id={h.run_id!r}: this run is {cfg.run_id!r}")
        self.guard.check(h.run_id, h.sender, h.round, h.seq, expected_round)
        # From here on the frame is signed, fresh and of this round: it uses up its sequence number
        # and one of its sender's frames for the round, whatever happens to it next.
        self._count_frame(h.sender, h.round)
        self.guard.commit(h.run_id, h.sender, h.round, h.seq)
        budget = bounds.max_frames_per_sender if bounds is not None else 0
        if budget and self.frames_seen[(h.sender, h.round)] > budget:
            raise BatchValidationError("too_many_frames", f"sender {h.sender!r} already delivered {budget} "
                                                          f"frame(s) for round {h.round}: limit {budget} per round")
        batch = self.decode_checked(h, body, bounds)
        token_level = token_level_usable(batch, cfg.tokenizer_fp)
        if token_level and bounds is not None and bounds.vocab_size is not None:
            check_vocab(batch, bounds.vocab_size)
        return Accepted(batch=batch, frame=frame, token_level=token_level, header=h)

    def decode_checked(self, h: WireHeader, body: bytes, bounds: ReceiveBounds | None) -> CompletionBatch:
        """A signed frame's (header, body) -> its batch, checked against ``bounds`` (and the senders'
        tokenizers, ``InboxConfig.tokenizers``): the declared sizes before a byte is decompressed,
        then the content. No replay or budget state is touched (the server checks a batch's texts
        variant with it, which shares the seq of the variant without texts)."""
        cfg = self.config
        said = (cfg.tokenizers or {}).get(h.sender)
        if said is not None and (h.tokenizer_fp != said[0] or (said[1] is not None and h.vocab_size != said[1])):
            raise BatchValidationError("wrong_tokenizer", f"tokenizer_fp={h.tokenizer_fp[:64]!r}, vocab_size="
                                                          f"{h.vocab_size}: {h.sender!r} said hello with "
                                                          f"{said[0][:64]!r}, {said[1]}")
        max_tokens = cfg.max_tokens
        if bounds is not None:
            check_header_limits(h, bounds.wire_limits())
            max_tokens = min(max_tokens, bounds.max_completion_tokens)
        if h.n_completion_tokens > max_tokens:
            raise BatchValidationError("too_large", f"batch has {h.n_completion_tokens} completion tokens: "
                                                    f"limit {max_tokens}")
        batch, flat = decode_payload_flat(h, body)
        if bounds is None:
            return batch.validate(max_tokens, flat=flat)
        batch.validate(max_tokens, max_new_tokens=bounds.max_new_tokens, max_text_chars=bounds.max_text_chars,
                       max_prompt_chars=bounds.max_prompt_chars, max_string_chars=bounds.max_string_chars,
                       max_prompt_tokens=bounds.max_prompt_tokens, max_group_size=bounds.max_group_size,
                       max_chars_per_token=CHARS_PER_TOKEN, flat=flat)
        if bounds.sampling is not None and batch.sampling != bounds.sampling:
            raise BatchValidationError("wrong_sampling", f"sampling={batch.sampling}: this run samples with "
                                                         f"{bounds.sampling}")
        return batch

    def charge(self, sender: str | None, reason: str, quarantine_after: int) -> bool:
        """One strike against ``sender`` for a refusal it controls (not one of ``NOT_THE_SENDERS_FAULT``);
        True when it is quarantined by it (``quarantine_after`` strikes; 0: never)."""
        if sender is None or sender.startswith("_") or reason in NOT_THE_SENDERS_FAULT:
            return False
        self.strikes[sender] += 1
        return self.quarantine_if_due(sender, quarantine_after)

    def quarantine_if_due(self, sender: str, quarantine_after: int) -> bool:
        """Quarantine ``sender`` once its strikes reach ``quarantine_after`` (> 0); True when it happens now."""
        if quarantine_after <= 0 or self.strikes[sender] < quarantine_after or sender in self.quarantined:
            return False
        self.quarantined.add(sender)
        return True

    def _count_frame(self, sender: str, round: int) -> None:
        """Count one fresh frame of ``sender`` for ``round``; keep only the entries of this round and the
        previous one. A newer round drops the older entries in one pass; otherwise only entries counted
        below that floor since (``_late``) can be stale: O(1) per frame, not O(entries) (4,096 senders:
        a scan of ~8,000 entries per frame was the server's largest cost per round)."""
        self.frames_seen[(sender, round)] += 1
        floor = round - 1
        if self._floor is None or floor > self._floor:
            self._floor = floor
            stale = [k for k in self.frames_seen if k[1] < floor]
        else:
            stale = [k for k in self._late if k[1] < floor]
        for k in stale:
            del self.frames_seen[k]
            self._late.discard(k)
        if round < self._floor:
            self._late.add((sender, round))


def check_vocab(batch: CompletionBatch, vocab_size: int) -> None:
    """Every prompt and completion id below the RECEIVER's ``vocab_size`` (``id_out_of_range``):
    checked before any id reaches an embedding lookup, whatever vocabulary the batch declares."""
    for gi, g in enumerate(batch.groups):
        for where, ids in [("prompt_ids", g.prompt_ids)] + [(f"completion_ids[{i}]", c)
                                                            for i, c in enumerate(g.completion_ids)]:
            if ids.size and int(np.max(ids)) >= vocab_size:
                raise BatchValidationError(
                    "id_out_of_range", f"groups[{gi}].{where}: id {int(np.max(ids))} >= this receiver's "
                                       f"vocabulary size {vocab_size} (the batch declares {batch.vocab_size})")
