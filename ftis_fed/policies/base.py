"""The model-backend interface every backend implements (``Policy``, an ABC).

A backend generates, scores and exposes its trainable parameters; it does not optimise:
  (a) ``generate``: sample G completions per prompt and record the log-probs of the distribution it
      *really* sampled from (temperature, top-k, top-p applied, renormalised); ``generate_greedy``
      for evaluation;
  (b) ``score`` / ``score_padded``: teacher-force any (prompt, completion) token sequences and return
      per-token log-probs under its current weights and the given sampling parameters (with or
      without gradient); ``retokenize``: a peer's texts in this backend's tokenizer;
  (c) ``trainable_parameters`` / ``train_mode`` / ``weights_changed``: what the optimizer in
      ``ftis_fed.learn.training.Trainer`` steps, and the hooks around a step (a generation engine that
      holds its own copy of the weights, e.g. vLLM, refreshes it in ``weights_changed``);
  (d) ``trainable_state`` / ``load_trainable_state``: the trainable weights, for the Trainer's
      checkpoint (resume).

Sampling-distribution log-probs are defined once, in ``processed_logprobs``: log_softmax of the
logits divided by the temperature after top-k and top-p filtering (HF's ``TopKLogitsWarper`` /
``TopPLogitsWarper`` semantics: keep the smallest set whose probability reaches top_p, always at
least one token). Backends must agree with it; tests check that they do.
"""

from __future__ import annotations

import hashlib
import json
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch

from ftis_fed.wire.batch import SamplingParams
from ftis_fed.tasks.prompt import Prompt  # noqa: F401  (re-exported: part of the policy interface)

if TYPE_CHECKING:
    from ftis_fed.policies.config import PolicyConfig


@dataclass
class Rollout:
    """G completions of one prompt, as generated.

    prompt_ids: (P,) the formatted prompt (chat template applied) as token ids.
    completion_ids / logprobs: G arrays (T_i,) int64 / float32, log-probs of the sampling distribution.
    completion_texts: G decoded completions (special tokens skipped).
    """

    prompt: Prompt
    prompt_ids: np.ndarray
    completion_ids: list[np.ndarray]
    logprobs: list[np.ndarray]
    completion_texts: list[str]


