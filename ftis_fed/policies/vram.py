"""GPU memory estimates of a participant, from parameter counts (pure arithmetic, no torch).

    python -m ftis_fed.policies.vram            # the table of docs/gpu.md (Qwen2.5 0.5B/1.5B/3B on 8/12/24 GB)

What is counted (bytes; ``Estimate`` keeps each part):

- weights: every parameter at the weight dtype (fp32 4, bf16/fp16 2); with ``quant="nf4"`` the
  decoder's linear layers at 4 bits plus their block constants (bitsandbytes NF4, block 64, double
  quantisation: 0.5 + 1/64 + 4/(64*256) bytes per weight), embeddings / norms / biases at the weight
  dtype (bitsandbytes leaves them, and the LM head, unquantised);
- trainable parameters: all (``adapter="full"``) or the LoRA matrices of every decoder linear layer
  (peft ``target_modules="all-linear"``: q, k, v, o, gate, up, down; r*(in+out) each). LoRA matrices
  are fp32 (peft upcasts adapters of a half-precision base);
- gradients: one per trainable parameter, at its dtype;
- optimizer state: ``adamw`` = two moments at the trainable dtype (torch keeps exp_avg / exp_avg_sq
  in the parameter's dtype: 8 B per fp32 parameter, 4 B per bf16 one); ``adamw8bit`` /
  ``paged-adamw8bit`` (bitsandbytes) = 2 B per parameter (+ 8 B per 2048-block of statistics); the
  paged variant can spill to host memory under pressure, the figure is what it takes when it does not;
- activations kept for backward (no gradient checkpointing): per token and decoder layer
  ``8H + 2*KV + 4I`` elements (H hidden, KV the key/value width, I the MLP width): norms' inputs and
  outputs, roped q/k, v, the attention output, gate, up, silu(gate), the product. Measured on CPU for
  SmolLM2-135M with SDPA: 11,188 elements vs 11,136 from the formula (tests/test_vram.py checks it on a
  tiny model). Element size: 4 (fp32), 2 (bf16/fp16 weights), 5.2 (fp32 weights under bf16
  autocast: autocast saves the bf16 copies *and* the fp32 inputs; measured). With gradient
  checkpointing: each layer's input (H per token and layer) plus one layer's activations;
- the LM head: ``ftis_fed.policies.scoring`` computes log-probs in chunks of ``logit_chunk``
  positions, so its transient peak is 3 fp32 (micro_batch, chunk, V) tensors (logits, processed
  log-probs, their gradient); a micro-batch whose (micro_batch, T, V) fp32 log-softmax fits in
  ``logit_graph_mb`` MiB keeps it for backward (no recompute: counted here with T = ``seq_len``, an
  upper bound), a larger one recomputes each chunk (checkpointing);
- generation (HF ``generate``): the KV cache of ``gen_sequences`` sequences of ``seq_len`` tokens at
  the weight dtype (2 * layers * KV per token). It is not live during training, so the peak is
  ``max(training, generation)`` on top of weights;
- ``overhead``: CUDA context, cuBLAS workspace and allocator fragmentation, a flat 0.75 GiB
  allowance (not measured here: no GPU was available).

A vLLM participant additionally reserves its engine's share (``gpu_memory_utilization`` of the card),
which is not in these figures.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

GiB = 1024 ** 3


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer (Llama / Qwen2 layout) as its config.json gives it."""

    name: str
    hidden: int            # hidden_size (H)
    intermediate: int      # intermediate_size (I)
    layers: int            # num_hidden_layers
    heads: int             # num_attention_heads
    kv_heads: int          # num_key_value_heads
    vocab: int             # vocab_size (V)
    tied: bool             # tie_word_embeddings
    qkv_bias: bool         # Qwen2 has biases on q/k/v, Llama none
    head_dim: int = 0      # 0 = hidden // heads

    @property
    def hd(self) -> int:
        return self.head_dim or self.hidden // self.heads

    @property
    def kv(self) -> int:
        """Width of the key (or value) projection."""
        return self.kv_heads * self.hd

    def linears(self) -> list[tuple[int, int]]:
        """(in, out) of each linear layer of one decoder layer: q, k, v, o, gate, up, down."""
        H, I, q = self.hidden, self.intermediate, self.heads * self.hd
        return [(H, q), (H, self.kv), (H, self.kv), (q, H), (H, I), (H, I), (I, H)]

    def linear_params(self) -> int:
        """Weights of the decoder's linear layers (what 4-bit quantisation compresses)."""
        return self.layers * sum(i * o for i, o in self.linears())

    def other_params(self) -> int:
        """Embeddings, LM head (if untied), norms, biases."""
        bias = (self.heads * self.hd + 2 * self.kv) if self.qkv_bias else 0
        per_layer = 2 * self.hidden + bias                                       # 2 RMSNorms
        head = 0 if self.tied else self.vocab * self.hidden
        return self.vocab * self.hidden + head + self.layers * per_layer + self.hidden

    def params(self) -> int:
        return self.linear_params() + self.other_params()

    def lora_params(self, r: int) -> int:
        return self.layers * sum(r * (i + o) for i, o in self.linears())


