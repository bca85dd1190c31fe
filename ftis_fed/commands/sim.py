"""``ftis-fed sim``: run the federation with ``flwr run``, using the connections in ``flower.toml``.

What it does, so the same can be done by hand:

1. The run config (``pyproject.toml`` < ``--preset`` < ``--run-config``) is checked whole before
   anything starts (``ftis_fed.config.federation.validate_run_config``): a bad value, an unknown key or a model
   that cannot be resolved offline ends the command with one line and exit status 2.
2. ``FLWR_HOME`` = ``$FLWR_HOME`` if set, else ``<app>/.flwr``. ``flower.toml``'s connections are
   merged into ``$FLWR_HOME/config.toml`` (where ``flwr`` reads its SuperLink connections): the
   project's connections are added or refreshed; any other connection and the default already set
   there are kept (the file is backed up as ``config.toml.bak`` before it is first rewritten).
3. ``FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1``: otherwise every ``flwr run`` would ``uv sync``
   the app's dependencies (torch included) into a fresh environment.
4. For a connection with ``ftis-managed = true`` (``local-sim``), a simulation SuperLink is started
   on its address (working directory: ``FLWR_HOME``, so the app is imported from the FAB) and stopped
   at the end (``--keep-superlink`` leaves it running; ``$FLWR_HOME/ftis-superlink.json`` records it,
   so the next run reuses it). A SuperLink that ftis-fed did not start on that address (for example
   one that plain ``flwr run`` started) is not used unless ``--reuse-superlink`` says so.
5. ``flwr run <app> <connection> --run-config ... --federation-config "num-supernodes=N
   init-args-num-cpus=W client-resources-num-cpus=1"``: one simulated SuperNode per participant
   (``p<i>-model`` or the ``population``), W = N / ``participants-per-worker`` of them able to work at
   once (one per worker process, which runs its participants' models);
   ``output-dir`` (and a ``p<i>-model`` that is a relative folder, ``task-data``,
   ``task-eval-data`` and file-form ``task-rewards``) is made absolute against the current directory.
6. The run's log is streamed; the exit status is the run's (``flwr run`` itself exits 0 even when the
   run failed), read with ``flwr ls --run-id``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any
from urllib.error import URLError
from urllib.request import urlopen

from ftis_fed.atomic import atomic_write


def _flwr_bin(name: str) -> str:
    exe = Path(sys.executable).parent / name
    return str(exe) if exe.exists() else name


def load_flower_toml(app: Path) -> dict:
    path = app / "flower.toml"
    if not path.exists():
        raise FileNotFoundError(f"{path}: the project's SuperLink connections are missing")
    return tomllib.loads(path.read_text())


class LaunchError(Exception):
    """The launcher refuses to go on (e.g. a SuperLink it did not start holds the address)."""


def merge_flower_config(app: Path, home: Path, connection: str | None = None,
                        address: str | None = None) -> Path:
    """Merge flower.toml's connections into $FLWR_HOME/config.toml (what `flwr` reads): the project's
    connections are added or replaced, every other connection and an existing default are kept.
    ``address`` replaces the address of ``connection`` (e.g. a free port for tests)."""
    import tomli_w

    home.mkdir(parents=True, exist_ok=True)
    dst = home / "config.toml"
    ours = load_flower_toml(app)["superlink"]
    if address is not None:
        ours[connection] = {**ours[connection], "address": address}
    old_text = dst.read_text() if dst.exists() else ""
    try:
        cfg = tomllib.loads(old_text)
    except tomllib.TOMLDecodeError as e:
        raise LaunchError(f"{dst}: not valid TOML ({e}); fix or remove it") from None
    links = cfg.setdefault("superlink", {})
    if not isinstance(links, dict):
        raise LaunchError(f"{dst}: [superlink] is not a table; fix or remove it")
    for name, conn in ours.items():
        if name != "default":
            links[name] = conn
    links.setdefault("default", ours["default"])
    new_text = tomli_w.dumps(cfg)
    if new_text != old_text:
        if old_text and not (home / "config.toml.bak").exists():
            shutil.copyfile(dst, home / "config.toml.bak")
        atomic_write(dst, new_text)
    return dst


def parse_overrides(items: list[str]) -> dict:
    """`--run-config "a=1 b='x'"` items -> dict, with Flower's own parser."""
    from click import ClickException
    from flwr.common.config import parse_config_args

    try:
        return dict(parse_config_args(items)) if items else {}
    except ClickException:
        raise ValueError(f"--run-config {' '.join(items)!r}: not space-separated TOML key=value pairs "
                         '(strings need quotes: p2-model="smollm2")') from None


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
    layers = [(preset, _toml_file(preset_path(app, preset)))] if preset else []
    layers += [(item, _toml_file(Path(item)) if item.endswith(".toml") else parse_overrides([item]))
               for item in items]
    merged: dict = {}
    for source, layer in layers:
        unknown = [k for k in layer if k not in known]
        if unknown:
            from ftis_fed.config.federation import MAX_PARTICIPANTS, PER_PARTICIPANT_KEYS
            from ftis_fed.config.trl_names import trl_hint

            m = re.match(r"^p(\d+)-(.+)$", unknown[0])
            if m and int(m.group(1)) >= MAX_PARTICIPANTS and m.group(2) in PER_PARTICIPANT_KEYS:
                raise ValueError(f"{unknown[0]} (from {source}): at most {MAX_PARTICIPANTS} participants "
                                 f"(p0 ... p{MAX_PARTICIPANTS - 1}; MAX_PARTICIPANTS in ftis_fed/config/federation.py)")
            raise ValueError(f"run-config key {unknown[0]!r} (from {source}) is not a key of "
                             f"[tool.flwr.app.config]{trl_hint(unknown[0])}; see docs/configuration.md")
        merged.update(layer)
    return merged


