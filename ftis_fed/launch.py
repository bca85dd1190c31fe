"""``ftis-fed sim``: run the federation with ``flwr run``, using the connections in ``flower.toml``.

What it does, so the same can be done by hand:

1. ``FLWR_HOME`` = ``<app>/.flwr`` (or ``$FLWR_HOME``); ``flower.toml`` is installed there as
   ``config.toml``, which is where ``flwr`` reads its SuperLink connections.
2. ``FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1``: otherwise every ``flwr run`` would ``uv sync``
   the app's dependencies (torch included) into a fresh environment.
3. For a connection on this machine with ``ftis-managed = true`` (``local-sim``), a simulation
   SuperLink is started on its address (working directory: ``FLWR_HOME``, so the app is imported
   from the FAB) and stopped at the end.
4. ``flwr run <app> <connection> --run-config ... --federation-config "num-supernodes=N
   init-args-num-cpus=N client-resources-num-cpus=1"``: one simulated SuperNode per participant
   (``p<i>-model``), all able to work at once (each runs its model in its own process);
   ``output-dir`` is made absolute against the current directory.
5. The run's log is streamed; the exit status is the run's (``flwr run`` itself exits 0 even when the
   run failed), read with ``flwr ls --run-id``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from urllib.error import URLError
from urllib.request import urlopen

from .config import participant_names


def _flwr_bin(name: str) -> str:
    exe = Path(sys.executable).parent / name
    return str(exe) if exe.exists() else name


def load_flower_toml(app: Path) -> dict:
    path = app / "flower.toml"
    if not path.exists():
        raise FileNotFoundError(f"{path}: the project's SuperLink connections are missing")
    return tomllib.loads(path.read_text())


def install_flower_config(app: Path, home: Path, connection: str | None = None,
                          address: str | None = None) -> Path:
    """Write flower.toml to $FLWR_HOME/config.toml (what `flwr` reads); ``address`` replaces the
    address of ``connection`` (e.g. a free port for tests)."""
    home.mkdir(parents=True, exist_ok=True)
    dst = home / "config.toml"
    if address is None:
        shutil.copyfile(app / "flower.toml", dst)
        return dst
    import tomli_w

    cfg = load_flower_toml(app)
    cfg["superlink"][connection]["address"] = address
    dst.write_text(tomli_w.dumps(cfg))
    return dst


def parse_overrides(items: list[str]) -> dict:
    """`--run-config "a=1 b='x'"` items -> dict, with Flower's own parser."""
    from flwr.common.config import parse_config_args

    return dict(parse_config_args(items)) if items else {}


def run_config_items(overrides: dict) -> list[str]:
    """dict -> ``key=value`` items for ``flwr run --run-config`` (TOML values via tomli_w, so strings
    with backslashes survive; Flower's item parser cannot take a double quote inside a value)."""
    import tomli_w

    items = []
    for k, v in overrides.items():
        if not isinstance(v, (bool, int, float, str)):
            raise ValueError(f"run-config {k}={v!r}: must be a string, number or boolean")
        if isinstance(v, str) and '"' in v:
            raise ValueError(f"run-config {k}={v!r}: double quotes are not supported")
        items.append(f"{k}={tomli_w.dumps({'v': v}).split('=', 1)[1].strip()}")
    return items


def preset_path(app: Path, preset: str) -> Path:
    """``NAME`` -> ``<app>/sims/presets/NAME.toml``; a path to a .toml file is taken as is."""
    path = Path(preset) if preset.endswith(".toml") else app / "sims" / "presets" / f"{preset}.toml"
    if not path.exists():
        names = sorted(p.stem for p in (app / "sims" / "presets").glob("*.toml"))
        raise FileNotFoundError(f"preset {preset!r}: {path} does not exist (presets: {', '.join(names)})")
    return path


def layered_overrides(app: Path, items: list[str], preset: str | None = None) -> dict:
    """A preset, then ``--run-config`` items (key=value strings or .toml files), the later winning;
    every key checked against the app's ``[tool.flwr.app.config]``."""
    known = merged_run_config(app, {})
    layers = [(preset, tomllib.loads(preset_path(app, preset).read_text()))] if preset else []
    layers += [(item, tomllib.loads(Path(item).read_text()) if item.endswith(".toml") else parse_overrides([item]))
               for item in items]
    merged: dict = {}
    for source, layer in layers:
        unknown = [k for k in layer if k not in known]
        if unknown:
            raise ValueError(f"run-config key {unknown[0]!r} (from {source}) is not a key of "
                             "[tool.flwr.app.config]; see docs/configuration.md")
        merged.update(layer)
    return merged


def expand_run_config(app: Path, items: list[str], preset: str | None = None) -> list[str]:
    """``layered_overrides`` as ``key=value`` items for ``flwr run``."""
    return run_config_items(layered_overrides(app, items, preset))


