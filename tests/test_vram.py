"""The VRAM estimator (ftis_fed/policies/vram.py) against real models: parameter counts of the Qwen2.5
shapes (transformers' own Qwen2 class, meta device, no download), and bytes measured on the CPU from
SmolLM2-135M loaded for real: weights by dtype, AdamW state of full and LoRA training, NF4 weights,
8-bit AdamW state, and the activations autograd keeps."""

from __future__ import annotations

import pytest
import torch

from ftis_fed.policies.vram import (NF4_BYTES, QWEN25_0_5B, QWEN25_1_5B, QWEN25_3B, SMOLLM2_135M, ModelShape, Setup,
                           activation_elements_per_token_layer, estimate, optimizer_bytes, table, weight_bytes)


def _qwen2(m: ModelShape):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(hidden_size=m.hidden, intermediate_size=m.intermediate, num_hidden_layers=m.layers,
                      num_attention_heads=m.heads, num_key_value_heads=m.kv_heads, vocab_size=m.vocab,
                      tie_word_embeddings=m.tied)
    with torch.device("meta"):
        return Qwen2ForCausalLM(cfg)


def test_qwen_shapes_count_exactly_what_transformers_builds():
    from peft import LoraConfig, get_peft_model

    for m in (QWEN25_0_5B, QWEN25_1_5B, QWEN25_3B):
        model = _qwen2(m)
        assert sum(p.numel() for p in model.parameters()) == m.params()
    assert round(QWEN25_0_5B.params() / 1e9, 2) == 0.49 and round(QWEN25_3B.params() / 1e9, 2) == 3.09
    peft = get_peft_model(_qwen2(QWEN25_0_5B), LoraConfig(r=16, target_modules="all-linear", task_type="CAUSAL_LM"))
    assert sum(p.numel() for p in peft.parameters() if p.requires_grad) == QWEN25_0_5B.lora_params(16)


@pytest.fixture(scope="module")
def smollm2():
    from transformers import AutoModelForCausalLM

    from ftis_fed.policies.models import resolve_model

    return resolve_model("smollm2"), AutoModelForCausalLM


def _state_bytes(opt) -> int:
    return sum(t.numel() * t.element_size() for st in opt.state.values() for t in st.values()
               if torch.is_tensor(t) and t.dim() > 0)


def _step_with_zero_grads(params, opt) -> None:
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()


@pytest.mark.slow                           # 20-110 s here: an AdamW step over all 135M parameters
def test_smollm2_weights_and_adamw_state_match_the_formula(smollm2):
    path, Auto = smollm2
    model = Auto.from_pretrained(path, dtype=torch.float32)
    c = model.config
    got = ModelShape("smol", c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.num_attention_heads,
                     c.num_key_value_heads, c.vocab_size, c.tie_word_embeddings, False)
    assert got == ModelShape("smol", *[getattr(SMOLLM2_135M, f) for f in
                                        ("hidden", "intermediate", "layers", "heads", "kv_heads", "vocab", "tied",
                                         "qkv_bias")])
    params = list(model.parameters())
    measured = sum(p.numel() * p.element_size() for p in params)
    assert measured == weight_bytes(SMOLLM2_135M, "fp32")
    opt = torch.optim.AdamW(params, lr=1e-5)
    _step_with_zero_grads(params, opt)
    est = estimate(SMOLLM2_135M, Setup(adapter="full", weights="fp32"))
    assert _state_bytes(opt) == est.optimizer == 8 * SMOLLM2_135M.params()
    assert est.gradients == measured
    model.to(torch.bfloat16)
    assert sum(p.numel() * p.element_size() for p in model.parameters()) == weight_bytes(SMOLLM2_135M, "bf16")


def test_smollm2_lora_trainables_and_state_match_the_formula(smollm2):
    from peft import LoraConfig, get_peft_model

    path, Auto = smollm2
    model = get_peft_model(Auto.from_pretrained(path, dtype=torch.float32),
                           LoraConfig(r=8, target_modules="all-linear", task_type="CAUSAL_LM"))
    train = [p for p in model.parameters() if p.requires_grad]
    est = estimate(SMOLLM2_135M, Setup(adapter="lora", weights="fp32", lora_r=8))
    assert sum(p.numel() for p in train) == est.trainable_params == SMOLLM2_135M.lora_params(8)
    opt = torch.optim.AdamW(train, lr=1e-4)
    _step_with_zero_grads(train, opt)
    assert _state_bytes(opt) == est.optimizer


