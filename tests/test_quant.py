"""4-bit + LoRA (QLoRA) on the CPU: the bitsandbytes repacking trap and its workaround (see ftis_fed/policies/quant.py)."""

from __future__ import annotations

import pytest

bnb = pytest.importorskip("bitsandbytes")

from ftis_fed.wire.batch import CompletionBatch, SamplingParams, make_group  # noqa: E402
from ftis_fed.learn.objective import ObjectiveConfig  # noqa: E402
from ftis_fed.policies import PolicyConfig, Prompt, build_policy  # noqa: E402
from ftis_fed.policies.hf import cpu_has_bf16  # noqa: E402
from ftis_fed.learn.training import Trainer, samples_from_batches  # noqa: E402

SP = SamplingParams(temperature=0.7, max_new_tokens=12)
PROMPTS = [Prompt("add/0", "What is 3 + 4? Reply with just the number.", "7"),
           Prompt("add/1", "What is 5 + 2? Reply with just the number.", "7")]


def lora_grads(pol, P, C):
    pol.model.zero_grad(set_to_none=True)
    pol.model.train()
    pol.score_padded(P, C, SP, grad=True).sum().backward()
    return {n: (0.0 if p.grad is None else p.grad.abs().sum().item())
            for n, p in pol.model.named_parameters() if p.requires_grad}


@pytest.mark.slow
def test_4bit_lora_learns_after_generating():
    pol = build_policy(PolicyConfig(model="smollm2", adapter="lora", quant="4bit", dtype="fp32", lora_r=4,
                                    lr=1e-3, micro_batch=8))
    layers = [m for m in pol.model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert layers and not any(m.support_avx512bf16_for_cpu for m in layers)
    rolls = pol.generate(PROMPTS, 3, SP, seed=0)                                 # eval-mode 4-bit forward
    P = [r.prompt_ids.tolist() for r in rolls for _ in r.completion_ids]
    C = [c.tolist() for r in rolls for c in r.completion_ids]
    grads = lora_grads(pol, P, C)
    # LoRA B starts at zero, so A's first gradient is zero by construction; every B must move,
    # the lowest layer's included (the trap kills gradients below the first repacked layer)
    b_grads = {n: g for n, g in grads.items() if "lora_B" in n}
    assert len(b_grads) == len(layers) and all(g > 0 for g in b_grads.values())

    groups = tuple(make_group(r.prompt_ids, r.completion_ids, r.logprobs, [1.0, 0.0, 0.0], r.prompt.task_id,
                              r.prompt.reference) for r in rolls)
    batch = CompletionBatch("me", "t", 0, 0, pol.model_id, pol.tokenizer_fp, pol.vocab_size, SP, groups).validate()
    samples = samples_from_batches([batch], "me", pol.tokenizer_fp, ObjectiveConfig())
    before = sum(s.float().sum().item() for s in pol.score(P, C, SP))
    trainer = Trainer(pol, ObjectiveConfig())
    for _ in range(3):
        m = trainer.step(samples, SP)
        assert m["train/grad_norm"] > 0
        pol.generate(PROMPTS[:1], 1, SP, seed=1)                                  # generating between steps
    after = sum(s.float().sum().item() for s in pol.score(P, C, SP))
    assert abs(after - before) > 1e-3                                            # the loss moved
    assert all(g > 0 for n, g in lora_grads(pol, P, C).items())                  # now A moves too



@pytest.mark.skipif(not cpu_has_bf16(), reason="the repacking trap needs a CPU with AVX512-BF16")
@pytest.mark.slow
def test_without_the_workaround_gradients_stop_at_every_4bit_matmul():
    """Negative control: the trap is real on this CPU, so the test above can fail.

    After generation the repacked 4-bit matmul has no autograd kernel, so no gradient passes through
    a quantized weight: a LoRA B whose output reaches the loss only through another 4-bit layer
    (q/k/v through o_proj, gate/up through down_proj) gets none, while o_proj and down_proj, which
    feed the residual stream directly, still do (the backward pass itself ran)."""
    pol = build_policy(PolicyConfig(model="smollm2", adapter="lora", quant="4bit", dtype="fp32", lora_r=4))
    for m in pol.model.modules():
        if isinstance(m, bnb.nn.Linear4bit):
            m.support_avx512bf16_for_cpu = True                                  # bitsandbytes' default
    rolls = pol.generate(PROMPTS[:1], 2, SP, seed=0)                             # repacks the 4-bit weights
    P = [r.prompt_ids.tolist() for r in rolls for _ in r.completion_ids]
    C = [c.tolist() for r in rolls for c in r.completion_ids]
    b = {n: g for n, g in lora_grads(pol, P, C).items() if "lora_B" in n}
    behind = [g for n, g in b.items() if any(k in n for k in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"))]
    direct = [g for n, g in b.items() if "o_proj" in n or "down_proj" in n]
    assert behind and all(g == 0.0 for g in behind)
    assert direct and all(g > 0 for g in direct)
