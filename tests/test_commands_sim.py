"""`ftis-fed sim` before it runs anything: the whole config checked first (exit 2, one line), the
project's connections merged into $FLWR_HOME/config.toml (the user's kept, read back by Flower's own
reader), and no SuperLink used that the launcher did not start."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import tomllib
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

from ftis_fed.commands import sim as launch

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sim(tmp: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "FLWR_HOME": str(tmp / "flwr-home"), "PYTHONPATH": str(ROOT)}     # this checkout's code
    return subprocess.run([sys.executable, "-m", "ftis_fed.commands.cli", "sim", "--app", str(ROOT), *args], env=env,
                          capture_output=True, text=True, timeout=300, cwd=tmp)


# ----------------------------------------------------------------------------- config checked first

@pytest.mark.parametrize("item,expected", [
    ("num-rounds=-1", "ftis-fed sim: error: num-rounds=-1: must be >= 1"),
    ('p3-model="smollm3"', "ftis-fed sim: error: p3-model='smollm3' (participant smol-bpe8k): unknown model"),
])
def test_a_bad_config_stops_the_launcher_before_anything_starts(tmp_path, item, expected):
    port = free_port()
    proc = sim(tmp_path, "--address", f"127.0.0.1:{port}", "--run-config", item)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(expected), proc.stderr
    assert proc.stdout == ""
    assert not (tmp_path / "flwr-home").exists()                    # nothing written, nothing started
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0


def test_checked_run_config_makes_paths_absolute_and_counts_participants(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model = tmp_path / "models" / "mine"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    from ftis_fed.config.federation import FederationConfig

    parses = []                                               # every FederationConfig made, whoever makes it
    real = FederationConfig.__post_init__
    monkeypatch.setattr(FederationConfig, "__post_init__", lambda self: parses.append(1) or real(self))
    overrides, n, fed = launch.checked_run_config(ROOT, {"output-dir": "out/x", "p1-model": "./models/mine"})
    assert n == 4 and overrides["output-dir"] == str(tmp_path / "out" / "x")
    assert overrides["p1-model"] == str(model)
    assert len(parses) == 1 and fed.output_dir == overrides["output-dir"]     # parsed once; the launcher reuses it
    from ftis_fed.config.validation import models_to_build

    models_to_build(launch.merged_run_config(ROOT, overrides))                # build_first: reads each model only
    assert len(parses) == 1


# ----------------------------------------------------------------------------- $FLWR_HOME/config.toml

USER_CONFIG = """[superlink]
default = "mine"

[superlink.mine]
address = "10.0.0.5:9093"
insecure = true

