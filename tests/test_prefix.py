"""Shared-prompt scoring (policies/prefix.py) equals the row-by-row computation: log-probs, the F-TIS
loss and every gradient, with variable prompt and completion lengths (incl. 1-token and empty
completions, a 1-token prompt), full fine-tuning and LoRA, gradient checkpointing on and off."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ftis_fed.wire.batch import SamplingParams
from ftis_fed.learn.objective import LossInputs, ObjectiveConfig, count_denominators, ftis_loss
from ftis_fed.policies import PolicyConfig, build_policy, logprobs, prefix
from ftis_fed.policies.prefix import prompt_index, shared_token_logprobs, supports_shared_prefix, worth_sharing
from ftis_fed.policies.logprobs import token_logprobs
from ftis_fed.policies.scoring import unwrap_causal_lm
from ftis_fed.learn.training import Trainer, TrainSample, row_order

SP = SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=16)
#: fp32: the two computations differ only in summation order (measured ~1e-6 relative on the whole
#: gradient; up to 1.1e-5 on SmolLM2's smallest-gradient tensor).
RTOL = 1e-5


def rows(vocab: int, seed: int = 1, prompt_lens=(5, 9, 1), completion_lens=((3, 0, 7, 1), (4, 4, 2), (2, 6, 1))):
    """G completions per prompt (G varies), rows of different prompts interleaved."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in prompt_lens]
    P, C = [], []
    for j in range(max(len(c) for c in completion_lens)):
        for p, lens in zip(prompts, completion_lens):
            if j < len(lens):
                P.append(p)
                C.append(torch.randint(0, vocab, (lens[j],), generator=g).tolist())
    return P, C


def ftis_loss_of(logp: torch.Tensor, C, seed: int = 3) -> torch.Tensor:
    """The F-TIS loss of one micro-batch (random generator log-probs and advantages, fixed seed)."""
    rng = np.random.default_rng(seed)
    lengths = torch.tensor([len(c) for c in C])
    T = logp.shape[1]
    mask = torch.arange(T)[None, :] < lengths[:, None]
    gen = torch.tensor(-rng.exponential(1.0, (len(C), T)), dtype=torch.float32) * mask
    x = LossInputs(logp=logp, logp_gen=gen, mask=mask,
                   advantages=torch.tensor(rng.standard_normal(len(C)), dtype=torch.float32),
                   source=torch.zeros(len(C), dtype=torch.long), local=torch.ones(len(C), dtype=torch.bool),
                   source_names=("me",), logp_old=None, seq_level=torch.zeros(len(C), dtype=torch.bool),
                   seq_logp_gen=gen.sum(1))
    cfg = ObjectiveConfig(mode="F-TIS", norm_constant=16)
    return ftis_loss(x, cfg, count_denominators(mask, torch.ones(len(C), dtype=torch.bool))).loss


def loss_and_grads(model, params, fn, P, C, pad_id, sampling=SP, **kw):
    model.zero_grad(set_to_none=True)
    lp = fn(model, P, C, sampling, pad_id, grad=True, chunk=3, **kw)
    loss = ftis_loss_of(lp, C)
    loss.backward()
    return lp.detach(), loss.detach(), [p.grad.clone() for p in params]


def assert_same(a, b):
    (lp_a, loss_a, g_a), (lp_b, loss_b, g_b) = a, b
    assert lp_a.shape == lp_b.shape
    fin = torch.isfinite(lp_a)
    assert torch.equal(fin, torch.isfinite(lp_b))                  # top-p: the same tokens fall outside
    torch.testing.assert_close(lp_a[fin], lp_b[fin], rtol=RTOL, atol=1e-5)
    torch.testing.assert_close(loss_a, loss_b, rtol=RTOL, atol=1e-7)
    assert all(g.abs().sum() > 0 for g in g_a)                       # every trainable tensor gets a gradient
    diff = torch.cat([(x - y).flatten() for x, y in zip(g_a, g_b)])
    assert float(diff.norm() / torch.cat([x.flatten() for x in g_a]).norm()) < RTOL    # the whole gradient
    for x, y in zip(g_a, g_b):              # each tensor (tiny ones, e.g. a norm's 3e-7, carry more fp32 noise)
        assert float((x - y).norm() / x.norm()) < 10 * RTOL


