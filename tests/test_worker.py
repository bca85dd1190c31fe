"""The participant worker's fault injection, used by the end-to-end tests only (an environment
variable, not a run-config key): which request of which participant fails, and how."""

from __future__ import annotations

import pytest

from clients.worker import FAULT_ENV, inject_fault


def test_only_the_named_participant_action_and_round_fail():
    env = {FAULT_ENV: "carol=exit:learn:1,bob=raise:generate:2"}
    with pytest.raises(RuntimeError, match="bob: injected fault at generate round 2"):
        inject_fault("bob", "generate", 2, env)
    for who, action, rnd in (("bob", "generate", 1), ("bob", "learn", 2), ("alice", "generate", 2)):
        inject_fault(who, action, rnd, env)                       # nothing happens
    inject_fault("bob", "generate", 2, {})                         # not set: never


def test_a_fault_file_is_read_at_every_request(tmp_path):
    faults = tmp_path / "faults"
    env = {FAULT_ENV: f"@{faults}"}
    inject_fault("bob", "learn", 3, env)                           # no file yet: nothing
    faults.write_text("bob=raise:learn:3\n")
    with pytest.raises(RuntimeError, match="bob: injected fault at learn round 3"):
        inject_fault("bob", "learn", 3, env)
    faults.write_text("")                                          # lifted
    inject_fault("bob", "learn", 3, env)


def test_a_delay_fault_waits_then_lets_the_request_through():
    import time

    t0 = time.monotonic()
    inject_fault("bob", "exchange", 10, {FAULT_ENV: "bob=delay0.2:exchange:10"})    # returns: handled
    assert time.monotonic() - t0 >= 0.2


def test_a_worker_of_another_run_of_the_same_state_dir_is_ended(tmp_path):
    """A resumed run (a new Flower run) ends the interrupted run's worker of the participant's state
    dir, which its SuperNode would otherwise keep alive with its model until worker-idle-timeout-s;
    the run's own worker, and a recorded process that has ended, are left alone."""
    import subprocess
    import sys

    from clients.worker import alive, end_other_run_worker, record_owner

    old = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    try:
        record_owner(tmp_path, "run-1", old.pid)
        assert end_other_run_worker(tmp_path, "run-1") is None and alive(old.pid)    # its own run: kept
        assert end_other_run_worker(tmp_path / "elsewhere", "run-2") is None          # nothing recorded there
        assert end_other_run_worker(tmp_path, "run-2") == (old.pid, "run-1")
        assert old.wait(timeout=10) == -9
        assert end_other_run_worker(tmp_path, "run-2") is None                        # gone (or a reused pid)
    finally:
        if old.poll() is None:
            old.kill()


def test_a_worker_closing_during_the_handshake_counts_as_no_worker(tmp_path, monkeypatch):
    """#31, 256 participants in 8 workers: the first ``finish`` of a worker's 32 ends it; a
    process-mate's ``finish`` that connected meanwhile saw the socket close before the handshake
    (EOFError), which the ClientApp raised as an error reply. No worker there is what it means."""
    import socket
    import threading

    from clients.worker import existing_worker, runtime_dir, worker_id

    monkeypatch.setenv("FTIS_FED_RUNTIME", str(tmp_path / "rt"))
    rt = runtime_dir()
    wid = worker_id("r1", "host0-of-32")
    (rt / f"{wid}.key").write_bytes(b"k" * 32)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(rt / f"{wid}.sock"))
    server.listen(1)

    def close_at_once() -> None:                                  # an exiting worker: accepted, then gone
        conn, _ = server.accept()
        conn.close()

    t = threading.Thread(target=close_at_once, daemon=True)
    t.start()
    assert existing_worker("r1", "host0-of-32") is None
    t.join(5)
    server.close()