[superlink.local-sim]
address = "127.0.0.1:1"
"""


def test_merge_keeps_the_users_connections_and_default(tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    (home / "config.toml").write_text(USER_CONFIG)
    dst = launch.merge_flower_config(ROOT, home)
    links = tomllib.loads(dst.read_text())["superlink"]
    ours = tomllib.loads((ROOT / "flower.toml").read_text())["superlink"]
    assert links["default"] == "mine"
    assert links["mine"] == {"address": "10.0.0.5:9093", "insecure": True}
    for name in ("local-sim", "lab", "local-deploy"):
        assert links[name] == ours[name]                              # refreshed from flower.toml
    assert (home / "config.toml.bak").read_text() == USER_CONFIG
    # Flower's own reader sees both, and the SuperNodes the project's connection declares
    from flwr.cli.flower_config import read_superlink_connection

    monkeypatch.setenv("FLWR_HOME", str(home))
    assert read_superlink_connection("mine").address == "10.0.0.5:9093"
    conn = read_superlink_connection("local-sim")
    assert conn.options.num_supernodes == ours["local-sim"]["options"]["num-supernodes"]
    assert conn.options.backend.client_resources.num_cpus == 1
    # a second merge changes nothing
    before = dst.read_text()
    launch.merge_flower_config(ROOT, home)
    assert dst.read_text() == before


def test_merge_into_a_fresh_home_uses_the_projects_default_and_an_address_override(tmp_path):
    dst = launch.merge_flower_config(ROOT, tmp_path / "fresh", "local-sim", "127.0.0.1:4242")
    links = tomllib.loads(dst.read_text())["superlink"]
    assert links["default"] == "local-sim" and links["local-sim"]["address"] == "127.0.0.1:4242"
    assert not (tmp_path / "fresh" / "config.toml.bak").exists()


# ----------------------------------------------------------------------------- SuperLinks

class _Health(BaseHTTPRequestHandler):
    def do_GET(self):                                                # noqa: N802 (http.server API)
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def foreign_superlink():
    """A listener that answers /health like a SuperLink the launcher did not start."""
    server = HTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_a_foreign_superlink_is_refused_unless_asked_for(tmp_path, foreign_superlink):
    with pytest.raises(launch.LaunchError, match=rf"{foreign_superlink}: a SuperLink that ftis-fed did not start"):
        launch.acquire_superlink(foreign_superlink, tmp_path, dict(os.environ))
    assert launch.acquire_superlink(foreign_superlink, tmp_path, dict(os.environ), reuse=True) is None
    assert not (tmp_path / "superlink.log").exists()                # nothing was started


def test_the_cli_refuses_a_foreign_superlink_with_one_line(tmp_path, foreign_superlink):
    proc = sim(tmp_path, "--preset", "quick", "--address", foreign_superlink)
    assert proc.returncode == 2
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and "a SuperLink that ftis-fed did not start" in err[0] and "--reuse-superlink" in err[0]


def test_a_port_held_by_another_program_is_refused(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        address = f"127.0.0.1:{s.getsockname()[1]}"
        with pytest.raises(launch.LaunchError, match="in use by another program"):
            launch.acquire_superlink(address, tmp_path, dict(os.environ))


def test_a_stale_ownership_record_is_not_trusted(tmp_path, foreign_superlink):
    # a record naming a live process that is not a flower-superlink (this test's own pid)
    (tmp_path / launch.OWNER_FILE).write_text(json.dumps({"pid": os.getpid(), "address": foreign_superlink}))
    assert launch.own_superlink(tmp_path, foreign_superlink) is None
    assert not (tmp_path / launch.OWNER_FILE).exists()
    with pytest.raises(launch.LaunchError):
        launch.acquire_superlink(foreign_superlink, tmp_path, dict(os.environ))


def test_a_superlink_the_launcher_started_and_kept_is_reused(tmp_path):
    """A real flower-superlink, started the way `ftis-fed sim` starts it, recorded in FLWR_HOME: the
    next run reuses it (--keep-superlink) instead of refusing it."""
    address = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "FLWR_DISABLE_UPDATE_CHECK": "1",                  # as simulate() sets them
           "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
    proc = launch.acquire_superlink(address, tmp_path, env)
    try:
        assert proc is not None and launch.own_superlink(tmp_path, address) == proc.pid
        assert launch.acquire_superlink(address, tmp_path, env) is None       # reused, not refused
        other = tmp_path / "other-home"
        other.mkdir()
        with pytest.raises(launch.LaunchError, match="did not start"):        # not ours from another FLWR_HOME
            launch.acquire_superlink(address, other, env)
    finally:
        launch.stop(proc)
    assert launch.own_superlink(tmp_path, address) is None                    # stale record dropped


# ----------------------------------------------------------------------------- signals

def _marked(mark: str) -> dict[int, str]:
    """pid -> command line of every process whose environment carries TEST_RUN_MARK=mark."""
    found = {}
    for d in Path("/proc").glob("[0-9]*"):
        try:
            if f"TEST_RUN_MARK={mark}".encode() in (d / "environ").read_bytes().split(b"\0"):
                found[int(d.name)] = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
    return found


def _kill_all(token: str, proc: subprocess.Popen) -> None:
    """A test's clean-up: every process of the launch ``token`` and ``proc`` itself killed."""
    for pid in launch.launched_processes(token):
        with contextlib.suppress(OSError):
            os.kill(pid, 9)
    proc.kill()
    proc.wait()


_SPAWNER = """
import os, signal, time
ending = []
signal.signal(signal.SIGTERM, lambda *_: ending.append(1))   # ends only by SIGKILL, as a stuck raylet,
while True:                                                    # and forks as it is being ended
    if ending and os.fork() == 0:
        time.sleep(120)
        os._exit(0)
    time.sleep(0.005 if ending else 0.05)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_end_launched_also_ends_what_forks_while_the_launch_is_being_ended():
    """A process of the launch that ignores SIGTERM and keeps forking: children it starts between the
    scan that finds it and its SIGKILL carry the token too, and none is left (one SIGKILL pass over one
    scan left some, as CI once saw Ray's DashboardAgent and RuntimeEnvAgent outlive the launcher)."""
    import secrets
    import time

    token = secrets.token_hex(8)
    spawner = subprocess.Popen([sys.executable, "-c", _SPAWNER], env={**os.environ, launch.LAUNCH_ENV: token})
    try:
        deadline = time.monotonic() + 30
        while not launch.launched_processes(token):
            assert time.monotonic() < deadline, "the spawner did not start"
            time.sleep(0.1)
        time.sleep(0.5)                                                    # its handler is installed
        found = launch.end_launched(token, grace_s=0.3, quiet_s=1.0)
        assert spawner.pid in found
        time.sleep(1.0)
        assert launch.launched_processes(token) == []
    finally:
        _kill_all(token, spawner)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_child_whose_environment_no_longer_shows_the_token_is_found_through_its_parent():
    """Ray's agents retitle themselves over their environment (the token unreadable in /proc); CI saw
    their DashboardAgent outlive the launcher. A child started without the token is part of the launch
    through its marked parent, and end_launched ends both."""
    import secrets
    import time

    token = secrets.token_hex(8)
    code = ("import os, subprocess, sys, time; env = {k: v for k, v in os.environ.items() if k != %r}; "
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], env=env); time.sleep(120)"
            % launch.LAUNCH_ENV)
    parent = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, launch.LAUNCH_ENV: token})
    try:
        deadline = time.monotonic() + 30
        while len(launch.launched_processes(token)) < 2:
            assert time.monotonic() < deadline, "the child did not start"
            time.sleep(0.1)
        child = [p for p in launch.launched_processes(token) if p != parent.pid]
        assert len(child) == 1 and b"LAUNCH" not in Path(f"/proc/{child[0]}/environ").read_bytes()
        launch.end_launched(token, grace_s=2.0, quiet_s=0.5)
        parent.wait(timeout=10)
        time.sleep(0.5)
        assert not Path(f"/proc/{child[0]}").exists() or "Z" in Path(f"/proc/{child[0]}/stat").read_text().split(")")[1][:3]
    finally:
        _kill_all(token, parent)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("signame", ["SIGTERM", "SIGHUP", "SIGINT"])
