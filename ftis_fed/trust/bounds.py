"""What a receiver accepts, from its OWN run config and tokenizer: never from the batch's header.

A batch's header says what its sender claims (vocabulary, max-new-tokens, counts); a hostile sender
claims whatever gets through. Every bound a receiver enforces comes from :class:`ReceiveBounds`,
built from the run's :class:`~ftis_fed.config.federation.FederationConfig` (which every participant shares)
and the receiver's own vocabulary size (``ReceiveBounds.from_run(fed, vocab_size)``).

From them follow the wire limits (``wire_limits``): the largest frame and decompressed payload an
honest batch of this run can have. A frame declaring more is refused from its header, before a
byte is decompressed (a 4 KB frame that would decompress to 122 MiB is refused in microseconds).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from ftis_fed.wire.batch import SamplingParams
from ftis_fed.wire.codec import MAX_HEADER_LEN, SIGNATURE_LEN, WireLimits

#: An honest completion of ``max_new_tokens`` tokens decodes to at most this many characters per
#: token (SmolLM2's longest token is 16 characters; 32 leaves room for other tokenizers).
CHARS_PER_TOKEN = 32

#: Another tokenizer's completion text may re-tokenize to at most this many tokens per token of the
#: run's ``max-new-tokens`` in the receiver's tokenizer (plus its EOS), and a batch's texts to this
#: many times the run's completion tokens per frame (``max_retokenized_tokens`` /
#: ``max_retokenized_batch_tokens``); beyond, the batch is refused (``retokenized_too_long``).
RETOKENIZE_FACTOR = 4


@dataclass(frozen=True)
class ReceiveBounds:
    """Receiver-side bounds of one run. ``from_run`` derives them; the defaults are only for the rest.

    vocab_size: the receiver's vocabulary; token ids a receiver scores (same tokenizer) must be below
        it. None: not checked (the relaying server, which scores nothing).
    max_new_tokens: the run's ``max-new-tokens``: no completion may be longer (in its own tokens).
    max_groups: prompt groups per frame (``prompts-per-round``).
    max_group_size: completions per group (``group-size``).
    max_completion_tokens: completion tokens per frame (groups x G x max_new_tokens, at most
        ``max-batch-tokens``).
    max_prompt_tokens: tokens of one prompt (chat template applied).
    max_text_chars: characters of one completion text (max_new_tokens x ``CHARS_PER_TOKEN``).
    max_prompt_chars: characters of one prompt text (the task's question).
    max_string_chars: characters of a task id or reference.
    max_frames_per_sender: signed frames one sender may deliver per round (1); the rest are refused
        (``too_many_frames``) whether or not the first was accepted. 0: no limit.
    time_budget_s: wall-clock budget for the content checks of one batch (re-scoring), from
        ``reverify-time-budget-s``; a batch that exceeds it is dropped (``time_budget``), never the round.
    sampling: the run's sampling distribution; a batch claiming another is refused
        (``wrong_sampling``). None: not checked.
    """

    vocab_size: int | None
    max_new_tokens: int
    max_groups: int
    max_group_size: int
    max_completion_tokens: int
    max_prompt_tokens: int = 2048
    max_text_chars: int = 4096
    max_prompt_chars: int = 8192
    max_string_chars: int = 256
    max_frames_per_sender: int = 1
    time_budget_s: float = 10.0
    sampling: SamplingParams | None = None

    def __post_init__(self) -> None:
        for name in ("max_new_tokens", "max_groups", "max_group_size", "max_completion_tokens",
                     "max_prompt_tokens", "max_text_chars", "max_prompt_chars", "max_string_chars"):
            if getattr(self, name) < 1:
                raise ValueError(f"ReceiveBounds.{name}={getattr(self, name)!r}: must be >= 1")
        if self.vocab_size is not None and self.vocab_size < 1:
            raise ValueError(f"ReceiveBounds.vocab_size={self.vocab_size!r}: must be >= 1 or None")
        if self.max_frames_per_sender < 0:
            raise ValueError(f"ReceiveBounds.max_frames_per_sender={self.max_frames_per_sender!r}: must be >= 0")
        if not self.time_budget_s > 0:
            raise ValueError(f"ReceiveBounds.time_budget_s={self.time_budget_s!r}: must be > 0")

    @classmethod
    def from_run(cls, fed, vocab_size: int | None, **overrides) -> "ReceiveBounds":
        """The bounds of run ``fed`` (a FederationConfig) for a receiver with ``vocab_size`` ids."""
        groups, g, mnt = fed.task.prompts_per_round, fed.group_size, fed.max_new_tokens
        kwargs = dict(vocab_size=vocab_size, max_new_tokens=mnt, max_groups=groups, max_group_size=g,
                      max_completion_tokens=min(groups * g * mnt, fed.max_batch_tokens),
                      max_text_chars=mnt * CHARS_PER_TOKEN, sampling=fed.sampling,
                      time_budget_s=fed.reverify.time_budget_s)
        kwargs.update(overrides)
        return cls(**kwargs)

    @property
    def max_completions(self) -> int:
        return self.max_groups * self.max_group_size

    @property
    def max_retokenized_tokens(self) -> int:
        """Tokens one completion text of another tokenizer may become here (its EOS included)."""
        return RETOKENIZE_FACTOR * self.max_new_tokens + 1

    @property
    def max_retokenized_batch_tokens(self) -> int:
        """Tokens the completion texts of one batch of another tokenizer may become here."""
        return RETOKENIZE_FACTOR * self.max_completion_tokens + self.max_completions

    @cached_property
    def max_raw_bytes(self) -> int:
        """Largest decompressed payload of an honest frame (worst case per field over wire v1 and v2:
        4-byte ids, a log-prob code (v2: a LEB128 varint of up to 3 bytes) plus an escaped f32 each,
        4 UTF-8 bytes per character; v2's varint sizes take no more than v1's u32s)."""
        per_group = (8 + 8 + 8 * self.max_string_chars              # table; task_id + reference
                     + 4 + 4 * self.max_prompt_chars + 4            # prompt text; n_texts
                     + 4 * self.max_prompt_tokens)                  # prompt ids
        per_completion = 4 + 4 + 4 + 4 * self.max_text_chars        # length, reward, text
        per_token = 4 + 3 + 4                                       # id; code (v2: <= 3 bytes) + escaped f32
        return (self.max_groups * per_group + self.max_completions * per_completion
                + self.max_completion_tokens * per_token)

    @cached_property
    def max_frame_bytes(self) -> int:
        """Largest signed frame: header (4 strings of <= 1 KiB, either wire version) + payload (stored
        raw at worst) + signature."""
        return MAX_HEADER_LEN + self.max_raw_bytes + SIGNATURE_LEN

    def wire_limits(self) -> WireLimits:
        """The wire-format limits these bounds imply (checked from the header, before decompressing)."""
        return self._wire_limits

    @cached_property
    def _wire_limits(self) -> WireLimits:                  # once per bounds (frozen): every frame asks
        return WireLimits(max_frame_bytes=self.max_frame_bytes, max_raw_bytes=self.max_raw_bytes,
                          max_tokens=self.max_completion_tokens,
                          max_prompt_tokens=self.max_groups * self.max_prompt_tokens,
                          max_groups=self.max_groups, max_completions=self.max_completions,
                          max_string_bytes=1024)
