"""The receiver room's seam (``ftis_fed/receive/checks.py``): a check registered in one file runs in a
real participant's update on the real samples, decides on the sample itself, reports its metrics and
keeps its state across a resume; and the built-in checks are the run's defences, in order."""

from __future__ import annotations

import json

import pytest

from ftis_fed.config.federation import FederationConfig, ParticipantSpec
from ftis_fed.learn.objective_config import ObjectiveConfig
from ftis_fed.learn.training import TrainSample
from ftis_fed.participant import Participant
from ftis_fed.policies.config import PolicyConfig
from ftis_fed.receive.checks import CHECKS, Check, Receiver, Update, build_checks, register_check
from ftis_fed.tasks.suite import TaskSpec
from ftis_fed.trust.reverify import ReverifyConfig
from ftis_fed.trust.signing import generate_keypair


@pytest.fixture
def toy_check():
    """A toy check, all of it in this file: drops every peer sample, counts what it saw, and keeps the
    count across a resume."""

    @register_check("toy")
    class Toy(Check):
        order = 50
        seen: list[TrainSample] = []

        def __init__(self):
            self.updates = 0

        def __call__(self, samples, update):
            self.updates += 1
            Toy.seen = list(samples)
            peers = [s for s in samples if not s.local]
            for s in peers:
                s.drop("toy")
            return {"toy/peer_samples": float(len(peers)), "toy/updates": float(self.updates)}

        def state(self):
            return {"updates": self.updates}

        def restore(self, state):
            self.updates = int(state["updates"])

    yield Toy
    CHECKS.pop("toy")


def _pair(tmp_path, resume=False):
    fed = FederationConfig(group_size=2, max_new_tokens=3, run_name="toy", output_dir=str(tmp_path), eval_every=0,
                           resume=resume, task=TaskSpec(families=("add1",), prompts_per_round=2))
    out = []
    for name in ("alice", "bob") if not resume else ():
        generate_keypair(name, tmp_path / "keys")
    for i, name in enumerate(("alice", "bob")):
        spec = ParticipantSpec(name, PolicyConfig(model="tiny-llama", adapter="full", lr=1e-3, seed=i), i, 2,
                               str(tmp_path / "keys"), str(tmp_path / name))
        out.append(Participant(spec, fed))
    return out


def test_a_check_in_one_file_runs_in_the_update_decides_on_the_sample_and_resumes(tmp_path, toy_check):
    alice, bob = _pair(tmp_path)
    assert [c.alias for c in alice.checks] == ["source-adapt", "toy"]     # the defences that are off are not built
    alice.generate(1, False)
    m = alice.learn(1, bob.generate(1, False)[0])
    peers = [s for s in toy_check.seen if not s.local]
    assert m["offpolicy/accepted"] == 1 and m["toy/peer_samples"] == len(peers) == 4 and m["toy/updates"] == 1
    assert all(s.advantage == 0.0 and s.weight == 0.0 and s.dropped == "toy" for s in peers)
    assert all(s.dropped == "" and s.batch.sender == "alice" for s in toy_check.seen if s.local)
    assert {(s.group_index, s.index) for s in peers} == {(g, i) for g in range(2) for i in range(2)}
    alice.save()
    assert json.loads((tmp_path / "alice" / "participant.json").read_text())["checks"]["toy"] == {"updates": 1}
    again, _ = _pair(tmp_path, resume=True)                  # a restart continues the check's own state
    assert next(c for c in again.checks if c.alias == "toy").updates == 1


def test_an_alias_is_registered_once(toy_check):
    with pytest.raises(ValueError, match="'toy' is registered twice"):
        register_check("toy")(type("Other", (Check,), {}))


def test_the_built_in_checks_follow_the_run_config_in_order():
    def aliases(**kw):
        fed = FederationConfig(**kw)
        return [c.alias for c in build_checks(Receiver("me", fed, None, None))]

    assert aliases() == ["source-adapt"]
    on = dict(objective=ObjectiveConfig(peer_phrase_ratio=4.0, peer_surprisal_max=12.0),
              reverify=ReverifyConfig(action="downweight"))
    assert aliases(**on) == ["reverify", "phrase", "surprisal-keep-needed", "source-adapt"]
    alone = dict(on, objective=ObjectiveConfig(mode="alone", peer_phrase_ratio=4.0))
    assert "phrase" not in aliases(**alone)                 # nothing of a peer is trained on


def test_reverify_downweight_lands_on_the_samples_of_that_batch():
    import numpy as np

    from ftis_fed.receive.frames import Received
    from ftis_fed.receive.reverified import Reverified

    class B:                                                  # two batches: only the second has weights
        sender = "bob"

    b1, b2 = B(), B()
    recv = Received(batches=[b1, b2], weights=[None, (np.array([1.0, 0.25], np.float32),)])
    samples = [TrainSample([1], [2], np.zeros(1, np.float32), 0.0, -2.0, "bob", False, batch=b, group_index=0,
                           index=i) for b in (b1, b2) for i in range(2)]
    Reverified()(samples, Update(None, recv))
    assert [s.advantage for s in samples] == [-2.0, -2.0, -2.0, -0.5]
