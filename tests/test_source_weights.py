"""The per-source adaptation rule (beyond the paper): running per-source KL -> weights of peers'
negative advantages, and its run-config keys."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ftis_fed.config.federation import FederationConfig, ParticipantSpec
from ftis_fed.config.keys import federation_from_run_config
from ftis_fed.learn.source_weights import SourceAdaptConfig, SourceAdapter, source_weight
from ftis_fed.learn.training import TrainSample
from ftis_fed.participant import Participant
from ftis_fed.policies.config import PolicyConfig
from ftis_fed.tasks.suite import TaskSpec
from ftis_fed.trust.signing import generate_keypair


def _s(source, adv, local=False):
    return TrainSample([1], [2, 3], np.zeros(2, np.float32), 0.0, adv, source, local)


def test_weight_is_one_on_policy_and_falls_with_kl():
    assert source_weight(0.0, 10.0) == 1.0
    assert source_weight(-3.0, 10.0) == 1.0                 # a negative k1 estimate is noise, not evidence
    assert source_weight(10.0, 10.0) == pytest.approx(math.exp(-1))
    ws = [source_weight(k, 5.0) for k in (0.5, 2, 8, 50)]
    assert ws == sorted(ws, reverse=True) and ws[-1] < 1e-4


def test_running_mean_per_source_ignores_self_and_bad_values():
    a = SourceAdapter(SourceAdaptConfig("kl", tau=10.0, decay=0.5), receiver="me")
    assert a.weight("far") == 1.0                           # no evidence yet
    a.observe({"me": 30.0, "far": 20.0, "near": 1.0})
    assert a.kl == {"far": 20.0, "near": 1.0}               # first observation taken as is; self ignored
    a.observe({"far": 40.0, "near": float("nan")})
    assert a.kl["far"] == pytest.approx(30.0) and a.kl["near"] == 1.0
    assert a.updates == {"far": 2, "near": 1}
    assert a.weight("far") == pytest.approx(math.exp(-3.0)) and a.weight("me") == 1.0
    assert a.weights()["near"] == pytest.approx(math.exp(-0.1))


def test_the_source_adapt_check_scales_only_peers_negative_advantages_on_the_samples():
    """``receive/source_adapt.py``, the registered check: under ``kl`` a peer's negative advantage is
    multiplied by w_s on the sample itself (its ``weight`` too); positive ones, the receiver's own and
    every sample under ``off`` are left alone."""
    from ftis_fed.config.federation import FederationConfig
    from ftis_fed.receive.checks import Receiver, Update
    from ftis_fed.receive.source_adapt import SourceAdapt

    def check(mode):
        fed = FederationConfig(checks={"source-adapt": SourceAdaptConfig(mode, tau=10.0, decay=1.0)})
        c = SourceAdapt.build(Receiver("me", fed, None, None))
        c.restore({"kl": {"far": 10.0}, "updates": {"far": 1}})
        return c

    samples = [_s("far", -1.0), _s("far", 0.5), _s("me", -1.0, local=True), _s("other", -2.0)]
    kl = check("kl")
    assert kl(samples, Update(kl.receiver)) == {}
    assert [s.advantage for s in samples] == pytest.approx([-math.exp(-1), 0.5, -1.0, -2.0])
    assert samples[0].weight == pytest.approx(math.exp(-1)) and samples[1].weight == 1.0
    fresh = [_s("far", -1.0), _s("other", -2.0)]
    off = check("off")
    off(fresh, Update(off.receiver))
    assert [s.advantage for s in fresh] == [-1.0, -2.0]
    assert off.adapter.weight("far") == 1.0


def test_state_round_trips_for_resume():
    cfg = SourceAdaptConfig("kl")
    a = SourceAdapter(cfg, "me")
    a.observe({"far": 12.0, "near": 0.3})
    b = SourceAdapter.from_json(cfg, "me", a.to_json())
    assert b.kl == a.kl and b.updates == a.updates and b.weights() == a.weights()
    assert a.metrics()["adapt/far/kl_ema"] == 12.0


def test_run_config_keys_and_their_errors():
    fed = federation_from_run_config({"source-adapt": "kl", "source-adapt-tau": 4, "source-adapt-decay": 0.25})
    assert fed.checks["source-adapt"] == SourceAdaptConfig("kl", 4.0, 0.25)
    assert federation_from_run_config({}).checks["source-adapt"].mode == "off"
    with pytest.raises(ValueError, match="source-adapt='KL'"):
        federation_from_run_config({"source-adapt": "KL"})
    with pytest.raises(ValueError, match="source-adapt-tau=0.0"):
        federation_from_run_config({"source-adapt-tau": 0})
    with pytest.raises(ValueError, match="source-adapt-decay=1.5"):
        federation_from_run_config({"source-adapt-decay": 1.5})
    assert federation_from_run_config({}).checks["source-adapt"].val_families == "trained"
    fed = federation_from_run_config({"source-adapt": "guard", "source-adapt-val-families": "task"})
    assert fed.checks["source-adapt"].val_families == "task"
    with pytest.raises(ValueError, match="source-adapt-val-families='peers': must be one of trained, task"):
        federation_from_run_config({"source-adapt-val-families": "peers"})
    assert federation_from_run_config({}).checks["source-adapt"].val_ood == 0.5
    fed = federation_from_run_config({"source-adapt": "shadow", "source-adapt-val-ood": 0})
    assert fed.checks["source-adapt"].val_ood == 0
    for bad in (1, 1.0, -0.1, float("nan")):
        with pytest.raises(ValueError, match=r"source-adapt-val-ood=.*: must be a number in \[0, 1\)"):
            federation_from_run_config({"source-adapt-val-ood": bad})
    with pytest.raises(ValueError, match="source-adapt-val-ood=True: must be a number"):
        federation_from_run_config({"source-adapt-val-ood": True})
    assert federation_from_run_config({}).checks["source-adapt"].val_score == "reward"
    fed = federation_from_run_config({"source-adapt": "guard", "source-adapt-val-score": "loglik"})
    assert fed.checks["source-adapt"].val_score == "loglik"
    with pytest.raises(ValueError, match="source-adapt-val-score='pass@k': must be one of reward, loglik"):
        federation_from_run_config({"source-adapt-val-score": "pass@k"})
    assert federation_from_run_config({}).checks["source-adapt"].align is True
    assert federation_from_run_config({"source-adapt-align": False}).checks["source-adapt"].align is False
    with pytest.raises(ValueError, match="source-adapt-align=1: must be true or false"):
        federation_from_run_config({"source-adapt-align": 1})
    assert federation_from_run_config({}).checks["source-adapt"].window == 1
    assert federation_from_run_config({"source-adapt-window": 20}).checks["source-adapt"].window == 20
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match=f"source-adapt-window={bad!r}: must be an integer"):
            federation_from_run_config({"source-adapt-window": bad})


def test_a_participant_adapts_to_the_kl_its_trainer_measured(tmp_path):
    """Through a real participant (tiny random models): the KL source-adapt folds in is the
    trainer's own per-source measurement, the one its metrics report (score-zero-advantage: a random
    model solves nothing, so every group's advantage is 0 and only then are its rows scored)."""
    fed = FederationConfig(group_size=2, max_new_tokens=3, run_name="adapt", output_dir=str(tmp_path), eval_every=0,
                           checks={"source-adapt": SourceAdaptConfig("kl")}, task=TaskSpec(families=("add1",), prompts_per_round=2))
    parts = []
    for name in ("alice", "bob"):
        generate_keypair(name, tmp_path / "keys")
    for i, name in enumerate(("alice", "bob")):
        spec = ParticipantSpec(name, PolicyConfig(model="tiny-llama", adapter="full", lr=1e-3, seed=i,
                                                  score_zero_advantage=True), i, 2,
                               str(tmp_path / "keys"), str(tmp_path / name))
        parts.append(Participant(spec, fed))
    alice, bob = parts
    alice.generate(1, False)
    m = alice.learn(1, bob.generate(1, False)[0])
    assert m["offpolicy/accepted"] == 1 and set(alice.trainer.source_kl) == {"bob"}
    assert next(c for c in alice.checks if c.alias == "source-adapt").adapter.kl == {"bob": max(0.0, m["offpolicy/bob/kl_mean"])} == {"bob": m["adapt/bob/kl_ema"]}