def test_a_signal_to_the_launcher_leaves_no_process_of_the_run_behind(tmp_path, signame):
    """`ftis-fed sim --preset quick`, signalled (to its pid only, as `kill`, a job scheduler or CI
    would) once a model worker runs: it exits with 128 + the signal, and within 30 s no process
    started for the run (SuperLink, SuperExec, simulation, Ray, ClientApps, model workers: all carry
    the test's mark in their environment) is left. Ctrl-C (SIGINT) is the reference."""
    import signal
    import time
    import uuid

    mark = uuid.uuid4().hex
    env = {**os.environ, "FLWR_HOME": str(tmp_path / "flwr-home"), "PYTHONPATH": str(ROOT), "TEST_RUN_MARK": mark}
    log = open(tmp_path / "launcher.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "ftis_fed.commands.cli", "sim", "--app", str(ROOT), "--preset",
                             "quick", "--address", f"127.0.0.1:{free_port()}",
                             "--run-config", f'output-dir="{tmp_path / "out"}" num-rounds=50'],
                            env=env, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path,
                            # as from a terminal: a pytest started in the background (`cmd &` in a script)
                            # passes SIGINT on ignored, and Python then installs no KeyboardInterrupt
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 400
        while not any("clients.worker" in c for c in _marked(mark).values()):
            assert proc.poll() is None, (tmp_path / "launcher.log").read_text()
            assert time.monotonic() < deadline, "no model worker started"
            time.sleep(1)
        before = _marked(mark)
        proc.send_signal(getattr(signal, signame))
        rc = proc.wait(timeout=120)
        text = (tmp_path / "launcher.log").read_text()
        assert rc == 128 + getattr(signal, signame), text
        assert f"[ftis-fed] {signame}: stopping the run and everything this launcher started" in text
        deadline = time.monotonic() + 30
        while _marked(mark) and time.monotonic() < deadline:
            time.sleep(0.5)
        left = _marked(mark)
        assert not left, f"left running ({len(before)} before the signal): {left}"
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in _marked(mark):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)


def test_address_leaves_the_users_flower_configuration_as_it_was(tmp_path):
    """`--address` is the launch's own: `$FLWR_HOME/config.toml` keeps flower.toml's address for
    local-sim (before: rewritten for good, so a later plain `flwr run . local-sim` hit a dead port),
    and the launch's private FLWR_HOME for its `flwr` commands is gone afterwards."""
    home = tmp_path / "flwr-home"
    launch.merge_flower_config(ROOT, home)
    before = (home / "config.toml").read_bytes()
    with socket.socket() as busy:                                 # the launch stops at the SuperLink
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        proc = sim(tmp_path, "--preset", "quick", "--address", f"127.0.0.1:{busy.getsockname()[1]}")
    assert proc.returncode == 2 and "in use by another program" in proc.stderr, proc.stdout + proc.stderr
    assert (home / "config.toml").read_bytes() == before
    assert tomllib.loads(before.decode())["superlink"]["local-sim"]["address"] == "127.0.0.1:39191"
    assert not list((home / launch.LAUNCH_HOMES).glob("*"))
    private = launch.launch_flower_home(ROOT, home, "local-sim", "127.0.0.1:4242", "t")
    assert tomllib.loads((private / "config.toml").read_text())["superlink"]["local-sim"]["address"] == "127.0.0.1:4242"
    assert (home / "config.toml").read_bytes() == before


# ----------------------------------------------------------------------------- models built first