def tiny(adapter: str, gc: bool):
    pol = build_policy(PolicyConfig(model="tiny-llama", adapter=adapter, lora_r=4, grad_checkpointing=gc))
    if adapter == "lora":                   # B starts at zero: a nonzero adapter so that A gets gradients
        with torch.no_grad():
            for p in pol.trainable:
                p.copy_(torch.randn_like(p) * 0.1)
    pol.model.train()
    return pol


@pytest.mark.parametrize("adapter, gc", [("full", False), pytest.param("lora", True, marks=pytest.mark.slow),
                                         pytest.param("full", True, marks=pytest.mark.slow),
                                         pytest.param("lora", False, marks=pytest.mark.slow)])
def test_shared_prefix_equals_unshared(adapter, gc):
    pol = tiny(adapter, gc)
    assert supports_shared_prefix(pol.model)
    assert all(m.gradient_checkpointing == gc for m in pol.model.modules() if hasattr(m, "gradient_checkpointing")
               and m is not pol.model)
    P, C = rows(pol.vocab_size)
    pad = pol.tokenizer.pad_token_id
    ref = loss_and_grads(pol.model, pol.trainable, token_logprobs, P, C, pad)
    assert_same(ref, loss_and_grads(pol.model, pol.trainable, shared_token_logprobs, P, C, pad))
    # the hook in token_logprobs takes the shared path and gives the same
    assert_same(ref, loss_and_grads(pol.model, pol.trainable, token_logprobs, P, C, pad, share_prefix=True))
    # the decoder layers' flags are restored afterwards
    assert not any("_can_checkpoint_with_cache" in m.__dict__ for m in pol.model.modules())
    # the LM head's log-softmax kept in the graph (logit-graph-mb) instead of recomputed per chunk: the same
    for fn in (token_logprobs, shared_token_logprobs):
        assert_same(ref, loss_and_grads(pol.model, pol.trainable, fn, P, C, pad, head_graph_mb=256.0))


@pytest.mark.parametrize("adapter", ["full", pytest.param("lora", marks=pytest.mark.slow)])
def test_sparse_tied_embedding_gradient_equals_the_dense_one(adapter):
    """The tied input embedding returns sparse row gradients (full fine-tuning on CPU); autograd sums them
    into the LM head's dense gradient: the same log-probs, loss and gradients as the dense embedding
    backward, on shared and unshared scoring, and the parameter's gradient stays dense."""
    from ftis_fed.policies.hf import sparse_tied_embedding_gradient

    pol = tiny(adapter, False)
    emb = unwrap_causal_lm(pol.model).get_input_embeddings()
    assert emb.sparse == (adapter == "full")                                 # LoRA: the embedding is frozen
    P, C = rows(pol.vocab_size)
    pad = pol.tokenizer.pad_token_id
    for fn in (token_logprobs, shared_token_logprobs):
        emb.sparse = adapter == "full"
        got = loss_and_grads(pol.model, pol.trainable, fn, P, C, pad)
        assert all(not p.grad.is_sparse for p in pol.trainable)
        emb.sparse = False
        assert_same(loss_and_grads(pol.model, pol.trainable, fn, P, C, pad), got)
    untied = build_policy(PolicyConfig(model="tiny-llama"))
    lm = unwrap_causal_lm(untied.model)
    lm.get_input_embeddings().sparse = False
    lm.lm_head.weight = torch.nn.Parameter(lm.lm_head.weight.detach().clone())
    assert not sparse_tied_embedding_gradient(lm) and not lm.get_input_embeddings().sparse


