"""Policies: model backends (generate, score, expose trainable parameters) behind one interface
(``base.Policy``); the optimizer is ``ftis_fed.training.Trainer``'s."""

from __future__ import annotations

from .base import Policy, Prompt, Rollout, processed_logprobs, tokenizer_fingerprint
from .config import PolicyConfig

__all__ = ["Policy", "PolicyConfig", "Prompt", "Rollout", "build_policy", "processed_logprobs",
           "tokenizer_fingerprint"]


def build_policy(cfg: PolicyConfig) -> Policy:
    """The backend ``cfg.backend`` names, loaded once (this is the expensive call)."""
    if cfg.backend == "vllm":
        from .vllm_policy import VLLMPolicy

        return VLLMPolicy(cfg)
    from .hf import HFPolicy

    return HFPolicy(cfg)
