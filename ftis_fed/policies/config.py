"""PolicyConfig: what model a participant runs and how it trains. Every field is a run/node-config
key declared with ``knob``; participants in simulation read ``p<i>-<key>`` from the run config,
SuperNodes read ``<key>`` from their node config (see ``ftis_fed.config.participants``)."""

from __future__ import annotations

from dataclasses import dataclass

from ftis_fed.knobs import knob


#: ``weights-dtype`` values -> the torch dtype name the model is loaded in
WEIGHT_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
#: ``optimizer`` values (built by ``ftis_fed.learn.training.make_optimizer``)
OPTIMIZERS = ("adamw", "adamw-8bit", "paged-adamw-8bit")


@dataclass(frozen=True)
class PolicyConfig:
    """What model a participant runs and how it trains. Each field is a run-config key (``knob``):
    run-wide in ``[tool.flwr.app.config]``, per participant as ``p<i>-<key>`` where declared so, and
    unprefixed in a SuperNode's ``--node-config``."""

    model: str = knob("model", "smollm2", """
        ``smollm2`` (offline, default), another registered offline model (see
        ``policies.models.OFFLINE_MODELS``), a local model folder, or a hub id (needs a hub, or the
        model in the local Hugging Face cache). Checked before the run starts; ``p<i>-model = ""``
        ends the list of simulated participants.""", run=False, per_participant=True)
    backend: str = knob("backend", "hf", """
        ``hf`` (transformers generate + train) or ``vllm`` (vLLM generates, the HF model trains;
        weights refreshed after each update; optional extra).""")
    adapter: str = knob("adapter", "full", """
        ``full`` (all weights train) or ``lora`` (peft LoraConfig on all linear layers).""",
        per_participant=True)
    quant: str = knob("quant", "none", """
        ``none``, ``4bit`` (NF4, QLoRA) or ``8bit`` (LLM.int8); quantized models need adapter=lora.
        bitsandbytes is an optional extra (``ftis-fed[quant]``).""", per_participant=True)
    lora_r: int = knob("lora-r", 16, "LoRA rank, >= 1.")
    lora_alpha: float = knob("lora-alpha", 32.0, "LoRA scaling alpha, > 0.")
    lora_dropout: float = knob("lora-dropout", 0.0, "LoRA dropout, in [0, 1).")
    lr: float = knob("lr", 0.0, """
        AdamW learning rate, >= 0. The paper uses 1e-6 for 1.5B-3B full fine-tuning; small models
        and LoRA need more (0 = auto: 1e-5 full, 2e-4 LoRA).""", per_participant=True)
    lr_warmup_steps: int = knob("lr-warmup-steps", 0, """
        linear warm-up of the learning rate over the first n updates (update s trains at
        lr * min(1, s / n), s = 1, 2, ...; TRL's ``warmup_steps`` with a constant schedule after it, except
        that transformers' first step trains at 0, ours at lr / n),
        >= 0; 0 = off (the full rate from the first update). Adam's first steps move every weight by
        about the full rate whatever the gradient's size, which a policy gradient from few rewarded
        samples turns into a collapse (docs/results/calibration/README.md); the step count is in
        the checkpoint, so a resumed run continues the schedule.""", per_participant=True)
    updates_per_round: int = knob("updates-per-round", 1, """
        optimizer steps on each round's samples, >= 1 (TRL's ``num_iterations``, PPO's epochs): the
        first step is the usual one; each further step re-scores the same samples under the updated
        weights, with the PPO clip taken against the log-probs of before the round's first step and
        the importance weights against the generator's, as always. 1 (default) = one update per round.""")
    weight_decay: float = knob("weight-decay", 0.0, "AdamW weight decay, >= 0.")
    max_grad_norm: float = knob("max-grad-norm", 1.0, "gradient clipping norm, > 0 (inf disables).")
    micro_batch: int = knob("micro-batch", 8, "completions per forward/backward, >= 1; memory scales with it.")
    score_zero_advantage: bool = knob("score-zero-advantage", False, """
        also run the forward pass of training micro-batches whose rows all have advantage 0 (groups of
        equal rewards: no gradient), so that they count in the off-policy diagnostics
        (``offpolicy/<source>/...``). Off (default): such micro-batches are skipped
        (``train/unscored_rows``); the loss and gradient of an update are the same either way. With
        ``source-adapt = kl`` the per-source weights read those diagnostics, so from the second
        update on they (and the model) differ with this knob; ``off`` and ``guard`` do not read them.""")
    logit_chunk: int = knob("logit-chunk", 32, "completion positions per LM-head chunk, >= 1; see scoring.py.")
    logit_graph_mb: float = knob("logit-graph-mb", 256.0, """
        MiB of LM-head log-softmax values (rows x completion positions x vocabulary, fp32) a training
        micro-batch may keep for the backward pass, >= 0. Within it the LM head's chunks are not
        recomputed in backward (SmolLM2, 8 rows x 64 tokens: 96 MiB); a larger micro-batch recomputes
        each chunk (activation checkpointing: one chunk of logits in memory). 0 = always recompute.""")
    grad_checkpointing: bool = knob("grad-checkpointing", False, """
        recompute each decoder layer's activations in the backward pass instead of keeping them
        (transformers' gradient checkpointing; TRL's default). SmolLM2-135M, 8 x 8 x 64-token step:
        peak RSS 4.6 -> 3.6 GB; costs up to ~30 % training time on short completions (the default
        federation), so off by default.""")
    share_prefix: bool = knob("share-prefix", True, """
        score rows that share a prompt with one pass over the prompt (its keys/values reused by every
        completion; ``policies/prefix.py``): the same log-probs and gradients, the prompt's forward
        and backward done once per micro-batch instead of once per completion. Applies where exact
        (the HF backend on a checked architecture with sdpa/eager attention); elsewhere rows are
        scored one by one. Generation (HF backend) likewise prefills each prompt once for its G
        completions (the same samples and recorded log-probs).""")
    grad_checkpointing_tokens: int = knob("grad-checkpointing-tokens", 0, """
        gradient checkpointing by sequence length, >= 0: when > 0, a training micro-batch whose
        padded prompt + completion tokens (rows x longest row) exceed this value is run with
        gradient checkpointing, a smaller one without (grad-checkpointing = true checkpoints every
        micro-batch; 0 = only that key decides). Activation memory grows with these tokens, so
        e.g. 4096 keeps short default-federation steps fast and long reasoning completions
        within memory.""")
    dtype: str = knob("dtype", "fp32", """
        ``fp32`` (default: recorded and recomputed log-probs agree to 1e-4), ``bf16`` (autocast;
        weights and optimizer stay fp32; ~0.03 nats/token generation-vs-training mismatch that the
        importance weights then absorb) or ``auto`` (bf16 on CUDA or a CPU with AVX512-BF16/AMX, else
        fp32).""", per_participant=True)
    weights_dtype: str = knob("weights-dtype", "fp32", """
        the dtype the model's weights are LOADED in: ``fp32`` (default), ``bf16`` or ``fp16``.
        Separate from ``dtype`` (autocast). bf16/fp16 weights halve weight memory and, for full
        fine-tuning, gradients and AdamW moments too (torch keeps them in the parameter's dtype);
        LoRA adapters stay fp32 (peft upcasts them). fp16 full fine-tuning is fragile (no loss
        scaling; AdamW's eps underflows): prefer bf16. Quantized models (quant) keep their
        bitsandbytes storage; this sets their non-quantized layers.""", per_participant=True)
    optimizer: str = knob("optimizer", "adamw", """
        ``adamw`` (torch AdamW), ``adamw-8bit`` (bitsandbytes AdamW8bit: 2 bytes of state per
        parameter instead of 8, blockwise-quantized moments) or ``paged-adamw-8bit`` (bitsandbytes
        PagedAdamW8bit: the same, its state paged to CPU memory under GPU memory pressure; on a CPU
        it runs unpaged). The 8-bit options need the ``quant`` extra (bitsandbytes).""")
    device: str = knob("device", "auto", """
        ``auto`` (a visible CUDA device chosen by the participant's partition id, ``cuda:(id mod
        count)``, so participants spread over the cards; the CPU only on a machine without NVIDIA
        GPUs: GPUs that torch cannot use stop the participant with the reason), ``cuda:N`` or
        ``cpu``. In simulation the participant processes get the GPUs the launcher (or, under a plain
        ``flwr run``, the Ray actor's start) saw, not Ray's empty mask; see docs/gpu.md.""", per_participant=True)
    gpu_memory_share: float = knob("gpu-memory-share", 0.0, """
        this participant's share of its GPU's memory for a vLLM engine, in [0, 0.9]; 0 = derived
        from the number of participants on the same device (``ftis_fed.policies.devices.memory_shares``).""",
        per_participant=True)
    max_model_len: int = knob("max-model-len", 0, """
        vLLM participants (backend = vllm): the longest prompt + completion the engine serves, in
        tokens (vLLM ``max_model_len``; its KV cache is sized for it), >= 0; 0 = the model's own
        context length (a 12 GB card may not hold a KV cache that long). More than max-new-tokens,
        at most the model's context (``max_position_embeddings``).""", per_participant=True)
    gpu_memory_utilization: float = knob("gpu-memory-utilization", 0.0, """
        vLLM participants (backend = vllm): the fraction of the whole card the engine reserves for
        its weights and KV cache (vLLM ``gpu_memory_utilization``), in [0, 0.95]; 0 = derived: 0.4
        of the participant's gpu-memory-share (the rest is its trainer's). At most gpu-memory-share
        when that is set.""", per_participant=True)
    share_base: bool = knob("share-base", False, """
        LoRA participants (adapter = lora, backend = hf) hosted by one worker process
        (``participants-per-worker``) share one copy of their base model: the first loads it, each
        adds its own adapter (peft's multi-adapter API) and its own optimizer over it, and every
        generation, scoring and training step switches to the participant's adapter. The same
        samples, losses and adapter weights as a copy per participant (``tests/test_shared_base.py``);
        memory per extra participant: its adapter, optimizer state and counters. Participants share
        a base when model, weights-dtype and quant are the same.""")
    seed: int = knob("policy-seed", 0, "torch seed for the initialisation of adapters.")
    name: str = knob("model-id", "", """
        label recorded in batches as the generator's model id ('' = derived from model, quant and
        adapter); deployment node config only.""", run=False)

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
        need(int(self.updates_per_round) == self.updates_per_round and self.updates_per_round >= 1,
             "updates_per_round", "must be an integer >= 1")
        need(int(self.lr_warmup_steps) == self.lr_warmup_steps and self.lr_warmup_steps >= 0, "lr_warmup_steps",
             "must be an integer >= 0 (0 = off)")
        need(self.max_grad_norm > 0, "max_grad_norm", "must be > 0 (inf disables)")
        need(self.micro_batch >= 1, "micro_batch", "must be >= 1")
        need(self.logit_chunk >= 1, "logit_chunk", "must be >= 1")
        need(self.logit_graph_mb >= 0, "logit_graph_mb", "must be >= 0")
        need(self.dtype in ("auto", "fp32", "bf16"), "dtype", "must be 'auto', 'fp32' or 'bf16'")
        need(self.weights_dtype in WEIGHT_DTYPES, "weights_dtype", "must be 'fp32', 'bf16' or 'fp16'")
        need(self.optimizer in OPTIMIZERS, "optimizer", "must be 'adamw', 'adamw-8bit' or 'paged-adamw-8bit'")
        need(not self.share_base or (self.adapter == "lora" and self.backend == "hf"), "share_base",
             f"shares a base model between LoRA adapters: needs adapter='lora' and backend='hf' "
             f"(adapter is {self.adapter!r}, backend {self.backend!r})")
        need(self.grad_checkpointing_tokens >= 0, "grad_checkpointing_tokens", "must be >= 0 (0 = off)")
        from ftis_fed.policies.devices import DeviceError, parse_device

        try:
            parse_device(self.device)
        except DeviceError:
            need(False, "device", "must be 'auto', 'cpu', 'cuda' or 'cuda:N' (N >= 0)")
        need(0.0 <= self.gpu_memory_share <= 0.9, "gpu_memory_share", "must be in [0, 0.9] (0 = derived)")
        need(self.max_model_len >= 0, "max_model_len", "must be >= 0 (0 = the model's context length)")
        need(0.0 <= self.gpu_memory_utilization <= 0.95, "gpu_memory_utilization",
             "must be in [0, 0.95] (0 = derived from gpu-memory-share)")
        for f in ("max_model_len", "gpu_memory_utilization"):
            need(self.backend == "vllm" or not getattr(self, f), f,
                 f"applies to vLLM participants only (backend='vllm'; backend is {self.backend!r}): leave it 0")
        need(not (self.gpu_memory_share and self.gpu_memory_utilization > self.gpu_memory_share),
             "gpu_memory_utilization", f"more than this participant's gpu-memory-share={self.gpu_memory_share:g} "
             "(the engine's part of the share): lower it or raise the share")

    @property
    def effective_lr(self) -> float:
        if self.lr > 0:
            return self.lr
        return 2e-4 if self.adapter == "lora" else 1e-5

    def lr_at(self, update: int) -> float:
        """The learning rate of update ``update`` (1-based): ``effective_lr`` after the linear warm-up."""
        n = int(self.lr_warmup_steps)
        return self.effective_lr * (min(1.0, update / n) if n > 0 else 1.0)

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