def _toml_file(path: Path) -> dict:
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{path}: not valid TOML ({e})") from None


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


def _listening(address: str) -> bool:
    """Something accepts TCP connections on ``host:port``."""
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=0.5):
            return True
    except (OSError, ValueError):
        return False


OWNER_FILE = "ftis-superlink.json"


def own_superlink(home: Path, address: str) -> int | None:
    """The pid of the SuperLink ftis-fed started on ``address`` with this FLWR_HOME and left running
    (``--keep-superlink``), if it still runs; a stale record is removed."""
    path = home / OWNER_FILE
    try:
        rec = json.loads(path.read_text())
        pid = int(rec["pid"])
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except (OSError, ValueError, KeyError, TypeError):
        cmd, rec = "", None
    if rec is not None and rec.get("address") == address and "flower-superlink" in cmd:
        return pid
    if rec is not None:
        path.unlink(missing_ok=True)
    return None


def acquire_superlink(address: str, home: Path, env: dict, reuse: bool = False) -> subprocess.Popen | None:
    """A simulation SuperLink on ``address``: the one this launcher started earlier (kept), a foreign
    one only when ``reuse``, else a new one (returned, to be stopped by the caller). Says which."""
    mine = own_superlink(home, address)
    if _healthy(address):
        if mine is not None:
            print(f"[ftis-fed] SuperLink: reusing the one ftis-fed started on {address} (pid {mine}, "
                  f"--keep-superlink; log {home / 'superlink.log'})", flush=True)
            return None
        if reuse:
            print(f"[ftis-fed] SuperLink: using the one already running on {address} (--reuse-superlink; "
                  "not started by ftis-fed)", flush=True)
            return None
        raise LaunchError(f"{address}: a SuperLink that ftis-fed did not start is already running there "
                          "(plain `flwr run` starts one of its own); stop it, pick another address with "
                          "--address HOST:PORT, or pass --reuse-superlink to run on it")
    if _listening(address):
        raise LaunchError(f"{address}: the port is in use by another program (not a SuperLink); "
                          "pick another address with --address HOST:PORT")
    print(f"[ftis-fed] SuperLink: starting a simulation SuperLink on {address} (FLWR_HOME={home}, "
          f"log {home / 'superlink.log'})", flush=True)
    proc = start_superlink(address, home, env)
    (home / OWNER_FILE).write_text(json.dumps({"pid": proc.pid, "address": address}))
    return proc


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


