"""PolicyConfig: what model a participant runs and how it trains. Every field is a run/node-config
key (kebab-case in brackets); participants in simulation read ``p<i>-<key>`` from the run config,
SuperNodes read ``<key>`` from their node config (see ``ftis_fed.config``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PolicyConfig:
    """
    model [model]: ``smollm2`` (offline, default), another registered offline model (see
        ``policies.models.OFFLINE_MODELS``), a local directory, or a hub id (needs a hub).
    backend [backend]: ``hf`` (transformers generate + train) or ``vllm`` (vLLM generates, the HF
        model trains; weights refreshed after each update; optional extra).
    adapter [adapter]: ``full`` (all weights train) or ``lora`` (peft LoraConfig on all linear layers).
    quant [quant]: ``none``, ``4bit`` (NF4, QLoRA) or ``8bit`` (LLM.int8); quantized models need
        adapter=lora. bitsandbytes is an optional extra (``ftis-fed[quant]``).
    lora_r [lora-r] / lora_alpha [lora-alpha] / lora_dropout [lora-dropout]: LoRA rank (>=1),
        scaling alpha (>0) and dropout in [0, 1).
    lr [lr]: AdamW learning rate (> 0). The paper uses 1e-6 for 1.5B-3B full fine-tuning; small
        models and LoRA need more (defaults: 1e-5 full, 2e-4 LoRA when lr = 0 = "auto").
    weight_decay [weight-decay]: AdamW weight decay (>= 0).
    max_grad_norm [max-grad-norm]: gradient clipping norm (> 0; inf disables).
    micro_batch [micro-batch]: completions per forward/backward (>= 1); memory scales with it.
    logit_chunk [logit-chunk]: completion positions per LM-head chunk (>= 1); see scoring.py.
    grad_checkpointing [grad-checkpointing]: recompute each decoder layer's activations in the
        backward pass instead of keeping them (transformers' gradient checkpointing; TRL's default).
        SmolLM2-135M, 8 x 8 x 64-token step: peak RSS 4.6 -> 3.6 GB; costs up to ~30 % training time
        on short completions (the default federation), so off by default.
    share_prefix [share-prefix]: score rows that share a prompt with one pass over the prompt (its
        keys/values reused by every completion; ``policies/prefix.py``): the same log-probs and
        gradients, the prompt's forward and backward done once per micro-batch instead of once per
        completion. Applies where exact (the HF backend on a checked architecture with sdpa/eager
        attention); elsewhere rows are scored one by one.
    dtype [dtype]: ``fp32`` (default: recorded and recomputed log-probs agree to 1e-4), ``bf16``
        (autocast; weights and optimizer stay fp32; ~0.03 nats/token generation-vs-training
        mismatch that the importance weights then absorb) or ``auto`` (bf16 on CUDA or a CPU with
        AVX512-BF16/AMX, else fp32).
    seed [policy-seed]: torch seed for the initialisation of adapters.
    name [model-id]: label recorded in batches as the generator's model id ('' = derived).
    """

    model: str = "smollm2"
    backend: str = "hf"
    adapter: str = "full"
    quant: str = "none"
    lora_r: int = 16
    lora_alpha: float = 32.0
    lora_dropout: float = 0.0
    lr: float = 0.0
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    micro_batch: int = 8
    logit_chunk: int = 32
    grad_checkpointing: bool = False
    share_prefix: bool = True
    dtype: str = "fp32"
    seed: int = 0
    name: str = ""

    def __post_init__(self) -> None:
        def need(ok: bool, field: str, limit: str) -> None:
            if not ok:
                raise ValueError(f"policy.{field}={getattr(self, field)!r}: {limit}")

        need(bool(self.model), "model", "must name a model (e.g. smollm2)")
        need(self.backend in ("hf", "vllm"), "backend", "must be 'hf' or 'vllm'")
        need(self.adapter in ("full", "lora"), "adapter", "must be 'full' or 'lora'")
        need(self.quant in ("none", "4bit", "8bit"), "quant", "must be 'none', '4bit' or '8bit'")
        need(self.quant == "none" or self.adapter == "lora", "quant",
             "quantized weights cannot train: set adapter='lora' (QLoRA)")
        need(self.lora_r >= 1, "lora_r", "must be >= 1")
        need(self.lora_alpha > 0, "lora_alpha", "must be > 0")
        need(0 <= self.lora_dropout < 1, "lora_dropout", "must be in [0, 1)")
        need(self.lr >= 0, "lr", "must be >= 0 (0 = auto: 1e-5 full, 2e-4 LoRA)")
        need(self.weight_decay >= 0, "weight_decay", "must be >= 0")
        need(self.max_grad_norm > 0, "max_grad_norm", "must be > 0 (inf disables)")
        need(self.micro_batch >= 1, "micro_batch", "must be >= 1")
        need(self.logit_chunk >= 1, "logit_chunk", "must be >= 1")
        need(self.dtype in ("auto", "fp32", "bf16"), "dtype", "must be 'auto', 'fp32' or 'bf16'")

    @property
    def effective_lr(self) -> float:
        if self.lr > 0:
            return self.lr
        return 2e-4 if self.adapter == "lora" else 1e-5

    @property
    def label(self) -> str:
        if self.name:
            return self.name
        parts = [self.model]
        if self.quant != "none":
            parts.append(self.quant)
        if self.adapter == "lora":
            parts.append("lora")
        return "+".join(parts)
