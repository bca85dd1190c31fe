"""The research tier's model family (ftis_fed.policies.micro): tokenizers, an end-to-end build of a
small configuration through the HF backend (generate, score, shared prefix, LoRA, cross-tokenizer
exchange), warm-up determinism, and the registry; the registered models under ``-m slow``."""

from __future__ import annotations

import hashlib
from dataclasses import replace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import PreTrainedTokenizerFast

from ftis_fed.learn.objective import ObjectiveConfig
from ftis_fed.learn.training import Trainer, samples_from_batches
from ftis_fed.policies import PolicyConfig, Prompt, build_policy, micro, tokenizer_fingerprint
from ftis_fed.policies.models import OFFLINE_MODELS
from ftis_fed.wire.batch import CompletionBatch, SamplingParams, make_group

PROMPTS = [Prompt("add30/train/0/0", "What is 17 + 25? Reply with just the number.", "42"),
           Prompt("sub30/train/0/0", "What is 25 - 17? Reply with just the number.", "8")]
SP = SamplingParams(temperature=1.0, max_new_tokens=6)
TINY = dict(hidden=32, layers=2, heads=4, kv_heads=2, intermediate=64, steps=4, batch=8, lr=3e-3)


def _state_hash(folder) -> str:
    w = load_file(str(folder / "model.safetensors"))
    h = hashlib.sha256()
    for k in sorted(w):
        h.update(k.encode())
        h.update(w[k].contiguous().numpy().tobytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """A tiny Llama/BPE and a tiny Qwen2/char model, built end to end by ``build_micro``."""
    root = tmp_path_factory.mktemp("micro")
    out = {}
    for name, spec in {"llama-bpe": micro.MicroSpec("llama", "bpe", families=("add30", "sub30"), **TINY),
                       "qwen-char": micro.MicroSpec("qwen2", "char", families=("sub30",), **TINY)}.items():
        micro.build_micro(root / name, spec, log=False)
        out[name] = root / name
    return out


def _batch(pol, rolls, sender):
    groups = tuple(make_group(r.prompt_ids, r.completion_ids, r.logprobs,
                              np.arange(len(r.completion_ids), dtype=np.float32) % 2, r.prompt.task_id,
                              r.prompt.reference, r.prompt.text, r.completion_texts) for r in rolls)
    return CompletionBatch(sender=sender, run_id="t", round=0, seq=0, model_id=pol.model_id,
                           tokenizer_fp=pol.tokenizer_fp, vocab_size=pol.vocab_size, sampling=SP,
                           groups=groups).validate()


def test_tokenizers_are_fast_with_chat_template_and_lossless():
    text = "Mia has 12 apples. She gives 3 away: 9 left — ok? é 😀"
    toks = {k: micro.build_tokenizer(k) for k in micro.TOKENIZERS}
    for kind, tok in toks.items():
        assert isinstance(tok, PreTrainedTokenizerFast)
        assert tok.pad_token == micro.PAD and tok.eos_token == micro.EOS and tok.pad_token_id != tok.eos_token_id
        assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text     # byte-level: lossless
        ids = tok.apply_chat_template([{"role": "user", "content": PROMPTS[0].text}], add_generation_prompt=True,
                                      tokenize=True, return_dict=False)
        assert ids[0] == tok.convert_tokens_to_ids(micro.USER) and ids[-1] == tok.convert_tokens_to_ids(micro.ASSISTANT)
        assert tok.decode(ids, skip_special_tokens=True) == PROMPTS[0].text
    char, bpe = toks["char"], toks["bpe"]
    assert len(char) == len(micro.SPECIALS) + 256
    assert len(char(text, add_special_tokens=False)["input_ids"]) == len(text.encode())   # one token per byte
    q = PROMPTS[0].text
    assert len(bpe(q, add_special_tokens=False)["input_ids"]) < len(q) / 3               # BPE merges the text
    assert [bpe.decode([i]) for i in bpe("1729", add_special_tokens=False)["input_ids"]] == list("1729")
    assert tokenizer_fingerprint(char) != tokenizer_fingerprint(bpe)
    assert micro.build_tokenizer("bpe").backend_tokenizer.to_str() == bpe.backend_tokenizer.to_str()   # seeded corpus


def test_tiny_build_loads_generates_scores_and_shares_prefixes(tiny_models):
    for name, folder in tiny_models.items():
        pol = build_policy(PolicyConfig(model=str(folder), micro_batch=4))
        assert pol._shares_prefills()                                   # llama and qwen2: prefix.MODEL_TYPES
        # the policy tokenizes exactly as the warm-up did (transformers would give qwen2 a Qwen2Tokenizer)
        built = micro.build_tokenizer("bpe" if "bpe" in name else "char")
        assert pol.tokenizer.backend_tokenizer.to_str() == built.backend_tokenizer.to_str()
        assert pol.format_prompt(PROMPTS[0].text) == built.apply_chat_template(
            [{"role": "user", "content": PROMPTS[0].text}], add_generation_prompt=True, tokenize=True, return_dict=False)
        rolls = pol.generate(PROMPTS, 3, SP, seed=1)
        assert [len(r.completion_ids) for r in rolls] == [3, 3]
        assert all(0 < len(c) <= SP.max_new_tokens for r in rolls for c in r.completion_ids)
        P = [r.prompt_ids.tolist() for r in rolls for _ in r.completion_ids]
        C = [c.tolist() for r in rolls for c in r.completion_ids]
        rec = torch.cat([torch.as_tensor(lp) for r in rolls for lp in r.logprobs])
        shared = torch.cat(pol.score(P, C, SP))
        assert (shared - rec).abs().max().item() < 1e-4, name          # recorded == teacher-forced
        plain = build_policy(PolicyConfig(model=str(folder), micro_batch=4, share_prefix=False))
        assert (torch.cat(plain.score(P, C, SP)) - shared).abs().max().item() < 1e-5
        assert len(pol.generate_greedy(PROMPTS, 4)) == 2


def test_tiny_build_trains_full_and_lora(tiny_models):
    for adapter in ("full", "lora"):
        pol = build_policy(PolicyConfig(model=str(tiny_models["llama-bpe"]), adapter=adapter, micro_batch=4, lora_r=4))
        rolls = pol.generate(PROMPTS, 4, SP, seed=3)
        samples = samples_from_batches([_batch(pol, rolls, "me")], "me", pol.tokenizer_fp, ObjectiveConfig())
        before = pol.trainable_state()
        m = Trainer(pol, ObjectiveConfig()).step(samples, SP)
        assert np.isfinite(m["train/loss"]) and m["train/grad_norm"] > 0
        after = pol.trainable_state()
        assert any(not torch.equal(before[k], after[k]) for k in before)
        if adapter == "lora":
            assert before and all("lora_" in k for k in before)


def test_lr_warmup_ramps_the_rate_and_a_resumed_trainer_continues_it(tiny_models, tmp_path):
    cfg = PolicyConfig(model=str(tiny_models["llama-bpe"]), micro_batch=4, lr=1e-3, lr_warmup_steps=4)
    assert [cfg.lr_at(s) for s in (1, 2, 4, 9)] == [2.5e-4, 5e-4, 1e-3, 1e-3]
    assert PolicyConfig(model="x", lr=1e-3).lr_at(1) == 1e-3                     # 0 = off
    with pytest.raises(ValueError, match="lr_warmup_steps"):
        PolicyConfig(model="x", lr_warmup_steps=-1)
    pol = build_policy(cfg)
    samples = samples_from_batches([_batch(pol, pol.generate(PROMPTS, 4, SP, seed=3), "me")], "me",
                                   pol.tokenizer_fp, ObjectiveConfig())
    t = Trainer(pol, ObjectiveConfig())
    lrs = [t.step(samples, SP)["train/lr"] for _ in range(2)]
    assert lrs == [2.5e-4, 5e-4] and t.optimizer.param_groups[0]["lr"] == 5e-4
    t.save(tmp_path / "ckpt.pt")
    resumed = Trainer(build_policy(cfg), ObjectiveConfig())
    resumed.load(tmp_path / "ckpt.pt")
    assert resumed.step(samples, SP)["train/lr"] == 7.5e-4                       # update 3 of the warm-up


def test_updates_per_round_steps_again_on_the_same_samples_clipped_against_the_rounds_start(tiny_models):
    def trained(n):
        pol = build_policy(PolicyConfig(model=str(tiny_models["llama-bpe"]), micro_batch=4, lr=3e-3,
                                        updates_per_round=n))
        rolls = pol.generate(PROMPTS, 4, SP, seed=3)
        samples = samples_from_batches([_batch(pol, rolls, "me")], "me", pol.tokenizer_fp, ObjectiveConfig())
        t = Trainer(pol, ObjectiveConfig())
        old = t.old_logprobs(samples, SP)                    # the PPO clip's reference: the round's start
        recorded = [torch.as_tensor(s.logp_gen) for s in samples]
        assert max((a - b).abs().max().item() for a, b in zip(old, recorded)) < 1e-4
        m = t.step(samples, SP)
        assert t.steps == n and m["train/updates"] == n
        new = t.old_logprobs(samples, SP)
        up = [(b - a).sum().item() for a, b, s in zip(old, new, samples) if s.advantage > 0]
        return float(np.mean(up))
    assert trained(3) > trained(1) > 0                       # rewarded completions gain more with more steps
    with pytest.raises(ValueError, match="updates_per_round"):
        PolicyConfig(model="x", updates_per_round=0)


def test_cross_tokenizer_exchange_between_char_and_bpe(tiny_models):
    bpe = build_policy(PolicyConfig(model=str(tiny_models["llama-bpe"]), micro_batch=4))
    char = build_policy(PolicyConfig(model=str(tiny_models["qwen-char"]), micro_batch=4))
    assert bpe.tokenizer_fp != char.tokenizer_fp
    cfg = ObjectiveConfig(mode="F-TIS")
    b_bpe = _batch(bpe, bpe.generate(PROMPTS, 2, SP, seed=5), "bpe")
    b_char = _batch(char, char.generate(PROMPTS, 2, SP, seed=6), "char")
    samples = samples_from_batches([b_char, b_bpe], "char", char.tokenizer_fp, cfg, retokenize=char.retokenize)
    peer = [s for s in samples if s.source == "bpe"]
    assert peer and all(s.seq_level for s in peer) and not any(s.seq_level for s in samples if s.local)
    for s, text in zip(peer, [t for g in b_bpe.groups for t in g.completion_texts]):
        body = s.completion_ids[:-1] if s.completion_ids and s.completion_ids[-1] == char.tokenizer.eos_token_id \
            else s.completion_ids
        assert char.tokenizer.decode(body) == text                      # the peer's text, exactly
    m = Trainer(char, cfg).step(samples, SP)
    assert np.isfinite(m["train/loss"]) and np.isfinite(m["offpolicy/bpe/ratio_mean"])


def test_warm_up_is_deterministic_and_seeded(tmp_path):
    spec = micro.MicroSpec("qwen2", "bpe", families=("add30",), **TINY)
    micro.build_micro(tmp_path / "a", spec, log=False)
    micro.build_micro(tmp_path / "b", spec, log=False)
    micro.build_micro(tmp_path / "c", replace(spec, seed=1), log=False)
    assert _state_hash(tmp_path / "a") == _state_hash(tmp_path / "b")
    assert _state_hash(tmp_path / "a") != _state_hash(tmp_path / "c")


def test_warm_up_rows_come_from_the_train_split_only():
    tok = micro.build_tokenizer("bpe")
    rows = micro.warmup_rows(tok, ("add30", "sub30"), 40, seed=0)
    assert rows == micro.warmup_rows(tok, ("add30", "sub30"), 40, seed=0)
    texts = {tok.decode(p, skip_special_tokens=True) for p, _ in rows}
    from ftis_fed.tasks.suite import make_tasks

    heldout = {p.text for f in ("add30", "sub30") for p in make_tasks(f, "eval", 80, seed=0)}
    assert texts and not texts & heldout
    assert all(r[-1] == tok.eos_token_id for _, r in rows)
    assert sum("+" in t for t in texts) and sum("-" in t for t in texts)


def test_pretrain_share_of_the_warm_up():
    """``pretrain`` families get round(n * share) of the warm-up's problems (train split only); without
    them the rows are exactly those of before (the models already built keep their weights)."""
    tok = micro.build_tokenizer("bpe")
    rows = micro.warmup_rows(tok, ("add30", "sub30"), 200, seed=0, pretrain=("add3", "next"), pretrain_share=0.1)
    texts = [tok.decode(p, skip_special_tokens=True) for p, _ in rows]
    from ftis_fed.tasks.suite import make_tasks, task_at

    pre = {task_at(f, "train", 0, i).text for f in ("add3", "next") for i in range(10)}
    assert len(rows) == 200 and sum(t in pre for t in texts) == 20
    heldout = {p.text for f in ("add3", "next") for p in make_tasks(f, "eval", 40, seed=0)}
    assert not set(texts) & heldout
    assert micro.warmup_rows(tok, ("add30",), 30, seed=0, pretrain=(), pretrain_share=0.0) == \
        micro.warmup_rows(tok, ("add30",), 30, seed=0)
    with pytest.raises(ValueError, match="pretrain_share"):
        replace(micro.MICRO_MODELS["micro-llama-s"], pretrain_share=0.1)
    with pytest.raises(ValueError, match="pretrain_share"):
        replace(micro.MICRO_MODELS["micro-llama-s"], pretrain=("add3",), pretrain_share=1.0)


def test_warm_up_lowers_the_reply_loss():
    """A small real warm-up (60 steps) must learn something: the reply cross-entropy falls."""
    from transformers import AutoModelForCausalLM

    spec = micro.MicroSpec("llama", "bpe", hidden=48, layers=2, heads=4, kv_heads=2, intermediate=96,
                           families=("sub30",), steps=60, lr=3e-3, batch=16)
    with micro.deterministic_cpu():
        tok = micro.build_tokenizer("bpe")
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(micro.model_config(spec, tok))
        losses = micro.warm_up(model, tok, spec, log=False)
    assert np.mean(losses[-10:]) < 0.75 * np.mean(losses[:5])


def test_registry_names_and_diversity():
    specs = micro.MICRO_MODELS
    assert set(specs) <= set(OFFLINE_MODELS)
    assert all(n.startswith("micro-") for n in specs)
    assert len({s.arch for s in specs.values()}) >= 2 and len({s.tokenizer for s in specs.values()}) >= 2
    assert len({s.families for s in specs.values()}) >= 2
    assert len({(s.hidden, s.layers) for s in specs.values()}) >= 2
    for name in specs:
        assert name in micro.__doc__                                    # published in the module docstring
    with pytest.raises(ValueError, match="arch"):
        replace(specs["micro-llama-s"], arch="gpt2")
    with pytest.raises(ValueError, match="heads"):
        replace(specs["micro-llama-s"], heads=5)


@pytest.mark.slow
def test_registered_specialist_builds_and_is_a_competent_specialist(tmp_path, monkeypatch):
    """``micro-llama-s-sub`` built from scratch (~30 CPU-s) through the registry: held-out greedy
    accuracy well above 0 on its family, ~0 on the other, non-trivial and not perfect overall."""
    from ftis_fed.learn.evaluation import evaluate
    from ftis_fed.tasks.suite import eval_sets, make_tasks

    monkeypatch.setenv("FTIS_FED_CACHE", str(tmp_path))
    pol = build_policy(PolicyConfig(model="micro-llama-s-sub", micro_batch=64))
    sets = {"id": eval_sets(64)["id"], "add30": make_tasks("add30", "eval", 64), "sub30": make_tasks("sub30", "eval", 64)}
    acc = evaluate(pol, sets, max_new_tokens=16)
    assert 0.3 <= acc["eval/sub30/accuracy"] <= 0.9
    assert acc["eval/add30/accuracy"] <= 0.1
    assert 0.15 <= acc["eval/id/accuracy"] <= 0.45


def test_sampled_eval_counts_each_prompts_solved_samples_reproducibly(tiny_models):
    """eval-samples: k sampled completions per held-out prompt; sampled_accuracy is the mean solved
    share, pass_at_k the share of prompts with one solved; the same seed gives the same counts, and
    the counts are what the verifier says of the very completions generate returns."""
    from ftis_fed.learn.evaluation import sampled_eval
    from ftis_fed.tasks.rewards import Verifier

    pol = build_policy(PolicyConfig(model=str(tiny_models["llama-bpe"]), micro_batch=4))
    sets = {"id": PROMPTS, "add3": [Prompt("add3/eval/0/0", "What is 1 + 2 + 3? Reply with just the number.", "6")]}
    counts: dict[str, list[int]] = {}
    out = sampled_eval(pol, sets, 5, SP, seed=11, per_prompt=counts)
    again: dict[str, list[int]] = {}
    assert sampled_eval(pol, sets, 5, SP, seed=11, per_prompt=again) == out and again == counts
    rolls = pol.generate(PROMPTS, 5, SP, seed=11)                  # the "id" set is the first chunk of seed 11
    v = Verifier()
    assert counts["id"] == [sum(bool(v.check(p.task_id, t, p.reference, p.text)[0]) for t in r.completion_texts)
                            for p, r in zip(PROMPTS, rolls)]
    assert out["eval/id/sampled_accuracy"] == sum(counts["id"]) / 10
    assert out["eval/id/pass_at_k"] == sum(c > 0 for c in counts["id"]) / 2
    assert out["eval/ood/sampled_accuracy"] == out["eval/ood/add3/sampled_accuracy"]
    with pytest.raises(ValueError, match="k=0"):
        sampled_eval(pol, sets, 0, SP, seed=0)
