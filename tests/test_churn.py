"""Simulated churn (``churn`` key, ``ftis_fed.config.churn``): the schedule's grammar and its errors,
where it may be set (``p<i>-churn``, a population entry, a draw; not a deployment's node config), the
ClientApp's side (an absent round answered with an error without reaching the worker; the probe
answered from the run config) and ``strategies.churn.ChurnTransport``'s listing per round over a
Grid whose nodes are the real ClientApp. The whole path through ``flwr run`` is
``tests/test_flower_e2e.py::test_simulated_churn_runs_the_membership_paths_through_flower`` (slow)."""

from __future__ import annotations

import json

import pytest
from flwr.app import Context, Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity

import clients.client_app as client_app
from ftis_fed.actions import message_type
from ftis_fed.config.churn import Churn, parse_churn
from ftis_fed.config.keys import federation_from_run_config
from ftis_fed.config.participants import participant_spec
from ftis_fed.config.validation import validate_run_config
from ftis_fed.engine.transport import Delivered, Failure
from ftis_fed.flower_io import request_to_content
from strategies.churn import ChurnTransport
from strategies.grid_transport import GridTransport


def test_a_schedule_says_in_which_rounds_a_node_is_connected_and_answers():
    c = parse_churn("join=3 absent=5,9 away=7-8 leave=12")
    assert [r for r in range(1, 14) if c.connected(r)] == [3, 4, 5, 6, 9, 10, 11]
    assert [r for r in range(1, 14) if c.answers(r)] == [3, 4, 6, 10, 11]
    assert parse_churn("") == Churn() and not Churn().any and c.any
    assert all(Churn().answers(r) for r in range(1, 100))
    assert parse_churn("away=2").connected(3) and not parse_churn("away=2").connected(2)


@pytest.mark.parametrize("text, says", [
    ("join=0", "1 <= a <= b"),
    ("join=2-3", "must be one round"),
    ("late=3", "kind one of join, absent, away, leave"),
    ("away", "expected kind=rounds"),
    ("away=x", "'x' is not a round"),
    ("absent=4-2", "1 <= a <= b"),
    ("join=5 absent=3", "before join=5"),
    ("join=4 leave=4", "leave=4 must come after join=4"),
    ("absent=3-5 away=5-6", "round 5 is both absent"),
    ("away=2 away=3", "given twice"),
    ("away=" + ",".join(map(str, range(1, 70))), "limit 64"),
])
def test_a_bad_schedule_is_refused_naming_the_key(text, says):
    with pytest.raises(ValueError, match="p1-churn") as e:
        parse_churn(text, "p1-churn")
    assert says in str(e.value)


RUN = {"p0-model": "tiny-llama", "p1-model": "tiny-llama", "p1-churn": "join=2 absent=4", "output-dir": "/tmp/x"}


def test_p_i_churn_and_a_population_entry_set_a_participant_schedule():
    fed = federation_from_run_config(RUN)
    assert participant_spec(RUN, {"partition-id": 1, "num-partitions": 2}, fed).schedule == parse_churn("join=2 absent=4")
    assert participant_spec(RUN, {"partition-id": 0, "num-partitions": 2}, fed).churn == ""
    pop = {"participants": [{"name": "a", "count": 2, "model": "tiny-llama", "overrides": {"1": {"churn": "away=3"}}},
                            {"name": "b", "count": 4, "model": "tiny-llama", "draw": {"churn": ["", "join=2"]}}]}
    rc = {"population": json.dumps(pop), "output-dir": "/tmp/x"}
    fed = federation_from_run_config(rc)
    specs = [participant_spec(rc, {"partition-id": i, "num-partitions": 6}, fed) for i in range(6)]
    assert [s.churn for s in specs[:2]] == ["", "away=3"]
    assert {s.churn for s in specs[2:]} <= {"", "join=2"}
    bad = {**RUN, "p1-churn": "join=2 away=1"}
    with pytest.raises(ValueError, match="p1-churn='join=2 away=1'|p1-churn: away=") as e:
        validate_run_config(bad, check_models=False)
    assert "before join=2" in str(e.value)


def test_a_deployment_node_config_refuses_churn():
    fed = federation_from_run_config({"output-dir": "/tmp/x"})
    with pytest.raises(ValueError, match="churn='away=3'.*in a deployment nodes come and go by themselves"):
        participant_spec({}, {"participant": "alice", "model": "tiny-llama", "churn": "away=3"}, fed)


# ----------------------------------------------------------------------------- the ClientApp's side

SIM_RC = {"p0-participant": "alice", "p0-model": "tiny-llama", "p1-participant": "bob", "p1-model": "tiny-llama",
          "p1-churn": "absent=2 away=4", "output-dir": "/tmp/ftis-churn-test"}


