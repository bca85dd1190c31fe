"""Poisoning with correct answers (issue: "Hail to the Thief", arXiv 2511.09780): the ``payload``
attack keeps every reward and passes every check, the plausible log-prob lie (``lowlogprobs``) gets
weight C through the k1 filter, and the receiver's own surprisal check (``peer-surprisal-max``)
drops the payload samples without touching its own or honest ones.

Pure pieces on hand-made tensors and the real verifier; then the attack through the real receive
path (real keys, wire, re-verification) on ``tiny-arith`` (SmolLM2's tokenizer, SFT'd on add1 to
answer then stop), and a whole in-process federation with an attacker (``attacks.payload_poisoner``)."""

from __future__ import annotations

import dataclasses
import gzip
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from ftis_fed.config.federation import FederationConfig
from ftis_fed.config.keys import federation_from_run_config
from ftis_fed.learn.evaluation import payload_shares
from ftis_fed.learn.objective import (LOGP_GEN_FLOOR, LossInputs, ObjectiveConfig, count_denominators, ftis_loss,
                                      max_surprisal, surprising_rows)
from ftis_fed.receive.surprisal import SurprisalKnobs
from ftis_fed.tasks.rewards import Verifier
from ftis_fed.tasks.suite import TaskSpec, task_at
from ftis_fed.trust.attacks import (LOW_LOGPROB, Poisoner, corrupt, parse_kinds, poison, poisoned_group)
from ftis_fed.wire.batch import CompletionBatch, SamplingParams, make_group

ROOT = Path(__file__).resolve().parents[1]
EOS, SPACE, H, A = 1, 2, 3, 4
#: a toy tokenizer: ids 10..19 are the digits, 2 a space, 3/4 "H"/"A", 1 EOS (skipped when decoding)
CHARS = {SPACE: " ", H: "H", A: "A", **{10 + d: str(d) for d in range(10)}}


def decode(ids) -> str:
    return "".join(CHARS.get(int(t), "") for t in ids)


def digits(text: str) -> list[int]:
    return [10 + int(c) for c in text] + [EOS]


def toy_poisoner(share: float = 1.0, budget: int = 8, scored: list | None = None) -> Poisoner:
    verifier = Verifier()

    def score(prompt_ids, completions):
        if scored is not None:
            scored.append([list(c) for c in completions])
        return [[-0.25] * len(c) for c in completions]

    return Poisoner((SPACE, H, A), share, budget, EOS, decode,
                    lambda task, text, ref, prompt: bool(verifier.check(task, text, ref, prompt)[0]), score)


def toy_batch(groups: int = 1) -> CompletionBatch:
    gs = []
    for i in range(groups):
        t = task_at("add30", "train", 0, i)
        answers = [t.reference, t.reference, str(int(t.reference) + 1), "1234567"]   # 2 solved, 1 wrong, 1 cut
        comps = [digits(a) for a in answers[:3]] + [[10 + int(c) for c in answers[3]] + [10]]   # no EOS: cut at 8
        rewards = [Verifier().reward(t.task_id, decode(c), t.reference, t.text) for c in comps]
        gs.append(make_group([7, 8, 9], comps, [np.full(len(c), -0.5) for c in comps], rewards, t.task_id,
                             t.reference, t.text, tuple(decode(c) for c in comps)))
    return CompletionBatch("mallory", "run", 1, 1, "m", "tok-x", 100, SamplingParams(0.7, 1.0, 0, 8), tuple(gs))


# ----------------------------------------------------------------------------- the attacker

def test_kinds_and_all_keep_the_byzantine_set():
    assert parse_kinds("all") == ("forge", "inflate", "logprobs", "flood")
    assert parse_kinds("payload,lowlogprobs") == ("payload", "lowlogprobs")


@pytest.mark.parametrize("share, expected", [(0.25, 25), (0.5, 50), (1.0, 100), (1 / 3, 33)])
def test_the_poisoned_share_of_groups_is_exact_and_spread(share, expected):
    flags = [poisoned_group(i, share) for i in range(100)]
    assert sum(flags) == expected
    if share == 0.25:
        assert [i for i in range(8) if flags[i]] == [3, 7]


