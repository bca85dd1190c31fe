"""HF policies with the real SmolLM2-135M: log-prob fidelity, training, LoRA, resume, tokenizers."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from ftis_fed.wire.batch import CompletionBatch, SamplingParams, make_group
from ftis_fed.learn.objective import ObjectiveConfig
from ftis_fed.policies import PolicyConfig, Prompt, build_policy, processed_logprobs
from ftis_fed.learn.training import Trainer, ftis_step, samples_from_batches

PROMPTS = [Prompt("add/0", "What is 3 + 4? Reply with just the number.", "7"),
           Prompt("add/1", "What is 12 + 35? Reply with just the number.", "47")]
SAMPLINGS = [SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=16),
             SamplingParams(temperature=1.3, top_k=50, max_new_tokens=16)]

#: fp32: recorded vs recomputed differ only by KV-cache vs full-sequence arithmetic (measured <= 3e-5).
FP32_TOL = 1e-4


@pytest.fixture(scope="module")
def smol():
    return build_policy(PolicyConfig(model="smollm2", dtype="fp32", micro_batch=4))


def rollout_rows(rolls):
    P = [r.prompt_ids.tolist() for r in rolls for _ in r.completion_ids]
    C = [c.tolist() for r in rolls for c in r.completion_ids]
    rec = [lp for r in rolls for lp in r.logprobs]
    return P, C, rec


def as_batch(pol, rolls, sender, sampling, rewards=None, texts=True):
    groups = []
    for k, r in enumerate(rolls):
        rw = rewards[k] if rewards is not None else np.arange(len(r.completion_ids), dtype=np.float32) % 2
        groups.append(make_group(r.prompt_ids, r.completion_ids, r.logprobs, rw, r.prompt.task_id,
                                 r.prompt.reference, r.prompt.text if texts else "",
                                 r.completion_texts if texts else ()))
    return CompletionBatch(sender=sender, run_id="t", round=0, seq=0, model_id=pol.model_id,
                           tokenizer_fp=pol.tokenizer_fp, vocab_size=pol.vocab_size, sampling=sampling,
                           groups=tuple(groups)).validate()


def test_processed_logprobs_match_hf_warpers():
    torch.manual_seed(0)
    logits = torch.randn(5, 300) * 3
    for sp in SAMPLINGS + [SamplingParams(temperature=0.5, top_k=7, top_p=0.8)]:
        warpers = LogitsProcessorList()
        warpers.append(TemperatureLogitsWarper(sp.temperature))
        if sp.top_k:
            warpers.append(TopKLogitsWarper(sp.top_k))
        if sp.top_p < 1:
            warpers.append(TopPLogitsWarper(sp.top_p))
        ref = torch.log_softmax(warpers(None, logits.clone()), -1)
        ours = processed_logprobs(logits, sp)
        assert torch.equal(torch.isinf(ref), torch.isinf(ours))
        assert torch.allclose(ref[~torch.isinf(ref)], ours[~torch.isinf(ours)], atol=1e-5)


@pytest.mark.slow
def test_the_sampler_draws_from_the_processed_distribution():
    """RecordingSampler's inverse-CDF draw (used instead of torch.multinomial) matches exp(log-probs): a
    chi-square test over 60,000 draws per row (top-k / top-p leave zero-probability tokens, never drawn),
    and it is seeded by torch's global generator."""
    from ftis_fed.policies.hf import sample_from_logprobs

    torch.manual_seed(0)
    logits = torch.randn(3, 40) * 2
    for sp in SAMPLINGS + [SamplingParams(temperature=0.5, top_k=7, top_p=0.8)]:
        lp = processed_logprobs(logits, sp)                                      # (3,40)
        torch.manual_seed(1)
        draws = torch.stack([sample_from_logprobs(lp) for _ in range(60_000)])   # (n,3)
        for r in range(3):
            counts = torch.bincount(draws[:, r], minlength=40).double()
            p = lp[r].exp().double()
            assert counts[p == 0].sum() == 0
            expected = p[p > 0] * len(draws)
            chi2 = float(((counts[p > 0] - expected) ** 2 / expected).sum())
            dof = int((p > 0).sum()) - 1
            assert chi2 < dof + 5 * math.sqrt(2 * dof) + 10, (sp, r, chi2, dof)   # ~5 sigma
        torch.manual_seed(1)
        assert torch.equal(sample_from_logprobs(lp), draws[0])
    # a row without mass (all -inf, or NaN) falls back to its most likely token instead of a random index
    bad = torch.full((2, 5), float("-inf"))
    bad[1, 3] = float("nan")
    assert sample_from_logprobs(bad).shape == (2,)