def processed_logprobs(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """(..., V) logits -> (..., V) log-probs of the sampling distribution.

    Order as in HF generate and vLLM: temperature, then top-k, then top-p; filtered tokens get -inf,
    the rest are renormalised. Differentiable w.r.t. the kept logits.
    """
    x = logits.float() / sampling.temperature
    if sampling.top_k and sampling.top_k < x.shape[-1]:
        kth = torch.topk(x, sampling.top_k, dim=-1).values[..., -1:]              # (..., 1)
        x = x.masked_fill(x < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_x, idx = torch.sort(x, dim=-1, descending=False)                   # ascending
        cum = sorted_x.softmax(-1).cumsum(-1)
        remove_sorted = cum <= (1 - sampling.top_p)
        remove_sorted[..., -1] = False                                            # keep the top token
        remove = remove_sorted.scatter(-1, idx, remove_sorted)
        x = x.masked_fill(remove, float("-inf"))
    return torch.log_softmax(x, dim=-1)


#: tokenizer_fingerprint's vocabulary hashes by tokenizer source (``store.load_tokenizer``'s key)
_VOCAB_HASHES: dict[tuple, "hashlib._Hash"] = {}


def tokenizer_fingerprint(tokenizer) -> str:
    """A short, stable hash of a tokenizer's vocabulary and special tokens.

    Equal fingerprints mean two participants map text to the same ids, so token-level importance
    ratios between them are valid. The vocabulary's part (~0.1 s of CPU for 49k tokens) is computed
    once per process for tokenizers that ``store.load_tokenizer`` loaded from the same unchanged files
    and that still have the size they were loaded with (no token added since); the special tokens
    are hashed every time.
    """
    source, loaded_len = getattr(tokenizer, "_ftis_fed_source", (None, None))
    key = source if source is not None and len(tokenizer) == loaded_len else None
    h = _VOCAB_HASHES.get(key) if key is not None else None
    if h is None:
        vocab = tokenizer.get_vocab()
        items = sorted(vocab.items(), key=lambda kv: kv[1])
        h = hashlib.sha256()
        h.update(json.dumps(items, ensure_ascii=False).encode())
        if key is not None:
            _VOCAB_HASHES[key] = h.copy()
    else:
        h = h.copy()
    special = {k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())}
    h.update(json.dumps(special, sort_keys=True).encode())
    return "tok-" + h.hexdigest()[:16]


class Policy(ABC):
    """A model backend: generates, scores and exposes its trainable parameters (module docstring).

    Attributes every backend sets: ``cfg`` (its ``PolicyConfig``), ``model_id`` (str, recorded in
    batches), ``tokenizer`` (HF tokenizer: chat template, ``decode``, ``eos_token_id``),
    ``tokenizer_fp`` (``tokenizer_fingerprint(tokenizer)``), ``vocab_size`` (int, ids are below it);
    ``weights_fp`` (``weights_fp.weights_fingerprint`` of the folder it loaded; "" = not known).
    Everything a participant, the evaluation and ``training.Trainer`` call is declared here.
    """

    cfg: "PolicyConfig"
    model_id: str
    tokenizer: object
    tokenizer_fp: str
    vocab_size: int
    weights_fp: str = ""

    def format_prompt(self, text: str) -> list[int]:
        """The user message with this model's chat template (generation prompt added)."""
        tok = self.tokenizer
        if getattr(tok, "chat_template", None):
            ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False)
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            return list(ids)
        return list(tok(text, add_special_tokens=True)["input_ids"])

    # ------------------------------------------------------------------ generate
    @abstractmethod
    def generate(self, prompts: Sequence[Prompt], group_size: int, sampling: SamplingParams,
                 seed: int) -> list[Rollout]:
        """G = group_size completions per prompt, with sampling-distribution log-probs."""

    def generate_greedy(self, prompts: Sequence[Prompt], max_new_tokens: int) -> list[str]:
        """Greedy completions (evaluation). Backends override when they can do better."""
        rolls = self.generate(prompts, 1, SamplingParams(temperature=1e-4, max_new_tokens=max_new_tokens), seed=0)
        return [r.completion_texts[0] for r in rolls]

    # ------------------------------------------------------------------ score
    @abstractmethod
    def score(self, prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]],
              sampling: SamplingParams, grad: bool = False) -> list[torch.Tensor]:
        """Per-token log-probs (T_i,) of each completion given its prompt under current weights."""

    @abstractmethod
    def score_padded(self, prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]],
                     sampling: SamplingParams, grad: bool) -> torch.Tensor:
        """(b, T) right-padded per-token log-probs of one micro-batch (the trainer's forward pass)."""

    def score_padded_and_reference(self, prompt_ids: Sequence[Sequence[int]],
                                   completion_ids: Sequence[Sequence[int]], sampling: SamplingParams,
                                   grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(logp, reference), both (b, T): ``score_padded``'s log-probs and, detached, those a no-grad
        ``score_padded`` in evaluation mode gives on the same weights (what a later PPO step of the round
        is clipped against). Called inside a training step (``train_mode(True)``). Default: a second,
        no-grad pass; a backend that reads the reference off the same forward overrides it."""
        logp = self.score_padded(prompt_ids, completion_ids, sampling, grad)
        if not grad:
            return logp, logp
        self.train_mode(False)
        try:
            with torch.no_grad():
                return logp, self.score_padded(prompt_ids, completion_ids, sampling, False)
        finally:
            self.train_mode(True)

    def score_layout(self, prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]]):
        """How ``score_padded`` lays these rows out (hashable), for a backend where a row's values depend
        on the call's other rows only through it: ``score_padded(some, ..., layout=...)`` then gives
        those rows what the whole call gives them. None (the default): not described."""
        return None

    @abstractmethod
    def retokenize(self, prompt_text: str, completion_text: str, ended: bool) -> tuple[list[int], list[int]]:
        """A peer's prompt and completion text as (prompt_ids, completion_ids) in this backend's
        tokenizer and chat template; EOS appended only when ``ended`` (the sender's completion
        ended with its EOS, not cut at max-new-tokens)."""

    # ------------------------------------------------------------------ training hooks
    @abstractmethod
    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        """The parameters the optimizer steps (all weights, or the LoRA adapters)."""

    def train_mode(self, training: bool) -> None:
        """Enter (True) or leave (False) training mode around an optimizer step. Default: nothing."""

    def weights_changed(self) -> None:
        """Called after every optimizer step and checkpoint load. Default: nothing."""

    @abstractmethod
    def trainable_state(self) -> dict[str, torch.Tensor]:
        """{name: tensor} copies of the trainable parameters (CPU)."""

    @abstractmethod
    def load_trainable_state(self, state: dict[str, torch.Tensor], source: str = "state") -> None:
        """Copy ``trainable_state()`` output back in; a name the model lacks is a ValueError naming
        ``source`` and the parameter."""

    @abstractmethod
    def export(self, path: str | Path) -> Path:
        """The trained model as a folder others load (``save_pretrained``: a peft adapter folder for
        LoRA, a full model folder otherwise, with the tokenizer); written atomically; returns it."""
