"""Policies: model backends (generate, score, expose trainable parameters) behind one interface
(``base.Policy``); the optimizer is ``ftis_fed.learn.training.Trainer``'s."""

from __future__ import annotations

from ftis_fed.policies.base import Policy, Prompt, Rollout, processed_logprobs, tokenizer_fingerprint
from ftis_fed.policies.config import PolicyConfig

__all__ = ["Policy", "PolicyConfig", "Prompt", "Rollout", "build_policy", "processed_logprobs",
           "tokenizer_fingerprint"]


def build_policy(cfg: PolicyConfig) -> Policy:
    """The backend ``cfg.backend`` names, loaded once (this is the expensive call)."""
    if cfg.backend == "vllm":
        from ftis_fed.policies.vllm_policy import VLLMPolicy

        return VLLMPolicy(cfg)
    from ftis_fed.policies.hf import HFPolicy

    return HFPolicy(cfg)