@pytest.mark.parametrize("adapter", ["full", "lora"])
def test_fused_lm_head_backward_equals_autograd(adapter, monkeypatch):
    """TargetLogProbs (kept log-probs reused in place in backward, one weight-gradient accumulation) gives
    the same log-probs, loss and gradients as the autograd path (per-chunk recompute), shared and unshared
    scoring; it applies only without top-k/top-p filters."""
    from ftis_fed.policies import scoring

    plain = SamplingParams(temperature=0.7, max_new_tokens=16)
    pol = tiny(adapter, False)
    head = unwrap_causal_lm(pol.model).get_output_embeddings()
    P, C = rows(pol.vocab_size)
    pad = pol.tokenizer.pad_token_id
    used = []
    real = scoring.TargetLogProbs.apply
    monkeypatch.setattr(scoring.TargetLogProbs, "apply", lambda *a: used.append(1) or real(*a))
    for fn in (token_logprobs, shared_token_logprobs):
        ref = loss_and_grads(pol.model, pol.trainable, fn, P, C, pad, sampling=plain)              # recompute
        assert not used
        assert_same(ref, loss_and_grads(pol.model, pol.trainable, fn, P, C, pad, sampling=plain, head_graph_mb=256.0))
        assert used
        used.clear()
    assert scoring.fused_head_ok(head, torch.zeros(1, 1, head.weight.shape[1]), plain)
    assert not scoring.fused_head_ok(head, torch.zeros(1, 1, head.weight.shape[1]), SP)      # top-p: autograd


def test_the_lm_head_graph_is_kept_only_within_its_budget(monkeypatch):
    """logit-graph-mb bounds the (rows x positions x vocabulary) fp32 values kept for backward; beyond it
    each chunk is checkpointed (recomputed in backward), and without gradient nothing is checkpointed."""
    from ftis_fed.policies import scoring

    pol = tiny("full", False)
    head = unwrap_causal_lm(pol.model).get_output_embeddings()
    V = head.weight.shape[0]
    assert scoring.keeps_head_graph(head, 4, 8, 4 * 8 * V * 4 / 2 ** 20)
    assert not scoring.keeps_head_graph(head, 4, 9, 4 * 8 * V * 4 / 2 ** 20)
    assert not scoring.keeps_head_graph(head, 1, 1, 0.0)                    # 0 = always recompute
    calls = []
    real = scoring.checkpoint
    monkeypatch.setattr(scoring, "checkpoint", lambda *a, **k: calls.append(1) or real(*a, **k))
    h, t = torch.randn(2, 6, head.weight.shape[1]), torch.randint(0, V, (2, 6))
    scoring.chunked_logprobs(head, h, t, SP, chunk=3, grad=True, head_graph_mb=1024.0)
    assert calls == []
    scoring.chunked_logprobs(head, h, t, SP, chunk=3, grad=True, head_graph_mb=0.0)
    assert calls == [1, 1]
    scoring.chunked_logprobs(head, h, t, SP, chunk=3, grad=False, head_graph_mb=0.0)
    assert calls == [1, 1]


def test_hook_dispatches_only_when_a_prompt_repeats(monkeypatch):
    pol = tiny("full", False)
    calls = []
    real = prefix.shared_token_logprobs
    monkeypatch.setattr(logprobs, "shared_token_logprobs", lambda *a, **k: calls.append(len(a[1])) or real(*a, **k))
    P, C = rows(pol.vocab_size)
    pad = pol.tokenizer.pad_token_id
    token_logprobs(pol.model, P, C, SP, pad, grad=False, share_prefix=True)
    token_logprobs(pol.model, P[:3], C[:3], SP, pad, grad=False, share_prefix=True)  # three distinct prompts
    token_logprobs(pol.model, P, C, SP, pad, grad=False, share_prefix=False)
    assert calls == [len(P)]


def test_edge_cases_one_prompt_all_empty_and_length_one():
    pol = tiny("full", False)
    pad = pol.tokenizer.pad_token_id
    p = [5, 6, 7]
    assert shared_token_logprobs(pol.model, [p, p], [[], []], SP, pad, grad=False).shape == (2, 0)
    for C in ([[11], [12], []], [[11, 12, 13], [14, 15, 16]]):          # T = 1: no completion pass
        P = [p] * len(C)
        a = token_logprobs(pol.model, P, C, SP, pad, grad=False)
        b = shared_token_logprobs(pol.model, P, C, SP, pad, grad=False)
        torch.testing.assert_close(a, b, rtol=RTOL, atol=1e-6)
    with pytest.raises(ValueError, match="at least one token"):
        shared_token_logprobs(pol.model, [[], []], [[1], [2]], SP, pad, grad=False)


