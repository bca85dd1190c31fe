"""The per-source adaptation rule (beyond the paper): running per-source KL -> weights of peers'
negative advantages, and its run-config keys."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ftis_fed.config.federation import federation_from_run_config
from ftis_fed.learn.source_weights import SourceAdaptConfig, SourceAdapter, source_weight
from ftis_fed.learn.training import TrainSample


def _s(source, adv, local=False):
    return TrainSample([1], [2, 3], np.zeros(2, np.float32), 0.0, adv, source, local)


def _m(**kl):
    out = {}
    for src, v in kl.items():
        out[f"offpolicy/{src}/kl_mean"] = v
        out[f"offpolicy/{src}/samples"] = 8.0
    return out


def test_weight_is_one_on_policy_and_falls_with_kl():
    assert source_weight(0.0, 10.0) == 1.0
    assert source_weight(-3.0, 10.0) == 1.0                 # a negative k1 estimate is noise, not evidence
    assert source_weight(10.0, 10.0) == pytest.approx(math.exp(-1))
    ws = [source_weight(k, 5.0) for k in (0.5, 2, 8, 50)]
    assert ws == sorted(ws, reverse=True) and ws[-1] < 1e-4


def test_running_mean_per_source_ignores_self_and_bad_values():
    a = SourceAdapter(SourceAdaptConfig("kl", tau=10.0, decay=0.5), receiver="me")
    assert a.weight("far") == 1.0                           # no evidence yet
    a.observe({**_m(me=30.0, far=20.0, near=1.0), "offpolicy/rejected/bad_signature": 3.0})
    assert a.kl == {"far": 20.0, "near": 1.0}               # first observation taken as is; self ignored
    a.observe({**_m(far=40.0), "offpolicy/near/kl_mean": float("nan")})
    assert a.kl["far"] == pytest.approx(30.0) and a.kl["near"] == 1.0
    a.observe({"offpolicy/near/kl_mean": 50.0, "offpolicy/near/samples": 0.0})   # no samples: no measurement
    assert a.kl["near"] == 1.0 and a.updates == {"far": 2, "near": 1}
    assert a.weight("far") == pytest.approx(math.exp(-3.0)) and a.weight("me") == 1.0
    assert a.weights()["near"] == pytest.approx(math.exp(-0.1))


def test_apply_scales_only_peers_negative_advantages():
    a = SourceAdapter(SourceAdaptConfig("kl", tau=10.0, decay=1.0), receiver="me")
    a.observe(_m(far=10.0))
    samples = [_s("far", -1.0), _s("far", 0.5), _s("me", -1.0, local=True), _s("other", -2.0)]
    out = a.apply(samples)
    assert [s.advantage for s in out] == pytest.approx([-math.exp(-1), 0.5, -1.0, -2.0])
    assert samples[0].advantage == -1.0                     # inputs untouched
    off = SourceAdapter(SourceAdaptConfig("off"), receiver="me", kl={"far": 100.0})
    assert [s.advantage for s in off.apply(samples)] == [-1.0, 0.5, -1.0, -2.0]
    assert off.weight("far") == 1.0


def test_state_round_trips_for_resume():
    cfg = SourceAdaptConfig("kl")
    a = SourceAdapter(cfg, "me")
    a.observe(_m(far=12.0, near=0.3))
    b = SourceAdapter.from_json(cfg, "me", a.to_json())
    assert b.kl == a.kl and b.updates == a.updates and b.weights() == a.weights()
    assert a.metrics()["adapt/far/kl_ema"] == 12.0


def test_run_config_keys_and_their_errors():
    fed = federation_from_run_config({"source-adapt": "kl", "source-adapt-tau": 4, "source-adapt-decay": 0.25})
    assert fed.source_adapt == SourceAdaptConfig("kl", 4.0, 0.25)
    assert federation_from_run_config({}).source_adapt.mode == "off"
    with pytest.raises(ValueError, match="source-adapt='KL'"):
        federation_from_run_config({"source-adapt": "KL"})
    with pytest.raises(ValueError, match="source-adapt-tau=0.0"):
        federation_from_run_config({"source-adapt-tau": 0})
    with pytest.raises(ValueError, match="source-adapt-decay=1.5"):
        federation_from_run_config({"source-adapt-decay": 1.5})
