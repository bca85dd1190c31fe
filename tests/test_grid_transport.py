"""``strategies.grid_transport.GridTransport`` against a fake Flower Grid: one message per node of the
action's type, pushed at once and pulled until every reply is in or the deadline passes; error
replies, missing replies, replies to other messages and unreadable replies become a ``Failure`` for
that node only; good replies come back unchecked as ``Delivered``. Real Flower messages and records;
a fake clock, so the deadline is exact."""

from __future__ import annotations

import pytest
from flwr.app import ConfigRecord, Error, Message, RecordDict
from flwr.common.constant import ErrorCode
from flwr.supercore.task_identity import TaskIdentity

from ftis_fed.engine.transport import NODE_GONE, Delivered, Failure
from ftis_fed.flower_io import content_to_request, reply_to_content
import strategies.grid_transport as gt
from strategies.grid_transport import GridTransport


@pytest.fixture(autouse=True)
def _identity(monkeypatch):
    monkeypatch.setattr(TaskIdentity, "_run_id", 1)
    monkeypatch.setattr(TaskIdentity, "_node_id", 0)
    monkeypatch.setattr(TaskIdentity, "_task_id", 1)


class FakeGrid:
    """Nodes answer through ``behaviour[node](msg) -> (pulls to wait, reply Message) | None``; every
    pull advances the shared fake clock by ``tick`` seconds (the transport's sleep is patched out)."""

    def __init__(self, behaviour, clock, tick: float = 1.0):
        self.behaviour, self.clock, self.tick = behaviour, clock, tick
        self.pushed: list[Message] = []
        self.queue: list[list] = []                     # [pulls left, reply]
        self.pulls = 0

    def get_node_ids(self):
        return list(self.behaviour)

    def push_messages(self, messages):
        ids = []
        for m in messages:
            m.metadata.__dict__["_message_id"] = f"m{len(self.pushed)}"   # as the SuperLink does
            self.pushed.append(m)
            ids.append(m.metadata.message_id)
            got = self.behaviour[m.metadata.dst_node_id](m)
            if got is not None:
                self.queue.append(list(got))
        return ids

    def pull_messages(self, message_ids):
        self.pulls += 1
        self.clock[0] += self.tick
        ready = [item for item in self.queue if item[0] <= 0 and item[1].metadata.reply_to_message_id in message_ids]
        for item in self.queue:
            item[0] -= 1
        self.queue = [item for item in self.queue if item not in ready]
        return [reply for _, reply in ready]


def transport(behaviour, tick: float = 1.0):
    clock = [0.0]
    grid = FakeGrid(behaviour, clock, tick)
    t = GridTransport(grid, clock=lambda: clock[0], poll_s=0.0)
    return t, grid


def answer(reply: dict, after: int = 0):
    return lambda msg: (after, Message(reply_to_content(reply), reply_to=msg))


METRICS = {"metrics": {"train/loss": 0.5}}


def test_one_message_per_node_of_the_actions_type_and_the_replies_unchecked():
    t, grid = transport({1: answer({"frames": [b"f1"], "metrics": {"m": 1.0}}),
                         2: answer({"frames": [b"f2", b"f3"], "metrics": {}}, after=2)})
    assert t.addresses() == [1, 2]
    out = t.send("generate", {1: {"round": 3, "texts": False}, 2: {"round": 3, "texts": [False, True]}}, timeout=10)
    assert [m.metadata.message_type for m in grid.pushed] == ["query.generate"] * 2
    assert [m.metadata.dst_node_id for m in grid.pushed] == [1, 2]
    assert {m.metadata.group_id for m in grid.pushed} == {"3-generate"}
    assert content_to_request(grid.pushed[1].content) == {"round": 3, "texts": [False, True]}
    assert out[1] == Delivered(1, {"frames": [b"f1"], "metrics": {"m": 1.0}})
    assert out[2] == Delivered(2, {"frames": [b"f2", b"f3"], "metrics": {}})   # two frames: for the boundary
    assert grid.pulls == 3                                                     # until the slowest was in


