"""The policy interface every backend implements.

A participant's policy can
  (a) ``generate``: sample G completions per prompt and record the log-probs of the distribution it
      *really* sampled from (temperature, top-k, top-p applied, renormalised);
  (b) ``score``: teacher-force any (prompt, completion) token sequences and return per-token log-probs
      under its current weights and the given sampling parameters (with or without gradient);
  (c) ``update``: take one optimizer step on the F-TIS objective (see ``ftis_fed.training``);
  (d) ``save`` / ``load`` its trainable state and optimizer, for resume.

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
from typing import Sequence

import numpy as np
import torch

from ..batch import SamplingParams


@dataclass(frozen=True)
class Prompt:
    """One task instance as a policy sees it.

    task_id: stable id of the instance; text: the user message (no chat template);
    reference: the reference answer (used by rewards, carried in batches).
    """

    task_id: str
    text: str
    reference: str


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


def tokenizer_fingerprint(tokenizer) -> str:
    """A short, stable hash of a tokenizer's vocabulary and special tokens.

    Equal fingerprints mean two participants map text to the same ids, so token-level importance
    ratios between them are valid.
    """
    vocab = tokenizer.get_vocab()
    items = sorted(vocab.items(), key=lambda kv: kv[1])
    special = {k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())}
    h = hashlib.sha256()
    h.update(json.dumps(items, ensure_ascii=False).encode())
    h.update(json.dumps(special, sort_keys=True).encode())
    return "tok-" + h.hexdigest()[:16]


class Policy(ABC):
    """A model that generates, scores and learns. See module docstring.

    Attributes every backend sets: ``model_id`` (str), ``tokenizer`` (HF tokenizer),
    ``tokenizer_fp`` (``tokenizer_fingerprint(tokenizer)``), ``vocab_size`` (int, ids are below it).
    """

    model_id: str
    tokenizer_fp: str
    vocab_size: int

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

    @abstractmethod
    def generate(self, prompts: Sequence[Prompt], group_size: int, sampling: SamplingParams,
                 seed: int) -> list[Rollout]:
        """G = group_size completions per prompt, with sampling-distribution log-probs."""

    @abstractmethod
    def score(self, prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]],
              sampling: SamplingParams, grad: bool = False) -> list[torch.Tensor]:
        """Per-token log-probs (T_i,) of each completion given its prompt under current weights."""

    def generate_greedy(self, prompts: Sequence[Prompt], max_new_tokens: int) -> list[str]:
        """Greedy completions (evaluation). Backends override when they can do better."""
        rolls = self.generate(prompts, 1, SamplingParams(temperature=1e-4, max_new_tokens=max_new_tokens), seed=0)
        return [r.completion_texts[0] for r in rolls]
