"""Deployment faults on loopback, with TLS and SuperNode authentication (``deploy_helpers``): one run
of the federation over 20 rounds (two SuperNodes, tiny models, ``scheme = "pipelined"``: one
message per round), during which

(a) alice's SuperNode **and** her participant worker are killed with SIGKILL while round
    ``KILL_AT`` is in flight at her node (its exchange delivered to the node; the test's fault hook
    ``FTIS_FED_TEST_FAULT`` holds her worker inside it, so the kill is certainly mid-round), then
    restarted with the same key: Flower gives it back the same node id (SuperNode authentication
    binds the id to the key); the server drops her from that round when the SuperLink reports the
    node unavailable, says hello to her again when she is back (``fed/rejoined``) and she continues
    from her saved state (model, optimizer, sequence number, replay guard), trained once per round;
(b) in round ``STOP_AT``, after alice answered it (she trained on it) and while bob's worker is
    still inside it (the same hook delays it 30 s), the SuperLink (with its SuperExec) and the
    ServerApp are killed with SIGKILL, the SuperLink restarted on the same ``--database`` (the
    registered nodes keep their keys and ids; the SuperNodes keep running and reconnect by
    themselves) and the coordinator
    starts a new run with ``resume=true``: it redoes round ``STOP_AT`` (both participants had
    trained on it, bob after the crash: neither is trained again), ends the interrupted run's
    workers and finishes the 20 rounds, completed.

Only external behaviour is asserted: exit statuses, run statuses, ``metrics.jsonl`` rows, the
participants' state files and log lines. Every process started carries the marker of
``deploy_helpers`` and is killed at the end. What each fault loses is written in
docs/security.md, "Deployment faults (tested)".
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
from pathlib import Path

import pytest

from clients.worker import FAULT_ENV, alive, worker_id
from tests.deploy_helpers import Deployment, kill_marked, make_tls, marked, metrics_rows, wait_for

PEOPLE = {"alice": "tiny-llama", "bob": "tiny-llama-b"}
ROUNDS = 20
KILL_AT = 4                     # alice's SuperNode and worker are killed during this round
STOP_AT = 10                    # the SuperLink and ServerApp are killed during this round: after alice
                                # answered it, while bob's worker is still inside it (delayed 30 s)
RUN_CONFIG = {"num-rounds": ROUNDS, "min-participants": 2, "scheme": "pipelined", "eval-every": 0,
              "group-size": 2, "prompts-per-round": 1, "max-new-tokens": 4, "task-families": "add1",
              "lr": 0.001, "round-timeout-s": 300.0, "export-final": False}
FED = "_federation"


def _fed(rows: list[dict]) -> dict[int, dict]:
    return {r["round"]: r for r in rows if r.get("participant") == FED}


def _own(rows: list[dict], name: str) -> dict[int, dict]:
    return {r["round"]: r for r in rows if r.get("participant") == name and r.get("phase") == "train"}


def _delivered(log: str, rnd: int) -> bool:
    """Flower's SuperNode log: round ``rnd``'s exchange message reached the node."""
    at = log.find(f", ROUND {rnd}-exchange]")
    return at >= 0 and "Received successfully" in log[at:]


def _sent(log: str, rnd: int) -> bool:
    """Flower's SuperNode log: the node sent its reply to round ``rnd``'s exchange."""
    for at in (i for i in range(len(log)) if log.startswith(f", ROUND {rnd}-exchange]", i)):
        if "Sending: train.exchange" in log[at:at + 300] and "Sent successfully" in log[at:]:
            return True
    return False


def _saved_round(out: Path) -> int:
    try:
        return int(json.loads((out / "server_state.json").read_text())["completed_round"])
    except (OSError, ValueError, KeyError):
        return 0


@pytest.mark.slow
def test_supernode_kill_and_superlink_restart_with_resume(tmp_path):
    """SIGKILL of a SuperNode and its worker mid-round, then of the SuperLink and the ServerApp; the
    run finishes its 20 rounds with nothing trained twice and no frame refused."""
    with Deployment(tmp_path) as dep:                # every process it started is killed at the end
        _run(dep)


def _run(dep: Deployment) -> None:
    base, out = dep.base, dep.base / "out"
    make_tls(base / "tls")
    printed = dep.exchange_keys(PEOPLE)
    db = base / "link" / "state.db"                 # Flower's state (registered nodes, runs) on disk
    link = dep.superlink(database=db)
    node_id = {n: dep.register(printed[n]) for n in PEOPLE}
    # the test's fault hook (clients.worker.FAULT_ENV), read from a file at every request: alice's
    # worker is held inside round KILL_AT; bob's takes 30 s longer over round STOP_AT (lifted before
    # the resume). (Held for good, bob's worker would block his SuperNode, which handles one message
    # at a time, until the ClientApp gives up after round-timeout-s.)
    faults = {n: base / n / "faults" for n in PEOPLE}
    faults["alice"].write_text(f"alice=hang:exchange:{KILL_AT}")
    faults["bob"].write_text(f"bob=delay30:exchange:{STOP_AT}")
    nodes = {n: dep.participant_node(n, m, i, len(PEOPLE), env={FAULT_ENV: f"@{faults[n]}"})
             for i, (n, m) in enumerate(PEOPLE.items())}
    for n in PEOPLE:
        wait_for(lambda n=n: f"SuperNode ID: {node_id[n]}" in dep.log("supernode", base / n), 120,
                 f"{n}'s SuperNode to connect with its registered node id")
    config = {**RUN_CONFIG, "keys-dir": str(base / "server-keys"), "output-dir": str(out)}
    run1 = dep.submit(config)

    # ---- (a) alice's SuperNode and worker, SIGKILL while round KILL_AT is in flight at her node
    alice_state = base / "alice" / "state"
    wait_for(lambda: _delivered(dep.log("supernode", base / "alice"), KILL_AT), 600,
             f"round {KILL_AT}'s exchange to reach alice's node")
    worker_pid = json.loads((alice_state / "model_loads.jsonl").read_text().splitlines()[-1])["pid"]
    assert alive(worker_pid)
    dep.kill(nodes["alice"])
    with contextlib.suppress(ProcessLookupError):        # (it may already have seen its SuperNode go)
        os.killpg(worker_pid, signal.SIGKILL)
    wait_for(lambda: not alive(worker_pid), 30, "alice's worker to be gone")
    assert KILL_AT not in _own(metrics_rows(out), "alice")
    # restarted with the same key and no fault; a restart before the SuperLink has seen the old node's
    # heartbeat lapse is refused by Flower (the node id is still online), so retry until it connects
    attempts = []
    while True:
        name = f"supernode-{len(attempts) + 2}"
        attempts.append(dep.participant_node("alice", PEOPLE["alice"], 0, len(PEOPLE), log_name=name))
        got = wait_for(lambda: ("up" if f"SuperNode ID: {node_id['alice']}" in dep.log(name, base / "alice")
                                else "refused" if attempts[-1].poll() is not None else None), 180,
                       "alice's restarted SuperNode to connect or be refused")
        if got == "up":
            break
        assert "Failed to activate SuperNode" in dep.log(name, base / "alice"), dep.log(name, base / "alice")[-2000:]
        assert len(attempts) < 3
        wait_for(lambda: dep.nodes().get(node_id["alice"]) == "offline", 180, "alice's old node to be offline")
    refused_restarts = len(attempts) - 1

    # re-admitted (hello) at a round boundary
    rejoin = wait_for(lambda: next((r for r, row in _fed(metrics_rows(out)).items() if row.get("fed/rejoined")), None),
                      600, "alice to be re-admitted")
    assert rejoin < STOP_AT - 1, f"alice re-admitted at round {rejoin}: too late for the SuperLink fault at {STOP_AT}"
    wait_for(lambda: _saved_round(out) >= rejoin + 1, 600, f"round {rejoin + 1}'s state to be saved")
    log1 = dep.flwr("log", run1, "tls", "--show").stdout                  # the ServerApp's log so far

    # ---- (b) SIGKILL the SuperLink and the ServerApp while round STOP_AT is in flight: alice has
    # answered it (trained on it), bob's worker is inside it (it finishes it while the SuperLink is
    # down); restart the SuperLink, resume
    alice_log = f"supernode-{len(attempts) + 1}"
    wait_for(lambda: _saved_round(out) == STOP_AT - 1 and _sent(dep.log(alice_log, base / "alice"), STOP_AT), 600,
             f"alice's reply to round {STOP_AT}")
    bob_worker = int((base / "rt" / f"{worker_id(run1, 'bob')}.pid").read_text())
    dep.kill(link)
    serverapps = kill_marked(str(base), contains="flwr-serverapp")
    kill_marked(str(base), contains=f"--parent-pid {link.pid} ")          # the SuperLink's own SuperExec
    saved = _saved_round(out)
    lines_before = len(metrics_rows(out))
    wait_for(lambda: not any("flwr-serverapp" in c for c in marked(str(base)).values()), 30, "no ServerApp left")
    faults["bob"].write_text("")                                         # bob's SuperNode keeps running
    dep.superlink(name="superlink-2", database=db)
    run1_after = dep.run_status(run1)
    run2 = dep.submit({**config, "resume": True})
    status = dep.wait_finished(run2)
    log2 = dep.flwr("log", run2, "tls", "--show").stdout
    assert status == "finished:completed", log2[-4000:]

    # ---- what survived
    rows = metrics_rows(out)
    fed, fed1, fed2 = _fed(rows), _fed(rows[:lines_before]), _fed(rows[lines_before:])
    assert saved == STOP_AT - 1 and f"resume: round {saved} done, continuing at round {saved + 1}" in log2
    assert sorted(fed2) == list(range(saved + 1, ROUNDS + 1))            # the resumed run: the rest, once each
    assert sorted(fed1) == list(range(1, saved + 1))                     # the interrupted run's, once each
    assert all(fed[r]["fed/rejected"] == 0 for r in fed), "a frame was refused by the server"
    for name in PEOPLE:                                                  # ... or by a receiver
        bad = {r: k for r, row in _own(rows, name).items() for k, v in row.items()
               if k.startswith("offpolicy/rejected/") and v}
        assert not bad, (name, bad)

    # (a): the round in flight is lost for alice, her node dropped when Flower reported it unavailable
    assert fed[KILL_AT]["fed/replies"] == 1 and fed[KILL_AT]["fed/dropped/node_unavailable"] == 1
    alice, bob = _own(rows, "alice"), _own(rows, "bob")
    assert KILL_AT not in alice and set(range(KILL_AT, rejoin)).isdisjoint(alice)
    assert sorted(bob) == list(range(1, ROUNDS + 1))
    assert fed[rejoin]["fed/rejoined"] == 1 and sum(fed[r].get("fed/rejoined", 0) for r in fed) == 1
    assert re.search(rf"participant\(s\) rejoined: alice \(node {node_id['alice']}, last trained round {KILL_AT - 1}\)",
                     log1), log1[-4000:]
    after = [alice[r] for r in range(rejoin, saved + 1)]
    assert all(r["worker/model_loads"] == 2 and r["worker/pid"] != worker_pid for r in after)   # a new process
    assert f"SuperNode ID: {node_id['alice']}" in dep.log(f"supernode-{len(attempts) + 1}", base / "alice")

    # no round trained twice, the model and optimizer continued: each participant's optimizer step
    # count (saved with its checkpoint) is the number of rounds it trained (rows that trained, plus
    # rows of a round it had trained before a fault: train/already_trained)
    for name, own in (("alice", alice), ("bob", bob)):
        trained = {r for r, row in own.items() if "train/own_samples" in row or row.get("train/already_trained")}
        assert own[ROUNDS]["train/steps"] == len(trained), (name, own[ROUNDS]["train/steps"], sorted(trained))
        state = json.loads((base / name / "state" / "participant.json").read_text())
        assert state["completed_round"] == ROUNDS and state["seq"] >= ROUNDS << 16
    assert set(alice) == set(range(1, KILL_AT)) | set(range(rejoin, ROUNDS + 1))

    # (b): the round in flight is redone; both had trained it (bob after the crash), neither is
    # trained again; each signs its batch anew (a new sequence number), accepted in the next round
    for own in (alice, bob):
        assert own[STOP_AT].get("train/already_trained") == 1 and "train/own_samples" not in own[STOP_AT]
        assert own[STOP_AT + 1]["offpolicy/accepted"] == 1
    assert all(alice[r]["worker/model_loads"] == 1 for r in range(STOP_AT + 1, ROUNDS + 1))  # the new run's worker
    # the interrupted Flower run is not completed
    assert run1_after != "finished:completed" and dep.run_status(run1) != "finished:completed"
    assert not alive(bob_worker)                          # bob's worker of the interrupted run
    for n in PEOPLE:            # the interrupted run's workers, ended when the resumed run's started
        assert not alive(int((base / "rt" / f"{worker_id(run1, n)}.pid").read_text()))
        wlog = (base / n / "state" / "worker.log").read_text()      # (or by themselves, had the restarted
        assert (f"this state dir's worker of run {run1}: run {run2} starts" in wlog     # SuperLink already
                or f"run {run1} is finished:failed at the SuperLink" in wlog), n        # failed run1)
    print(f"[faults] rounds 1-{ROUNDS}; alice killed in round {KILL_AT} ({refused_restarts} restart(s) refused "
          f"before the old node went offline), re-admitted at round {rejoin}; SuperLink + ServerApp "
          f"({len(serverapps)} process(es)) killed after round {saved}'s state; interrupted run {run1}: "
          f"{run1_after!r} at the restart, {dep.run_status(run1)!r} at the end; resumed run {run2}: {status}; "
          f"round {STOP_AT} redone")