def test_a_resumed_participant_keeps_its_guard_s_window(tmp_path):
    """``source-adapt = guard`` with a window: the last rounds' score differences are saved with the
    checkpoint and a resumed participant restores them (a real participant, tiny model)."""
    def fed(resume):
        return FederationConfig(group_size=2, max_new_tokens=3, run_name="win", output_dir=str(tmp_path), eval_every=0,
                                resume=resume, checks={"source-adapt": SourceAdaptConfig("guard", window=4)},
                                task=TaskSpec(families=("add1",), prompts_per_round=2))
    generate_keypair("alice", tmp_path / "keys")
    spec = ParticipantSpec("alice", PolicyConfig(model="tiny-llama", adapter="full", lr=1e-3), 0, 1,
                           str(tmp_path / "keys"), str(tmp_path / "alice"))
    alice = Participant(spec, fed(False))
    assert alice.guarded.window == 4 and not alice.guarded.diffs
    for w, wo in [(0.5, 0.25), (0.0, 0.5)]:
        alice.guarded.keeps_peers(w, wo)
    alice.save()
    again = Participant(spec, fed(True))
    assert list(again.guarded.diffs["all"]) == [0.25, -0.5] and again.guarded.diffs["all"].maxlen == 4
    fresh = Participant(spec, fed(False))                        # not resumed: a window of its own
    assert not fresh.guarded.diffs