@pytest.mark.slow                       # builds two tiny models into a fresh cache: ~20 s here
def _fresh_cache_run_config(tmp_path, monkeypatch, p0_model: str, p1_model: str) -> dict:
    """A two-participant run config over an empty model cache (FTIS_FED_CACHE in tmp) with SmolLM2
    linked in (the tiny models take its tokenizer)."""
    from ftis_fed.policies.models import resolve_model

    real = Path(resolve_model("smollm2"))
    monkeypatch.setenv("FTIS_FED_CACHE", str(tmp_path / "cache"))
    (tmp_path / "cache" / "models").mkdir(parents=True)
    (tmp_path / "cache" / "models" / "smollm2").symlink_to(real)
    overrides, _, _ = launch.checked_run_config(ROOT, {"p0-model": p0_model, "p1-model": p1_model,
                                                    "p2-model": "", "output-dir": str(tmp_path / "out")})
    return launch.merged_run_config(ROOT, overrides)


def test_the_launcher_builds_and_verifies_missing_models_before_flower_starts(tmp_path, monkeypatch, capsys):
    """In a fresh cache (SmolLM2 linked in: the tiny models take its tokenizer), the models a run
    needs are listed, built with "building …" and the time, verified, and not built again."""
    from ftis_fed.commands.sim import build_models
    from ftis_fed.config.validation import models_to_build

    cfg = _fresh_cache_run_config(tmp_path, monkeypatch, "tiny-llama", "tiny-llama-b")
    assert models_to_build(cfg) == {"tiny-llama": ["smol-full"], "tiny-llama-b": ["smol-lora"]}
    lines: list[str] = []
    built = build_models({"tiny-llama": ["smol-full"]}, say=lines.append, every_s=0.05)
    assert lines[0] == "[ftis-fed] building model tiny-llama (first use, for smol-full; cached for later runs) ..."
    assert any(line.startswith("[ftis-fed] building model tiny-llama: ") for line in lines[1:-1]), lines
    assert lines[-1].startswith("[ftis-fed] built model tiny-llama in ") and Path(built["tiny-llama"]).is_dir()
    launch.build_first(cfg)                                       # what ftis-fed sim does before Flower
    out = capsys.readouterr().out
    assert "[ftis-fed] building model tiny-llama-b (first use, for smol-lora" in out and "tiny-llama " not in out
    assert models_to_build(cfg) == {}
    launch.build_first(cfg)
    assert capsys.readouterr().out == ""


@pytest.mark.slow                       # builds a tiny model into a fresh cache: ~15 s here
def test_under_plain_flwr_run_the_serverapp_builds_before_the_first_hello(tmp_path, monkeypatch):
    """#29 "a worker building its model does not end the run": under plain `flwr run` (no launcher)
    the ServerApp builds the missing offline models before it says hello to anyone, so the hello
    wait (wait-for-participants-s) only covers loading; it says which and names the command; the
    model is then in the cache, so the participants' workers load it instead of building it."""
    from ftis_fed.config.validation import models_to_build
    from strategies.server_app import build_before_hello

    cfg = _fresh_cache_run_config(tmp_path, monkeypatch, "tiny-llama", "smollm2")
    assert models_to_build(cfg) == {"tiny-llama": ["smol-full"]}
    said: list[str] = []
    build_before_hello(cfg, log=lambda level, msg, *a: said.append(msg % a))
    assert said[0].startswith("ftis-fed: model tiny-llama (for smol-full) is not built yet: building it now, before "
                              "the participants are asked") and "`ftis-fed models build tiny-llama`" in said[0]
    assert said[1].startswith("[ftis-fed] building model tiny-llama") and said[-1].startswith("[ftis-fed] built model")
    assert models_to_build(cfg) == {}
    said.clear()
    build_before_hello(cfg, log=lambda level, msg, *a: said.append(msg % a))
    assert said == []                                             # built once


def test_models_build_with_a_preset_lists_the_run_s_missing_models(tmp_path, monkeypatch, capsys):
    """``ftis-fed models build --preset research`` in an empty cache asks to build exactly the preset's
    two micro models, each with the participant using it (the build itself is stubbed: this is the
    command's reading of the run config, which once unpacked the launcher's parse wrongly)."""
    import ftis_fed.commands.sim as sim_mod
    from ftis_fed.commands.cli import main

    monkeypatch.setenv("FTIS_FED_CACHE", str(tmp_path / "cache"))
    asked: list[dict] = []
    monkeypatch.setattr(sim_mod, "build_models", lambda todo, say=None, **kw: asked.append(todo) or {})
    assert main(["models", "build", "--app", str(ROOT), "--preset", "research"]) == 0
    assert asked == [{"micro-llama-s": ["base"], "micro-llama-s-sub": ["spec"]}]
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == {"built": {}}