@pytest.fixture
def worker_calls(monkeypatch, tmp_path):
    monkeypatch.setenv("FTIS_FED_RUNTIME", str(tmp_path))
    monkeypatch.setattr(TaskIdentity, "_run_id", 1)
    monkeypatch.setattr(TaskIdentity, "_node_id", 0)
    monkeypatch.setattr(TaskIdentity, "_task_id", 1)
    calls = []

    def call(conn, action, request, timeout=None, participant=None, node_config=None):
        calls.append((participant, action, request.get("round")))
        if action == "hello":
            return {"info": {"participant": participant, "proof": b"sig"}}
        return {"frames": [b"frame"], "metrics": {"reward/mean": 0.5}}

    monkeypatch.setattr(client_app, "_worker", lambda ctx: ("conn", 5.0, (client_app._spec(ctx)[3].name, {})))
    monkeypatch.setattr(client_app, "call", call)
    return calls


def context(node: int, pid: int) -> Context:
    return Context(run_id=5, node_id=node, node_config={"partition-id": pid, "num-partitions": 2}, state=RecordDict(),
                   run_config=SIM_RC)


def test_an_absent_round_is_answered_with_an_error_without_reaching_the_worker(worker_calls):
    bob = context(8, 1)
    for rnd in (1, 2, 3):
        reply = client_app.app(Message(request_to_content({"round": rnd, "texts": False}), 8,
                                       message_type("generate")), bob)
        assert reply.has_error() == (rnd == 2)
    assert "simulated churn: participant 'bob' is absent in round 2" in reply_error(bob, 2)
    hello = client_app.app(Message(request_to_content({"run": "r", "node": "8", "challenge": b"c" * 32}), 8,
                                   message_type("hello")), bob)
    assert not hello.has_error()                                          # a hello is always answered
    assert worker_calls == [("bob", "generate", 1), ("bob", "generate", 3), ("bob", "hello", None)]


def reply_error(ctx: Context, rnd: int) -> str:
    rep = client_app.app(Message(request_to_content({"round": rnd, "frames": []}), 8, message_type("learn")), ctx)
    return str(rep.error.reason)


def test_the_probe_names_the_participant_without_a_worker(worker_calls, monkeypatch):
    monkeypatch.setattr(client_app, "_worker", lambda ctx: pytest.fail("the probe started a worker"))
    rep = client_app.app(Message(RecordDict(), 8, "query.churn"), context(8, 1))
    assert rep.content["churn"]["participant"] == "bob" and worker_calls == []


class ClientAppGrid:
    """A Grid whose nodes are the real ClientApp (its worker calls recorded by ``worker_calls``):
    what GridTransport and ChurnTransport push, it answers at once."""

    def __init__(self, nodes: dict[int, int]):
        self.nodes, self.replies, self.pushed = nodes, {}, []

    def get_node_ids(self):
        return list(self.nodes)

    def push_messages(self, msgs):
        ids = []
        for i, m in enumerate(msgs):
            mid = f"m{len(self.replies)}-{i}"
            m.metadata.__dict__["_message_id"] = mid
            self.pushed.append((m.metadata.dst_node_id, m.metadata.message_type))
            rep = client_app.app(m, context(m.metadata.dst_node_id, self.nodes[m.metadata.dst_node_id]))
            rep.metadata.__dict__["_src_node_id"] = m.metadata.dst_node_id
            self.replies[mid] = rep
            ids.append(mid)
        return ids

    def pull_messages(self, ids):
        return [self.replies.pop(i) for i in ids if i in self.replies]


def test_the_churn_transport_lists_a_node_only_in_its_connected_rounds(worker_calls):
    grid = ClientAppGrid({7: 0, 8: 1})
    t = ChurnTransport(GridTransport(grid, poll_s=0.0), {"bob": parse_churn("absent=2 away=4")})
    listed = {}
    for rnd in (1, 2, 3, 4, 5):
        t.at_round(rnd)
        listed[rnd] = t.addresses()
    assert listed == {1: [7, 8], 2: [7, 8], 3: [7, 8], 4: [7], 5: [7, 8]}
    assert [p for p in grid.pushed if p[1] == "query.churn"] == [(7, "query.churn"), (8, "query.churn")]  # once
    t.at_round(4)
    out = t.send("evaluate", {7: {"round": 4}, 8: {"round": 4}}, 5.0)
    assert isinstance(out[7], Delivered) and isinstance(out[8], Failure) and out[8].reason == "node_unavailable"
    t.send("finish", {7: {}, 8: {}}, 5.0)                                 # finish reaches an away node too
    assert (8, "query.finish") in grid.pushed
    t.at_round(2)
    out = t.send("generate", {7: {"round": 2, "texts": False}, 8: {"round": 2, "texts": False}}, 5.0)
    assert isinstance(out[7], Delivered) and out[8].reason == "error" and "absent in round 2" in out[8].detail


def test_the_in_process_transport_refuses_churn_instead_of_ignoring_it(tmp_path):
    from ftis_fed.commands.inprocess import run_inprocess

    rc = {**RUN, "output-dir": str(tmp_path / "out")}
    with pytest.raises(ValueError, match=r"churn \(participants p1\): simulated churn runs through flwr run"):
        run_inprocess(rc)
    assert not (tmp_path / "out" / "keys").exists()                       # refused before anything ran