def merged_run_config(app: Path, overrides: dict) -> dict:
    cfg = tomllib.loads((app / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    return {**cfg, **overrides}


def _healthy(address: str) -> bool:
    try:
        with urlopen(f"http://{address}/health", timeout=0.5) as r:
            return r.status == 200
    except (URLError, OSError, ValueError):
        return False


def start_superlink(address: str, home: Path, env: dict) -> subprocess.Popen:
    host, port = address.rsplit(":", 1)
    log = open(home / "superlink.log", "ab")
    proc = subprocess.Popen([_flwr_bin("flower-superlink"), "--insecure", "--simulation", "--host", host,
                             "--port", port, "--database", str(home / "superlink-state.db")],
                            cwd=home, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = (home / "superlink.log").read_text(errors="replace").strip().splitlines()[-6:]
            raise RuntimeError(f"flower-superlink exited with {proc.returncode}; see {home / 'superlink.log'}:\n"
                               + "\n".join(tail))
        if _healthy(address):
            return proc
        time.sleep(0.3)
    stop(proc)
    raise RuntimeError(f"flower-superlink did not become healthy on {address}; see {home / 'superlink.log'}")


def stop(proc: subprocess.Popen | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=20)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        os.killpg(proc.pid, signal.SIGKILL)


def run_status(connection: str, run_id: str, env: dict) -> dict:
    r = subprocess.run([_flwr_bin("flwr"), "ls", connection, "--run-id", run_id, "--format", "json"],
                       env=env, capture_output=True, text=True, timeout=120)
    return json.loads(r.stdout)["runs"][0]


def simulate(app: str | Path = ".", connection: str | None = None, run_config: list[str] | None = None,
             keep_superlink: bool = False, stream: bool = True, address: str | None = None,
             preset: str | None = None) -> int:
    """Run the federation; returns 0 when the run finished:completed."""
    app = Path(app).resolve()
    overrides = layered_overrides(app, list(run_config or []), preset)
    flower = load_flower_toml(app)
    connection = connection or flower["superlink"]["default"]
    conn = flower["superlink"].get(connection)
    if conn is None:
        raise ValueError(f"connection {connection!r} is not in {app / 'flower.toml'}: "
                         f"{sorted(k for k in flower['superlink'] if k != 'default')}")
    if address:
        conn = {**conn, "address": address}
    home = Path(os.environ.get("FLWR_HOME", app / ".flwr")).resolve()
    install_flower_config(app, home, connection, address)
    # the SuperLink starts `flower-superexec` (which starts the apps) by name: our interpreter's
    # bin directory goes first on PATH so `.venv/bin/ftis-fed` works without an activated venv
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    env = {**os.environ, "PATH": path, "FLWR_HOME": str(home), "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
           "FLWR_DISABLE_UPDATE_CHECK": "1",
           "PYTHONUNBUFFERED": "1"}                   # progress lines reach a redirected log as they come
    cfg = merged_run_config(app, overrides)
    out = Path(str(cfg.get("output-dir", "outputs/default"))).resolve()  # relative: to this directory
    overrides["output-dir"] = str(out)
    n = len(participant_names(cfg))
    if n == 0:
        raise ValueError("no participants: set p0-model (and p1-model, ...) in the run config")
    link = None
    if conn.get("ftis-managed") and not _healthy(conn["address"]):
        print(f"[ftis-fed] starting a simulation SuperLink on {conn['address']} (FLWR_HOME={home})", flush=True)
        link = start_superlink(conn["address"], home, env)
    try:
        cmd = [_flwr_bin("flwr"), "run", str(app), connection, "--format", "json",
               "--federation-config", f"num-supernodes={n} init-args-num-cpus={n} client-resources-num-cpus=1"]
        for item in run_config_items(overrides):
            cmd += ["--run-config", item]
        print("[ftis-fed] " + " ".join(cmd), flush=True)
        started = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        try:
            run_id = json.loads(started.stdout)["run-id"]
        except (json.JSONDecodeError, KeyError):
            print(started.stdout + started.stderr, file=sys.stderr)
            return 2
        print(f"[ftis-fed] run {run_id}: {n} participants, results in {out}", flush=True)
        if stream:
            subprocess.run([_flwr_bin("flwr"), "log", run_id, connection, "--stream"], env=env)
        while True:
            status = run_status(connection, run_id, env)
            if str(status.get("status", "")).startswith("finished"):
                break
            time.sleep(2)
        print(f"[ftis-fed] run {run_id}: {status['status']} {status.get('status-details', '')} "
              f"elapsed {float(status.get('elapsed', 0)):.0f} s", flush=True)
        return 0 if status["status"] == "finished:completed" else 1
    finally:
        if not keep_superlink:
            stop(link)


def add_cli(sub) -> None:
    p = sub.add_parser("sim", help="run the federation with flwr run (simulation on this machine)")
    p.add_argument("--app", default=".", help="the Flower app folder (default: .)")
    p.add_argument("--connection", default=None, help="a connection of flower.toml (default: its default)")
    p.add_argument("--preset", default=None,
                   help="a run-config preset: NAME of sims/presets/NAME.toml, or a .toml path")
    p.add_argument("--run-config", action="append", default=[],
                   help='overrides on top of the preset, e.g. "num-rounds=2", or a .toml file')
    p.add_argument("--keep-superlink", action="store_true", help="leave the SuperLink running afterwards")
    p.add_argument("--address", default=None, help="host:port replacing the connection's address")
    p.set_defaults(func=lambda a: simulate(a.app, a.connection, a.run_config, a.keep_superlink,
                                           address=a.address, preset=a.preset))