@pytest.mark.parametrize("sampling", [SAMPLINGS[0], pytest.param(SAMPLINGS[1], marks=pytest.mark.slow)],
                         ids=["T0.7-p0.9", "T1.3-k50"])
def test_recorded_logprobs_equal_teacher_forced_recomputation(smol, sampling):
    rolls = smol.generate(PROMPTS, 3, sampling, seed=1)
    P, C, rec = rollout_rows(rolls)
    assert all(len(c) >= 1 for c in C)
    scored = smol.score(P, C, sampling)
    diff = torch.cat([(s - torch.as_tensor(r)).abs() for s, r in zip(scored, rec)])
    assert diff.max().item() <= FP32_TOL
    # and the recorded values are of the *processed* distribution, not the raw model's
    raw = smol.score(P, C, SamplingParams(max_new_tokens=16))
    assert max((s - torch.as_tensor(r)).abs().max().item() for s, r in zip(raw, rec)) > 10 * FP32_TOL


def test_generation_is_seeded_and_stops_at_eos(smol):
    sp = SAMPLINGS[0]
    a = smol.generate(PROMPTS, 2, sp, seed=3)
    b = smol.generate(PROMPTS, 2, sp, seed=3)
    for ra, rb in zip(a, b):
        for x, y in zip(ra.completion_ids, rb.completion_ids):
            assert np.array_equal(x, y)
        for c in ra.completion_ids:
            eos = smol.tokenizer.eos_token_id
            assert eos not in c[:-1].tolist()                                    # nothing after EOS


@pytest.mark.slow
def test_bf16_autocast_fidelity_within_stated_tolerance():
    pol = build_policy(PolicyConfig(model="smollm2", dtype="bf16", micro_batch=4))
    sp = SAMPLINGS[0]
    rolls = pol.generate(PROMPTS, 2, sp, seed=1)
    P, C, rec = rollout_rows(rolls)
    diff = torch.cat([(s - torch.as_tensor(r)).abs() for s, r in zip(pol.score(P, C, sp), rec)])
    # bf16 KV-cache decoding vs a full bf16 pass: measured mean 0.02-0.03, max 0.2 nats
    assert diff.mean().item() <= 0.08 and diff.max().item() <= 1.0


@pytest.mark.slow
def test_full_update_changes_weights_and_own_samples_are_on_policy(smol):
    sp = SAMPLINGS[0]
    rolls = smol.generate(PROMPTS, 4, sp, seed=2)
    batch = as_batch(smol, rolls, "me", sp)
    samples = samples_from_batches([batch], "me", smol.tokenizer_fp, ObjectiveConfig())
    before = {n: p.detach().clone() for n, p in smol.model.named_parameters()}
    m = Trainer(smol, ObjectiveConfig()).step(samples, sp)
    assert np.isfinite(m["train/loss"]) and m["train/grad_norm"] > 0
    assert abs(m["offpolicy/me/ratio_mean"] - 1.0) < 1e-3                     # own fp32 samples: ratio 1
    assert m["offpolicy/me/truncated_frac"] == 0.0
    changed = sum(not torch.equal(before[n], p) for n, p in smol.model.named_parameters())
    assert changed > 100