def checked_run_config(app: Path, overrides: dict) -> tuple[dict, int, Any]:
    """``overrides`` with output-dir (and relative p<i>-model folders) made absolute against this
    directory, the number of participants and the parsed run config (the launcher's one parse); the
    whole run config validated first (ValueError, one line). Imports the config dataclasses, nothing
    heavier; builds and loads no model."""
    from ftis_fed.config.federation import MAX_PARTICIPANTS, absolute_paths, participant_names, validate_run_config
    from ftis_fed.engine.schedules import get_schedule

    overrides = dict(overrides)                                  # what the user set (preset, --run-config)
    cfg = merged_run_config(app, overrides)
    overrides["output-dir"] = str(Path(str(cfg.get("output-dir", "outputs/default"))).resolve())
    for i in range(MAX_PARTICIPANTS):
        model = str(cfg.get(f"p{i}-model", ""))
        folder = Path(model).expanduser()
        if ("/" in model or model.startswith((".", "~"))) and not folder.is_absolute() and folder.exists():
            overrides[f"p{i}-model"] = str(folder.resolve())    # the workers run in another directory
    overrides.update(absolute_paths({k: cfg[k] for k in ("task-data", "task-eval-data", "task-rewards")
                                     if cfg.get(k)}, {})[0])    # your own task's files, likewise
    cfg = merged_run_config(app, overrides)
    fed = validate_run_config(cfg, explicit=overrides)
    get_schedule(fed.scheme)                                   # the engine's check of the scheme name, before starting
    return overrides, len(participant_names(cfg)), fed


def gpu_check_at_start(cfg: dict, n: int, problem: str | None) -> None:
    """A machine whose GPUs torch cannot use (``problem``: ``devices.launcher_cuda_problem``) is
    reported in one line at start; when a participant asks for CUDA (``device`` auto or cuda:N) the
    run does not start (ValueError naming its key), since that participant would stop at once."""
    if problem is None:
        return
    print(f"[ftis-fed] CUDA: {problem}", flush=True)
    for i in range(n):
        key = f"p{i}-device" if str(cfg.get(f"p{i}-device", "")).strip() else "device"
        value = str(cfg.get(key, "") or "auto").strip().lower()
        if value != "cpu":
            who = cfg.get(f"p{i}-participant") or f"p{i}"
            raise ValueError(f"{key}={value!r} (participant {who}): {problem}; set {key}='cpu' to run on the CPU")