# Sources: the models' config.json on the Hugging Face hub (Qwen/Qwen2.5-0.5B-Instruct,
# Qwen/Qwen2.5-1.5B-Instruct, Qwen/Qwen2.5-3B-Instruct, Qwen/Qwen2.5-Coder-1.5B-Instruct:
# hidden_size, intermediate_size, num_hidden_layers, num_attention_heads, num_key_value_heads,
# vocab_size, tie_word_embeddings; Qwen2 attention has q/k/v biases). SmolLM2: the model this
# project builds offline (HuggingFaceTB/SmolLM2-135M-Instruct's config; checked against the loaded
# model in tests/test_vram.py).
QWEN25_0_5B = ModelShape("Qwen2.5-0.5B-Instruct", 896, 4864, 24, 14, 2, 151936, True, True)
QWEN25_1_5B = ModelShape("Qwen2.5-1.5B-Instruct", 1536, 8960, 28, 12, 2, 151936, True, True)
QWEN25_3B = ModelShape("Qwen2.5-3B-Instruct", 2048, 11008, 36, 16, 2, 151936, True, True)
QWEN25_CODER_1_5B = ModelShape("Qwen2.5-Coder-1.5B-Instruct", 1536, 8960, 28, 12, 2, 151936, True, True)
SMOLLM2_135M = ModelShape("SmolLM2-135M-Instruct", 576, 1536, 30, 9, 3, 49152, True, False)

SHAPES = {s.name: s for s in (QWEN25_0_5B, QWEN25_1_5B, QWEN25_3B, QWEN25_CODER_1_5B, SMOLLM2_135M)}

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
#: bitsandbytes NF4 with double quantisation: 4 bits + 8-bit absmax per 64 + fp32 per 256 absmaxes.
NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)
#: Activation bytes per element: fp32, half precision, and fp32 weights under bf16 autocast (measured).
ACT_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp32+autocast": 5.2}
OPTIMIZERS = ("adamw", "adamw8bit", "paged-adamw8bit", "none")
OVERHEAD = int(0.75 * GiB)


@dataclass(frozen=True)
class Setup:
    """How a participant trains (the figures the estimate depends on).

    adapter: ``full`` or ``lora``. weights: ``fp32``/``bf16``/``fp16`` (the non-quantised parameters).
    quant: ``none`` or ``nf4`` (needs lora). autocast: bf16 autocast over fp32 weights.
    optimizer: one of OPTIMIZERS. lora_r: LoRA rank. micro_batch: completions per forward/backward.
    seq_len: prompt + completion tokens per row. logit_chunk: positions per LM-head chunk.
    grad_checkpointing: recompute layers in backward. gen_sequences: sequences generated at once
    (prompts x G) for the KV-cache term. logit_graph_mb: the policy key ``logit-graph-mb``.
    """

    adapter: str = "full"
    weights: str = "bf16"
    quant: str = "none"
    autocast: bool = False
    optimizer: str = "adamw"
    lora_r: int = 16
    micro_batch: int = 4
    seq_len: int = 512
    logit_chunk: int = 32
    grad_checkpointing: bool = True
    gen_sequences: int = 32
    logit_graph_mb: float = 256.0

    def __post_init__(self) -> None:
        if self.adapter not in ("full", "lora"):
            raise ValueError(f"adapter={self.adapter!r}: must be 'full' or 'lora'")
        if self.weights not in DTYPE_BYTES:
            raise ValueError(f"weights={self.weights!r}: must be one of {sorted(DTYPE_BYTES)}")
        if self.quant not in ("none", "nf4"):
            raise ValueError(f"quant={self.quant!r}: must be 'none' or 'nf4'")
        if self.quant != "none" and self.adapter != "lora":
            raise ValueError("quant='nf4' trains only with adapter='lora'")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer={self.optimizer!r}: must be one of {OPTIMIZERS}")


@dataclass(frozen=True)
class Estimate:
    """Bytes per part; ``total`` = weights + trainable state + max(training peak, generation) + overhead."""

    weights: int
    trainable_params: int
    gradients: int
    optimizer: int
    activations: int
    logits: int
    kv_cache: int
    overhead: int

    @property
    def total(self) -> int:
        train = self.gradients + self.optimizer + self.activations + self.logits
        return self.weights + max(train, self.kv_cache) + self.overhead

    def gib(self) -> dict[str, float]:
        d = {k: v / GiB for k, v in asdict(self).items() if k != "trainable_params"}
        d["total"] = self.total / GiB
        return d


