"""The participant worker ends with its run (clients/worker.py): it watches the process that ties it
to the run and exits, with its process group, as soon as that process is gone; a worker that
cannot have its device exits at once with one line saying why."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

from clients.worker import alive, liveness_anchors, process_start

ROOT = Path(__file__).resolve().parent.parent


def test_alive_tells_a_running_process_from_an_ended_or_reused_one():
    me = os.getpid()
    assert alive(me) and alive(me, process_start(me))
    assert not alive(me, "0")                                        # same pid, another start: reused
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    start = process_start(p.pid)
    subprocess.run([sys.executable, "-c", "import time; time.sleep(0.5)"])
    assert not alive(p.pid, start)                                   # exited, not yet reaped: a zombie
    p.wait()
    assert not alive(p.pid, start)


def test_anchors_are_the_simulation_actor_or_the_supernode_side_parent():
    assert liveness_anchors({"partition-id": 0, "num-partitions": 2}) == [[os.getpid(), process_start(os.getpid())]]
    parent = os.getppid()                                            # 1 when this test run was orphaned
    assert liveness_anchors({"participant": "alice"}) == ([[parent, process_start(parent)]] if parent > 1 else [])


def _run_config(tmp: Path, **over) -> dict:
    rc = dict(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"])
    rc.update({"output-dir": str(tmp / "out"), "p0-model": "tiny-llama", "p1-model": "tiny-llama", "p2-model": "",
               "worker-idle-timeout-s": 3600.0, **over})
    return rc


# A stand-in for the ClientApp process (a Ray actor in simulation): starts the participant's
# worker with ensure_worker, says so, and stays until it is killed.
_CLIENTAPP = textwrap.dedent(r"""
    import json, sys, time
    from pathlib import Path
    from clients.client_app import worker_payload
    from clients.worker import WorkerError, call, ensure_worker
    from ftis_fed.config.keys import federation_from_run_config
    from ftis_fed.config.participants import absolute_paths, participant_spec
    given = json.loads(sys.argv[1])
    run_config, node_config = absolute_paths(given["run_config"], given["node_config"])
    fed = federation_from_run_config(run_config)
    spec = participant_spec(run_config, node_config, fed)           # what the ClientApp resolves
    host, payload = worker_payload(run_config, node_config, fed, spec, given["run_key"])
    try:
        conn = ensure_worker("run-1", host, payload, Path(sys.argv[2]), start_timeout=given.get("start_timeout", 600))
    except WorkerError as e:
        print(json.dumps({"error": str(e)}), flush=True)
        sys.exit(0)
    pid = int((Path(sys.argv[3]) / sorted(p.name for p in Path(sys.argv[3]).glob("*.pid"))[0]).read_text())
    print(json.dumps({"worker_pid": pid}), flush=True)
    conn.close()
    time.sleep(3600)