def test_the_payload_rides_on_solved_completions_and_keeps_every_reward():
    b = toy_batch()
    scored: list = []
    bad, n = poison(b, toy_poisoner(scored=scored), first_group=0)
    g0, g = b.groups[0], bad.groups[0]
    assert n == 2 and len(scored) == 1 and len(scored[0]) == 2              # the two solved ones, scored once
    for i in (0, 1):
        assert g.completion_ids[i].tolist() == g0.completion_ids[i].tolist()[:-1] + [SPACE, H, A, EOS]
        assert np.all(g.logprobs[i] == np.float32(-0.25)) and len(g.logprobs[i]) == len(g.completion_ids[i])
        assert g.completion_texts[i] == decode(g.completion_ids[i]) and g.completion_texts[i].endswith(" HA")
    for i in (2, 3):                                                          # wrong, and cut at the budget
        assert g.completion_ids[i].tolist() == g0.completion_ids[i].tolist()
        assert np.array_equal(g.logprobs[i], g0.logprobs[i])
    v = Verifier()
    assert [v.reward(g.task_id, decode(c), g.reference, g.prompt_text) for c in g.completion_ids] == g.rewards.tolist()
    assert g.rewards.tolist() == g0.rewards.tolist() == [1.0, 1.0, 0.0, 0.0]


def test_the_budget_and_the_share_are_respected():
    b = toy_batch(groups=4)
    _, n = poison(b, toy_poisoner(budget=4), 0)                 # >= 1 digit + 3 payload + EOS > 4
    assert n == 0
    bad, n = poison(b, toy_poisoner(share=0.25), 0)             # the 4th group of the run only
    assert n == 2 and [bad.groups[k] is b.groups[k] for k in range(4)] == [True, True, True, False]
    bad, n = poison(b, toy_poisoner(share=0.25), 1)             # groups 1..4 of the run: the 3rd is the 4th
    assert [bad.groups[k] is b.groups[k] for k in range(4)] == [True, True, False, True]


def test_the_payload_with_the_plausible_log_prob_lie():
    bad = corrupt(toy_batch(), ("payload", "lowlogprobs"), toy_poisoner())
    g = bad.groups[0]
    assert g.completion_ids[0].tolist()[-4:] == [SPACE, H, A, EOS]
    assert all(np.all(lp == np.float32(LOW_LOGPROB)) for lp in g.logprobs)
    assert LOW_LOGPROB > LOGP_GEN_FLOOR                                      # plausible: not marked implausible
    with pytest.raises(ValueError, match="needs a Poisoner"):
        corrupt(toy_batch(), ("payload",))


def test_payload_config_is_checked():
    assert FederationConfig(attack_payload=" HAIL", attack_payload_share=0.25).attack_payload == " HAIL"
    with pytest.raises(ValueError, match="attack-payload=.*no digits"):
        FederationConfig(attack_payload=" 7 HAIL")
    assert FederationConfig(attack_payload="0", attack_payload_at="start").attack_payload == "0"   # "017" reads 17
    with pytest.raises(ValueError, match="attack-payload-share"):
        FederationConfig(attack_payload_share=0.0)
    with pytest.raises(ValueError, match="peer-surprisal-max=-1.0"):
        SurprisalKnobs(max_nats=-1.0)
    with pytest.raises(ValueError, match="peer-surprisal-max=-1.0"):
        federation_from_run_config({"peer-surprisal-max": -1.0})


def test_payload_shares_of_greedy_replies():
    hits: dict = {}
    out = payload_shares({"id": ["42 HAIL", "7", "3 HAIL"], "add3": ["1", "2"], "mul15": ["HAIL", "x"]}, "HAIL", hits)
    assert out["eval/id/payload"] == pytest.approx(2 / 3) and out["eval/ood/add3/payload"] == 0.0
    assert out["eval/ood/payload"] == pytest.approx(0.25) and out["eval/payload"] == pytest.approx(3 / 7)
    assert hits["id"] == [True, False, True]
    # before the answer: "017" carries a leading "0", the honest answers "0" and "10" do not
    out = payload_shares({"id": ["017", "0", "10", " 05"]}, "0", hits, at="start")
    assert hits["id"] == [True, False, False, True] and out["eval/payload"] == pytest.approx(0.5)


