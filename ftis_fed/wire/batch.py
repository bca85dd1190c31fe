"""The completion batch: what one participant generated in one round, as it travels.

One :class:`CompletionBatch` holds, per prompt, one :class:`PromptGroup`: the prompt token ids
(stored once), the G completions' token ids, the generator's per-token log-probs of its *actual
sampling distribution* (temperature / top-p / top-k applied, see ``SamplingParams``), the rewards,
and the task id + reference answer so a receiver can re-verify the rewards.

The batch is immutable and validated on construction: every violation raises
:class:`BatchValidationError` naming the field, the offending value and the limit, with a stable
``reason`` string that receivers count per reason (``offpolicy/rejected/<reason>``).
"""

from __future__ import annotations

import hashlib
import math
import struct
from dataclasses import dataclass

import numpy as np

#: Largest batch anyone accepts unless configured otherwise (tokens over all completions).
DEFAULT_MAX_TOKENS = 1 << 20

#: Sequence numbers stay below 2**63 (they fit a signed 64-bit integer): an accepted seq of 2**64 - 1
#: would leave its sender no higher one, and nothing honest comes near it (round << 16 + frames).
MAX_SEQ = 1 << 63


class BatchValidationError(ValueError):
    """A batch (or its encoding) broke a rule. ``reason`` is a short, stable counter key."""

    def __init__(self, reason: str, message: str, sender: str | None = None):
        super().__init__(f"[{reason}] {message}")
        self.reason = reason
        self.sender = sender        # set once the frame's signature held: whom the rejection is charged to


def _fail(reason: str, message: str) -> None:
    raise BatchValidationError(reason, message)


