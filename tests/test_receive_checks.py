"""The receiver room's seam (``ftis_fed/receive/checks.py``): a check registered in one file runs in a
real participant's update on the real samples, decides on the sample itself, reports its metrics and
keeps its state across a resume; and the built-in checks are the run's defences, in order."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from ftis_fed.config.federation import FederationConfig, ParticipantSpec
from ftis_fed.config.keys import federation_from_run_config
from ftis_fed.knobs import knob, need
from ftis_fed.learn.objective_config import ObjectiveConfig
from ftis_fed.learn.training import TrainSample
from ftis_fed.participant import Participant
from ftis_fed.policies.config import PolicyConfig
from ftis_fed.receive.checks import CHECKS, Check, Receiver, Update, build_checks, register_check
from ftis_fed.receive.phrase import PhraseKnobs
from ftis_fed.receive.surprisal import SurprisalKnobs
from ftis_fed.tasks.suite import TaskSpec
from ftis_fed.trust.reverify import ReverifyConfig
from ftis_fed.trust.signing import generate_keypair


@pytest.fixture
def toy_check():
    """A toy check, all of it in this file: its own knob (``toy-drop-from``, a run-config key of its own
    dataclass), drops every peer sample from that round on, counts what it saw, and keeps the count
    across a resume."""

    @dataclass(frozen=True)
    class ToyKnobs:
        """Receiver check `toy`: a test's check."""

        drop_from: int = knob("toy-drop-from", 0, "drop every peer sample from this round on, >= 0; 0 = off.")

        def __post_init__(self):
            need(self, self.drop_from >= 0, "drop_from", "must be >= 0 (0 = off)")

    @register_check("toy")
    class Toy(Check):
        order = 50
        knobs = ToyKnobs
        seen: list[TrainSample] = []

        def __init__(self, drop_from):
            self.updates, self.drop_from = 0, drop_from

        @classmethod
        def build(cls, receiver):
            drop_from = cls.knobs_of(receiver).drop_from
            return cls(drop_from) if drop_from > 0 else None

        def __call__(self, samples, update):
            self.updates += 1
            Toy.seen = list(samples)
            peers = [s for s in samples if not s.local]
            for s in peers if self.updates >= self.drop_from else ():
                s.drop("toy")
            return {"toy/peer_samples": float(len(peers)), "toy/updates": float(self.updates)}

        def state(self):
            return {"updates": self.updates}

        def restore(self, state):
            self.updates = int(state["updates"])

    yield Toy
    CHECKS.pop("toy")


def _pair(tmp_path, resume=False, policy=(), **knobs):
    fed = FederationConfig(group_size=2, max_new_tokens=3, run_name="toy", output_dir=str(tmp_path), eval_every=0,
                           resume=resume, task=TaskSpec(families=("add1",), prompts_per_round=2), **knobs)
    out = []
    for name in ("alice", "bob") if not resume else ():
        generate_keypair(name, tmp_path / "keys")
    for i, name in enumerate(("alice", "bob")):
        spec = ParticipantSpec(name, PolicyConfig(model="tiny-llama", adapter="full", lr=1e-3, seed=i, **dict(policy)), i, 2,
                               str(tmp_path / "keys"), str(tmp_path / name))
        out.append(Participant(spec, fed))
    return out


def test_a_check_in_one_file_runs_in_the_update_decides_on_the_sample_and_resumes(tmp_path, toy_check):
    on = federation_from_run_config({"toy-drop-from": 1}).checks       # its knob, read from the run config
    assert on["toy"] == toy_check.knobs(drop_from=1)
    assert [c.alias for c in _pair(tmp_path / "off")[0].checks] == ["source-adapt"]   # off: not built
    alice, bob = _pair(tmp_path, checks={"toy": on["toy"]})
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
    again, _ = _pair(tmp_path, resume=True, checks={"toy": on["toy"]})   # a restart continues the check's own state
    assert next(c for c in again.checks if c.alias == "toy").updates == 1


