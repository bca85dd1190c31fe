"""The paper's horizontal mode, schedule side: every participant takes the round's SHARED prompts and
generates its share ceil(G/N) of each prompt's group; receivers accept a peer's group only for one
of those prompts (recomputed by the receiver, never taken from the sender) and only up to the
share; advantages are computed over the mixed group. Real tiny models, real keys, the engine's
in-process transport."""

from __future__ import annotations

import json

import pytest

from ftis_fed.config.federation import FederationConfig, ParticipantSpec
from ftis_fed.config.keys import federation_from_run_config
from ftis_fed.config.validation import validate_run_config
from ftis_fed.engine.core import Engine
from ftis_fed.engine.inprocess import InProcessTransport
from ftis_fed.learn.objective import ObjectiveConfig
from ftis_fed.participant import Participant
from ftis_fed.policies.config import PolicyConfig
from ftis_fed.trust.signing import generate_keypair, load_key_directory
from ftis_fed.tasks.suite import TaskSpec


def _fed(tmp_path, n: int, group_size: int, mode: str = "F-TIS", groups: str = "horizontal",
         scheme: str = "auto", run_name: str = "horiz") -> FederationConfig:
    return FederationConfig(num_rounds=1, scheme="sync", min_participants=n, group_size=group_size,
                            max_new_tokens=4, run_name=run_name, output_dir=str(tmp_path), eval_every=0,
                            objective=ObjectiveConfig(mode=mode, advantage_groups=groups),
                            task=TaskSpec(scheme=scheme, families=("add1",), prompts_per_round=2))


def _participant(tmp_path, fed, name: str, pid: int, n: int, state: str = "") -> Participant:
    spec = ParticipantSpec(name, PolicyConfig(model="tiny-llama", adapter="full", lr=1e-3), pid, n,
                           str(tmp_path / "keys"), str(tmp_path / "participants" / (state or name)))
    return Participant(spec, fed)


def _keys(tmp_path, *names):
    for n in names:
        generate_keypair(n, tmp_path / "keys")


# ----------------------------------------------------------------------------- configuration

def test_auto_task_scheme_follows_the_advantage_groups(tmp_path):
    assert _fed(tmp_path, 2, 4).task.scheme == "shared"
    assert _fed(tmp_path, 2, 4, groups="vertical").task.scheme == "iid"
    fed = federation_from_run_config({"advantage-groups": "horizontal"})
    assert fed.task.scheme == "shared"
    assert federation_from_run_config({}).task.scheme == "iid"


@pytest.mark.parametrize("scheme", ["iid", "expertise", "dirichlet"])
def test_horizontal_groups_with_a_non_shared_partition_is_a_config_error(scheme):
    with pytest.raises(ValueError, match=rf"task-scheme='{scheme}' with advantage-groups='horizontal'.*task-scheme=shared"):
        federation_from_run_config({"advantage-groups": "horizontal", "task-scheme": scheme})
    federation_from_run_config({"advantage-groups": "horizontal", "task-scheme": "shared"})   # explicit: fine


def test_horizontal_groups_with_the_pipelined_schedule_is_a_config_error():
    with pytest.raises(ValueError, match=r"scheme='pipelined' with advantage-groups='horizontal'.*scheme=sync"):
        federation_from_run_config({"advantage-groups": "horizontal", "scheme": "pipelined"})


def test_each_participant_generates_ceil_g_over_n():
    fed = federation_from_run_config({"advantage-groups": "horizontal", "group-size": 6})
    assert [fed.completions_per_prompt(n) for n in (1, 2, 3, 4, 5, 6)] == [6, 3, 2, 2, 2, 1]
    assert federation_from_run_config({"group-size": 6}).completions_per_prompt(4) == 6    # vertical: all of G


def test_alone_with_horizontal_groups_generates_the_full_group_of_the_shared_prompts():
    """The horizontal baseline trains alone on the same shared prompts with the full group G (not on
    its share ceil(G/N) of a mixed group, which would confound the comparison with half the data)."""
    rc = {"advantage-groups": "horizontal", "loss-mode": "alone", "group-size": 2,
          "p0-model": "tiny-llama", "p1-model": "tiny-llama", "p2-model": ""}
    fed = validate_run_config(rc)
    assert fed.completions_per_prompt(2) == 2 and fed.task.scheme == "shared"
    assert validate_run_config({**rc, "group-size": 6}).completions_per_prompt(3) == 6
    assert validate_run_config({**rc, "loss-mode": "F-TIS"}).completions_per_prompt(2) == 1   # mixed group: 2


# ----------------------------------------------------------------------------- participants

