"""End to end through the real `flwr run` simulation (tiny models, 3 participants, 2 rounds).

Each run starts its own simulation SuperLink on a free port with a private FLWR_HOME (via
``ftis-fed sim --address``), so nothing leaks between tests or into the user's ~/.flwr.

The default tier runs one simulation (``normal_run``, read by three tests: batches cross and
verify, parameters change, models load once, metrics and plots are written). The slow tier adds
what only real processes show: a worker that dies (restarted, model loaded again) or hangs
(dropped at the round timeout), a pipelined run resumed by a second ``flwr run``, and Flower's
own run status when a plain ``flwr run`` has too few SuperNodes. The engine's side of each (drops,
timeouts, resume, the SuperNode count) is tested in-process in tests/test_engine.py.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from clients.worker import FAULT_ENV

ROOT = Path(__file__).resolve().parent.parent
TINY = {"p0-participant": "alice", "p0-model": "tiny-arith", "p0-adapter": "full", "p0-quant": "none",
        "p1-participant": "bob", "p1-model": "tiny-arith", "p1-adapter": "lora", "p1-quant": "none",
        "p2-participant": "carol", "p2-model": "tiny-llama-b", "p2-adapter": "full", "p2-quant": "none",
        "p3-model": "", "task-families": "add1", "group-size": 4, "prompts-per-round": 8, "max-new-tokens": 6,
        "eval-every": 2, "eval-size": 8, "eval-max-new-tokens": 6, "lr": 0.001}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_sim(tmp: Path, extra: dict, timeout: int = 900, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "FLWR_HOME": str(tmp / "flwr-home"), "FTIS_FED_RUNTIME": str(tmp / "rt"), **(env or {})}
    cfg = {**TINY, "output-dir": str(tmp / "out"), **extra}
    overrides = " ".join(f"{k}={json.dumps(v)}" for k, v in cfg.items())
    cmd = [sys.executable, "-m", "ftis_fed.commands.cli", "sim", "--app", str(ROOT), "--address", f"127.0.0.1:{free_port()}",
           "--run-config", overrides]
    try:
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=tmp)
    finally:
        _kill_leftovers(tmp)


def _kill_leftovers(tmp: Path) -> None:
    """This test's processes only: workers (spec files in its runtime folder) and, if the launcher
    was killed by the timeout, its SuperLink (database in its FLWR_HOME)."""
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if ("clients.worker" in cmd or "flower-superlink" in cmd) and str(tmp) in cmd:
            os.kill(int(d.name), signal.SIGKILL)


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def normal_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("e2e")
    # score-zero-advantage: the per-source diagnostics below count every received sample (by default the
    # micro-batches of equal-reward groups are not scored: tests/test_prefix.py)
    proc = run_sim(tmp, {"num-rounds": 2, "score-zero-advantage": True})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return tmp / "out", proc.stdout + proc.stderr


def test_batches_cross_between_participants_and_verify(normal_run):
    out, log = normal_run
    train = [r for r in rows(out) if r["phase"] == "train"]
    fed = {r["round"]: r for r in train if r["participant"] == "_federation"}
    assert sorted(fed) == [1, 2]
    for rnd in (1, 2):
        assert fed[rnd]["fed/replies"] == 3 and fed[rnd]["fed/frames_verified"] == 3
        assert fed[rnd]["fed/rejected"] == 0 and fed[rnd]["fed/bytes_relayed"] > 0
    people = [r for r in train if r["participant"] != "_federation"]
    assert {r["participant"] for r in people} == {"alice", "bob", "carol"}
    for r in people:
        me = r["participant"]
        peers = {"alice", "bob", "carol"} - {me}
        assert r["offpolicy/received"] == 2 and r["offpolicy/accepted"] == 2       # receivers verified both
        for p in peers:                                                         # and trained on them
            assert r[f"offpolicy/{p}/samples"] == 32
        assert r["train/own_samples"] == 32 and r["train/peer_samples"] == 64 and r["train/unscored_rows"] == 0
        assert abs(r["train/loss"]) < 1e6 and r["train/grad_norm"] == r["train/grad_norm"]  # finite
        assert abs(r[f"offpolicy/{me}/ratio_mean"] - 1.0) < 1e-3                   # own samples on-policy
        assert r["model_weights"].startswith("w-")                               # said with its hello
    assert len({r["model_weights"] for r in people if r["participant"] in ("alice", "bob")}) == 1   # tiny-arith


def test_parameters_changed_and_models_loaded_once(normal_run):
    out, _ = normal_run
    people = [r for r in rows(out) if r["phase"] == "train" and r["participant"] != "_federation"]
    for name in ("alice", "bob", "carol"):
        mine = [r for r in people if r["participant"] == name]
        assert len(mine) == 2
        assert len({r["worker/pid"] for r in mine}) == 1                           # one long-lived process
        assert all(r["worker/model_loads"] == 1 for r in mine)                   # model loaded once per run
        assert any(r["train/grad_norm"] > 0 for r in mine)
    from transformers import AutoModelForCausalLM

    from ftis_fed.policies.models import resolve_model

    base = AutoModelForCausalLM.from_pretrained(resolve_model("tiny-arith")).state_dict()
    saved = torch.load(out / "participants" / "alice" / "policy.pt", weights_only=True)["trainable"]
    assert any(not torch.equal(saved[k], base[k]) for k in saved if k in base)
    lora = torch.load(out / "participants" / "bob" / "policy.pt", weights_only=True)["trainable"]
    assert lora and all("lora_" in k for k in lora)


def test_metrics_and_plots_written(normal_run):
    out, log = normal_run
    for f in ("metrics.jsonl", "metrics.csv", "reward.png", "accuracy.png", "fed.png", "config.json",
              "server_state.json"):
        assert (out / f).stat().st_size > 0, f
    evals = [r for r in rows(out) if r["phase"] == "eval"]
    assert {r["round"] for r in evals} == {0, 2}
    assert all(0.0 <= r["eval/id/accuracy"] <= 1.0 for r in evals)
    assert "round 2/2" in log and "finished:completed" in log
    assert json.loads((out / "server_state.json").read_text())["completed_round"] == 2


@pytest.mark.slow
def test_simulated_churn_runs_the_membership_paths_through_flower(tmp_path):
    """Simulated churn through ``flwr run`` (``p<i>-churn``, ``strategies.churn``): bob arrives at
    round 2 and is absent in round 3, carol is away in round 2; one worker process hosts all three.
    Round 1 runs with alice and carol; at round 2's boundary bob is said hello to and admitted (a late
    joiner) while carol is not listed; at round 3's, carol is said hello to again and admitted as a
    rejoiner (her last trained round 1), and bob, asked, answers both phases with errors: the round
    goes on without him."""
    proc = run_sim(tmp_path, {"num-rounds": 3, "eval-every": 0, "participants-per-worker": 3,
                              "p1-churn": "join=2 absent=3", "p2-churn": "away=2"})
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    every = rows(tmp_path / "out")
    fed = {r["round"]: r for r in every if r["participant"] == "_federation"}
    trained = {rnd: sorted(r["participant"] for r in every if r["round"] == rnd and r["phase"] == "train"
                           and r["participant"] != "_federation") for rnd in (1, 2, 3)}
    assert trained == {1: ["alice", "carol"], 2: ["alice", "bob"], 3: ["alice", "carol"]}
    assert fed[1]["fed/participants"] == 2 and fed[1]["fed/joined"] == 0
    assert fed[2]["fed/joined"] == 1 and fed[2]["fed/rejoined"] == 0 and fed[2]["fed/sampled"] == 2
    assert fed[2]["fed/participants"] == 3                       # carol away, still admitted (not retired)
    assert fed[3]["fed/rejoined"] == 1 and fed[3]["fed/joined"] == 0 and fed[3]["fed/sampled"] == 3
    assert fed[3]["fed/dropped/error"] == 2 and fed[3]["fed/replies"] == 2      # bob's generate and learn
    assert fed[3]["fed/frames_verified"] == 2
    assert "1 late joiner(s) admitted: bob" in log
    assert "1 participant(s) rejoined: carol" in log and "last trained round 1" in log
    assert "simulated churn: participant 'bob' is absent in round 3" in log


@pytest.mark.slow
def test_a_participant_failing_mid_round_does_not_stall_it(tmp_path):
    """carol's worker process dies in phase 2 of round 1: that round finishes with the replies it has,
    the next message starts a new worker (the model loaded again) and the run completes."""
    # a dead worker is an error reply at once; the round timeout only bounds carol's restart (a new
    # process loading its model), which takes seconds idle and can take half a minute on a loaded machine
    proc = run_sim(tmp_path, {"num-rounds": 2, "eval-every": 0, "round-timeout-s": 90.0},
                   env={FAULT_ENV: "carol=exit:learn:1"})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    out = tmp_path / "out"
    fed = {r["round"]: r for r in rows(out) if r["participant"] == "_federation"}
    assert fed[1]["fed/replies"] == 2 and fed[1]["fed/train_failures"] == 1
    assert fed[1]["fed/complete"] == 1.0
    # round 2: carol's worker is restarted by the next message (a new process, the model loaded again)
    assert fed[2]["fed/replies"] == 3
    r2 = {r["participant"]: r for r in rows(out) if r["round"] == 2 and r["participant"] != "_federation"}
    assert r2["alice"]["offpolicy/accepted"] == 2
    assert r2["carol"]["worker/model_loads"] == 2 and r2["alice"]["worker/model_loads"] == 1
    assert "dropped from this phase" in proc.stdout + proc.stderr


@pytest.mark.slow
def test_a_hanging_participant_is_dropped_at_the_round_timeout(tmp_path):
    proc = run_sim(tmp_path, {"num-rounds": 2, "eval-every": 0, "round-timeout-s": 20.0},
                   env={FAULT_ENV: "bob=hang:generate:2"})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    fed = {r["round"]: r for r in rows(tmp_path / "out") if r["participant"] == "_federation"}
    assert fed[1]["fed/replies"] == 3
    assert fed[2]["fed/generate_failures"] == 1 and fed[2]["fed/frames_verified"] == 2
    assert fed[2]["fed/replies"] >= 2 and fed[2]["fed/complete"] == 1.0


@pytest.mark.slow
def test_pipelined_run_resumes_where_the_server_stopped(tmp_path):
    """Pipelined scheme: round 1 trains on own samples only and keeps the verified batches; the run
    stops. A new run with resume=true starts at round 2, relays round 1's saved batches (one round
    old) to every peer, and the participants continue from their checkpoints."""
    base = {"scheme": "pipelined", "eval-every": 0, "run-name": "pipe"}
    first = run_sim(tmp_path, {**base, "num-rounds": 1})
    assert first.returncode == 0, first.stdout[-4000:] + first.stderr[-4000:]
    out = tmp_path / "out"
    state = json.loads((out / "server_state.json").read_text())
    assert state["completed_round"] == 1 and len(state["pending"]) == 3
    r1 = {r["participant"]: r for r in rows(out) if r["round"] == 1 and r["participant"] != "_federation"}
    assert all(r["train/peer_samples"] == 0 and r["train/own_samples"] == 32 for r in r1.values())

    second = run_sim(tmp_path, {**base, "num-rounds": 2, "resume": True})
    assert second.returncode == 0, second.stdout[-4000:] + second.stderr[-4000:]
    log = second.stdout + second.stderr
    assert "continuing at round 2" in log and "round 1/2" not in log
    train = [r for r in rows(out) if r["phase"] == "train"]
    assert sorted(r["round"] for r in train if r["participant"] == "_federation") == [1, 2]   # appended
    fed2 = next(r for r in train if r["round"] == 2 and r["participant"] == "_federation")
    assert fed2["fed/frames_verified"] == 3 and fed2["fed/rejected"] == 0
    for r in (r for r in train if r["round"] == 2 and r["participant"] != "_federation"):
        assert r["offpolicy/received"] == 2 and r["offpolicy/accepted"] == 2     # round 1's, from peers
        assert r["train/peer_samples"] == 64 and r["worker/model_loads"] == 1   # a new run, a new worker
    assert json.loads((out / "server_state.json").read_text())["completed_round"] == 2


@pytest.mark.slow
def test_plain_flwr_run_with_fewer_supernodes_than_participants_stops_with_the_fix(tmp_path):
    """`flwr run` with Flower's default of 2 simulated SuperNodes and 3 declared participants:
    the run must not silently go on with 2; it ends failed, naming the command that fixes it."""
    home, addr = tmp_path / "flwr-home", f"127.0.0.1:{free_port()}"
    home.mkdir()
    (home / "config.toml").write_text(f'[superlink]\ndefault = "t"\n\n[superlink.t]\naddress = "{addr}"\n'
                                      "insecure = true\n")
    bindir = str(Path(sys.executable).parent)
    env = {**os.environ, "FLWR_HOME": str(home), "FTIS_FED_RUNTIME": str(tmp_path / "rt"),
           "PATH": bindir + os.pathsep + os.environ.get("PATH", ""),
           "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1", "FLWR_DISABLE_UPDATE_CHECK": "1"}
    host, port = addr.rsplit(":", 1)
    link = subprocess.Popen([f"{bindir}/flower-superlink", "--insecure", "--simulation", "--host", host, "--port",
                             port, "--database", str(home / "state.db")], cwd=home, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        cfg = {**TINY, "output-dir": str(tmp_path / "out"), "num-rounds": 1, "eval-every": 0}
        items = [a for k, v in cfg.items() for a in ("--run-config", f"{k}={json.dumps(v)}")]
        cmd = [f"{bindir}/flwr", "run", str(ROOT), "t", "--format", "json",
               "--federation-config", "num-supernodes=2", *items]
        for _ in range(60):                                  # the SuperLink needs a moment to listen
            started = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
            if '"run-id"' in started.stdout:
                break
            time.sleep(1)
        run_id = str(json.loads(started.stdout)["run-id"])
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            ls = subprocess.run([f"{bindir}/flwr", "ls", "t", "--run-id", run_id, "--format", "json"], env=env,
                                capture_output=True, text=True, timeout=120, cwd=tmp_path)
            status = json.loads(ls.stdout)["runs"][0]
            if str(status["status"]).startswith("finished"):
                break
            time.sleep(2)
        assert status["status"] == "finished:failed", status
        details = status.get("status-details", "")
        assert "declares 3 participants" in details and "2 SuperNodes" in details, details
        assert 'num-supernodes=3' in details and "ftis-fed sim" in details, details
        assert not (tmp_path / "out" / "metrics.jsonl").exists()              # no round ran
    finally:
        os.killpg(link.pid, signal.SIGKILL)
        _kill_leftovers(tmp_path)