def test_frames_travel_in_the_batches_record():
    t, grid = transport({5: answer(METRICS)})
    t.send("learn", {5: {"round": 1, "texts": False, "frames": [b"a", b"b"]}}, timeout=5)
    msg = grid.pushed[0]
    assert msg.metadata.message_type == "train"
    assert content_to_request(msg.content)["frames"] == [b"a", b"b"]


def test_error_missing_and_late_replies_are_failures_of_their_node_only():
    def error(msg):
        return 0, Message(Error(code=3, reason="worker raised ValueError"), reply_to=msg)

    t, grid = transport({1: answer(METRICS), 2: error, 3: lambda msg: None, 4: answer(METRICS, after=50)})
    replies = []
    out = t.send("evaluate", {n: {"round": 2} for n in (1, 2, 3, 4)}, timeout=5, on_reply=replies.append)
    assert isinstance(out[1], Delivered) and out[1].content == METRICS
    assert out[2] == Failure("error", "error 3: worker raised ValueError")
    assert out[3].reason == "timeout" and out[4].reason == "timeout"
    assert out[3].detail == "no reply within 5 s"
    assert sorted(replies) == [1, 2]                     # progress: the replies that arrived
    assert grid.pulls == 5                               # the deadline, not the slow node, ended the wait


def test_the_superlinks_reply_for_a_node_whose_heartbeat_lapsed_says_the_node_is_gone():
    """Flower's SuperLink answers a message to a node that stopped heartbeating (a killed SuperNode)
    with error NODE_UNAVAILABLE: that node went away (its participant did not fail), so the engine
    says hello to it again when it is back."""
    def lapsed(msg):
        return 0, Message(Error(code=ErrorCode.NODE_UNAVAILABLE, reason="Error: Node Unavailable"), reply_to=msg)

    t, _ = transport({1: lapsed, 2: answer(METRICS)})
    out = t.send("exchange", {n: {"round": 4, "frames": [], "texts": False} for n in (1, 2)}, timeout=3)
    assert out[1] == Failure("node_unavailable", "error 5: Error: Node Unavailable") and out[1].reason in NODE_GONE
    assert isinstance(out[2], Delivered)


def test_a_reply_to_another_message_is_ignored_and_an_unreadable_one_is_a_failure(monkeypatch):
    stray = Message(RecordDict({"info": ConfigRecord({"x": 1})}), 9, "query.hello")
    stray.metadata.__dict__["_message_id"] = "other"

    def misdirected(msg):
        return 0, Message(RecordDict(), reply_to=stray)            # replies to a message we did not send

    t, _ = transport({1: misdirected, 2: answer(METRICS)})
    out = t.send("learn", {1: {"round": 1, "frames": []}, 2: {"round": 1, "frames": []}}, timeout=3)
    assert out[1].reason == "timeout" and isinstance(out[2], Delivered)

    def broken(content):
        raise KeyError("frames")

    monkeypatch.setattr(gt, "content_to_reply", broken)
    t, _ = transport({1: answer(METRICS)})
    got = t.send("evaluate", {1: {"round": 1}}, timeout=3)[1]
    assert got.reason == "internal_error" and "KeyError" in got.detail


def test_a_failing_progress_callback_does_not_lose_the_reply():
    t, _ = transport({1: answer(METRICS)})

    def boom(node):
        raise RuntimeError("progress line broke")

    assert isinstance(t.send("evaluate", {1: {"round": 1}}, timeout=3, on_reply=boom)[1], Delivered)


# ------------------------------------------------------------------ organisations named, not node ids