@pytest.mark.slow                           # 20-90 s here: a 4-bit load of SmolLM2
def test_smollm2_nf4_weights_match_the_formula(smollm2):
    pytest.importorskip("bitsandbytes")
    from ftis_fed.policies.quant import bnb_config

    path, Auto = smollm2
    model = Auto.from_pretrained(path, dtype=torch.float32, quantization_config=bnb_config("4bit"),
                                 device_map={"": "cpu"})
    measured = 0
    for p in model.parameters():
        measured += p.numel() * p.element_size()
        qs = getattr(p, "quant_state", None)
        if qs is not None:                                   # absmax (+ nested absmax and code)
            measured += qs.absmax.numel() * qs.absmax.element_size()
            if qs.state2 is not None:
                measured += qs.state2.absmax.numel() * qs.state2.absmax.element_size()
    est = weight_bytes(SMOLLM2_135M, "fp32", quant="nf4")     # this loader keeps the rest in fp32
    assert abs(measured - est) / est < 0.01, (measured, est)
    assert NF4_BYTES < 0.52


def test_8bit_adamw_state_matches_the_formula_for_large_tensors():
    bnb = pytest.importorskip("bitsandbytes")
    p = torch.nn.Parameter(torch.zeros(256, 1024))                  # >= 4096 elements: 8-bit state
    try:
        opt = bnb.optim.AdamW8bit([p], lr=1e-3)
        _step_with_zero_grads([p], opt)
    except (RuntimeError, NotImplementedError, AttributeError) as e:  # pragma: no cover - build without CPU 8-bit
        pytest.skip(f"bitsandbytes 8-bit optimizer unavailable on this CPU: {e}")
    measured = _state_bytes(opt)
    expected = optimizer_bytes(p.numel(), 4, "adamw8bit")
    assert abs(measured - expected) / expected < 0.02, (measured, expected)


def test_activations_kept_for_backward_match_the_formula():
    """Bytes autograd saves in a forward pass (deduplicated storages, parameters excluded) of a
    random-init Llama, fp32, no checkpointing: within 8 % of the formula, and linear in tokens."""
    from transformers import LlamaConfig, LlamaForCausalLM

    m = ModelShape("t", 128, 352, 3, 4, 2, 512, True, False)
    cfg = LlamaConfig(hidden_size=m.hidden, intermediate_size=m.intermediate, num_hidden_layers=m.layers,
                      num_attention_heads=m.heads, num_key_value_heads=m.kv_heads, vocab_size=m.vocab,
                      tie_word_embeddings=True, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def saved(B: int, T: int) -> int:
        seen: dict[int, int] = {}

        def pack(t):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model.model(input_ids=torch.randint(0, m.vocab, (B, T)), use_cache=False)
        return sum(v for k, v in seen.items() if k not in params)

    per = saved(2, 64) / (2 * 64 * m.layers * 4)                   # elements per token and layer
    assert abs(per - activation_elements_per_token_layer(m)) / per < 0.08, (per, activation_elements_per_token_layer(m))
    assert saved(4, 64) == pytest.approx(2 * saved(2, 64), rel=0.02)
    no_ckpt = estimate(m, Setup(adapter="full", weights="fp32", micro_batch=2, seq_len=64, grad_checkpointing=False))
    assert no_ckpt.activations == m.layers * activation_elements_per_token_layer(m) * 2 * 64 * 4


def test_the_table_answers_the_consumer_card_questions():
    est = estimate(QWEN25_1_5B, Setup(adapter="full", weights="fp32", autocast=True))
    assert 24 < est.total / 2**30 < 26                              # the "~25 GB" for fp32 full 1.5B
    assert estimate(QWEN25_3B, Setup(adapter="lora", quant="nf4")).total < 8 * 2**30
    assert estimate(QWEN25_1_5B, Setup(adapter="lora", quant="nf4")).total < \
        estimate(QWEN25_1_5B, Setup(adapter="lora")).total < estimate(QWEN25_1_5B, Setup(adapter="full")).total
    t = table()
    assert t.count("\n") == 2 + 3 * 5 and "| Qwen2.5-3B-Instruct | 4-bit NF4 LoRA r16 |" in t
    with pytest.raises(ValueError, match="quant='nf4' trains only with adapter='lora'"):
        Setup(adapter="full", quant="nf4")
    with pytest.raises(ValueError, match="optimizer='sgd'"):
        Setup(optimizer="sgd")