@pytest.mark.slow
def test_lora_trains_only_adapters_and_resumes(tmp_path):
    pol = build_policy(PolicyConfig(model="smollm2", adapter="lora", dtype="fp32", micro_batch=4, lora_r=4))
    sp = SAMPLINGS[0]
    rolls = pol.generate(PROMPTS, 4, sp, seed=4)
    P, C, rec = rollout_rows(rolls)
    diff = torch.cat([(s - torch.as_tensor(r)).abs() for s, r in zip(pol.score(P, C, sp), rec)])
    assert diff.max().item() <= FP32_TOL
    frozen = {n: p.detach().clone() for n, p in pol.model.named_parameters() if not p.requires_grad}
    samples = samples_from_batches([as_batch(pol, rolls, "me", sp)], "me", pol.tokenizer_fp, ObjectiveConfig())
    trainer = Trainer(pol, ObjectiveConfig())
    m = trainer.step(samples, sp)
    assert m["train/grad_norm"] > 0
    assert all(torch.equal(frozen[n], p) for n, p in pol.model.named_parameters() if not p.requires_grad)
    assert all("lora_" in n for n, p in pol.model.named_parameters() if p.requires_grad)
    trainer.save(tmp_path / "state.pt")
    twin = build_policy(PolicyConfig(model="smollm2", adapter="lora", dtype="fp32", micro_batch=4, lora_r=4, seed=9))
    twin_trainer = Trainer(twin, ObjectiveConfig())
    twin_trainer.load(tmp_path / "state.pt")
    a, b = pol.trainable_state(), twin.trainable_state()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert twin_trainer.steps == 1
    assert twin_trainer.optimizer.state_dict()["state"].keys() == trainer.optimizer.state_dict()["state"].keys()
    # the resumed twin scores exactly like the original
    s1, s2 = pol.score(P[:2], C[:2], sp), twin.score(P[:2], C[:2], sp)
    assert all(torch.allclose(x, y) for x, y in zip(s1, s2))


@pytest.fixture(scope="module")
def bpe8k():
    return build_policy(PolicyConfig(model="smollm2-bpe8k", dtype="fp32", micro_batch=4))


@pytest.mark.slow
def test_cross_tokenizer_batches_train_at_sequence_level(smol, bpe8k):
    """A SmolLM2 batch used by the bpe8k participant (different tokenizer) and vice versa."""
    other = bpe8k
    assert other.tokenizer_fp != smol.tokenizer_fp and other.vocab_size < smol.vocab_size
    sp = SAMPLINGS[0]
    b_smol = as_batch(smol, smol.generate(PROMPTS, 2, sp, seed=5), "smol", sp)
    b_other = as_batch(other, other.generate(PROMPTS, 2, sp, seed=6), "bpe", sp)
    cfg = ObjectiveConfig(mode="F-TIS")
    samples = samples_from_batches([b_other, b_smol], "bpe", other.tokenizer_fp, cfg, retokenize=other.retokenize)
    peer = [s for s in samples if s.source == "smol"]
    assert peer and all(s.seq_level for s in peer) and not any(s.seq_level for s in samples if s.local)
    assert all(max(s.completion_ids) < other.vocab_size for s in peer)
    m = Trainer(other, cfg).step(samples, sp)
    assert np.isfinite(m["train/loss"]) and m["train/grad_norm"] > 0
    assert "offpolicy/smol/kl_mean" in m and np.isfinite(m["offpolicy/smol/ratio_mean"])
    with pytest.raises(ValueError, match="retokenize"):
        samples_from_batches([b_smol], "bpe", other.tokenizer_fp, cfg)
    no_text = as_batch(smol, smol.generate(PROMPTS[:1], 2, sp, seed=5), "smol", sp, texts=False)
    with pytest.raises(ValueError, match="completion_texts"):
        samples_from_batches([no_text], "bpe", other.tokenizer_fp, cfg, retokenize=other.retokenize)


def test_retokenized_completion_gets_eos_only_when_the_sender_stopped_at_eos(smol, bpe8k):
    """Issue 13: the receiver appended EOS to every re-tokenized completion, also to one the sender
    cut at max-new-tokens, adding a log pi(EOS) term the sender's summed log-prob lacks."""
    tok, eos = smol.tokenizer, smol.tokenizer.eos_token_id
    words = tok("The answer is 7 because", add_special_tokens=False)["input_ids"]
    budget = 4
    comps = [tok("7", add_special_tokens=False)["input_ids"] + [eos],       # stopped early at EOS
             words[:4],                                                    # cut at the budget
             words[:3] + [eos]]                                            # EOS exactly at the budget
    assert [len(c) for c in comps][1:] == [budget, budget]
    texts = [tok.decode(c, skip_special_tokens=True) for c in comps]
    sp = SamplingParams(temperature=1.0, max_new_tokens=budget)
    group = make_group(smol.format_prompt(PROMPTS[0].text), comps, [[-1.0] * len(c) for c in comps], [1.0, 0.0, 1.0],
                       PROMPTS[0].task_id, PROMPTS[0].reference, PROMPTS[0].text, texts)
    batch = CompletionBatch(sender="smol", run_id="t", round=0, seq=0, model_id=smol.model_id,
                            tokenizer_fp=smol.tokenizer_fp, vocab_size=smol.vocab_size, sampling=sp,
                            groups=(group,)).validate()
    samples = samples_from_batches([batch], "bpe", bpe8k.tokenizer_fp, ObjectiveConfig(), retokenize=bpe8k.retokenize)
    other_eos = bpe8k.tokenizer.eos_token_id
    assert [s.completion_ids[-1] == other_eos for s in samples] == [True, False, True]
    for s, text in zip(samples, texts):
        body = [i for i in s.completion_ids if i != other_eos]
        assert body == bpe8k.tokenizer(text, add_special_tokens=False)["input_ids"]
        assert s.seq_level and s.prompt_ids == bpe8k.format_prompt(PROMPTS[0].text)