@dataclass(frozen=True)
class SamplingParams:
    """The sampling distribution the recorded log-probs belong to.

    temperature: > 0 (greedy decoding has no distribution to importance-weight against).
    top_p: in (0, 1]; 1 disables nucleus filtering.
    top_k: >= 0; 0 disables top-k filtering.
    max_new_tokens: >= 1; the generation budget (also Dr. GRPO's length-normalisation constant).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 128

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            _fail("bad_sampling", f"sampling.temperature={self.temperature!r}: must be finite and > 0")
        if not (0.0 < self.top_p <= 1.0):
            _fail("bad_sampling", f"sampling.top_p={self.top_p!r}: must be in (0, 1]")
        if int(self.top_k) != self.top_k or self.top_k < 0:
            _fail("bad_sampling", f"sampling.top_k={self.top_k!r}: must be an integer >= 0")
        if int(self.max_new_tokens) != self.max_new_tokens or self.max_new_tokens < 1:
            _fail("bad_sampling", f"sampling.max_new_tokens={self.max_new_tokens!r}: must be an integer >= 1")


@dataclass(frozen=True)
class PromptGroup:
    """One prompt and the G completions its generator sampled for it.

    prompt_ids: (P,) int64 token ids of the formatted prompt (chat template applied), once.
    completion_ids: G arrays (T_i,) int64, each completion's token ids (EOS included when sampled).
    logprobs: G arrays (T_i,) float32, log pi_gen(token | prefix) under the sampling distribution.
    rewards: (G,) float32, the sender's claimed rewards (receivers re-verify); NaN = no reward for
        that completion (TRL's None: every reward function declined it), advantage 0.
    task_id: identifies the task instance (family/split/seed/index), e.g. ``"add1/id/17"``.
    reference: the reference answer the reward was checked against.
    prompt_text: the task's question as plain text (user message, no chat template). Receivers with
        a different tokenizer format it with their own template and score ``completion_texts``.
    completion_texts: the decoded completions; required for cross-tokenizer (sequence-level) use,
        otherwise may be empty to save bytes.
    """

    prompt_ids: np.ndarray
    completion_ids: tuple[np.ndarray, ...]
    logprobs: tuple[np.ndarray, ...]
    rewards: np.ndarray
    task_id: str
    reference: str
    prompt_text: str = ""
    completion_texts: tuple[str, ...] = ()

    @property
    def size(self) -> int:
        return len(self.completion_ids)

    @property
    def num_completion_tokens(self) -> int:
        return int(sum(len(c) for c in self.completion_ids))



@dataclass(frozen=True)
class FlatGroups:
    """A decoded batch's groups as the flat arrays their views were cut from (``codec.decode_payload_flat``):
    what :meth:`CompletionBatch.validate` checks all at once, with ``flat=``, instead of group by group.

    group_sizes / prompt_lengths: per group (prompt_lengths all 0 in a batch that carries only the
    prompt digest); lengths: per completion, in order. prompt_ids / completion_ids: (sum of the
    lengths,) int64, read from unsigned integers; rewards: (n_completions,) float32; logprobs:
    (sum of lengths,) float32; free_logprobs: those not read from a fixed-point code (escaped values, or
    all of them in a float32 frame), the only ones that can be non-finite or positive. names: per
    group (task_id, reference); texts: per group (prompt_text, completion_texts: () or one per completion).
    """

    group_sizes: list[int]
    prompt_lengths: list[int]
    lengths: list[int]
    prompt_ids: np.ndarray
    completion_ids: np.ndarray
    rewards: np.ndarray
    logprobs: np.ndarray
    free_logprobs: np.ndarray
    names: list[tuple[str, str]]
    texts: list[tuple[str, tuple[str, ...]]]


@dataclass(frozen=True)
class CompletionBatch:
    """All groups one participant generated in one round, with who/what/when generated them.

    sender: participant id (the name its public key is registered under).
    run_id: the federation run this batch belongs to; round: the server round (>= 0).
    seq: per-sender sequence number, strictly increasing per (sender, run): replay protection.
    model_id: the generator's model identifier (free text, e.g. ``smollm2-135m+lora``).
    tokenizer_fp: fingerprint of the generator's tokenizer (see ``policies.tokenizer_fingerprint``);
        token-level importance ratios are only valid when it equals the receiver's.
    vocab_size: the generator's vocabulary size; every token id must be below it.
    sampling: the sampling parameters the log-probs belong to.
    groups: one PromptGroup per prompt.
    prompt_digest: b"" when every group carries its prompt ids; else the 8-byte
        :func:`prompt_ids_digest` of the prompt ids the sender generated from, and every group's
        ``prompt_ids`` is empty (a decoded wire-v2 frame without prompt ids; the receiver renders
        the prompts itself and checks the digest, ``receive.py``).
    eos_id: the generator's end-of-sequence token id (generation stops only there before
        ``max_new_tokens``), or None when not carried (wire v1, older v2 frames): a receiver with
        another tokenizer reads from it whether a completion ended or was cut at the budget.
    """

    sender: str
    run_id: str
    round: int
    seq: int
    model_id: str
    tokenizer_fp: str
    vocab_size: int
    sampling: SamplingParams
    groups: tuple[PromptGroup, ...]
    prompt_digest: bytes = b""
    eos_id: int | None = None

    @property
    def num_completions(self) -> int:
        return sum(g.size for g in self.groups)

    @property
    def num_completion_tokens(self) -> int:
        return sum(g.num_completion_tokens for g in self.groups)

    def validate(self, max_tokens: int = DEFAULT_MAX_TOKENS, *, max_new_tokens: int | None = None,
                 max_text_chars: int | None = None, max_prompt_chars: int | None = None,
                 max_string_chars: int | None = None, max_prompt_tokens: int | None = None,
                 max_group_size: int | None = None, max_chars_per_token: int | None = None,
                 flat: FlatGroups | None = None) -> "CompletionBatch":
        """Check every field; raise BatchValidationError naming the first violation.

        The keyword limits are a receiver's own (``bounds.ReceiveBounds``), applied on top of what the
        batch declares: ``max_new_tokens`` caps every completion's length (the smaller of it and the
        batch's ``sampling.max_new_tokens`` applies); ``max_text_chars`` / ``max_prompt_chars`` cap each
        completion / prompt text (``text_too_long``); ``max_string_chars`` each task id and reference
        (``too_large``); ``max_prompt_tokens`` each prompt and ``max_group_size`` each group's completions
        (``too_large``); ``max_chars_per_token`` each completion text against its own ids (at most that
        many characters per id, ``text_too_long``: a text that is not the decoding of its ids). None: not
        checked. ``seq`` must be below ``MAX_SEQ``.

        ``flat``: the flat arrays this batch's groups are views of, as the decoder returned them
        (``codec.decode_payload_flat``); when every group's checks hold over them at once (a few
        min / max over the whole batch), the group-by-group checks are skipped; when any does not,
        they run and name the first failure, as without ``flat``.
        """
        for name in ("sender", "run_id", "model_id", "tokenizer_fp"):
            v = getattr(self, name)
            if not isinstance(v, str) or not v:
                _fail("missing_field", f"{name}={v!r}: must be a non-empty string")
            if len(v) > 256:
                _fail("too_large", f"{name} has {len(v)} characters: limit 256")
        for name in ("round", "seq", "vocab_size"):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 0:
                _fail("bad_header", f"{name}={v!r}: must be an integer >= 0")
        if self.seq >= MAX_SEQ:
            _fail("bad_header", f"seq={self.seq}: must be below 2**63 (a sender's seq only grows)")
        if not 1 <= self.vocab_size <= 1 << 32:
            _fail("bad_header", f"vocab_size={self.vocab_size}: must be in [1, 2**32]")
        if self.eos_id is not None and not 0 <= int(self.eos_id) < self.vocab_size:
            _fail("bad_header", f"eos_id={self.eos_id}: must be in [0, vocab_size={self.vocab_size})")
        if not isinstance(self.sampling, SamplingParams):
            _fail("missing_field", "sampling: must be a SamplingParams")
        if not self.groups:
            _fail("missing_field", "groups: a batch needs at least one prompt group")
        if flat is not None and len(flat.group_sizes) != len(self.groups):
            flat = None                                 # not this batch's: checked group by group
        total = sum(flat.lengths) if flat is not None else self.num_completion_tokens
        if total > max_tokens:
            _fail("too_large", f"batch has {total} completion tokens: limit {max_tokens}")
        mnt = self.sampling.max_new_tokens if max_new_tokens is None else min(max_new_tokens,
                                                                              self.sampling.max_new_tokens)
        digest = self.prompt_digest
        if not isinstance(digest, bytes) or len(digest) not in (0, PROMPT_DIGEST_LEN):
            _fail("bad_header", f"prompt_digest: {len(digest) if isinstance(digest, bytes) else type(digest).__name__}"
                                f" bytes, must be empty or {PROMPT_DIGEST_LEN}")
        if flat is not None and _flat_pass(
                flat, self.vocab_size, mnt, bool(digest), max_text_chars, max_prompt_chars, max_string_chars,
                max_prompt_tokens, max_group_size, max_chars_per_token):
            return self
        for gi, g in enumerate(self.groups):
            _validate_group(g, gi, self.vocab_size, mnt, bool(digest))
            _validate_sizes(g, gi, max_text_chars, max_prompt_chars, max_string_chars, max_prompt_tokens,
                            max_group_size, max_chars_per_token)
        return self


def _check_ids(ids: np.ndarray, where: str, vocab_size: int) -> None:
    if not isinstance(ids, np.ndarray) or ids.ndim != 1 or ids.dtype.kind not in "iu":
        _fail("bad_ids", f"{where}: must be a 1-D integer array, got {type(ids).__name__}")
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        _fail("id_out_of_range",
              f"{where}: ids must be in [0, {vocab_size}), got [{int(ids.min())}, {int(ids.max())}]")


def _completions_pass(ids_list, lps, vocab_size: int, max_new_tokens: int) -> bool:
    """True only when every completion passes the per-completion checks of :func:`_validate_group`
    (ids: 1-D integers in [0, vocab_size), at most ``max_new_tokens``; log-probs: 1-D floats of the
    same shape, finite, <= 0), with one min / max / isfinite over the group's concatenated arrays
    instead of three numpy calls per completion. False when any fails or is not certain (mixed
    dtypes): the per-completion loop then runs and names the first failure, as before."""
    if not ids_list:
        return True
    if not (isinstance(ids_list[0], np.ndarray) and isinstance(lps[0], np.ndarray)):
        return False
    id_dtype, lp_dtype = ids_list[0].dtype, lps[0].dtype
    if id_dtype.kind not in "iu" or lp_dtype.kind != "f":
        return False
    for ids, lp in zip(ids_list, lps):
        if not (isinstance(ids, np.ndarray) and ids.ndim == 1 and ids.dtype == id_dtype and len(ids) <= max_new_tokens
                and isinstance(lp, np.ndarray) and lp.ndim == 1 and lp.dtype == lp_dtype and lp.shape == ids.shape):
            return False
    ids = np.concatenate(ids_list)
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        return False
    lp = np.concatenate(lps)
    return not lp.size or (bool(np.isfinite(lp).all()) and float(lp.max()) <= 0.0)


def _flat_pass(f: FlatGroups, vocab_size: int, max_new_tokens: int, digest: bool, max_text_chars: int | None,
               max_prompt_chars: int | None, max_string_chars: int | None, max_prompt_tokens: int | None,
               max_group_size: int | None, max_chars_per_token: int | None) -> bool:
    """True only when every group of a decoded batch passes :func:`_validate_group` and
    :func:`_validate_sizes`, checked over its flat arrays at once. What the decoder guarantees is not
    checked again: 1-D int64 ids and float32 log-probs, one log-prob per id and G rewards per group,
    string fields that are strings, 0 or G completion texts, ids >= 0, fixed-point log-probs finite and <= 0."""
    sizes, plens, lengths = f.group_sizes, f.prompt_lengths, f.lengths
    if not sizes or min(sizes) < 1 or (max_group_size is not None and max(sizes) > max_group_size):
        return False
    if (any(plens) if digest else min(plens) < 1) or (max_prompt_tokens is not None and max(plens) > max_prompt_tokens):
        return False
    if lengths and max(lengths) > max_new_tokens:
        return False
    for ids in (f.prompt_ids, f.completion_ids):               # read from unsigned integers: never < 0
        if ids.size and int(ids.max()) >= vocab_size:
            return False
    if f.rewards.size and bool(np.isinf(f.rewards).any()):
        return False
    lp = f.free_logprobs
    if lp.size and not (bool(np.isfinite(lp).all()) and float(lp.max()) <= 0.0):
        return False
    for task_id, reference in f.names:
        if not task_id or (max_string_chars is not None and max(len(task_id), len(reference)) > max_string_chars):
            return False
    j = 0                                                       # the group's first completion
    for size, (prompt_text, texts) in zip(sizes, f.texts):
        if max_prompt_chars is not None and len(prompt_text) > max_prompt_chars:
            return False
        for t, n in zip(texts, lengths[j:j + size]):
            if (max_text_chars is not None and len(t) > max_text_chars) or (
                    max_chars_per_token is not None and len(t) > max_chars_per_token * n):
                return False
        j += size
    return True


def _validate_group(g: PromptGroup, gi: int, vocab_size: int, max_new_tokens: int, digest: bool = False) -> None:
    where = f"groups[{gi}]"
    if not isinstance(g.task_id, str) or not g.task_id:
        _fail("missing_field", f"{where}.task_id: must be a non-empty string")
    if not isinstance(g.reference, str):
        _fail("missing_field", f"{where}.reference: must be a string")
    _check_ids(g.prompt_ids, f"{where}.prompt_ids", vocab_size)
    if digest and g.prompt_ids.size:
        _fail("length_mismatch", f"{where}.prompt_ids: {g.prompt_ids.size} ids in a batch that carries only "
                                 "their digest (prompt_digest)")
    if not digest and g.prompt_ids.size == 0:
        _fail("length_mismatch", f"{where}.prompt_ids: a prompt needs at least one token")
    G = len(g.completion_ids)
    if G < 1:
        _fail("missing_field", f"{where}.completion_ids: a group needs at least one completion")
    if len(g.logprobs) != G:
        _fail("length_mismatch", f"{where}.logprobs: {len(g.logprobs)} arrays for {G} completions")
    rewards = np.asarray(g.rewards)
    if rewards.shape != (G,):
        _fail("length_mismatch", f"{where}.rewards: shape {rewards.shape}, expected ({G},)")
    if np.any(np.isinf(rewards)):
        _fail("bad_reward", f"{where}.rewards: must be finite (or NaN: no reward)")
    if g.completion_texts and len(g.completion_texts) != G:
        _fail("length_mismatch", f"{where}.completion_texts: {len(g.completion_texts)} texts for {G} completions")
    if _completions_pass(g.completion_ids, g.logprobs, vocab_size, max_new_tokens):
        return
    for i, (ids, lp) in enumerate(zip(g.completion_ids, g.logprobs)):      # names the first that fails
        _check_ids(ids, f"{where}.completion_ids[{i}]", vocab_size)
        if len(ids) > max_new_tokens:
            _fail("length_mismatch",
                  f"{where}.completion_ids[{i}]: {len(ids)} tokens, limit max_new_tokens={max_new_tokens}")
        if not isinstance(lp, np.ndarray) or lp.ndim != 1 or lp.dtype.kind != "f":
            _fail("missing_field", f"{where}.logprobs[{i}]: must be a 1-D float array")
        if lp.shape != ids.shape:
            _fail("length_mismatch", f"{where}.logprobs[{i}]: {lp.shape[0]} log-probs for {ids.shape[0]} tokens")
        if lp.size:
            if not np.all(np.isfinite(lp)):
                _fail("nonfinite_logprob", f"{where}.logprobs[{i}]: NaN or inf (a sampled token has finite log-prob)")
            if float(lp.max()) > 0.0:
                _fail("positive_logprob", f"{where}.logprobs[{i}]: max {float(lp.max()):.4g} > 0 (a log-probability is <= 0)")


def _validate_sizes(g: PromptGroup, gi: int, max_text_chars: int | None, max_prompt_chars: int | None,
                    max_string_chars: int | None, max_prompt_tokens: int | None,
                    max_group_size: int | None, max_chars_per_token: int | None = None) -> None:
    where = f"groups[{gi}]"
    if max_group_size is not None and g.size > max_group_size:
        _fail("too_large", f"{where}: {g.size} completions, limit group-size={max_group_size}")
    if max_string_chars is not None:
        for name in ("task_id", "reference"):
            n = len(getattr(g, name))
            if n > max_string_chars:
                _fail("too_large", f"{where}.{name} has {n} characters: limit {max_string_chars}")
    if max_prompt_tokens is not None and g.prompt_ids.size > max_prompt_tokens:
        _fail("too_large", f"{where}.prompt_ids: {g.prompt_ids.size} tokens, limit {max_prompt_tokens}")
    if max_prompt_chars is not None and len(g.prompt_text) > max_prompt_chars:
        _fail("text_too_long", f"{where}.prompt_text has {len(g.prompt_text)} characters: limit {max_prompt_chars}")
    if max_text_chars is not None:
        for i, t in enumerate(g.completion_texts):
            if len(t) > max_text_chars:
                _fail("text_too_long", f"{where}.completion_texts[{i}] has {len(t)} characters: limit "
                                       f"{max_text_chars} (max-new-tokens x characters per token)")
    if max_chars_per_token is not None:
        for i, (t, ids) in enumerate(zip(g.completion_texts, g.completion_ids)):
            if len(t) > max_chars_per_token * len(ids):
                _fail("text_too_long", f"{where}.completion_texts[{i}] has {len(t)} characters for its {len(ids)} "
                                       f"ids: limit {max_chars_per_token} per id (not the decoding of its ids)")


#: Bytes of :func:`prompt_ids_digest`.
PROMPT_DIGEST_LEN = 8
_PROMPT_DOMAIN = b"ftis-fed/prompt-ids/v2\0"


def prompt_ids_digest(prompts) -> bytes:
    """8 bytes of SHA-256 over every group's prompt ids, in order (each as u32 count + u32 ids):
    what a wire-v2 frame without prompt ids carries so that a receiver can check its own rendering
    of the batch's tasks is the one the sender generated from."""
    h = hashlib.sha256(_PROMPT_DOMAIN)
    prompts = list(prompts)
    h.update(struct.pack("<I", len(prompts)))
    for p in prompts:
        a = np.asarray(p, dtype=np.int64).reshape(-1)
        if a.size and (int(a.min()) < 0 or int(a.max()) >= 1 << 32):
            _fail("id_out_of_range", "prompt ids must be in [0, 2**32) to be digested")
        h.update(struct.pack("<I", a.size) + a.astype("<u4").tobytes())
    return h.digest()[:PROMPT_DIGEST_LEN]


def make_group(
    prompt_ids, completion_ids, logprobs, rewards, task_id: str, reference: str,
    prompt_text: str = "", completion_texts=(),
) -> PromptGroup:
    """Build a PromptGroup from lists/tensors, normalising dtypes (int64 ids, float32 log-probs)."""
    as_ids = lambda x: np.asarray(x, dtype=np.int64).reshape(-1)  # noqa: E731
    as_lp = lambda x: np.asarray(x, dtype=np.float32).reshape(-1)  # noqa: E731
    return PromptGroup(
        prompt_ids=as_ids(prompt_ids),
        completion_ids=tuple(as_ids(c) for c in completion_ids),
        logprobs=tuple(as_lp(lp) for lp in logprobs),
        rewards=np.asarray(rewards, dtype=np.float32).reshape(-1),
        task_id=task_id,
        reference=reference,
        prompt_text=prompt_text,
        completion_texts=tuple(completion_texts),
    )