def test_prompt_index_and_row_order():
    P = [[1, 2], [3], [1, 2], [4, 5, 6], [3], [1, 2]]
    C = [[9] * n for n in (2, 5, 4, 1, 1, 3)]
    unique, idx = prompt_index(P)
    assert unique == [[1, 2], [3], [4, 5, 6]] and idx == [0, 1, 0, 2, 1, 0]
    assert worth_sharing(P) and not worth_sharing(unique)
    order = row_order(P, C, group_prompts=True)
    assert sorted(order) == list(range(len(P)))
    seen = [tuple(P[i]) for i in order]
    assert [k for j, k in enumerate(seen) if j == 0 or seen[j - 1] != k] == [(1, 2), (3,), (4, 5, 6)]  # contiguous
    assert order == [2, 5, 0, 1, 4, 3]      # longest group first (ties: first seen), longest completion first
    assert row_order(P, C, group_prompts=False) == sorted(range(6), key=lambda i: -len(P[i]) - len(C[i]))
    # rows / whole prompt groups of advantage 0 go last (they fill the micro-batches that need no backward)
    zero = [True, False, True, False, False, True]             # prompt (1, 2) all zero; (3,) half zero
    assert row_order(P, C, group_prompts=True, zero=zero) == [1, 4, 3, 2, 5, 0]
    assert row_order(P, C, group_prompts=False, zero=zero) == [1, 3, 4, 2, 5, 0]


def test_update_with_and_without_sharing_is_the_same_step():
    """Trainer.step (ftis_step micro-batches grouped by prompt) with share-prefix on/off: the same
    loss, gradient norm and weights after one AdamW step; each micro-batch scores whole prompt groups."""
    P, C = rows(1000, seed=7, prompt_lens=(6, 3), completion_lens=((4, 2, 5, 1), (3, 3, 0, 6)))
    rng = np.random.default_rng(0)
    samples = [TrainSample(p, c, -rng.exponential(1.0, len(c)).astype(np.float32), 0.0, float(rng.standard_normal()),
                           "me", True) for p, c in zip(P, C)]
    out = []
    for share in (False, True):
        pol = build_policy(PolicyConfig(model="tiny-llama", micro_batch=4, share_prefix=share, lr=1e-3))
        seen = []
        score = pol.score_padded
        pol.score_padded = lambda p, c, s, g, _f=score: seen.append(len({tuple(x) for x in p})) or _f(p, c, s, g)
        m = Trainer(pol, ObjectiveConfig()).step(samples, SP)
        out.append((m, pol.trainable_state(), seen))
    (m0, w0, s0), (m1, w1, s1) = out
    assert s1 == [1, 1] and s0 == [2, 2]                       # grouped: one prompt per micro-batch of 4
    for k in ("train/loss", "train/grad_norm"):
        assert m1[k] == pytest.approx(m0[k], rel=RTOL)
    for n in w0:                                               # AdamW's first step ~ lr * sign(g)
        torch.testing.assert_close(w0[n], w1[n], rtol=0, atol=1e-6)