class GradRecorder(torch.optim.SGD):
    """An optimizer that only records the gradients it is asked to apply."""

    def __init__(self, params):
        super().__init__(params, lr=0.0)
        self.grads: list[torch.Tensor] = []

    def step(self, closure=None):
        self.grads = [torch.zeros_like(p) if p.grad is None else p.grad.clone()
                      for g in self.param_groups for p in g["params"]]


def test_alone_gradient_is_independent_of_peers_with_horizontal_groups():
    """Issue 13: Alone's gradient must not depend on its peers, whatever the advantage groups."""
    pol = build_policy(PolicyConfig(model="tiny-llama", micro_batch=4))
    sp = SamplingParams(temperature=1.0, max_new_tokens=6)
    own = as_batch(pol, pol.generate(PROMPTS, 3, sp, seed=0), "me", sp, rewards=[[1, 0, 0], [0, 1, 1]])
    peer = as_batch(pol, pol.generate(PROMPTS, 3, sp, seed=1), "peer", sp, rewards=[[1, 1, 1], [0, 0, 0]])
    grads = {}
    for groups in ("vertical", "horizontal"):
        cfg = ObjectiveConfig(mode="alone", advantage_groups=groups)
        for name, batches in (("alone", [own]), ("with_peers", [own, peer])):
            rec = GradRecorder(pol.trainable_parameters())
            samples = samples_from_batches(batches, "me", pol.tokenizer_fp, cfg)
            pol.train_mode(True)
            ftis_step(lambda p, c, g: pol.score_padded(p, c, sp, g), pol.trainable_parameters(), rec, samples, cfg,
                      micro_batch=4, max_grad_norm=math.inf)
            grads[groups, name] = rec.grads
        a, b = grads[groups, "alone"], grads[groups, "with_peers"]
        assert any(g.abs().sum() > 0 for g in a)
        assert all(torch.equal(x, y) for x, y in zip(a, b)), groups


def test_backend_interface_is_declared_and_backends_do_not_optimise():
    """Everything the participant and the Trainer call is declared on ``Policy``; the optimizer is
    the Trainer's (issue 9)."""
    from ftis_fed.policies.base import Policy
    from ftis_fed.policies.hf import HFPolicy
    from ftis_fed.policies.vllm_policy import VLLMPolicy

    assert Policy.__abstractmethods__ == {"generate", "score", "score_padded", "retokenize", "trainable_parameters",
                                          "trainable_state", "load_trainable_state", "export"}
    for name in ("generate_greedy", "format_prompt", "train_mode", "weights_changed"):
        assert callable(getattr(Policy, name))
    for backend in (HFPolicy, VLLMPolicy):
        assert not backend.__abstractmethods__
        assert not any(hasattr(backend, n) for n in ("update", "save", "load", "optimizer"))