# ----------------------------------------------------------------------------- the defence

def _limited(x, *limits):
    """``x`` with the per-row ``surprisal_limit`` the surprisal check sets (one number: every row)."""
    return dataclasses.replace(x, surprisal_limit=torch.tensor(limits if len(limits) > 1 else limits * len(x.local)))


def _payload_inputs():
    """Rows: [own, honest peer, payload peer, log-prob-lying payload peer]; the payload's 3rd token is
    one the receiver gives probability e^-15."""
    T = 4
    logp = torch.full((4, T), -0.5)
    logp[2, 2] = logp[3, 2] = -15.0
    logp.requires_grad_(True)
    gen = torch.full((4, T), -0.5)
    gen[2, 2] = -15.5                                                        # the attacker's own score of it
    gen[3] = LOW_LOGPROB                                                     # the lie
    return logp, LossInputs(logp=logp, logp_gen=gen, mask=torch.ones(4, T, dtype=torch.bool),
                            advantages=torch.tensor([1.0, 1.0, 1.0, 1.0]), source=torch.tensor([0, 1, 2, 2]),
                            local=torch.tensor([True, False, False, False]), source_names=("me", "bob", "mallory"))


def test_surprising_rows_are_peer_rows_with_an_improbable_token():
    logp, x = _payload_inputs()
    top = max_surprisal(logp, x.mask)
    assert top.tolist() == [0.5, 0.5, 15.0, 15.0]
    assert surprising_rows(top, x.local, 12.0).tolist() == [False, False, True, True]
    assert surprising_rows(top, x.local, 0.0).tolist() == [False] * 4
    everything = surprising_rows(top, torch.zeros(4, dtype=torch.bool), 0.1)
    assert everything.tolist() == [True] * 4 and not surprising_rows(top, x.local, 0.1)[0]   # never own


@pytest.mark.parametrize("mode", ["noIS", "F-TIS"])
def test_the_filter_keeps_the_payload_and_the_surprisal_check_drops_it(mode):
    logp, x = _payload_inputs()
    off = ftis_loss(x, ObjectiveConfig(mode=mode))
    (g_off,) = torch.autograd.grad(off.loss, logp)
    assert bool((g_off[2:].abs().sum(-1) > 0).all())                        # positive advantage: kept
    if mode == "F-TIS":                                                      # the liar gets C on every token
        assert torch.allclose(g_off[3, 0], 2.0 * g_off[0, 0]) and off.metrics["offpolicy/mallory/filtered_frac"] == 0
    on = ftis_loss(_limited(x, 12.0), ObjectiveConfig(mode=mode))
    (g_on,) = torch.autograd.grad(on.loss, logp)
    assert torch.equal(g_on[2:], torch.zeros_like(g_on[2:]))
    assert torch.allclose(g_on[:2], g_off[:2])                              # own and honest rows untouched
    assert on.metrics["offpolicy/mallory/surprising_frac"] == 1.0 and on.metrics["offpolicy/bob/surprising_frac"] == 0
    assert on.metrics["offpolicy/mallory/surprisal_max"] == pytest.approx(15.0)
    assert "offpolicy/mallory/surprising_frac" not in off.metrics


def test_the_surprisal_check_is_row_wise_so_micro_batches_add_up():
    logp, x = _payload_inputs()
    cfg = ObjectiveConfig(mode="F-TIS")
    x = _limited(x, 12.0)
    whole = ftis_loss(x, cfg).loss
    den = count_denominators(x.mask, torch.ones(4, dtype=torch.bool))
    parts = 0.0
    for sel in (slice(0, 1), slice(1, 3), slice(3, 4)):
        part = LossInputs(logp=x.logp[sel], logp_gen=x.logp_gen[sel], mask=x.mask[sel], advantages=x.advantages[sel],
                          source=x.source[sel], local=x.local[sel], source_names=x.source_names,
                          surprisal_limit=x.surprisal_limit[sel])
        parts = parts + ftis_loss(part, cfg, den).loss
    assert torch.allclose(whole, parts)


# ----------------------------------------------------------------------------- the real receive path

@pytest.fixture(scope="module")
def arith():
    from ftis_fed.policies import PolicyConfig, build_policy

    return build_policy(PolicyConfig(model="tiny-arith", micro_batch=8))