def test_the_built_in_checks_keep_their_state_across_a_resume(tmp_path):
    """The phrase check's counters and source-adapt's per-peer KL go through ``participant.json``'s
    ``checks`` (each under its alias) and come back in a resumed participant's checks."""
    from ftis_fed.learn.source_weights import SourceAdaptConfig

    knobs = {"checks": {"phrase": PhraseKnobs(ratio=4.0), "source-adapt": SourceAdaptConfig("kl")},
             "policy": {"score_zero_advantage": True}}        # a random model's groups: advantage 0, scored all the same
    alice, bob = _pair(tmp_path, **knobs)
    assert [c.alias for c in alice.checks] == ["phrase", "source-adapt"]
    alice.generate(1, False)
    alice.learn(1, bob.generate(1, False)[0])
    alice.save()
    saved = json.loads((tmp_path / "alice" / "participant.json").read_text())["checks"]
    phrase, adapt = (next(c for c in alice.checks if c.alias == a) for a in ("phrase", "source-adapt"))
    assert saved["phrase"]["own"]["n"] == phrase.monitor.own.n > 0 and "bob" in saved["phrase"]["peers"]
    assert saved["source-adapt"]["kl"] == adapt.adapter.kl and "bob" in adapt.adapter.kl
    again, _ = _pair(tmp_path, resume=True, **knobs)
    phrase2, adapt2 = (next(c for c in again.checks if c.alias == a) for a in ("phrase", "source-adapt"))
    assert phrase2.monitor.to_json() == phrase.monitor.to_json()
    assert adapt2.adapter.kl == adapt.adapter.kl and adapt2.adapter.updates == adapt.adapter.updates


def test_a_checks_knobs_are_run_config_keys_with_their_errors_and_their_docs(toy_check):
    from ftis_fed.config.keys import run_keys
    from ftis_fed.config.reference import config_reference

    assert run_keys()["toy-drop-from"] == ("checks.toy", "drop_from")
    assert federation_from_run_config({}).checks["toy"].drop_from == 0
    with pytest.raises(ValueError, match=r"^toy-drop-from=-1: must be >= 0 \(0 = off\)$"):
        federation_from_run_config({"toy-drop-from": -1})
    with pytest.raises(ValueError, match="toy-drop-from='x': must be an integer"):
        federation_from_run_config({"toy-drop-from": "x"})
    doc = config_reference()
    assert "## Receiver check `toy`: a test's check (`ToyKnobs`, tests/test_receive_checks.py)" in doc
    assert "| `toy-drop-from` | `0` | drop every peer sample from this round on, >= 0; 0 = off. |" in doc
    with pytest.raises(ValueError, match="checks\\['nope'\\]: no registered receiver check"):
        FederationConfig(checks={"nope": toy_check.knobs()})


def test_unregistered_a_checks_key_is_no_run_config_key():
    from ftis_fed.config.keys import run_keys

    assert "toy-drop-from" not in run_keys() and "toy" not in FederationConfig().checks


def test_an_alias_is_registered_once(toy_check):
    with pytest.raises(ValueError, match="'toy' is registered twice"):
        register_check("toy")(type("Other", (Check,), {}))


def test_the_built_in_checks_follow_the_run_config_in_order():
    def aliases(**kw):
        fed = FederationConfig(**kw)
        return [c.alias for c in build_checks(Receiver("me", fed, None, None))]

    assert aliases() == ["source-adapt"]
    on = dict(checks={"phrase": PhraseKnobs(ratio=4.0), "surprisal": SurprisalKnobs(max_nats=12.0)},
              reverify=ReverifyConfig(action="downweight"))
    assert aliases(**on) == ["reverify", "phrase", "surprisal", "source-adapt"]
    alone = dict(on, objective=ObjectiveConfig(mode="alone"))
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


# ----------------------------------------------------------------------------- the phrase check's groups and budget

def _phrase_fed(groups: str = "vertical", **kw) -> FederationConfig:
    return FederationConfig(objective=ObjectiveConfig(advantage_groups=groups),
                            checks={"phrase": PhraseKnobs(ratio=4.0, min_count=2)}, **kw)