def test_trainer_steps_the_backend_and_tells_it_its_weights_changed(tmp_path):
    """The Trainer's optimizer moves exactly the backend's trainable parameters, leaves the model in
    eval mode, and calls ``weights_changed`` after every step and load (the vLLM backend refreshes
    its engine there)."""
    from ftis_fed.policies.hf import HFPolicy

    class Recording(HFPolicy):
        changes = 0

        def weights_changed(self):
            self.changes += 1

    pol = Recording(PolicyConfig(model="tiny-llama", micro_batch=4, lr=1e-3))
    sp = SamplingParams(temperature=1.0, max_new_tokens=6)
    batch = as_batch(pol, pol.generate(PROMPTS, 3, sp, seed=0), "me", sp, rewards=[[1, 0, 0], [0, 1, 1]])
    trainer = Trainer(pol, ObjectiveConfig())
    assert trainer.params == pol.trainable_parameters() and trainer.optimizer.param_groups[0]["lr"] == 1e-3
    before = pol.trainable_state()
    m = trainer.step(samples_from_batches([batch], "me", pol.tokenizer_fp, ObjectiveConfig()), sp)
    assert m["train/grad_norm"] > 0 and m["train/advantage_groups"] == 2.0
    assert pol.changes == 1 and trainer.steps == 1 and not pol.model.training
    assert any(not torch.equal(before[n], t) for n, t in pol.trainable_state().items())
    trainer.save(tmp_path / "ckpt.pt")
    twin = Recording(PolicyConfig(model="tiny-llama", micro_batch=4, lr=1e-3))
    Trainer(twin, ObjectiveConfig()).load(tmp_path / "ckpt.pt")
    assert twin.changes == 1
    assert all(torch.equal(a, b) for a, b in zip(pol.trainable_state().values(), twin.trainable_state().values()))


@pytest.mark.parametrize("adapter", ["full", "lora"])
def test_grad_checkpointing_gives_the_same_gradients(adapter):
    """Decoder activation checkpointing recomputes activations in backward: same loss, same grads,
    and generation (eval mode) keeps its KV cache: the same tokens and log-probs."""
    sp = SamplingParams(temperature=0.7, max_new_tokens=8)
    prompts = [Prompt("a/0", "What is 2 + 3?", "5"), Prompt("a/1", "What is 4 + 4?", "8")]
    pols = [build_policy(PolicyConfig(model="tiny-llama", adapter=adapter, grad_checkpointing=gc, lora_r=4))
            for gc in (True, False)]
    if adapter == "lora":                       # B starts at zero: give both the same nonzero adapter
        for p0, p1 in zip(pols[0].trainable, pols[1].trainable):
            with torch.no_grad():
                p0.copy_(torch.randn_like(p0) * 0.1)
                p1.copy_(p0)
    rolls = [pol.generate(prompts, 3, sp, seed=0) for pol in pols]
    for a, b in zip(*rolls):
        assert all(np.array_equal(x, y) for x, y in zip(a.completion_ids, b.completion_ids))
        assert all(np.allclose(x, y, atol=1e-6) for x, y in zip(a.logprobs, b.logprobs))
    P, C, _ = rollout_rows(rolls[0])
    grads = []
    for pol in pols:
        pol.model.train()
        pol.score_padded(P, C, sp, grad=True).sum().backward()
        grads.append([p.grad.clone() for p in pol.trainable])
    flags = [[m.gradient_checkpointing for m in pol.model.modules() if hasattr(m, "gradient_checkpointing")]
             for pol in pols]
    assert flags[0] and all(flags[0]) and not any(flags[1])
    assert all(torch.allclose(g0, g1, atol=1e-5, rtol=1e-4) for g0, g1 in zip(*grads))
    assert any(g.abs().sum() > 0 for g in grads[0])


@pytest.mark.slow
def test_subtraction_specialist_is_a_specialist():
    """smollm2-sub30 (built on first use, ~5 min) beats the base on held-out subtraction problems
    (measured: 33 % vs 12.5 % greedy, docs/models.md)."""
    from ftis_fed.learn.evaluation import TextGenerator, evaluate
    from ftis_fed.tasks.rewards import Verifier
    from ftis_fed.tasks.suite import make_tasks

    sets = {f: make_tasks(f, "eval", 48, 0) for f in ("add30", "sub30")}
    base = evaluate(TextGenerator("smollm2"), sets, Verifier(), max_new_tokens=16)
    spec = evaluate(TextGenerator("smollm2-sub30"), sets, Verifier(), max_new_tokens=16)
    assert spec["eval/sub30/accuracy"] >= base["eval/sub30/accuracy"] + 0.1


