"""The Flower adapters without a SuperLink: the ClientApp forwarder maps each message type to one
action of ``Participant.handle`` (the worker call is recorded instead of made), and the
request/reply packing round-trips through real Flower records."""

from __future__ import annotations

import pytest
from flwr.app import Context, Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity

import clients.client_app as client_app
from ftis_fed.engine.validation import check_reply
from ftis_fed.actions import action_of, message_type
from ftis_fed.flower_io import content_to_reply, request_to_content

SIM = {"partition-id": 0, "num-partitions": 2}
DEPLOY = {"participant": "alice", "model": "smollm2"}


@pytest.fixture
def worker_calls(monkeypatch):
    monkeypatch.setattr(TaskIdentity, "_run_id", 1)
    monkeypatch.setattr(TaskIdentity, "_node_id", 0)
    monkeypatch.setattr(TaskIdentity, "_task_id", 1)
    calls = []

    def call(conn, action, request, timeout=None, participant=None, node_config=None):
        calls.append((action, request))
        if action == "hello":
            return {"info": {"participant": "alice", "proof": b"sig"}}
        if action in ("generate", "exchange"):
            return {"frames": [b"frame"], "metrics": {"reward/mean": 0.5}}
        return {"metrics": {"train/loss": 0.1}}

    monkeypatch.setattr(client_app, "_worker", lambda ctx: ("conn", 5.0, ("alice", dict(ctx.node_config))))
    monkeypatch.setattr(client_app, "call", call)
    return calls


def deliver(action: str, request: dict, node_config: dict) -> dict:
    msg = Message(request_to_content(request), 7, message_type(action))
    ctx = Context(run_id=1, node_id=7, node_config=node_config, state=RecordDict(), run_config={})
    return content_to_reply(client_app.app(msg, ctx).content)


@pytest.mark.parametrize("action", ["generate", "learn", "exchange", "evaluate"])
def test_every_message_type_reaches_the_participant_as_one_action(worker_calls, action):
    reply = deliver(action, {"round": 3, "texts": False, "frames": [b"a", b"b"]}, SIM)
    assert worker_calls == [(action, {"round": 3, "texts": False, "frames": [b"a", b"b"]})]
    assert action_of(message_type(action)) == action
    check_reply(action, reply)                                           # what the server will accept


def test_hello_reports_the_simulated_supernodes_only_in_a_simulation(worker_calls):
    sim = deliver("hello", {"run": "r", "node": "7", "challenge": b"c" * 32}, SIM)
    assert sim["info"]["supernodes"] == 2 and sim["info"]["proof"] == b"sig"
    assert worker_calls[0] == ("hello", {"run": "r", "node": "7", "challenge": b"c" * 32})
    assert "supernodes" not in deliver("hello", {"run": "r", "node": "7", "challenge": b"c"}, DEPLOY)["info"]


def test_finish_does_not_start_a_worker_to_stop_it(worker_calls, monkeypatch, tmp_path):
    monkeypatch.setenv("FTIS_FED_RUNTIME", str(tmp_path))
    monkeypatch.setattr(client_app, "_worker", lambda ctx: pytest.fail("finish started a worker"))
    reply = deliver("finish", {}, DEPLOY)
    assert reply == {"info": {"stopped": False}} and worker_calls == []


def test_message_types_that_carry_no_action_are_refused():
    with pytest.raises(ValueError):
        action_of("train.unknown")


def test_the_run_config_is_parsed_once_per_process_and_node(worker_calls, monkeypatch, tmp_path):
    """Flower calls the ClientApp for every message; the run config is parsed on the first one only."""
    monkeypatch.setenv("FTIS_FED_RUNTIME", str(tmp_path))
    parses = []
    real = client_app.federation_from_run_config
    monkeypatch.setattr(client_app, "federation_from_run_config", lambda rc: parses.append(1) or real(rc))
    for node in (7, 7, 7, 8):
        msg = Message(request_to_content({}), node, message_type("finish"))
        ctx = Context(run_id=99, node_id=node, node_config=DEPLOY, state=RecordDict(), run_config={})
        assert content_to_reply(client_app.app(msg, ctx).content) == {"info": {"stopped": False}}
    assert len(parses) == 2                                               # node 7 once, node 8 once


def test_the_clientapp_process_imports_no_torch():
    """In deployment Flower starts a ClientApp process for every message; it only forwards to the
    participant's worker, so importing it and resolving the node's participant must not import torch
    (seconds per message on a busy machine)."""
    import subprocess
    import sys
    from pathlib import Path

    code = ("import sys, tomllib\n"
            "import clients.client_app as ca\n"
            "from ftis_fed.config.keys import federation_from_run_config\n"
            "from ftis_fed.config.participants import absolute_paths, participant_spec\n"
            "rc = dict(tomllib.loads(open('pyproject.toml').read())['tool']['flwr']['app']['config'])\n"
            "nc = {'participant': 'alice', 'model': 'tiny-llama', 'keys-dir': 'k', 'state-dir': 's',\n"
            "      'partition-id': 0, 'num-partitions': 2}\n"
            "run_config, node_config = absolute_paths(rc, nc)\n"
            "fed = federation_from_run_config(run_config)\n"
            "ca.worker_payload(run_config, node_config, fed, participant_spec(run_config, node_config, fed), 'r')\n"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n")
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"