def test_participants_generate_their_share_and_train_on_mixed_groups(tmp_path):
    """G = 3 over N = 2: each generates ceil(3/2) = 2 completions of each of the 2 shared prompts;
    each trains on 2 mixed groups of 4 completions (2 own + 2 of the peer)."""
    names = ("alice", "bob")
    _keys(tmp_path, *names)
    fed = _fed(tmp_path, 2, 3)
    parts = {n: _participant(tmp_path, fed, n, i, 2) for i, n in enumerate(names)}
    eng = Engine(fed, load_key_directory(tmp_path / "keys"), tmp_path, InProcessTransport(parts), plots=False)
    assert eng.run() == 1
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    r1 = {r["participant"]: r for r in rows if r["round"] == 1}
    for n in names:
        assert r1[n]["offpolicy/accepted"] == 1
        assert r1[n]["train/own_samples"] == 4 and r1[n]["train/peer_samples"] == 4   # 2 prompts x 2 each
        assert r1[n]["train/advantage_groups"] == 2
        assert r1[n]["train/horizontal_mixed_groups"] == 2 and r1[n]["train/horizontal_unshared_groups"] == 0


def test_a_peer_group_for_another_task_or_over_the_share_is_refused(tmp_path):
    """bob signs validly but generated for other prompts (an iid partition): alice recomputes the
    round's shared prompts herself and refuses the batch as ``unshared_task``; a batch with more
    completions per prompt than the share is refused before that (``too_large``)."""
    _keys(tmp_path, "alice", "bob")
    fed = _fed(tmp_path, 2, 4)                                             # share 2
    alice = _participant(tmp_path, fed, "alice", 0, 2)
    other = _fed(tmp_path, 2, 2, groups="vertical", scheme="iid")          # G=2 = alice's share, own prompts
    bob = _participant(tmp_path, other, "bob", 1, 2)
    own, _ = alice.generate(1, False)
    theirs, _ = bob.generate(1, False)
    assert {g.task_id for g in bob.own[1].groups}.isdisjoint({g.task_id for g in alice.own[1].groups})
    m = alice.learn(1, theirs)
    assert m["offpolicy/rejected/unshared_task"] == 1 and m["trust/bob/rejected/unshared_task"] == 1
    assert m["train/peer_samples"] == 0 and m["train/own_samples"] == 4
    assert alice.inbox.strikes["bob"] == 1                                 # the sender's fault

    big = _participant(tmp_path, _fed(tmp_path, 2, 4, groups="vertical", scheme="shared"), "bob", 1, 2, "bob-big")
    big.seq = bob.seq                                                      # a fresh, higher seq
    frames, _ = big.generate(2, False)                                     # shared prompts, but G = 4 > share 2
    alice.generate(2, False)
    m2 = alice.learn(2, frames)
    assert m2["offpolicy/rejected/too_large"] == 1 and m2["train/peer_samples"] == 0


def test_alone_with_horizontal_groups_trains_on_its_own_full_groups_only(tmp_path):
    """alone + horizontal: a participant generates all G of each shared prompt and its update is the
    same with or without its peer's batch; two identical copies of alice, one given bob's frame."""
    _keys(tmp_path, "alice", "bob")
    fed = _fed(tmp_path, 2, 4, mode="alone")                               # full G = 4
    a1 = _participant(tmp_path, fed, "alice", 0, 2, "a1")
    a2 = _participant(tmp_path, fed, "alice", 0, 2, "a2")
    bob = _participant(tmp_path, _fed(tmp_path, 2, 4), "bob", 1, 2)       # F-TIS peer (share 2), same prompts
    frames, _ = bob.generate(1, False)
    a1.generate(1, False)
    a2.generate(1, False)
    with_peer, without = a1.learn(1, frames), a2.learn(1, [])
    assert with_peer["offpolicy/accepted"] == 1                            # bob's batch was valid and shared
    assert with_peer["train/peer_samples"] == 0 and with_peer["train/own_samples"] == 8   # 2 prompts x G
    assert with_peer["train/horizontal_mixed_groups"] == 0
    for k in ("train/loss", "train/grad_norm", "train/samples"):
        assert with_peer[k] == without[k], k


def test_deployment_node_configs_with_partition_id_but_no_num_partitions_agree_or_fail_clearly(tmp_path):
    """Issue 20: without ``num-partitions`` every node takes min-participants (never a value from its
    own partition-id), so all compute the same share ceil(G/N); a partition-id beyond it is a
    config error naming both keys, not a run whose participants refuse each other's groups."""
    from ftis_fed.config.participants import participant_spec

    fed = _fed(tmp_path, 3, 6)
    specs = [participant_spec({}, {"participant": n, "partition-id": i}, fed) for i, n in enumerate(("a", "b", "c"))]
    assert [s.num_partitions for s in specs] == [3, 3, 3]
    assert {fed.completions_per_prompt(s.num_partitions) for s in specs} == {2}
    with pytest.raises(ValueError, match=r"partition-id=3: must be in \[0, num-partitions=3\).*min-participants"):
        participant_spec({}, {"participant": "d", "partition-id": 3}, fed)
    with pytest.raises(ValueError, match=r"partition-id=4: must be in \[0, num-partitions=4\) \(num-partitions as set"):
        participant_spec({}, {"participant": "d", "partition-id": 4, "num-partitions": 4}, fed)