def test_adamw_uses_the_fused_kernel_with_the_same_update():
    """make_optimizer('adamw') takes torch's fused AdamW for CPU float parameters; three steps give the
    same weights as the single-tensor AdamW (and a non-float parameter list falls back)."""
    from ftis_fed.learn.training import fused_adamw_ok, make_optimizer

    cfg = PolicyConfig(model="tiny-llama", lr=1e-2, weight_decay=0.1)
    torch.manual_seed(0)
    w0 = [torch.randn(7, 5), torch.randn(3)]
    ours = [torch.nn.Parameter(w.clone()) for w in w0]
    ref = [torch.nn.Parameter(w.clone()) for w in w0]
    opt = make_optimizer(ours, cfg)
    assert opt.defaults["fused"] is True
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1, foreach=False)
    for k in range(3):
        g = [torch.randn_like(w) for w in w0]
        for p, q, gi in zip(ours, ref, g):
            p.grad, q.grad = gi.clone(), gi.clone()
        opt.step()
        ref_opt.step()
    for p, q in zip(ours, ref):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-7)
    assert not fused_adamw_ok([torch.nn.Parameter(torch.zeros(3, dtype=torch.int64), requires_grad=False)])


def test_lora_init_does_not_depend_on_a_warm_model_cache(monkeypatch):
    """A model built on first use (a micro model's warm-up, a derived model) draws from torch's global
    generator; the adapter's random init must not see that draw, or the first run after a cache
    clear gives a LoRA participant other weights than every later run (a research cell did)."""
    import ftis_fed.policies.hf as hf

    cfg = PolicyConfig(model="tiny-llama", adapter="lora", lora_r=4, seed=3)
    warm = build_policy(cfg)
    resolve = hf.resolve_model

    def building(name):                         # what a cache miss does: a seeded build in between
        torch.manual_seed(12345)
        torch.randn(1000)
        return resolve(name)

    monkeypatch.setattr(hf, "resolve_model", building)
    cold = build_policy(cfg)
    lora = [n for n, _ in warm.model.named_parameters() if "lora_A" in n]
    assert lora
    a, b = dict(warm.model.named_parameters()), dict(cold.model.named_parameters())
    assert all(torch.equal(a[n], b[n]) for n in lora)


def test_the_tokenizer_fingerprint_hashes_a_folders_vocabulary_once_and_again_after_any_change(tmp_path):
    """base.tokenizer_fingerprint keeps the vocabulary's hash per unchanged tokenizer folder (a test run
    loads the same tokenizer ~130 times): a second load of the folder does not read its vocabulary again
    and gives the fingerprint of the uncached computation; a token added after loading is hashed again,
    another special token changes the fingerprint as uncached, and an edited file is read again."""
    import os
    import shutil
    from pathlib import Path

    from ftis_fed.policies import tokenizer_fingerprint
    from ftis_fed.policies.models import load_tokenizer, resolve_model

    folder = tmp_path / "tok"
    folder.mkdir()
    for f in Path(resolve_model("tiny-llama")).iterdir():                     # the tokenizer's files, no weights
        if not f.name.endswith(".safetensors"):
            shutil.copy(f, folder / f.name)
    reads = []

    def load():
        tok = load_tokenizer(str(folder))
        real = tok.get_vocab
        tok.get_vocab = lambda: reads.append(1) or real()
        return tok

    def uncached(tok) -> str:
        source = vars(tok).pop("_ftis_fed_source")
        try:
            return tokenizer_fingerprint(tok)
        finally:
            tok._ftis_fed_source = source

    a = load()
    first = tokenizer_fingerprint(a)
    assert len(reads) == 1
    b = load()
    assert tokenizer_fingerprint(b) == first and len(reads) == 1                 # cached: not read again
    assert uncached(b) == first and len(reads) == 2
    b.add_tokens(["<zz-new>"])
    assert tokenizer_fingerprint(b) == uncached(b) != first and len(reads) == 4  # grown: read, not cached
    a.pad_token = a.convert_ids_to_tokens(5)                                     # special tokens: every time
    assert tokenizer_fingerprint(a) != first and len(reads) == 4
    assert tokenizer_fingerprint(a) == uncached(a) and len(reads) == 5
    tj = folder / "tokenizer.json"
    st = tj.stat()
    os.utime(tj, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))                  # an edited file: read again
    assert tokenizer_fingerprint(load()) == first and len(reads) == 6