@pytest.mark.parametrize("arch", ["qwen2", "mistral", "llama-eager"])
def test_other_checked_architectures(arch):
    """Every architecture in prefix.MODEL_TYPES, and eager attention (additive 4D mask), random tiny weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kind = arch.split("-")[0]
    cfg = AutoConfig.for_model(kind, vocab_size=500, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                               pad_token_id=0)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager" if arch.endswith("eager") else "sdpa",
                                             dtype=torch.float32)
    model.train()
    assert supports_shared_prefix(model)
    P, C = rows(500)
    params = [p for p in model.parameters()]
    ref = loss_and_grads(model, params, token_logprobs, P, C, 0)
    assert_same(ref, loss_and_grads(model, params, shared_token_logprobs, P, C, 0))


def test_unsupported_setups_fall_back():
    pol = tiny("full", False)
    pol.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    assert not supports_shared_prefix(pol.model)          # reentrant: no graph through the recorded keys
    pol.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert supports_shared_prefix(pol.model)
    pol.model.config._attn_implementation = "flex_attention"
    assert not supports_shared_prefix(pol.model)


@pytest.mark.slow
def test_smollm2_shared_prefix_equals_unshared():
    """The real model (SmolLM2-135M, fp32, chat-template prompts of different lengths), full fine-tuning;
    no top-p (random tokens would all fall outside a trained model's nucleus: -inf, no gradient)."""
    pol = build_policy(PolicyConfig(model="smollm2", dtype="fp32"))
    pol.model.train()
    prompts = [pol.format_prompt("What is 3 + 4?"), pol.format_prompt("Compute 12 * 11 and reply with the number.")]
    assert len(prompts[0]) != len(prompts[1])
    g = torch.Generator().manual_seed(0)
    P, C = [], []
    for p, lens in zip(prompts, ((5, 1, 3), (4, 0, 6))):
        for n in lens:
            P.append(p)
            C.append(torch.randint(0, 49152, (n,), generator=g).tolist())
    pad = pol.tokenizer.pad_token_id
    sp = SamplingParams(temperature=0.7, max_new_tokens=16)
    ref = loss_and_grads(pol.model, pol.trainable, token_logprobs, P, C, pad, sampling=sp)
    assert_same(ref, loss_and_grads(pol.model, pol.trainable, shared_token_logprobs, P, C, pad, sampling=sp))


@pytest.mark.slow
def test_4bit_lora_shared_prefix_equals_unshared():
    """QLoRA (bitsandbytes NF4 SmolLM2 + LoRA, the path of tests/test_quant.py), after generating."""
    pytest.importorskip("bitsandbytes")
    from ftis_fed.policies import Prompt

    pol = build_policy(PolicyConfig(model="smollm2", adapter="lora", quant="4bit", dtype="fp32", lora_r=4))
    with torch.no_grad():
        for p in pol.trainable:
            p.copy_(torch.randn_like(p) * 0.02)
    sp = SamplingParams(temperature=0.7, max_new_tokens=6)
    rolls = pol.generate([Prompt("a/0", "What is 3 + 4?", "7"), Prompt("a/1", "What is 10 - 2? Just the number.", "8")],
                         3, sp, seed=0)
    P = [r.prompt_ids.tolist() for r in rolls for _ in r.completion_ids]
    C = [c.tolist() for r in rolls for c in r.completion_ids]
    pol.model.train()
    assert supports_shared_prefix(pol.model)
    pad = pol.tokenizer.pad_token_id
    ref = loss_and_grads(pol.model, pol.trainable, token_logprobs, P, C, pad, sampling=sp)
    assert_same(ref, loss_and_grads(pol.model, pol.trainable, shared_token_logprobs, P, C, pad, sampling=sp))


@pytest.mark.parametrize("adapter", ["full", "lora"])
def test_generation_prefills_each_prompt_once_with_the_same_samples(adapter):
    """HFPolicy.generate with share-prefix: the prompt's first P-1 positions run once per prompt (not per
    completion) and the G rows continue from a copy of that cache; same seed -> the same tokens and
    recorded log-probs as the unshared prefill, and the recorded log-probs still equal a teacher-forced
    rescoring (prompts of different lengths: left padding)."""
    from ftis_fed.policies import Prompt

    prompts = [Prompt("a/0", "What is 3 + 4? Reply with just the number.", "7"),
               Prompt("a/1", "What is 12 + 35 + 8 + 1? Reply with just the number, please.", "56")]
    sp = SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=8)
    out = {}
    for share in (False, True):
        pol = build_policy(PolicyConfig(model="tiny-llama", adapter=adapter, lora_r=4, share_prefix=share))
        first_batch = []
        hook = unwrap_causal_lm(pol.model).register_forward_pre_hook(
            lambda m, a, kw: first_batch.append(kw["input_ids"].shape) if not first_batch else None, with_kwargs=True)
        rolls = pol.generate(prompts, 3, sp, seed=5)
        hook.remove()
        P_ = [r.prompt_ids.tolist() for r in rolls for _ in r.completion_ids]
        C_ = [c.tolist() for r in rolls for c in r.completion_ids]
        rec = [lp for r in rolls for lp in r.logprobs]
        rescored = pol.score(P_, C_, sp)
        assert max(float((s - torch.as_tensor(r)).abs().max()) for s, r in zip(rescored, rec)) <= 1e-4
        out[share] = (rolls, first_batch[0])
    (r0, shape0), (r1, shape1) = out[False], out[True]
    P = max(len(r.prompt_ids) for r in r0)
    assert len({len(r.prompt_ids) for r in r0}) == 2
    assert tuple(shape0) == (6, P) and tuple(shape1) == (2, P - 1)     # prefill: 6 rows vs 2 prompts once
    for a, b in zip(r0, r1):
        for x, y in zip(a.completion_ids, b.completion_ids):
            assert np.array_equal(x, y)
        for x, y in zip(a.logprobs, b.logprobs):
            np.testing.assert_allclose(x, y, rtol=0, atol=1e-5)


