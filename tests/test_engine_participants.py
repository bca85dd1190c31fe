"""Real participants (tiny models, real keys) driven by the engine through the in-process
transport: the one entry point ``Participant.handle`` end to end, with no Flower and no worker."""

from __future__ import annotations

import json

import pytest

from ftis_fed.config.federation import FederationConfig, ParticipantSpec
from ftis_fed.engine.core import Engine
from ftis_fed.engine.inprocess import InProcessTransport
from ftis_fed.participant import Participant
from ftis_fed.policies.config import PolicyConfig
from ftis_fed.trust.signing import generate_keypair, load_key_directory
from ftis_fed.tasks.suite import TaskSpec


def tiny_federation(tmp_path, names, num_rounds: int, run_name: str) -> FederationConfig:
    """Keys for ``names`` in tmp_path/keys and a small sync federation of them (G = 2, 2 add1
    prompts per round, 4 new tokens, no evaluation)."""
    for n in names:
        generate_keypair(n, tmp_path / "keys")
    return FederationConfig(num_rounds=num_rounds, scheme="sync", min_participants=len(names), group_size=2,
                            max_new_tokens=4, run_name=run_name, output_dir=str(tmp_path), eval_every=0,
                            task=TaskSpec(families=("add1",), prompts_per_round=2))


@pytest.mark.slow
def test_real_participants_learn_from_each_other_in_one_process(tmp_path):
    names = ("alice", "bob")
    fed = tiny_federation(tmp_path, names, num_rounds=1, run_name="inproc")
    parts = {n: Participant(ParticipantSpec(n, PolicyConfig(model="tiny-llama", adapter="full", lr=1e-3), i, 2,
                                            str(tmp_path / "keys"), str(tmp_path / "participants" / n)), fed)
             for i, n in enumerate(names)}
    eng = Engine(fed, load_key_directory(tmp_path / "keys"), tmp_path, InProcessTransport(parts), plots=False)
    assert eng.run() == 1
    assert sorted(i["participant"] for i in eng.nodes.values()) == list(names)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    r1 = {r["participant"]: r for r in rows if r["round"] == 1}
    assert r1["_federation"]["fed/frames_verified"] == 2 and r1["_federation"]["fed/rejected"] == 0
    for n in names:
        assert r1[n]["offpolicy/accepted"] == 1 and r1[n]["train/peer_samples"] == 4   # the peer's batch
        assert r1[n]["train/own_samples"] == 4 and r1[n]["model_id"] == "tiny-llama"


def test_a_byzantine_participant_is_bounded_by_server_and_receivers(tmp_path):
    """mallory signs validly but lies (forged references + rewards 1 + implausible log-probs) in
    round 1 and floods in round 2: the server refuses the flood whole, the honest receiver corrects
    the rewards from its own reference and records it against mallory; the run completes."""
    names = ("alice", "mallory")
    fed = tiny_federation(tmp_path, names, num_rounds=2, run_name="byz")
    specs = [ParticipantSpec("alice", PolicyConfig(model="tiny-llama", adapter="full", lr=1e-3), 0, 2,
                             str(tmp_path / "keys"), str(tmp_path / "participants" / "alice")),
             ParticipantSpec("mallory", PolicyConfig(model="tiny-llama", adapter="full", lr=1e-3), 1, 2,
                             str(tmp_path / "keys"), str(tmp_path / "participants" / "mallory"), byzantine="all")]
    parts = {s.name: Participant(s, fed) for s in specs}
    eng = Engine(fed, load_key_directory(tmp_path / "keys"), tmp_path, InProcessTransport(parts), plots=False)
    assert eng.run() == 2
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    by = {(r["round"], r["participant"]): r for r in rows}
    r1 = by[(1, "alice")]
    assert r1["trust/mallory/accepted"] == 1
    assert r1["trust/mallory/forged_references"] == 2          # both groups' references were forged
    assert r1["trust/mallory/rewards_corrected"] >= 1           # rewards 1 on wrong answers -> own verdict
    assert by[(2, "_federation")]["fed/dropped/too_many_frames"] == 1
    assert by[(2, "alice")]["offpolicy/received"] == 0          # the flood never reached alice
    assert by[(2, "alice")]["train/own_samples"] == 4           # and alice's round went on


@pytest.mark.slow
def test_texts_go_only_to_the_participant_with_another_tokenizer(tmp_path):
    """alice and bob share SmolLM2's tokenizer, carol (smollm2-bpe8k) has another: alice and bob
    sign both variants, carol only the one with texts; each receiver gets what it needs and accepts
    every peer batch (alice and bob token-level from each other, sequence-level from carol)."""
    names = ("alice", "bob", "carol")
    fed = tiny_federation(tmp_path, names, num_rounds=1, run_name="variants")
    models = {"alice": "tiny-llama", "bob": "tiny-llama-b", "carol": "smollm2-bpe8k"}
    parts = {n: Participant(ParticipantSpec(n, PolicyConfig(model=models[n], adapter="full", lr=1e-4), i, 3,
                                            str(tmp_path / "keys"), str(tmp_path / "participants" / n)), fed)
             for i, n in enumerate(names)}
    eng = Engine(fed, load_key_directory(tmp_path / "keys"), tmp_path, InProcessTransport(parts), plots=False)
    assert eng.run() == 1
    assert eng.variants == {"alice": (False, True), "bob": (False, True), "carol": (True,)}
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    r1 = {r["participant"]: r for r in rows if r["round"] == 1}
    fed_row = r1["_federation"]
    assert fed_row["fed/rejected"] == 0 and fed_row["fed/frames_relayed"] == 6
    assert 0 < fed_row["wire/bytes_per_token"] < fed_row["wire/bytes_per_token_texts"]
    for n in ("alice", "bob"):
        assert r1[n]["offpolicy/accepted"] == 2 and r1[n]["trust/carol/accepted"] == 1
        assert r1[n]["wire/bytes_per_token"] < r1[n]["wire/bytes_per_token_texts"]
    # carol would reject a frame without texts (wrong_tokenizer): it got the variants with texts
    assert r1["carol"]["offpolicy/accepted"] == 2
    assert r1["carol"]["trust/alice/accepted"] == 1 and r1["carol"]["trust/bob/accepted"] == 1
    assert "wire/bytes_per_token" not in r1["carol"] and r1["carol"]["wire/bytes_per_token_texts"] > 0
