"""Policies: model backends (generate, score, expose trainable parameters) behind one interface
(``base.Policy``); the optimizer is ``ftis_fed.learn.training.Trainer``'s."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ftis_fed.policies.config import PolicyConfig

if TYPE_CHECKING:
    from ftis_fed.policies.base import Policy, Prompt, Rollout, processed_logprobs, tokenizer_fingerprint

__all__ = ["Policy", "PolicyConfig", "Prompt", "Rollout", "build_policy", "processed_logprobs",
           "tokenizer_fingerprint"]

_FROM_BASE = frozenset({"Policy", "Prompt", "Rollout", "processed_logprobs", "tokenizer_fingerprint"})


def __getattr__(name: str) -> Any:
    """``base``'s names on first use: importing the package (``policies.devices``, which the
    ClientApp needs, is in it) must not import torch. In deployment Flower starts a ClientApp
    process for every message, and that process only forwards to the worker."""
    if name in _FROM_BASE:
        from ftis_fed.policies import base

        return getattr(base, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def build_policy(cfg: PolicyConfig) -> "Policy":
    """The backend ``cfg.backend`` names, loaded once (this is the expensive call)."""
    if cfg.backend == "vllm":
        from ftis_fed.policies.vllm_policy import VLLMPolicy

        return VLLMPolicy(cfg)
    from ftis_fed.policies.hf import HFPolicy

    return HFPolicy(cfg)