@pytest.mark.parametrize("adapter", ["full", "lora"])
def test_greedy_evaluation_prefills_the_common_prefix_once_with_the_same_replies(adapter):
    """generate_greedy with share-prefix: the rows' longest common prefix (the chat template's system
    message) runs once for one row, the rest of each row after a masked gap; the same greedy tokens
    (replies) and the same next-token logits as left-padded rows computed in full."""
    from ftis_fed.policies import Prompt

    prompts = [Prompt(f"a/{i}", t, "0") for i, t in enumerate(
        ["What is 3 + 4?", "What is 12 + 35 + 8 + 1? Reply with just the number, please.", "Next: 2, 4, 6, ?"])]
    out = {}
    for share in (False, True):
        pol = build_policy(PolicyConfig(model="tiny-llama", adapter=adapter, lora_r=4, share_prefix=share))
        calls = []
        hook = unwrap_causal_lm(pol.model).register_forward_pre_hook(
            lambda m, a, kw: calls.append(tuple(kw["input_ids"].shape)), with_kwargs=True)
        out[share] = pol.generate_greedy(prompts, 6)
        hook.remove()
        rows = [pol.format_prompt(p.text) for p in prompts]
        out[share, "calls"] = calls[:2]
        if share:
            ids, attn, cache = pol._common_prefix_rows(rows)
            L = next(i for i in range(ids.shape[1]) if attn[1:, i].min() == 0)     # the gap after the prefix
            assert all(r[:L] == rows[0][:L] for r in rows) and L >= 2
            with torch.no_grad():
                pos_s = (attn.cumsum(-1) - 1).clamp(min=0)
                shared = pol.model(input_ids=ids[:, L:], attention_mask=attn, position_ids=pos_s[:, L:],
                                   past_key_values=cache).logits[:, -1]
                from ftis_fed.policies.hf import left_pad
                full_ids, full_attn = left_pad(rows, pol.tokenizer.pad_token_id)
                pos = (full_attn.cumsum(-1) - 1).clamp(min=0)
                full = pol.model(input_ids=full_ids, attention_mask=full_attn, position_ids=pos).logits[:, -1]
            torch.testing.assert_close(shared, full, rtol=0, atol=1e-4)
    assert out[True] == out[False]
    n, P = len(prompts), max(len(pol.format_prompt(p.text)) for p in prompts)
    assert out[False, "calls"][0] == (n, P) and out[True, "calls"][0] == (1, L)   # the prefix alone, once
    assert out[True, "calls"][1][1] == P - L                                        # then only the rest


def test_generation_after_an_update_uses_the_new_weights():
    """The shared prefill runs on the live weights: after a Trainer step, generate's recorded log-probs
    equal a rescoring under the updated model (and differ from the pre-update model's)."""
    from ftis_fed.policies import Prompt

    prompts = [Prompt("a/0", "What is 3 + 4? Reply with just the number.", "7")]
    sp = SamplingParams(temperature=1.0, max_new_tokens=6)
    pol = build_policy(PolicyConfig(model="tiny-llama", share_prefix=True, lr=1e-2))
    before = pol.generate(prompts, 4, sp, seed=2)
    samples = [TrainSample(before[0].prompt_ids.tolist(), c.tolist(), lp, float(lp.sum()), float(a), "me", True)
               for c, lp, a in zip(before[0].completion_ids, before[0].logprobs, (1.0, -1.0, 0.5, -0.5))]
    Trainer(pol, ObjectiveConfig()).step(samples, sp)
    after = pol.generate(prompts, 4, sp, seed=2)
    P_ = [after[0].prompt_ids.tolist()] * 4
    C_ = [c.tolist() for c in after[0].completion_ids]
    rescored = pol.score(P_, C_, sp)
    assert max(float((s - torch.as_tensor(r)).abs().max()) for s, r in zip(rescored, after[0].logprobs)) <= 1e-4
    assert any(not np.allclose(x, y, atol=1e-3) for x, y in zip(before[0].logprobs, after[0].logprobs)
               if len(x) == len(y))