def simulate(app: str | Path = ".", connection: str | None = None, run_config: list[str] | None = None,
             keep_superlink: bool = False, stream: bool = True, address: str | None = None,
             preset: str | None = None, reuse_superlink: bool = False) -> int:
    """Run the federation; returns 0 when the run finished:completed. Raises ValueError /
    FileNotFoundError (bad configuration) or LaunchError (refused) before anything starts."""
    app = Path(app).resolve()
    overrides = layered_overrides(app, list(run_config or []), preset)
    flower = load_flower_toml(app)
    connection = connection or flower["superlink"]["default"]
    conn = flower["superlink"].get(connection)
    if not isinstance(conn, dict):
        raise ValueError(f"connection {connection!r} is not in {app / 'flower.toml'}: "
                         f"{sorted(k for k in flower['superlink'] if k != 'default')}")
    if address:
        conn = {**conn, "address": address}
    overrides, n, fed = checked_run_config(app, overrides)    # the run config parsed once, here
    per = fed.participants_per_worker
    actors = -(-n // per)                                        # one ClientApp actor per worker process
    out = overrides["output-dir"]
    home = Path(os.environ.get("FLWR_HOME", app / ".flwr")).resolve()
    merged = merge_flower_config(app, home, connection, address)
    print(f"[ftis-fed] FLWR_HOME={home}: flower.toml's connections merged into {merged}", flush=True)
    # the SuperLink starts `flower-superexec` (which starts the apps) by name: our interpreter's
    # bin directory goes first on PATH so `.venv/bin/ftis-fed` works without an activated venv
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    from ftis_fed.policies.devices import launcher_cuda_problem, launcher_env

    # launcher_env records the GPUs visible here (FTIS_FED_VISIBLE_DEVICES) before Ray masks them
    env = launcher_env({**os.environ, "PATH": path, "FLWR_HOME": str(home),
                        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1", "FLWR_DISABLE_UPDATE_CHECK": "1",
                        "PYTHONUNBUFFERED": "1"})     # progress lines reach a redirected log as they come
    gpu_check_at_start(merged_run_config(app, overrides), n, launcher_cuda_problem(env))
    link = None
    if conn.get("ftis-managed"):
        link = acquire_superlink(conn["address"], home, env, reuse_superlink)
    else:
        print(f"[ftis-fed] SuperLink: connection {connection!r} at {conn.get('address')} (not started by ftis-fed)",
              flush=True)
    try:
        cmd = [_flwr_bin("flwr"), "run", str(app), connection, "--format", "json",
               "--federation-config", f"num-supernodes={n} init-args-num-cpus={actors} client-resources-num-cpus=1"]
        for item in run_config_items(overrides):
            cmd += ["--run-config", item]
        print("[ftis-fed] " + " ".join(cmd), flush=True)
        started = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        try:
            run_id = json.loads(started.stdout)["run-id"]
        except (json.JSONDecodeError, KeyError, TypeError):
            print(started.stdout + started.stderr, file=sys.stderr)
            return 2
        if run_id is None:
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
        if link is not None and not keep_superlink:
            stop(link)
            (home / OWNER_FILE).unlink(missing_ok=True)


def simulate_inprocess(app: str | Path = ".", run_config: list[str] | None = None, preset: str | None = None) -> int:
    """The same run config as ``simulate``, run through the in-process transport
    (``ftis_fed.commands.inprocess``: same engine, same participants, no Flower); 0 when every round
    completed."""
    import logging

    from ftis_fed.commands.inprocess import run_inprocess

    if not logging.getLogger().handlers:            # the engine's round lines, as flwr run's log has them
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    app = Path(app).resolve()
    overrides, _, _ = checked_run_config(app, layered_overrides(app, list(run_config or []), preset))
    cfg = merged_run_config(app, overrides)
    print(f"[ftis-fed] in-process run: results in {overrides['output-dir']}", flush=True)
    done = run_inprocess(cfg)
    return 0 if done == int(cfg.get("num-rounds", 0)) else 1


def _sim_cli(a) -> int:
    try:
        if a.transport == "inprocess":
            return simulate_inprocess(a.app, a.run_config, a.preset)
        return simulate(a.app, a.connection, a.run_config, a.keep_superlink, address=a.address, preset=a.preset,
                        reuse_superlink=a.reuse_superlink)
    except (ValueError, FileNotFoundError, LaunchError) as e:
        print(f"ftis-fed sim: error: {e}", file=sys.stderr, flush=True)
        return 2


def add_cli(sub) -> None:
    p = sub.add_parser("sim", help="run the federation with flwr run (simulation on this machine)")
    p.add_argument("--app", default=".", help="the Flower app folder (default: .)")
    p.add_argument("--connection", default=None, help="a connection of flower.toml (default: its default)")
    p.add_argument("--preset", default=None,
                   help="a run-config preset: NAME of sims/presets/NAME.toml, or a .toml path")
    p.add_argument("--run-config", action="append", default=[],
                   help='overrides on top of the preset, e.g. "num-rounds=2", or a .toml file')
    p.add_argument("--keep-superlink", action="store_true",
                   help="leave the SuperLink it started running afterwards (the next run reuses it)")
    p.add_argument("--reuse-superlink", action="store_true",
                   help="run on a SuperLink already listening on the connection's address that ftis-fed did not start")
    p.add_argument("--address", default=None, help="host:port replacing the connection's address")
    p.add_argument("--transport", choices=("flwr", "inprocess"), default="flwr",
                   help="flwr (default: flwr run on a SuperLink) or inprocess (the same engine and participants "
                        "in this process, no Flower: ftis_fed/commands/inprocess.py)")
    p.set_defaults(func=_sim_cli)