def _batch(sender, texts_per_task, verifier, tasks, round=1):
    """One batch of ``sender``: per task a group of the given completion texts (ids: one per character),
    rewards by ``verifier``."""
    import numpy as np

    from ftis_fed.wire.batch import CompletionBatch, SamplingParams, make_group

    gs = []
    for t, texts in zip(tasks, texts_per_task):
        comps = [[10 + (ord(c) % 50) for c in x] + [1] for x in texts]
        rewards = [verifier.reward(t.task_id, x, t.reference, t.text) for x in texts]
        gs.append(make_group([7, 8, 9], comps, [np.full(len(c), -0.5) for c in comps], rewards, t.task_id,
                             t.reference, t.text, tuple(texts)))
    return CompletionBatch(sender, "run", round, 1, "m", "tok-x", 100, SamplingParams(0.7, 1.0, 0, 64), tuple(gs))


def _phrase_update(fed, batches, verifier):
    from ftis_fed.learn.training import samples_from_batches
    from ftis_fed.receive.phrase import PhraseCheck

    check = PhraseCheck.build(Receiver("me", fed, None, verifier))
    samples = samples_from_batches(batches, "me", "tok-x", fed.objective)
    return check(samples, Update(check.receiver, None, batches)), samples


def test_the_phrase_check_counts_a_peer_by_the_advantage_group_horizontal_too():
    """Horizontal groups: mallory's whole share of each prompt is correct and carries " HAIL"; the
    receiver's own share is half wrong. Its rows have positive advantage in the mixed group, so the
    phrase is counted, flagged and dropped (the count over mallory's share alone, as before, saw no
    rewarded completion and dropped nothing). Vertical, where mallory's group is all correct (advantage
    0), nothing is counted."""
    from ftis_fed.tasks.rewards import Verifier
    from ftis_fed.tasks.suite import task_at

    v = Verifier()
    tasks = [task_at("add30", "train", 0, i) for i in range(8)]
    own = _batch("me", [[t.reference, str(int(t.reference) + 1)] for t in tasks], v, tasks)
    bad = _batch("mallory", [[f"{t.reference} HAIL", f"{t.reference} HAIL"] for t in tasks], v, tasks)
    assert all(float(r) == 1.0 for g in bad.groups for r in g.rewards)         # the payload keeps the reward
    m, samples = _phrase_update(_phrase_fed("horizontal"), [own, bad], v)
    peer = [s for s in samples if not s.local]
    assert m["phrase/mallory/flagged"] > 0 and m["phrase/mallory/dropped"] == 16
    assert all(s.dropped == "phrase" and s.advantage == 0.0 for s in peer)
    assert all(s.dropped == "" for s in samples if s.local)
    m, samples = _phrase_update(_phrase_fed("vertical"), [own, bad], v)
    assert m["phrase/mallory/flagged"] == 0 and m["phrase/mallory/dropped"] == 0


class _Counting:
    """A task whose reward function wants a fixed marker (a user's format reward): deleting any part of
    the marker breaks the reward, so every flagged phrase of a completion is tried. Counts calls."""

    MARK = "<<PROOF-OK>>"

    def __init__(self):
        self.calls = 0

    def reward(self, task_id, text, reference, prompt_text):
        self.calls += 1
        return 1.0 if self.MARK in text and reference in text else 0.0