@pytest.mark.parametrize("score_zero", [True, False])
@pytest.mark.parametrize("share", [False, True])
def test_zero_advantage_micro_batches_skip_the_backward_with_the_same_step(share, score_zero):
    """A micro-batch whose rows all have advantage 0 gets no backward (its gradient is exactly zero): with
    ``score-zero-advantage`` it is scored without a graph (same loss, diagnostics, gradient norm and
    weights as the reference step that runs every micro-batch with a graph and a backward); without it,
    it is not scored at all (same loss, gradient norm and weights; the diagnostics cover the other rows)."""
    P, C = rows(1000, seed=7, prompt_lens=(6, 3), completion_lens=((4, 2, 5, 1), (3, 3, 2, 6)))
    rng = np.random.default_rng(0)
    zero = tuple(P[0])                                         # the first prompt's group: all rewards equal
    samples = [TrainSample(p, c, -rng.exponential(1.0, len(c)).astype(np.float32), 0.0,
                           0.0 if tuple(p) == zero else float(rng.standard_normal()), "me", True)
               for p, c in zip(P, C)]
    out = []
    for force_graph, knob in ((True, True), (False, score_zero)):
        pol = build_policy(PolicyConfig(model="tiny-llama", micro_batch=4, share_prefix=share, lr=1e-3,
                                        score_zero_advantage=knob))
        asked = []
        score = pol.score_padded
        pol.score_padded = lambda p, c, s, g, _f=score, _force=force_graph: asked.append(g) or _f(p, c, s, g or _force)
        m = Trainer(pol, ObjectiveConfig()).step(samples, SP)
        out.append((m, pol.trainable_state(), asked))
    (m0, w0, _), (m1, w1, asked) = out
    # the zero rows are ordered last (``row_order``): with or without grouping they fill one micro-batch
    assert m1["train/no_backward_rows"] == 4.0
    skipped = not score_zero
    assert m1["train/unscored_rows"] == (4.0 if skipped else 0.0)
    assert sorted(asked) == ([True] if skipped else [False, True])
    same = ("train/loss", "train/grad_norm", "train/samples", "train/tokens") if skipped else m0
    for k in same:
        assert m1[k] == pytest.approx(m0[k], rel=RTOL, abs=1e-7), k
    if skipped:                                                # diagnostics over the 4 rows that were scored
        assert m1["offpolicy/me/samples"] == 4.0 and m0["offpolicy/me/samples"] == 8.0
    for n in w0:
        torch.testing.assert_close(w0[n], w1[n], rtol=0, atol=1e-7)


def test_an_update_of_only_zero_advantages_still_steps_adamw():
    """No backward at all: the zero gradients are filled in, so AdamW still takes its step (weight decay,
    and momentum from the previous step) as it did when the backward ran."""
    P, C = rows(1000, seed=7, prompt_lens=(6,), completion_lens=((4, 2, 5, 1),))
    pol = build_policy(PolicyConfig(model="tiny-llama", micro_batch=4, lr=1e-3, weight_decay=0.5))
    trainer = Trainer(pol, ObjectiveConfig())
    lp = [-np.ones(len(c), dtype=np.float32) for c in C]
    trainer.step([TrainSample(p, c, l, 0.0, a, "me", True) for p, c, l, a in zip(P, C, lp, (1.0, -1.0, 0.5, -0.5))], SP)
    before = pol.trainable_state()
    m = trainer.step([TrainSample(p, c, l, 0.0, 0.0, "me", True) for p, c, l in zip(P, C, lp)], SP)
    after = pol.trainable_state()
    assert m["train/no_backward_rows"] == 4.0 and m["train/grad_norm"] == 0.0
    assert all(not torch.equal(before[n], after[n]) for n in before)
