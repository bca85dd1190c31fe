"""Participant sampling (fraction-train with a minimum) and peer sampling (peers-per-round on a
rotating ring): exact counts over rounds, deterministic from the seed; and the same through the
engine with light participants that sign and verify real frames."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from ftis_fed.bench.swarm import light_federation
from ftis_fed.config.federation import FederationConfig
from ftis_fed.engine.core import Engine
from ftis_fed.engine.inprocess import InProcessTransport
from ftis_fed.engine.sampling import peer_plan, reach, sample_participants, sample_size

NAMES = [f"n{i}" for i in range(7)]


@pytest.mark.parametrize("n,k", [(7, 2), (7, 3), (10, 4), (5, 1)])
def test_peer_sampling_is_exactly_fair_over_rounds(n, k):
    names = [f"n{i}" for i in range(n)]
    pairs = Counter()
    for rnd in range(1, n):                                         # n - 1 rounds
        plan = peer_plan(names, names, k, seed=3, rnd=rnd)
        assert all(len(got) == k and r not in got and len(set(got)) == k for r, got in plan.items())
        assert set(reach(plan).values()) == {k}                     # every sender reaches exactly k receivers
        pairs.update((r, s) for r, got in plan.items() for s in got)
    assert set(pairs.values()) == {k} and len(pairs) == n * (n - 1)  # every receiver got every peer k times


def test_peer_sampling_is_deterministic_from_the_seed_and_zero_means_all():
    assert peer_plan(NAMES, NAMES, 2, seed=1, rnd=4) == peer_plan(NAMES, NAMES, 2, seed=1, rnd=4)
    assert peer_plan(NAMES, NAMES, 2, seed=1, rnd=4) != peer_plan(NAMES, NAMES, 2, seed=2, rnd=4)
    for k in (0, 6, 9):                                              # 0 or >= n - 1: every other sender
        assert all(sorted(got) == sorted(set(NAMES) - {r}) for r, got in peer_plan(NAMES, NAMES, k, 0, 1).items())


def test_a_receiver_without_a_frame_still_gets_k_distinct_senders():
    senders = NAMES[:5]
    plan = peer_plan(senders, NAMES, 2, seed=0, rnd=3)
    for r in NAMES[5:]:
        assert len(plan[r]) == 2 and len(set(plan[r])) == 2 and set(plan[r]) <= set(senders)


def test_participant_sampling_fraction_minimum_and_equal_turns():
    assert sample_size(10, 0.3, 2) == 3 and sample_size(10, 0.05, 4) == 4 and sample_size(3, 0.1, 5) == 3
    assert sample_size(64, 0.25, 8) == 16 and sample_size(10, 1.0, 2) == 10
    names = [f"p{i}" for i in range(10)]
    turns = Counter()
    for rnd in range(1, 11):                                        # n / gcd(n, m) = 10 rounds
        got = sample_participants(names, 0.3, 2, seed=5, rnd=rnd)
        assert len(got) == 3 == len(set(got))
        turns.update(got)
    assert set(turns.values()) == {3} and len(turns) == 10
    assert sorted(sample_participants(names, 0.05, 4, seed=5, rnd=1)) != [] and \
        len(sample_participants(names, 0.05, 4, seed=5, rnd=1)) == 4
    assert sorted(sample_participants(names[:3], 0.5, 5, seed=5, rnd=1)) == names[:3]


def test_knob_limits_are_named():
    for kw, msg in (({"fraction_train": 0.0}, "fraction-train=0.0: must be in (0, 1]"),
                    ({"fraction_train": 1.5}, "fraction-train=1.5"), ({"min_train_participants": 0}, "min-train-participants=0"),
                    ({"peers_per_round": -1}, "peers-per-round=-1"), ({"retire_after_rounds": -1}, "retire-after-rounds=-1"),
                    ({"join_timeout_s": 0.0}, "join-timeout-s=0.0")):
        with pytest.raises(ValueError, match=msg.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
            FederationConfig(eval_every=0, **kw)


def _rows(path):
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("scheme", ["sync", "pipelined"])
def test_engine_relays_k_peers_per_receiver_every_sender_equally(tmp_path, scheme):
    n, k = 7, 2
    parts, keys = light_federation(tmp_path, n)
    fed = FederationConfig(num_rounds=n - 1, scheme=scheme, min_participants=n, run_name="swarm",
                           output_dir=str(tmp_path), eval_every=0, peers_per_round=k, progress_every_s=0)
    assert Engine(fed, keys, tmp_path, InProcessTransport(parts), plots=False).run() == n - 1
    fed_rows = [r for r in _rows(tmp_path) if r["participant"] == "_federation"]
    relayed = [r["fed/frames_relayed"] for r in fed_rows]
    assert relayed == ([n * k] * (n - 1) if scheme == "sync" else [0] + [n * k] * (n - 2))
    for r in fed_rows[scheme == "pipelined":]:
        assert r["fed/sender_reach_min"] == r["fed/sender_reach_max"] == k and r["fed/peers_per_receiver"] == k
        assert r["fed/rejected"] == 0
    pairs = Counter((p.name, s) for p in parts.values() for got in p.accepted.values() for s in got)
    if scheme == "sync":                                             # n - 1 rounds: every ordered pair k times
        assert set(pairs.values()) == {k} and len(pairs) == n * (n - 1)
    assert all(len(got) == k for p in parts.values() for rnd, got in p.accepted.items() if rnd > 1 or scheme == "sync")


def test_engine_samples_participants_per_round(tmp_path):
    n = 10
    parts, keys = light_federation(tmp_path, n)
    fed = FederationConfig(num_rounds=10, min_participants=2, run_name="swarm", output_dir=str(tmp_path),
                           eval_every=0, fraction_train=0.3, min_train_participants=2, progress_every_s=0)
    Engine(fed, keys, tmp_path, InProcessTransport(parts), plots=False).run()
    fed_rows = [r for r in _rows(tmp_path) if r["participant"] == "_federation"]
    assert [r["fed/sampled"] for r in fed_rows] == [3.0] * 10 and {r["fed/participants"] for r in fed_rows} == {10.0}
    assert [r["fed/replies"] for r in fed_rows] == [3.0] * 10
    assert sorted(len(p.trained) for p in parts.values()) == [3] * 10      # equal turns over 10 rounds
    for p in parts.values():                                               # only sampled peers' frames
        for rnd, got in p.accepted.items():
            assert len(got) == 2 and rnd in p.trained