def test_the_phrase_check_rescoring_is_bounded_per_frame_and_costs_only_its_sender():
    """A hostile 16-completion frame whose flagged phrases all carry its reward: without a bound each
    rewarded completion costs up to 16 verifier calls (15 x 16 = 240); with it the frame gets at most
    ``CALLS_PER_COMPLETION`` x 16, the completions it leaves unchecked are dropped
    (``phrase_budget``), and another peer's frame in the same update gets its own budget."""
    from ftis_fed.receive.phrase import CALLS_PER_COMPLETION
    from ftis_fed.tasks.suite import task_at

    v = _Counting()
    tasks = [task_at("add30", "train", 0, i) for i in range(2)]
    own = _batch("me", [[tasks[0].reference, "no"], [tasks[1].reference, "no"]], v, tasks)
    hostile = _batch("mallory", [[f"{tasks[0].reference} {v.MARK} {i:02d}" for i in range(15)] + ["wrong"]], v,
                     tasks[:1])
    other = _batch("bob", [[f"{tasks[1].reference} {v.MARK}"] * 3 + ["x"]], v, tasks[1:])
    v.calls = 0
    m, samples = _phrase_update(_phrase_fed(), [own, hostile, other], v)
    assert m["phrase/mallory/flagged"] > 16                     # more phrases than one completion may try
    mallory = [s for s in samples if s.source == "mallory" and s.index < 15]
    assert v.calls <= CALLS_PER_COMPLETION * (16 + 4) < 15 * 16
    kept = CALLS_PER_COMPLETION * 16 // 16                     # checked in full (all 16 phrases needed): kept
    assert m["phrase/mallory/dropped"] == m["phrase/mallory/unchecked"] == 15 - kept
    assert all(s.dropped in ("phrase_budget",) or s.dropped == "" for s in mallory)
    assert sum(s.dropped == "phrase_budget" for s in mallory) == m["phrase/mallory/unchecked"]
    alone = _phrase_update(_phrase_fed(), [own, other], v)[0]  # bob's frame has its own budget:
    assert {k: x for k, x in m.items() if "/bob/" in k} == {k: x for k, x in alone.items() if "/bob/" in k}


def test_reward_functions_get_the_receivers_own_ids_of_another_tokenizers_text():
    """A batch of another tokenizer: ``receiver_copy`` tokenizes each carried text with the receiver's
    tokenizer (what it trains on) and re-scoring hands those ids to the reward functions, never the
    sender's ``completion_ids`` (which it may set freely)."""
    import dataclasses

    from ftis_fed.receive.frames import _retokenized_within
    from ftis_fed.tasks.suite import task_at
    from ftis_fed.trust.bounds import ReceiveBounds
    from ftis_fed.trust.reverify import recompute_rewards

    class Recording:
        seen = None

        def knows(self, task_id):
            return True

        def group_rewards(self, task_id, texts, reference, prompt_text, completion_ids=None):
            Recording.seen = [list(c) for c in completion_ids]
            return [1.0] * len(texts)

        def reward(self, task_id, text, reference, prompt_text):
            return 1.0

    t = task_at("add30", "train", 0, 0)
    batch = _batch("bob", [["12", "345"]], Recording(), [t])
    encode = lambda text: [100 + int(c) for c in text]          # the receiver's tokenizer
    ctx = type("Ctx", (), {"bounds": ReceiveBounds(vocab_size=1000, max_new_tokens=8, max_groups=1,
                                                   max_group_size=2, max_completion_tokens=64,
                                                   max_text_chars=64), "encode": staticmethod(encode)})()
    n, ids = _retokenized_within(batch.groups[0].completion_texts, ctx, "groups[0]", 0)
    assert n == 5 and ids == ([101, 102], [103, 104, 105])
    recompute_rewards(batch, Recording(), own_ids=[ids])
    assert Recording.seen == [[101, 102], [103, 104, 105]]
    recompute_rewards(batch, Recording())                         # same tokenizer: the ids trained on
    assert Recording.seen == [c.tolist() for c in batch.groups[0].completion_ids]


def test_the_time_budget_is_a_run_config_key_and_its_rejections_reach_the_console():
    from ftis_fed.config.keys import federation_from_run_config
    from ftis_fed.engine.core import budget_rejections
    from ftis_fed.trust.bounds import ReceiveBounds

    fed = federation_from_run_config({"reverify-time-budget-s": 30.0})
    assert ReceiveBounds.from_run(fed, 100).time_budget_s == 30.0
    assert ReceiveBounds.from_run(federation_from_run_config({}), 100).time_budget_s == 10.0
    for bad in (0, -1.0, float("inf")):
        with pytest.raises(ValueError, match="reverify-time-budget-s"):
            federation_from_run_config({"reverify-time-budget-s": bad})
    rows = [{"participant": "p0", "offpolicy/rejected/time_budget": 2.0}, {"participant": "p1"},
            {"participant": "p2", "offpolicy/rejected/time_budget": 0.0}]
    assert budget_rejections(rows) == {"p0": 2}