def test_wait_lines_and_refusals_name_the_organisation_not_only_the_node_id(tmp_path):
    """#29: Flower's ``NodeInfo`` carries the name a SuperNode key was registered under (``flwr
    supernode register ... --name``) and the key itself; the server names each node by it (or by the
    organisation whose SuperNode key is in its keys-dir), by the participant admitted there, or by
    the participant whose key its hello proved, in the wait line, in every refusal and in the final
    error; never by a name its hello claimed without the key.
    Real light participants answer hello through Flower messages; real keys."""
    from flwr.proto.node_pb2 import NodeInfo
    from cryptography.hazmat.primitives import serialization

    from ftis_fed.bench.swarm import LightParticipant, light_federation
    from ftis_fed.config.federation import FederationConfig
    from ftis_fed.engine.core import AdmissionError, Engine
    from ftis_fed.trust.deploy_keys import generate_supernode_keypair, load_supernode_public_key
    from ftis_fed.trust.signing import generate_keypair, key_paths, load_private_key
    from strategies.grid_transport import supernode_key_names

    parts, keys = light_federation(tmp_path, 1, prefix="alice")                 # alice0000, key known
    generate_keypair("mallory", tmp_path / "rogue")                              # a key nobody has
    mallory = LightParticipant("mallory", load_private_key(key_paths("mallory", tmp_path / "rogue").private),
                               keys, "swarm")
    generate_supernode_keypair("bob", tmp_path / "keys")                         # <keys-dir>/supernode/bob.pub
    bob_pem = load_supernode_public_key(tmp_path / "keys" / "supernode" / "bob.pub").public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)   # as Flower keeps it

    def hello_by(p):
        return lambda msg: (0, Message(reply_to_content(p.handle("hello", content_to_request(msg.content))),
                                       reply_to=msg))

    def cuda_error(msg):
        return 0, Message(Error(code=3, reason="RuntimeError: CUDA requested but this machine has none"), reply_to=msg)

    class Registry(FakeGrid):
        def __init__(self, behaviour, clock, infos):
            super().__init__(behaviour, clock)
            self.infos = infos

        def get_nodes(self):
            return [self.infos[n] for n in self.get_node_ids()]

    infos = {11: NodeInfo(node_id=11, name="alice-lab"), 12: NodeInfo(node_id=12, public_key=bob_pem),
             13: NodeInfo(node_id=13), 14: NodeInfo(node_id=14)}

    def engine(behaviour, min_participants):
        clock, logs = [0.0], []
        grid = Registry(behaviour, clock, infos)
        t = GridTransport(grid, clock=lambda: clock[0], poll_s=0.0, supernode_keys=supernode_key_names(tmp_path / "keys"))
        fed = FederationConfig(num_rounds=1, min_participants=min_participants, run_name="swarm", eval_every=0,
                               output_dir=str(tmp_path / f"out{min_participants}"), wait_for_participants_s=30,
                               progress_every_s=10)
        sleep = lambda s: clock.__setitem__(0, clock[0] + s)                     # noqa: E731 - a fake clock
        return t, Engine(fed, keys, tmp_path / f"out{min_participants}", t, clock=lambda: clock[0], sleep=sleep,
                         plots=False, log=lambda lvl, msg, *a: logs.append(msg % a)), logs

    t, _, _ = engine({11: hello_by(parts["alice0000"]), 12: cuda_error, 13: hello_by(mallory)}, 3)
    assert t.node_names() == {11: "alice-lab", 12: "bob"}                      # registered name; key's organisation

    # one node connected, two needed: the wait line and the final error name it
    _, eng, logs = engine({11: hello_by(parts["alice0000"])}, 2)
    with pytest.raises(AdmissionError, match=r"only 0 admitted of 1 connected \(alice-lab \(node 11\)\)"):
        eng.run()
    waiting = [line for line in logs if line.startswith("waiting for participants:")]
    assert waiting and "1 connected (alice-lab (node 11)), 0 admitted, min-participants=2" in waiting[0]

    # four connected: alice admitted, bob's worker fails, mallory's key is unknown, a second node proves
    # alice's key (a duplicate): every refusal by name
    _, eng, logs = engine({11: hello_by(parts["alice0000"]), 12: cuda_error, 13: hello_by(mallory),
                           14: hello_by(parts["alice0000"])}, 3)
    with pytest.raises(AdmissionError) as err:
        eng.run()
    assert eng.label(11) == "alice0000 (node 11)"                             # admitted: its participant
    assert "bob (node 12) not admitted (error): error 3: RuntimeError: CUDA requested" in "\n".join(logs)
    # an unproven claim does not name a node (the reason says what it claimed)
    assert "node 13 not admitted (unknown_participant): says it is 'mallory'" in "\n".join(logs)
    assert "refused: bob (node 12): error: error 3: RuntimeError: CUDA requested but this machine has none; " \
           "node 13: unknown_participant: says it is 'mallory', which has no public key" in str(err.value)
    assert "; alice0000 (node 14): duplicate_participant: participant 'alice0000' is already connected" in str(err.value)