def weight_bytes(m: ModelShape, weights: str = "bf16", quant: str = "none") -> int:
    w = DTYPE_BYTES[weights]
    if quant == "nf4":
        return int(m.linear_params() * NF4_BYTES) + m.other_params() * w
    return m.params() * w


def optimizer_bytes(n_trainable: int, param_bytes: int, optimizer: str) -> int:
    """State of ``optimizer`` for ``n_trainable`` parameters of ``param_bytes`` each."""
    if optimizer == "adamw":
        return 2 * n_trainable * param_bytes
    if optimizer in ("adamw8bit", "paged-adamw8bit"):
        return 2 * n_trainable + 2 * 4 * -(-n_trainable // 2048)
    return 0


def activation_elements_per_token_layer(m: ModelShape) -> int:
    """Elements a decoder layer keeps for backward per token (see the module docstring)."""
    return 8 * m.hidden + 2 * m.kv + 4 * m.intermediate


def estimate(m: ModelShape, s: Setup) -> Estimate:
    lora = s.adapter == "lora"
    n_train = m.lora_params(s.lora_r) if lora else m.params()
    train_bytes = 4 if lora else DTYPE_BYTES[s.weights]
    act_key = "fp32+autocast" if (s.autocast and s.weights == "fp32") else s.weights
    e = ACT_BYTES[act_key]
    tokens = s.micro_batch * s.seq_len
    per_layer = activation_elements_per_token_layer(m) * tokens * e
    if s.grad_checkpointing:
        act = m.layers * m.hidden * tokens * e + per_layer
    else:
        act = m.layers * per_layer
    logits = 3 * s.micro_batch * min(s.logit_chunk, s.seq_len) * m.vocab * 4
    kept = s.micro_batch * s.seq_len * m.vocab * 4                               # (micro_batch, T, V) fp32
    if 0 < kept <= s.logit_graph_mb * 2 ** 20:
        logits += kept
    kv_cache = 2 * m.layers * m.kv * s.gen_sequences * s.seq_len * DTYPE_BYTES[s.weights]
    return Estimate(weights=weight_bytes(m, s.weights, s.quant), trainable_params=n_train,
                    gradients=n_train * train_bytes, optimizer=optimizer_bytes(n_train, train_bytes, s.optimizer),
                    activations=int(act), logits=logits, kv_cache=kv_cache, overhead=OVERHEAD)


#: The participant kinds of the table: label -> Setup.
KINDS = {
    "full fp32 + AdamW (today's default)": Setup(adapter="full", weights="fp32", autocast=True),
    "full bf16 + AdamW": Setup(adapter="full", weights="bf16"),
    "full bf16 + 8-bit AdamW": Setup(adapter="full", weights="bf16", optimizer="adamw8bit"),
    "LoRA r16, bf16 base": Setup(adapter="lora", weights="bf16"),
    "4-bit NF4 LoRA r16": Setup(adapter="lora", weights="bf16", quant="nf4"),
}
CARDS_GB = (8, 12, 24)


def table(models=(QWEN25_0_5B, QWEN25_1_5B, QWEN25_3B), kinds=None, cards=CARDS_GB) -> str:
    """Markdown: estimated GiB per model x participant kind, and whether the total fits each card
    (an "8 GB" card has 8 GiB; the CUDA context is in ``overhead``): ``fits``, ``tight`` (over 90 %
    of the card: an estimate this close is not a promise) or ``no``."""
    kinds = kinds or KINDS
    head = "| model | participant | params | trainable | weights | grads+optim | activ.+logits | total GiB | " + \
        " | ".join(f"{c} GB" for c in cards) + " |"
    lines = [head, "|" + "---|" * (8 + len(cards))]
    for m in models:
        for label, s in kinds.items():
            est = estimate(m, s)
            g = est.gib()
            fits = ["no" if est.total > c * GiB else "tight" if est.total > 0.9 * c * GiB else "fits"
                    for c in cards]
            lines.append(f"| {m.name} | {label} | {m.params() / 1e9:.2f} B | {est.trainable_params / 1e6:.1f} M | "
                         f"{g['weights']:.2f} | {g['gradients'] + g['optimizer']:.2f} | "
                         f"{g['activations'] + g['logits']:.2f} | {g['total']:.2f} | " + " | ".join(fits) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # pragma: no cover - documentation generator
    s = Setup()
    print(f"Setup: micro-batch {s.micro_batch} x {s.seq_len} tokens, gradient checkpointing on, LM-head chunk "
          f"{s.logit_chunk}, generation KV cache for {s.gen_sequences} sequences, overhead "
          f"{OVERHEAD / GiB:.2f} GiB.\n")
    print(table())