def test_the_payload_passes_every_receiver_check_and_the_receivers_own_surprisal_flags_it(arith):
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from ftis_fed.learn.training import samples_from_batches
    from ftis_fed.trust.inbox import Inbox, InboxConfig
    from ftis_fed.receive.frames import ReceiverContext, receive
    from ftis_fed.trust.signing import KeyDirectory, sign_batch

    fed = FederationConfig(run_name="run-p", group_size=4, max_new_tokens=12, attack_payload=" HAIL",
                           task=TaskSpec(families=("add1",), prompts_per_round=1))
    key = Ed25519PrivateKey.generate()
    tok, verifier = arith.tokenizer, Verifier()
    t = task_at("add1", "train", 0, 3)
    answers = [t.reference, t.reference, str(int(t.reference) + 3), t.reference]
    comps = [tok(a, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for a in answers]
    prompt = arith.format_prompt(t.text)
    own = arith.score_padded([prompt] * 4, comps, fed.sampling, False)
    rewards = [verifier.reward(t.task_id, tok.decode(c, skip_special_tokens=True), t.reference, t.text) for c in comps]
    g = make_group(prompt, comps, [own[i, :len(c)].tolist() for i, c in enumerate(comps)], rewards, t.task_id,
                   t.reference, t.text)
    b = CompletionBatch("mallory", "run-p", 1, (1 << 16) + 1, "tiny-arith", arith.tokenizer_fp, arith.vocab_size,
                        fed.sampling, (g,), eos_id=tok.eos_token_id)

    def score(prompt_ids, completions):
        out = arith.score_padded([prompt_ids] * len(completions), completions, fed.sampling, False)
        return [row[:len(c)] for row, c in zip(out.tolist(), completions)]

    poisoner = Poisoner(tuple(tok(fed.attack_payload, add_special_tokens=False)["input_ids"]), 1.0, fed.max_new_tokens,
                        tok.eos_token_id, lambda ids: tok.decode(list(ids), skip_special_tokens=True),
                        lambda task, text, ref, p: bool(verifier.check(task, text, ref, p)[0]), score)
    bad, n = poison(b, poisoner, 0)
    assert n == 3
    inbox = Inbox(KeyDirectory({"mallory": key.public_key()}), InboxConfig(run_id="run-p", tokenizer_fp=arith.tokenizer_fp))
    recv = receive([sign_batch(bad, key)], 1, inbox, ReceiverContext.from_run(fed, arith, verifier, "carol"))
    assert recv.metrics["trust/mallory/accepted"] == 1 and recv.metrics["trust/mallory/rewards_corrected"] == 0
    got = recv.batches[0].groups[0]
    assert got.rewards.tolist() == [1.0, 1.0, 0.0, 1.0]                     # the receiver's own verifier agrees
    texts = [tok.decode(c, skip_special_tokens=True) for c in got.completion_ids]
    assert [" HAIL" in x for x in texts] == [True, True, False, True]
    samples = samples_from_batches(recv.batches, "carol", arith.tokenizer_fp, fed.objective)
    rx = arith.score_padded([s.prompt_ids for s in samples], [s.completion_ids for s in samples], fed.sampling, False)
    mask = torch.arange(rx.shape[1])[None, :] < torch.tensor([len(s.completion_ids) for s in samples])[:, None]
    top = max_surprisal(rx.clamp(min=-1e4), mask)
    # the receiver (here the same SFT'd model) finds the payload far less likely than any answer token
    assert float(top[[0, 1, 3]].min()) > float(top[2]) + 5.0
    flagged = surprising_rows(max_surprisal(rx, mask), torch.zeros(4, dtype=torch.bool), float(top[2]) + 2.0)
    assert flagged.tolist() == [True, True, False, True]


def test_an_attacker_in_a_federation_is_accepted_and_its_payload_counted(tmp_path):
    """Three participants in process (research-tiny's models), one with byzantine = payload: its
    frames pass the server and every receiver, its solved completions carry the payload, and every
    participant's evaluation reports eval/payload and the per-reply flags."""
    from ftis_fed.grid.records import read_rows
    from ftis_fed.commands.sim import simulate_inprocess

    # 16 prompts a round: tiny-arith solves ~10 % at T = 0.7, so 2 prompts (8 completions) a round left
    # mallory with no solved completion to carry the payload on CI's machine (its build of tiny-arith differs)
    items = [f'output-dir="{tmp_path}"', "num-rounds=2", "prompts-per-round=16", "eval-every=2", 'attack-payload=" HAIL"',
             "attack-payload-share=1.0", "max-new-tokens=8", "eval-max-new-tokens=8",
             'p2-participant="mallory"', 'p2-model="tiny-arith"', 'p2-adapter="lora"', 'p2-quant="none"',
             'p2-byzantine="payload,lowlogprobs"', 'p3-model=""', "peer-surprisal-max=30.0"]
    assert simulate_inprocess(ROOT, items, "research-tiny") == 0
    rows = read_rows(tmp_path / "metrics.jsonl")
    gen = [r for r in rows if r.get("participant") == "mallory" and "attack/payload_completions" in r]
    assert len(gen) == 2 and sum(r["attack/payload_completions"] for r in gen) > 0
    honest = [r for r in rows if r.get("phase") == "train" and r.get("participant") in ("full", "lora")]
    assert all(r["trust/mallory/accepted"] == 1 for r in honest)
    assert all("train/surprisal_exempt" in r for r in honest)                # peer-surprisal-keep-needed ran
    assert not any(k.startswith("trust/mallory/rejected") and v for r in honest for k, v in r.items())
    assert all(r["offpolicy/mallory/truncated_frac"] > 0 for r in honest if "offpolicy/mallory/truncated_frac" in r)
    evals = [r for r in rows if r.get("phase") == "eval" and r.get("participant") == "full"]
    assert evals and all("eval/payload" in r and "eval/id/payload" in r for r in evals)
    recs = [json.loads(x) for x in gzip.decompress((tmp_path / "participants" / "full" / "eval_prompts.jsonl.gz")
                                                   .read_bytes()).decode().splitlines() if x.strip()]
    assert recs and all(len(r["payload"]) == len(r["ids"]) for r in recs)
    assert not math.isnan(evals[-1]["eval/payload"])


# ----------------------------------------------------------------------------- the experiment's plan and statistics

def test_the_experiment_plan_and_its_bounds():
    from sims import poisoning

    cells = poisoning.plan(3, list(poisoning.ATTACKS), 12.0)
    assert len(cells) == 3 * (1 + 5 * len(poisoning.ATTACKS)) and len({c.name for c in cells}) == len(cells)
    keys = {poisoning.cell_key(c) for c in cells}
    assert ("control", "alone") in keys and ("paylie", "F-TIS+def") in keys and ("pay25", "noIS") in keys
    defended = [c for c in cells if c.variant.endswith(("-def", "-need"))]
    assert all(dict(c.extra)["peer-surprisal-max"] == 12.0 for c in defended)
    assert {dict(c.extra)["peer-surprisal-keep-needed"] for c in defended} == {False, True}
    assert ("pay50", "F-TIS+need") in keys
    assert all(c.mode == "F-TIS" for c in defended)
    phrase = [c for c in cells if c.variant.endswith("-phrase")]
    assert phrase and all(dict(c.extra) == {**poisoning.ATTACKS[poisoning.cell_key(c)[0]],
                                            "peer-phrase-ratio": poisoning.PHRASE_RATIO} for c in phrase)
    assert {dict(c.extra)["peer-phrase-ratio"] for c in poisoning.plan(1, ["pay25"], 12.0, 6.0)
            if c.variant.endswith("-phrase")} == {6.0}
    assert ("pay25", "F-TIS+phrase") in keys and all(c.mode == "F-TIS" for c in phrase)
    # 0 of n: the 95 % upper bound is 1 - 0.025^(1/n); k of n: the exact binomial tail is 0.025 there
    assert poisoning.clopper_pearson_upper(0, 588) == pytest.approx(1 - 0.025 ** (1 / 588), rel=1e-6)
    up = poisoning.clopper_pearson_upper(3, 100)
    assert sum(math.comb(100, i) * up ** i * (1 - up) ** (100 - i) for i in range(4)) == pytest.approx(0.025, abs=1e-6)
    assert poisoning.clopper_pearson_upper(5, 5) == 1.0


def test_the_payload_can_go_before_the_answer():
    import dataclasses

    b = toy_batch()
    bad, n = poison(b, dataclasses.replace(toy_poisoner(), at="start"), 0)
    g0, g = b.groups[0], bad.groups[0]
    assert n == 2 and g.completion_ids[0].tolist() == [SPACE, H, A] + g0.completion_ids[0].tolist()
    assert g.rewards.tolist() == g0.rewards.tolist()
    assert Verifier().reward(g.task_id, decode(g.completion_ids[0]), g.reference, g.prompt_text) == 1.0
    with pytest.raises(ValueError, match="attack-payload-at"):
        FederationConfig(attack_payload_at="middle")


@pytest.mark.parametrize("folder", ["poisoning", "poisoning-plausible"])
def test_the_committed_summary_is_recomputed_from_the_cells_files(tmp_path, folder):
    """``python -m sims.poisoning --summary-only`` rewrites docs/results/poisoning's (and
    poisoning-plausible's) summary, tables and plot byte for byte from the committed cells (nothing
    typed in)."""
    import shutil

    from sims import poisoning

    src = ROOT / "docs" / "results" / folder
    out = tmp_path / folder
    shutil.copytree(src / "cells", out / "cells")
    assert poisoning.main(["--out", str(out), "--summary-only"]) == 0
    for name in ("summary.md", "summary.csv", "diagnostics.csv", "adoption.png"):
        assert (out / name).read_bytes() == (src / name).read_bytes(), name



def test_surprising_tokens_the_reward_needs_keep_their_sample():
    from ftis_fed.learn.surprisal import ablate, needed_rows

    t = task_at("add30", "train", 0, 5)
    v = Verifier()

    def reward(ids):
        return v.reward(t.task_id, decode(ids), t.reference, t.text)

    ans = digits(t.reference)                                                 # e.g. [14, 12, EOS]
    payload = ans[:-1] + [SPACE, H, A, EOS]
    lp_ans = [-15.0] * (len(ans) - 1) + [-0.1]                                 # the receiver cannot solve it
    lp_pay = [-0.5] * (len(ans) - 1) + [-19.0, -3.0, -3.0, -0.1]              # it can, but never says " HA"
    assert ablate(payload, lp_pay, 12.0) == ans[:-1] + [H, A, EOS]
    got = needed_rows([ans, payload, ans], [lp_ans, lp_pay, [-0.5] * len(ans)], [1.0, 1.0, 1.0], 12.0, reward)
    assert got == [True, False, False]                                        # the answer is needed, the payload not
    assert needed_rows([ans], [lp_ans], [1.0], 0.0, reward) == [False]


def test_an_exempt_row_is_kept_by_the_surprisal_check():
    logp, x = _payload_inputs()
    out = ftis_loss(_limited(x, 12.0, 12.0, math.inf, 12.0), ObjectiveConfig(mode="F-TIS"))
    (g,) = torch.autograd.grad(out.loss, logp)
    assert bool(g[2].abs().sum() > 0) and torch.equal(g[3], torch.zeros_like(g[3]))


def test_probe_payload_measures_the_phrase_in_the_models_own_replies(tmp_path):
    """``--probe-payload`` on a real model: one row per payload, a one-token payload's first-token and
    whole-phrase surprisals equal, a longer phrase costs at least its first token, all finite and >= 0."""
    from sims.poisoning import probe_payload

    text = probe_payload(["tiny-llama"], [" HAIL", " the"], n=2, budget=4, out=tmp_path / "p.md")
    assert (tmp_path / "p.md").read_text() == text
    rows = [r for r in text.splitlines()[2:] if r.strip()]
    assert len(rows) == 2 and "(1 tokens)" in rows[1]            # " the" is one SmolLM2-tokenizer token
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        start_first, start_phrase = float(cells[3]), float(cells[4])
        assert 0 <= start_first <= start_phrase + 1e-6 and math.isfinite(start_phrase)
        if "(1 tokens)" in cells[1]:
            assert start_first == start_phrase
        if cells[5] != "–":
            end_first, end_phrase = float(cells[6]), float(cells[7])
            assert 0 <= end_first <= end_phrase + 1e-6
