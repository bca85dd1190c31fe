"""Issue 11, memory and fidelity on real tiny models: the weights dtype, the 8-bit optimizers,
gradient checkpointing by sequence length, generation that ignores the model's
generation_config.json, the end-of-run export (reloaded with transformers / peft), the checkpoint
cadence, and ``ftis-fed models fetch`` (cache and offline paths; no network here)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LogitsProcessorList

from ftis_fed.wire.batch import CompletionBatch, SamplingParams, make_group
from ftis_fed.learn.objective import ObjectiveConfig
from ftis_fed.participant import checkpoint_due
from ftis_fed.policies import PolicyConfig, Prompt, build_policy
from ftis_fed.policies.hf import RecordingSampler, left_pad, sampling_generation_config, unwrap_causal_lm, use_checkpointing
from ftis_fed.policies.models import resolve_model
from ftis_fed.learn.training import Trainer, samples_from_batches

PROMPTS = [Prompt("a/0", "What is 2 + 3?", "5"), Prompt("a/1", "What is 4 + 4?", "8")]
SP = SamplingParams(temperature=0.8, max_new_tokens=8)


def train_one_step(pol, seed=0):
    rolls = pol.generate(PROMPTS, 3, SP, seed=seed)
    groups = [make_group(r.prompt_ids, r.completion_ids, r.logprobs, np.array([1.0, 0.0, 1.0]), r.prompt.task_id,
                         r.prompt.reference) for r in rolls]
    batch = CompletionBatch("me", "t", 0, 0, pol.model_id, pol.tokenizer_fp, pol.vocab_size, SP, tuple(groups))
    trainer = Trainer(pol, ObjectiveConfig())
    before = {n: t.clone() for n, t in pol.trainable_state().items()}
    m = trainer.step(samples_from_batches([batch.validate()], "me", pol.tokenizer_fp, ObjectiveConfig()), SP)
    changed = sum(not torch.equal(before[n], t) for n, t in pol.trainable_state().items())
    return trainer, m, changed


# ----------------------------------------------------------------------------- weights dtype / optimizer
@pytest.mark.parametrize("wd,dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_weights_load_in_the_weights_dtype_and_a_step_runs(wd, dtype):
    pol = build_policy(PolicyConfig(model="tiny-llama", weights_dtype=wd, lr=1e-2))
    floats = [p for p in pol.model.parameters() if p.is_floating_point()]
    assert floats and all(p.dtype == dtype for p in floats)
    fp32 = build_policy(PolicyConfig(model="tiny-llama"))
    assert sum(p.numel() * p.element_size() for p in floats) * 2 == sum(
        p.numel() * p.element_size() for p in fp32.model.parameters())
    trainer, m, changed = train_one_step(pol)
    assert np.isfinite(m["train/loss"]) and m["train/grad_norm"] > 0 and changed > 0
    # torch keeps AdamW's moments in the parameter's dtype: half the fp32 optimizer memory
    st = next(iter(trainer.optimizer.state.values()))
    assert st["exp_avg"].dtype == dtype


def test_lora_on_bf16_weights_keeps_fp32_adapters():
    pol = build_policy(PolicyConfig(model="tiny-llama", weights_dtype="bf16", adapter="lora", lora_r=4, lr=1e-2))
    assert all(p.dtype == torch.float32 for p in pol.trainable_parameters())
    assert all(p.dtype == torch.bfloat16 for n, p in pol.model.named_parameters() if "lora_" not in n)
    _, m, changed = train_one_step(pol)
    assert np.isfinite(m["train/loss"]) and changed > 0


@pytest.mark.parametrize("opt", ["adamw-8bit", "paged-adamw-8bit"])
def test_8bit_adamw_steps_saves_and_resumes(opt, tmp_path):
    pytest.importorskip("bitsandbytes")
    import bitsandbytes as bnb

    pol = build_policy(PolicyConfig(model="tiny-llama", optimizer=opt, lr=1e-2))
    trainer, m, changed = train_one_step(pol)
    assert isinstance(trainer.optimizer, bnb.optim.optimizer.Optimizer8bit)
    assert changed > 0 and np.isfinite(m["train/loss"])
    big = [s for s in trainer.optimizer.state.values() if "state1" in s and s["state1"].numel() >= 4096]
    assert big and all(s["state1"].dtype == torch.uint8 and s["state2"].dtype == torch.uint8 for s in big)
    trainer.save(tmp_path / "policy.pt")
    twin = build_policy(PolicyConfig(model="tiny-llama", optimizer=opt, lr=1e-2))
    t2 = Trainer(twin, ObjectiveConfig())
    t2.load(tmp_path / "policy.pt")
    assert t2.steps == 1
    assert all(torch.equal(a, b) for a, b in zip(pol.trainable_state().values(), twin.trainable_state().values()))


def test_bad_policy_keys_name_the_key():
    with pytest.raises(ValueError, match=r"policy.weights_dtype='fp8': must be 'fp32', 'bf16' or 'fp16'"):
        PolicyConfig(weights_dtype="fp8")
    with pytest.raises(ValueError, match=r"policy.optimizer='sgd'"):
        PolicyConfig(optimizer="sgd")
    with pytest.raises(ValueError, match=r"policy.grad_checkpointing_tokens=-1"):
        PolicyConfig(grad_checkpointing_tokens=-1)


# ----------------------------------------------------------------------------- checkpointing by length
def test_grad_checkpointing_by_sequence_length():
    cfg = PolicyConfig(grad_checkpointing_tokens=100)
    assert not use_checkpointing(cfg, [[1] * 10] * 4, [[2] * 15] * 4)          # 4 x 25 = 100: not over
    assert use_checkpointing(cfg, [[1] * 10] * 4, [[2] * 15, [2] * 16, [2], [2]])  # 4 x 26 = 104
    assert use_checkpointing(PolicyConfig(grad_checkpointing=True), [[1]], [[2]])
    assert not use_checkpointing(PolicyConfig(), [[1] * 1000], [[2] * 1000])
    pol = build_policy(PolicyConfig(model="tiny-llama", grad_checkpointing_tokens=60))
    flags = lambda: [m.gradient_checkpointing for m in pol.model.modules() if hasattr(m, "gradient_checkpointing")]
    p = pol.format_prompt("What is 2 + 3?")
    pol.model.train()
    pol.score_padded([p], [[5, 6]], SP, grad=True)                # short: off
    assert not any(flags()) and not pol.checkpointing
    pol.score_padded([p] * 4, [[5] * 20] * 4, SP, grad=True)      # long: on
    assert all(flags()) and pol.checkpointing
    pol.score_padded([p], [[5, 6]], SP, grad=True)
    assert not any(flags())


# ----------------------------------------------------------------------------- generation fidelity
LEAKY = dict(repetition_penalty=1.3, min_p=0.1, typical_p=0.9, no_repeat_ngram_size=2)


@pytest.fixture(scope="module")
def leaky_model(tmp_path_factory):
    """tiny-llama with a peaked LM head (so penalties matter) and a generation_config.json that sets
    a repetition penalty, min-p, typical-p and no-repeat-ngram, as hub instruct models do."""
    out = tmp_path_factory.mktemp("leaky") / "model"
    src = resolve_model("tiny-llama")
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(40.0)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(src).save_pretrained(out)
    gc = json.loads((out / "generation_config.json").read_text())
    (out / "generation_config.json").write_text(json.dumps({**gc, **LEAKY}))
    return out


def test_recorded_logprobs_ignore_the_models_generation_config(leaky_model):
    pol = build_policy(PolicyConfig(model=str(leaky_model)))
    assert {k: getattr(pol.hub_generation_config, k) for k in LEAKY} == LEAKY        # it was read
    rolls = pol.generate(PROMPTS, 4, SP, seed=0)
    P = [r.prompt_ids.tolist() for r in rolls for _ in r.completion_ids]
    C = [c.tolist() for r in rolls for c in r.completion_ids]
    rec = [lp for r in rolls for lp in r.logprobs]
    diff = max((s - torch.as_tensor(r)).abs().max().item() for s, r in zip(pol.score(P, C, SP), rec))
    assert diff <= 1e-4

    # the test can fail: the previous configuration (only temperature / top-k / top-p set) with the
    # model's generation_config in place lets its repetition penalty reach the recorded log-probs
    lm = unwrap_causal_lm(pol.model)
    lm.generation_config = pol.hub_generation_config
    tok = pol.tokenizer
    rows = [pol.format_prompt(p.text) for p in PROMPTS for _ in range(4)]
    ids, attn = left_pad(rows, tok.pad_token_id)
    sampler = RecordingSampler(SP, ids.shape[1])
    old = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=SP.max_new_tokens,
                           eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    seqs = pol.model.generate(input_ids=ids, attention_mask=attn, generation_config=old,
                              logits_processor=LogitsProcessorList([sampler]))
    rec = sampler.finish(seqs)
    gen = seqs[:, ids.shape[1]:].tolist()
    leaked = (pol.score_padded(rows, gen, SP, grad=False) - rec).abs().max().item()
    assert leaked > 100 * diff and leaked > 1e-2
    # and with the explicit configuration the model's file no longer matters even when in place
    sampler = RecordingSampler(SP, ids.shape[1])
    seqs = pol.model.generate(input_ids=ids, attention_mask=attn, logits_processor=LogitsProcessorList([sampler]),
                              generation_config=sampling_generation_config(SP.max_new_tokens, tok))
    gen = seqs[:, ids.shape[1]:].tolist()
    assert (pol.score_padded(rows, gen, SP, grad=False) - sampler.finish(seqs)).abs().max().item() <= 1e-4


# ----------------------------------------------------------------------------- export
def greedy_reloaded(model, tok, pol, prompts, n):
    """(texts, generated ids, last-prompt-position logits) of plain transformers greedy decoding."""
    rows = [pol.format_prompt(p.text) for p in prompts]
    ids, attn = left_pad(rows, tok.pad_token_id)
    cfg = GenerationConfig(do_sample=False, max_new_tokens=n, eos_token_id=tok.eos_token_id,
                           pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id)
    with torch.no_grad():
        seqs = model.generate(input_ids=ids, attention_mask=attn, generation_config=cfg)
        logits = model(input_ids=ids, attention_mask=attn).logits[:, -1]
    gen = seqs[:, ids.shape[1]:]
    return tok.batch_decode(gen, skip_special_tokens=True), gen, logits


@pytest.mark.parametrize("adapter", ["full", "lora"])
def test_export_reloads_with_transformers_and_reproduces_greedy_output(adapter, tmp_path):
    pol = build_policy(PolicyConfig(model="tiny-llama", adapter=adapter, lora_r=4, lr=5e-2))
    _, _, changed = train_one_step(pol)
    assert changed > 0
    prompts = PROMPTS + [Prompt("a/2", "Name a colour.", "red")]
    ours = pol.generate_greedy(prompts, 12)
    pol.model.eval()
    _, our_ids, our_logits = greedy_reloaded(pol.model, pol.tokenizer, pol, prompts, 12)
    out = pol.export(tmp_path / "export")
    assert out == tmp_path / "export" and not (tmp_path / "export.tmp").exists()
    tok = AutoTokenizer.from_pretrained(out)
    if adapter == "lora":
        from peft import PeftModel

        assert (out / "adapter_config.json").exists() and not (out / "model.safetensors").exists()
        base_path = json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"]
        base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
        before_training = greedy_reloaded(base, tok, pol, prompts, 12)
        model = PeftModel.from_pretrained(base, out)
    else:
        assert (out / "config.json").exists() and (out / "model.safetensors").exists()
        model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
        before_training = greedy_reloaded(AutoModelForCausalLM.from_pretrained(resolve_model("tiny-llama")),
                                          tok, pol, prompts, 12)
    model.eval()
    texts, ids, logits = greedy_reloaded(model, tok, pol, prompts, 12)
    assert texts == ours and torch.equal(ids, our_ids)
    assert torch.allclose(logits, our_logits, atol=1e-5)
    assert not torch.allclose(before_training[2], our_logits, atol=1e-4)      # the export carries the update
    pol.export(tmp_path / "export")                     # a second export replaces the first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]


# ----------------------------------------------------------------------------- checkpoint cadence
def test_checkpoint_cadence():
    assert [r for r in range(1, 8) if checkpoint_due(r, 7, 1)] == [1, 2, 3, 4, 5, 6, 7]
    assert [r for r in range(1, 8) if checkpoint_due(r, 7, 3)] == [3, 6, 7]
    assert [r for r in range(1, 8) if checkpoint_due(r, 7, 0)] == [7]


# ----------------------------------------------------------------------------- models fetch
def test_models_fetch_uses_the_cache_and_fails_clearly_offline(tmp_path, monkeypatch, capsys):
    from huggingface_hub import constants

    from ftis_fed.commands.cli import main

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["models", "fetch", "org/some-model"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("ftis-fed: models fetch org/some-model: not in the Hugging Face cache") and "HF_HUB_OFFLINE" in err
    assert main(["models", "fetch", "not-a-hub-id"]) == 1
    assert "not a hub id" in capsys.readouterr().err

    repo = tmp_path / "hub" / "models--org--some-model"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "snapshots" / commit / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    assert main(["models", "fetch", "org/some-model"]) == 0
    line = json.loads(capsys.readouterr().out)
    assert line == {"model": "org/some-model", "revision": None, "path": str(repo / "snapshots" / commit),
                    "cached": True}
    assert main(["models", "fetch", "org/some-model", "--revision", commit]) == 0            # a commit
    assert json.loads(capsys.readouterr().out)["cached"] is True
    assert main(["models", "fetch", "org/some-model", "--revision", "v2"]) == 1              # not cached
    assert "org/some-model@v2: not in the Hugging Face cache" in capsys.readouterr().err
