"""Issue 20: a run id that frames are bound to, different for every run unless it is resumed.

Real participants (tiny-llama, real keys) told their run id by hello, as the engine does: a frame
a participant signed in run A is refused by a receiver in run B of the same run name (same keys,
same round, same seq); a participant resumed from its checkpoint keeps run A's id and accepts it,
and a worker restarted mid-run (no hello) still signs for its run.
"""

from __future__ import annotations

import pytest

from ftis_fed.config.federation import FederationConfig, ParticipantSpec
from ftis_fed.participant import Participant
from ftis_fed.policies.config import PolicyConfig
from ftis_fed.tasks.suite import TaskSpec
from ftis_fed.trust.signing import generate_keypair, new_run_id, run_name_of
from ftis_fed.wire.codec import parse_header

NAME = "idrun"


def test_run_ids_are_fresh_and_name_their_run():
    a, b = new_run_id(NAME), new_run_id(NAME)
    assert a != b and run_name_of(a) == run_name_of(b) == NAME
    assert run_name_of("with@at@" + a.split("@")[-1]) == "with@at"
    assert run_name_of("plain") == "plain" and run_name_of("x@not-a-nonce") == "x@not-a-nonce"


@pytest.fixture
def people(tmp_path):
    for n in ("alice", "bob"):
        generate_keypair(n, tmp_path / "keys")

    def make(name: str, pid: int, resume: bool = False, run: str = "a") -> Participant:
        fed = FederationConfig(num_rounds=5, export_final=False, group_size=2, max_new_tokens=4, run_name=NAME,
                               output_dir=str(tmp_path), eval_every=0, resume=resume,
                               task=TaskSpec(families=("add1",), prompts_per_round=1))
        spec = ParticipantSpec(name, PolicyConfig(model="tiny-llama", adapter="full", lr=1e-3), pid, 2,
                               str(tmp_path / "keys"), str(tmp_path / run / name))
        return Participant(spec, fed)
    return make


@pytest.mark.slow
def test_a_frame_of_run_a_is_refused_in_run_b_and_a_resumed_run_accepts_its_own(people):
    run_a, run_b = new_run_id(NAME), new_run_id(NAME)
    alice, bob = people("alice", 0), people("bob", 1)
    for p in (alice, bob):
        p.hello(run_a, "node", b"c" * 32)
    frames, _ = alice.generate(1, False)
    assert parse_header(frames[0]).run_id == run_a
    # alice's worker killed and restarted mid-run (no hello): it still signs for run A
    restarted = people("alice", 0)
    assert restarted.run_id == run_a
    later, _ = restarted.generate(2, False)
    assert parse_header(later[0]).run_id == run_a
    bob.learn(1, [])                                                    # bob's round 1 (checkpointed)
    # run B: the same participants started afresh under the same run name
    bob_b = people("bob", 1, run="b")
    bob_b.hello(run_b, "node", b"c" * 32)
    m = bob_b.learn(1, frames)
    assert m["offpolicy/rejected/wrong_run"] == 1 and m["offpolicy/accepted"] == 0
    # run A resumed: bob's checkpoint holds run A's id, hello names it again, alice's frame counts
    bob_again = people("bob", 1, resume=True)
    assert bob_again.run_id == run_a
    bob_again.hello(run_a, "node", b"c" * 32)
    m = bob_again.learn(2, frames, peer_round=1)
    assert m["offpolicy/accepted"] == 1
    assert bob_again.learn(3, later, peer_round=2)["offpolicy/accepted"] == 1   # the restarted worker's
    with pytest.raises(ValueError, match="belongs to run 'idrun'"):
        bob_again.hello(new_run_id("another"), "node", b"c" * 32)


def test_a_fresh_participant_refuses_a_run_id_it_served_in_another_flower_run(tmp_path, monkeypatch):
    """The operator's replay (issue 28): run A's id re-announced in a later, fresh run is refused; the
    same Flower run (a worker restarted mid-run) and a resume are answered (participant_state)."""
    from ftis_fed import participant_state as ps

    run_a = new_run_id(NAME)
    ps.record_served(tmp_path, run_a, "flower-run-1")
    served = ps.served_runs(tmp_path)
    assert served == {run_a: "flower-run-1"}
    assert "is not resuming it" in ps.replayed_run(run_a, served, "flower-run-2", resume=False)
    assert "is not resuming it" in ps.replayed_run(run_a, served, "", resume=False)      # no Flower run to tell
    assert ps.replayed_run(run_a, served, "flower-run-1", resume=False) == ""            # restarted mid-run
    assert ps.replayed_run(run_a, served, "flower-run-2", resume=True) == ""             # run A resumed
    assert ps.replayed_run(new_run_id(NAME), served, "flower-run-2", resume=False) == ""  # a new run
    monkeypatch.setattr(ps, "MAX_SERVED", 3)                                             # bounded: newest kept
    ids = [new_run_id(NAME) for _ in range(4)]
    for i in ids:
        ps.record_served(tmp_path, i, "k")
    assert list(ps.served_runs(tmp_path)) == ids[1:]


@pytest.mark.slow
def test_the_operators_replay_of_an_earlier_run_is_refused_at_hello(people):
    """Real participants: alice served run A (Flower run 1); a fresh start (Flower run 2, resume off)
    told run A's id again refuses to answer hello, so it neither signs for run A nor accepts run A's
    recorded frames; told a new id it answers; resumed, it answers run A."""
    run_a = new_run_id(NAME)
    alice = people("alice", 0)
    alice.run_key = "flower-1"
    alice.hello(run_a, "node", b"c" * 32)
    fresh = people("alice", 0)
    fresh.run_key = "flower-2"
    with pytest.raises(ValueError, match="served that run before"):
        fresh.hello(run_a, "node", b"c" * 32)
    assert fresh.hello(new_run_id(NAME), "node", b"c" * 32)["participant"] == "alice"
    resumed = people("alice", 0, resume=True)
    resumed.run_key = "flower-3"
    assert resumed.hello(run_a, "node", b"c" * 32)["participant"] == "alice"
