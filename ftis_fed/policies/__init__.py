"""Policies: generation + scoring + training backends behind one interface (see base.py)."""

from __future__ import annotations

from .base import Policy, Prompt, Rollout, processed_logprobs, tokenizer_fingerprint
from .config import PolicyConfig

__all__ = ["Policy", "PolicyConfig", "Prompt", "Rollout", "build_policy", "processed_logprobs",
           "tokenizer_fingerprint"]


def build_policy(cfg: PolicyConfig, objective=None) -> Policy:
    """The backend ``cfg.backend`` names, loaded once (this is the expensive call)."""
    if cfg.backend == "vllm":
        from .vllm_policy import VLLMPolicy

        return VLLMPolicy(cfg, objective)
    from .hf import HFPolicy

    return HFPolicy(cfg, objective)