""")


def _clientapp(tmp: Path, run_config: dict, extra_env: dict | None = None, start_timeout: float = 600) -> subprocess.Popen:
    payload = {"run_config": run_config, "node_config": {"partition-id": 0, "num-partitions": 2}, "run_key": "run-1",
               "start_timeout": start_timeout}
    env = {**os.environ, "FTIS_FED_RUNTIME": str(tmp / "rt"), "PYTHONPATH": str(ROOT), **(extra_env or {})}
    return subprocess.Popen([sys.executable, "-c", _CLIENTAPP, json.dumps(payload), str(tmp / "worker.log"),
                             str(tmp / "rt")], env=env, cwd=ROOT, stdout=subprocess.PIPE, text=True)


@pytest.mark.slow                       # a worker loading a tiny model: ~20-40 s on 2 busy cores
def test_a_worker_whose_run_is_gone_exits(tmp_path):
    """The worker's idle timeout is an hour; killing the process that started it (what ending a
    simulation does to its Ray actors) ends the worker within its liveness check, not the hour. It
    runs with the pinned kernels (``store.with_pinned_kernels``) its parent was not started with."""
    from ftis_fed.config.participants import participant_names
    from ftis_fed.trust.signing import generate_keypair

    rc = _run_config(tmp_path)
    generate_keypair(participant_names(rc)[0], tmp_path / "out" / "keys")     # what the ServerApp prepares
    app = _clientapp(tmp_path, rc)
    line = json.loads(app.stdout.readline())
    assert "worker_pid" in line, line
    pid = line["worker_pid"]
    start = process_start(pid)
    assert alive(pid, start)
    # the worker computes with a run's pinned kernels although its parent was started without them
    from ftis_fed.policies.store import PINNED_KERNELS, with_pinned_kernels
    environ = dict(v.split("=", 1) for v in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in v)
    want = with_pinned_kernels(os.environ)
    assert {k: environ.get(k) for k in PINNED_KERNELS} == {k: want.get(k) for k in PINNED_KERNELS}
    app.kill()
    app.wait()
    for _ in range(600):                # an event, not a speed: fails only if the worker stays
        if not alive(pid, start):
            break
        subprocess.run(["sleep", "0.1"])
    log = (tmp_path / "worker.log").read_text()
    assert not alive(pid, start), log[-2000:]
    assert "which ties this worker to its run, has ended: exiting" in log


@pytest.mark.slow                       # two processes importing torch: ~20 s
def test_a_worker_that_cannot_have_its_device_stops_with_one_line(tmp_path):
    from ftis_fed.config.participants import participant_names

    rc = _run_config(tmp_path, **{"p0-device": "cuda:3"})
    app = _clientapp(tmp_path, rc)
    out = json.loads(app.stdout.readline())
    app.wait(timeout=120)
    err = out["error"]
    name = participant_names(rc)[0]
    assert err.startswith(f"participant '{name}': p0-device='cuda:3': names a CUDA device, but no CUDA device is "
                          "visible on this machine (visible CUDA devices: none"), err
    assert "set p0-device='cpu' to run on the CPU" in err
    assert "\n" not in err and "Traceback" not in err


@pytest.mark.slow                       # three processes importing torch: ~30 s
def test_on_a_gpu_machine_torch_cannot_use_the_worker_says_why(tmp_path):
    """A fake nvidia-smi shows two GPUs; this machine's torch cannot use them (a CPU build here; on a
    GPU box with an old driver: the CUDA build's driver requirement): the run's participant stops
    with that one line instead of training on the CPU."""
    from tests.test_devices import fake_smi

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake_smi(bin_dir)
    app = _clientapp(tmp_path, _run_config(tmp_path), {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"})
    out = json.loads(app.stdout.readline())
    app.wait(timeout=300)
    err = out["error"]
    assert "p0-device='auto': this machine has 2 NVIDIA GPUs (NVIDIA H200; driver 550.54.14, CUDA 12.4) but torch" in err
    assert err.endswith(f"set p0-device='cpu' to run on the CPU (worker log {tmp_path / 'worker.log'})")
    assert "\n" not in err


@pytest.mark.slow                       # a worker waiting 60 s on a model build, then loading a tiny model
def test_a_worker_building_its_model_does_not_run_out_its_start_timeout(tmp_path):
    """A model built on first use (here: the build lock held by another builder for 60 s, longer than
    the 40 s start timeout) does not make ensure_worker give up (before: "worker did not start
    within 300 s" ended the run); the worker says it is building and names the command."""
    import fcntl
    import time

    from ftis_fed.config.participants import participant_names
    from ftis_fed.trust.signing import generate_keypair

    cache = tmp_path / "cache"
    (cache / "models").mkdir(parents=True)
    real = Path(os.environ.get("FTIS_FED_CACHE", Path.home() / ".cache" / "ftis-fed"))
    from ftis_fed.policies.models import resolve_model

    resolve_model("smollm2")                                         # tiny-llama takes its tokenizer
    (cache / "models" / "smollm2").symlink_to(real / "models" / "smollm2")
    rc = _run_config(tmp_path)
    generate_keypair(participant_names(rc)[0], tmp_path / "out" / "keys")
    (cache / "locks").mkdir()
    with open(cache / "locks" / "tiny-llama.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)                             # someone else is building it
        t0 = time.monotonic()
        app = _clientapp(tmp_path, rc, {"FTIS_FED_CACHE": str(cache)}, start_timeout=40)
        try:
            marker_seen = False
            while time.monotonic() - t0 < 60:
                marker_seen |= any((tmp_path / "rt").glob("*.building"))
                assert app.poll() is None
                time.sleep(0.5)
            fcntl.flock(lock, fcntl.LOCK_UN)
            line = json.loads(app.stdout.readline())
        finally:
            app.kill()
            app.wait()
    log = (tmp_path / "worker.log").read_text()
    assert "worker_pid" in line, (line, log[-2000:])
    assert marker_seen and "building model tiny-llama (first use; `ftis-fed models build tiny-llama`" in log
    assert (cache / "models" / "tiny-llama" / "config.json").exists()
    pid = line["worker_pid"]
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, 9)


@pytest.mark.slow                       # a worker loading a tiny model: ~20-40 s on 2 busy cores
def test_a_stopped_runs_worker_is_ended_by_deploy_end_worker(tmp_path):
    """Where the SuperLink cannot be asked (clients.run_status), the worker of a stopped run would keep
    its model until worker-idle-timeout-s (an hour here) while its SuperNode (the anchor) lives on:
    `ftis-fed deploy end-worker --state-dir` ends it (and says which), the anchor still alive."""
    from ftis_fed.config.participants import participant_names
    from ftis_fed.trust.signing import generate_keypair

    rc = _run_config(tmp_path)
    generate_keypair(participant_names(rc)[0], tmp_path / "out" / "keys")
    app = _clientapp(tmp_path, rc)
    try:
        line = json.loads(app.stdout.readline())
        assert "worker_pid" in line, line
        pid = line["worker_pid"]
        start = process_start(pid)
        state_dir = next((tmp_path / "out").rglob("worker.json")).parent
        r = subprocess.run([sys.executable, "-m", "ftis_fed.commands.cli", "deploy", "end-worker", "--state-dir",
                            str(state_dir)], capture_output=True, text=True, timeout=120,
                           env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert r.returncode == 0 and r.stdout.strip() == f"ended worker pid {pid} of run run-1", r.stdout + r.stderr
        assert not alive(pid, start) and app.poll() is None
    finally:
        app.kill()
        app.wait()


def test_a_deployment_worker_finds_its_superlink_on_the_supernodes_command_line(tmp_path):
    """Flower 1.42's process tree on a SuperNode host, as real processes: ``flower-supernode
    --superlink ... --root-certificates ...`` starts ``flower-superexec ... --parent-pid <supernode>``
    (its own ``--insecure`` is for the local runtime API), which starts the ClientApp whose parent is
    the worker's anchor. From the anchor the worker finds the SuperNode's SuperLink and CA."""
    from flwr.supercore.constant import SUPERLINK_DEFAULT_CLIENT_ADDRESS

    from clients.run_status import SuperLink, find_superlink

    sleeper = "import sys, time; time.sleep(120)"
    script = tmp_path / "flower-supernode"                    # a program of that name, as the real one
    script.write_text("import subprocess, sys, os, time\n"
                      f"p = subprocess.Popen([sys.executable, '-c', {sleeper!r}, 'flower-superexec', '--insecure', "
                      "'--runtime-api-address', '127.0.0.1:9094', '--parent-pid', str(os.getpid())])\n"
                      "print(p.pid, flush=True)\ntime.sleep(120)\n")
    node = subprocess.Popen([sys.executable, str(script), "--superlink", "203.0.113.7:9093",
                             "--root-certificates=/srv/ftis/certs/ca.crt", "--node-config", "participant='alice'"],
                            stdout=subprocess.PIPE, text=True)
    plain = subprocess.Popen([sys.executable, str(script), "--insecure"], stdout=subprocess.PIPE, text=True)
    try:
        superexec = int(node.stdout.readline())
        assert find_superlink(superexec) == SuperLink("203.0.113.7:9093", "/srv/ftis/certs/ca.crt", False)
        assert find_superlink(int(plain.stdout.readline())) == SuperLink(SUPERLINK_DEFAULT_CLIENT_ADDRESS, None, True)
        assert find_superlink(os.getpid()) is None                 # no SuperNode above (simulation, tests)
    finally:
        for p in (node, plain):
            with contextlib.suppress(Exception):
                os.kill(int(p.pid), 9)
            p.wait()


@pytest.mark.slow                       # a SuperLink over TLS, a SuperNode, a tiny model, `flwr stop`: ~2 min
def test_flwr_stop_ends_the_runs_worker_in_deployment(tmp_path):
    """A real deployment on loopback (TLS, SuperNode authentication): `flwr stop` of the running run
    reaches no worker (Flower revokes the ServerApp's token first) and the SuperNode, the worker's
    anchor, lives on; the idle worker asks the SuperLink, finds the run finished:stopped and ends
    itself, its SuperNode still running."""
    from tests.deploy_helpers import Deployment, make_tls, metrics_rows, wait_for

    with Deployment(tmp_path) as dep:
        make_tls(dep.base / "tls")
        printed = dep.exchange_keys({"alice": "tiny-llama"})
        dep.superlink()
        dep.register(printed["alice"])
        node = dep.participant_node("alice", "tiny-llama", 0, 1)
        out = dep.base / "out"
        run = dep.submit({"num-rounds": 200, "min-participants": 1, "eval-every": 0, "group-size": 2,
                          "prompts-per-round": 1, "max-new-tokens": 4, "task-families": "add1",
                          "keys-dir": str(dep.base / "server-keys"), "output-dir": str(out)})
        wait_for(lambda: any(r.get("round") == 1 for r in metrics_rows(out)), 600, "round 1")
        owner = json.loads((dep.base / "alice" / "state" / "worker.json").read_text())
        pid, start = owner["pid"], owner["start"]
        assert owner["run_key"] == run and alive(pid, start)
        log = dep.base / "alice" / "state" / "worker.log"
        assert f"asks the SuperLink 127.0.0.1:{dep.port} (CA {dep.ca}) for run {run}'s status" in log.read_text()
        stopped = dep.flwr("stop", run, "tls")
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        wait_for(lambda: not alive(pid, start), 120, "the stopped run's worker to end")
        assert f"run {run} is finished:stopped at the SuperLink 127.0.0.1:{dep.port}: exiting" in log.read_text()
        assert node.poll() is None                                # its SuperNode (the anchor) goes on
        assert "cannot ask the SuperLink" not in log.read_text()
