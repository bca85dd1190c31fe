"""``ftis-fed sim``: run the federation with ``flwr run``, using the connections in ``flower.toml``.

Why one module of ~600 lines: the launch is one sequence (check, build models, start or reuse a
SuperLink, run, supervise, clean up on a signal) whose steps share the processes they started; the
steps are functions a reader follows top to bottom, the cleanup in one ``finally``.

What it does, so the same can be done by hand:

1. The run config (``pyproject.toml`` < ``--preset`` < ``--run-config``) is checked whole before
   anything starts (``ftis_fed.config.validation.validate_run_config``): a bad value, an unknown key or a model
   that cannot be resolved offline ends the command with one line and exit status 2.
   Then the device (``gpu_check_at_start``: ``requires-gpu``, ``cuda:N`` without a visible CUDA
   device) and the offline models the run needs (``build_first``: built and verified now, with
   "building …" lines, not inside the participants' hello wait).
2. ``FLWR_HOME`` = ``$FLWR_HOME`` if set, else ``<app>/.flwr``. ``flower.toml``'s connections are
   merged into ``$FLWR_HOME/config.toml`` (where ``flwr`` reads its SuperLink connections): the
   project's connections are added or refreshed; any other connection and the default already set
   there are kept (the file is backed up as ``config.toml.bak`` before it is first rewritten).
   ``--address`` is not written there: this launch's ``flwr`` commands read a private copy
   (``launch_flower_home``).
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
7. Ctrl-C, SIGTERM and SIGHUP end the launch alike (exit 128 + the signal): the SuperLink it started
   is stopped (a foreign one gets ``flwr stop <run>``), then every process still carrying this
   launch's ``FTIS_FED_LAUNCH`` token in its environment is ended (``end_launched``).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from pathlib import Path
from typing import Any
from urllib.error import URLError
from urllib.request import urlopen

from ftis_fed.atomic import atomic_write
from ftis_fed.commands.app_stage import stage_app


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
    ``address`` replaces the address of ``connection`` in the file written (used for the launch's
    private copy, ``launch_flower_home``; never for the user's own file)."""
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


#: Under FLWR_HOME: one folder per launch given --address, the `flwr` CLI's own FLWR_HOME for it.
LAUNCH_HOMES = "ftis-launches"


def launch_flower_home(app: Path, home: Path, connection: str, address: str, token: str) -> Path:
    """A private FLWR_HOME for this launch's ``flwr`` commands (run, log, ls, stop), holding a copy of
    ``home``'s config.toml with ``connection``'s address replaced by ``address``: ``--address``
    changes nothing in the user's ``$FLWR_HOME/config.toml``, so a later plain ``flwr run . local-sim``
    still targets the address flower.toml gives. Removed when the launch ends."""
    private = home / LAUNCH_HOMES / token
    private.mkdir(parents=True, exist_ok=True)
    if (home / "config.toml").exists():
        shutil.copyfile(home / "config.toml", private / "config.toml")
    merge_flower_config(app, private, connection, address)
    return private


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


def check_superlink_address(address: str, home: Path, reuse: bool = False) -> None:
    """Raise LaunchError when ``acquire_superlink`` would refuse ``address`` (a foreign SuperLink
    without ``reuse``, or a port another program holds): ``simulate`` asks before it builds any model,
    so a refusal costs a second, not a model conversion."""
    if _healthy(address):
        if own_superlink(home, address) is None and not reuse:
            raise LaunchError(f"{address}: a SuperLink that ftis-fed did not start is already running there "
                              "(plain `flwr run` starts one of its own); stop it, pick another address with "
                              "--address HOST:PORT, or pass --reuse-superlink to run on it")
    elif _listening(address):
        raise LaunchError(f"{address}: the port is in use by another program (not a SuperLink); "
                          "pick another address with --address HOST:PORT")


def acquire_superlink(address: str, home: Path, env: dict, reuse: bool = False) -> subprocess.Popen | None:
    """A simulation SuperLink on ``address``: the one this launcher started earlier (kept), a foreign
    one only when ``reuse``, else a new one (returned, to be stopped by the caller). Says which."""
    check_superlink_address(address, home, reuse)
    if _healthy(address):
        mine = own_superlink(home, address)
        if mine is not None:
            print(f"[ftis-fed] SuperLink: reusing the one ftis-fed started on {address} (pid {mine}, "
                  f"--keep-superlink; log {home / 'superlink.log'})", flush=True)
        else:
            print(f"[ftis-fed] SuperLink: using the one already running on {address} (--reuse-superlink; "
                  "not started by ftis-fed)", flush=True)
        return None
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


#: In the environment of every process the launcher starts (and so of everything they start: the
#: SuperLink, SuperExec, the simulation process, Ray, the ClientApps, the model workers): a token of
#: this launch, by which it finds and ends what it started, whichever session or process group it is in.
LAUNCH_ENV = "FTIS_FED_LAUNCH"


class Interrupted(KeyboardInterrupt):
    """SIGTERM or SIGHUP, turned into what Ctrl-C raises, so the launcher cleans up the same way."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_interrupted(signum, frame):
    raise Interrupted(signum)


def launched_processes(token: str, proc: str | Path = "/proc") -> list[int]:
    """The pids (not this process) whose environment carries ``LAUNCH_ENV=token`` (Linux ``/proc``;
    processes of other users are unreadable and skipped), and every descendant of theirs: a process
    that rewrites its title over its environment (Ray's agents, ``setproctitle``) no longer shows the
    token in ``/proc/<pid>/environ``, but its parent does."""
    mark = f"{LAUNCH_ENV}={token}".encode()
    found, parent = set(), {}
    for d in Path(proc).glob("[0-9]*"):
        pid = int(d.name)
        if pid == os.getpid():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            parent[pid] = int(_stat_fields(d / "stat")[1])
        try:
            if mark in (d / "environ").read_bytes().split(b"\0"):
                found.add(pid)
        except OSError:
            continue
    grew = True
    while grew:
        new = {pid for pid, ppid in parent.items() if ppid in found and pid not in found}
        found |= new
        grew = bool(new)
    return sorted(found)


def end_launched(token: str, grace_s: float = 10.0, quiet_s: float = 1.0, limit_s: float = 30.0) -> list[int]:
    """SIGTERM every process of this launch still running (``launched_processes``), SIGKILL those left
    after ``grace_s`` (found then or before: an orphan whose title hides the token is found by its
    parent only while the parent lives), and SIGKILL again whatever of the launch appears until none
    has been seen for ``quiet_s`` (at most ``limit_s``): a process forked between a scan and its
    parent's end is ended too. The pids it found."""
    found = set(launched_processes(token))
    for pid in found:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and (left := launched_processes(token)):
        found.update(left)
        if not any(_alive(pid) for pid in found):
            break
        time.sleep(0.2)
    for pid in found:
        if _alive(pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
    quiet_from = time.monotonic()
    give_up = quiet_from + limit_s
    while time.monotonic() - quiet_from < quiet_s and time.monotonic() < give_up:
        left = launched_processes(token)
        if left:
            quiet_from = time.monotonic()
            found.update(left)
            for pid in left:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)
    return sorted(found)


def _stat_fields(stat: Path) -> list[str]:
    """The fields of a ``/proc/<pid>/stat`` file after the command name: state, ppid, ..."""
    return stat.read_text().rsplit(")", 1)[1].split()


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, ended but not yet reaped, does not)."""
    try:
        return _stat_fields(Path(f"/proc/{pid}/stat"))[0] != "Z"
    except (OSError, IndexError):
        return False


def run_status(connection: str, run_id: str, env: dict) -> dict:
    r = subprocess.run([_flwr_bin("flwr"), "ls", connection, "--run-id", run_id, "--format", "json"],
                       env=env, capture_output=True, text=True, timeout=120)
    return json.loads(r.stdout)["runs"][0]


def launch_overrides(app: Path, overrides: dict) -> dict:
    """``overrides`` with output-dir (and relative p<i>-model folders, your own task's files) made
    absolute against this directory, for workers that run in another one. Parses nothing."""
    from ftis_fed.config.federation import MAX_PARTICIPANTS
    from ftis_fed.config.participants import absolute_paths

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
    return overrides


def checked_run_config(app: Path, overrides: dict) -> tuple[dict, int, Any]:
    """``launch_overrides``, the number of participants and the parsed run config (the launcher's one
    parse); the whole run config validated first (ValueError, one line). Imports the config
    dataclasses, nothing heavier; builds and loads no model."""
    from ftis_fed.config.participants import participant_names
    from ftis_fed.config.validation import validate_run_config
    from ftis_fed.engine.schedules import get_schedule

    overrides = launch_overrides(app, overrides)
    cfg = merged_run_config(app, overrides)
    fed = validate_run_config(cfg, explicit=overrides)
    get_schedule(fed.scheme)                                   # the engine's check of the scheme name, before starting
    return overrides, len(participant_names(cfg)), fed


def gpu_check_at_start(cfg: dict, n: int, problem: str | None, cuda_count: int = 0) -> None:
    """The device check before Flower starts. A machine whose GPUs torch cannot use (``problem``:
    ``devices.launcher_cuda``) is reported in one line, and a participant that asks for CUDA
    (``device`` auto or cuda:N) stops the run here (ValueError naming its key), since it would stop
    at once. With no CUDA device visible (``cuda_count`` 0), a participant whose device is ``cuda:N``,
    or ``auto`` in a run that says ``requires-gpu = true`` (the GPU presets), stops it too
    (``devices.no_gpu_refusal``): only ``device = "cpu"`` runs such a participant on the CPU."""
    from ftis_fed.policies.devices import no_gpu_refusal

    if problem is not None:
        print(f"[ftis-fed] CUDA: {problem}", flush=True)
    requires = cfg.get("requires-gpu") is True
    for i in range(n):
        key = f"p{i}-device" if str(cfg.get(f"p{i}-device", "")).strip() else "device"
        value = str(cfg.get(key, "") or "auto").strip().lower()
        who = cfg.get(f"p{i}-participant") or f"p{i}"
        if problem is not None and value != "cpu":
            raise ValueError(f"{key}={value!r} (participant {who}): {problem}; set {key}='cpu' to run on the CPU")
        if problem is None:
            refusal = no_gpu_refusal(value, cuda_count, requires, key)
            if refusal:
                raise ValueError(f"{refusal.split(': ', 1)[0]} (participant {who}): {refusal.split(': ', 1)[1]}")


#: seconds between the "still building" lines
BUILD_PROGRESS_EVERY_S = 15.0


def build_models(todo: dict[str, list[str]], say=print, every_s: float = BUILD_PROGRESS_EVERY_S) -> dict[str, str]:
    """Build each offline model of ``todo`` (name -> the participants using it) into the cache,
    saying so with the time every ``every_s`` seconds, and verify it (its config and tokenizer load
    from the folder); name -> folder. Raises RuntimeError naming the model on a failed build."""
    import threading
    import time

    from ftis_fed.policies.models import load_tokenizer, resolve_model

    done: dict[str, str] = {}
    for name, users in todo.items():
        say(f"[ftis-fed] building model {name} (first use, for {', '.join(users)}; cached for later runs) ...")
        t0, stop = time.monotonic(), threading.Event()

        def beat(name=name, t0=t0, stop=stop) -> None:
            while not stop.wait(every_s):
                say(f"[ftis-fed] building model {name}: {time.monotonic() - t0:.0f} s ...")

        threading.Thread(target=beat, daemon=True).start()
        try:
            path = resolve_model(name)
            from transformers import AutoConfig

            AutoConfig.from_pretrained(path)
            load_tokenizer(path)
        except Exception as e:                               # noqa: BLE001 - one line naming the model
            raise RuntimeError(f"building model {name!r} failed: {type(e).__name__}: {e}") from e
        finally:
            stop.set()
        say(f"[ftis-fed] built model {name} in {time.monotonic() - t0:.0f} s: {path}")
        done[name] = path
    return done


def build_first(cfg: dict) -> None:
    """The offline models the run needs and the cache lacks, built and verified now, before Flower
    starts (``build_models``: "building …" with the time every 15 s), so no
    participant builds one inside the hello wait (``wait-for-participants-s``). A failed build ends
    the launch (ValueError, one line naming the model)."""
    from ftis_fed.config.validation import models_to_build

    todo = models_to_build(cfg)
    if not todo:
        return
    try:
        build_models(todo, say=lambda line: print(line, flush=True))
    except RuntimeError as e:
        raise ValueError(str(e)) from None


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
    # the SuperLink starts `flower-superexec` (which starts the apps) by name: our interpreter's
    # bin directory goes first on PATH so `.venv/bin/ftis-fed` works without an activated venv
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    from ftis_fed.policies.devices import launcher_cuda, launcher_env

    # launcher_env records the GPUs visible here (FTIS_FED_VISIBLE_DEVICES) before Ray masks them
    env = launcher_env({**os.environ, "PATH": path, "FLWR_HOME": str(home),
                        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1", "FLWR_DISABLE_UPDATE_CHECK": "1",
                        "PYTHONUNBUFFERED": "1"})     # progress lines reach a redirected log as they come
    cfg = merged_run_config(app, overrides)                      # the merged items (the parse is ``fed``)
    gpu_check_at_start(cfg, n, *launcher_cuda(env))
    if conn.get("ftis-managed"):                                 # refused before minutes of model builds
        check_superlink_address(conn["address"], home, reuse_superlink)
    build_first(cfg)
    merged = merge_flower_config(app, home, connection)
    print(f"[ftis-fed] FLWR_HOME={home}: flower.toml's connections merged into {merged}", flush=True)
    token = env[LAUNCH_ENV] = f"{os.getpid()}-{secrets.token_hex(8)}"
    cli_env = env
    if address:                                                  # the user's config.toml keeps its address
        cli_env = {**env, "FLWR_HOME": str(launch_flower_home(app, home, connection, address, token))}
    handlers = {}
    if threading.current_thread() is threading.main_thread():   # SIGTERM / SIGHUP end it as Ctrl-C does
        handlers = {sig: signal.signal(sig, _raise_interrupted) for sig in (signal.SIGTERM, signal.SIGHUP)}
    started_link: list = []
    run_ids: list = []
    interrupted = False
    try:
        return _launch(app, connection, conn, n, actors, out, overrides, home, env, cli_env, reuse_superlink,
                       stream, started_link, run_ids)
    except KeyboardInterrupt as e:                               # Ctrl-C, SIGTERM, SIGHUP
        interrupted = True
        signum = e.signum if isinstance(e, Interrupted) else int(signal.SIGINT)
        print(f"\n[ftis-fed] {signal.Signals(signum).name}: stopping the run and everything this launcher "
              "started", file=sys.stderr, flush=True)
        return 128 + signum
    finally:
        if handlers:                                             # a second signal does not cut the cleanup short
            handlers[signal.SIGINT] = signal.getsignal(signal.SIGINT)
            for sig in handlers:
                signal.signal(sig, signal.SIG_IGN)
        link = started_link[0] if started_link else None
        keep = keep_superlink and not interrupted               # an interrupted launch keeps nothing
        try:
            if interrupted and run_ids and link is None:         # a SuperLink it did not start stays up
                with contextlib.suppress(OSError, subprocess.SubprocessError):
                    subprocess.run([_flwr_bin("flwr"), "stop", str(run_ids[0]), connection], env=cli_env,
                                   capture_output=True, timeout=60)
            if link is not None and not keep:
                stop(link)
                (home / OWNER_FILE).unlink(missing_ok=True)
            if not keep:
                left = end_launched(token)
                if left:
                    print(f"[ftis-fed] ended {len(left)} process(es) of this launch still running "
                          f"(pids {', '.join(map(str, sorted(left)))})", file=sys.stderr, flush=True)
        finally:
            if cli_env is not env:
                shutil.rmtree(cli_env["FLWR_HOME"], ignore_errors=True)
            for sig, old_handler in handlers.items():
                signal.signal(sig, old_handler)


def _launch(app: Path, connection: str, conn: dict, n: int, actors: int, out: str, overrides: dict, home: Path,
            env: dict, cli_env: dict, reuse_superlink: bool, stream: bool, started_link: list,
            run_ids: list) -> int:
    """Start (or reuse) the SuperLink (``env``), submit the run, stream its log, return its exit status
    (the ``flwr`` commands with ``cli_env``); what it started goes into ``started_link`` /
    ``run_ids`` as it happens, for ``simulate``'s cleanup."""
    if conn.get("ftis-managed"):
        link = acquire_superlink(conn["address"], home, env, reuse_superlink)
        if link is not None:
            started_link.append(link)
    else:
        print(f"[ftis-fed] SuperLink: connection {connection!r} at {conn.get('address')} (not started by ftis-fed)",
              flush=True)
    cmd = [_flwr_bin("flwr"), "run", str(app), connection, "--format", "json",
           "--federation-config", f"num-supernodes={n} init-args-num-cpus={actors} client-resources-num-cpus=1"]
    for item in run_config_items(overrides):
        cmd += ["--run-config", item]
    print("[ftis-fed] " + " ".join(cmd), flush=True)
    with tempfile.TemporaryDirectory(dir=home, prefix="app-") as stage:     # flwr builds the FAB from it:
        cmd[2] = str(stage_app(app, Path(stage) / "app"))                     # the same bundle, minus a
        started = subprocess.run(cmd, env=cli_env, capture_output=True,       # walk of .venv (app_stage.py)
                                 text=True, timeout=600)
    try:
        run_id = json.loads(started.stdout)["run-id"]
    except (json.JSONDecodeError, KeyError, TypeError):
        print(started.stdout + started.stderr, file=sys.stderr)
        return 2
    if run_id is None:
        print(started.stdout + started.stderr, file=sys.stderr)
        return 2
    run_ids.append(run_id)
    print(f"[ftis-fed] run {run_id}: {n} participants, results in {out}", flush=True)
    if stream:
        subprocess.run([_flwr_bin("flwr"), "log", run_id, connection, "--stream"], env=cli_env)
    while True:
        status = run_status(connection, run_id, cli_env)
        if str(status.get("status", "")).startswith("finished"):
            break
        time.sleep(2)
    print(f"[ftis-fed] run {run_id}: {status['status']} {status.get('status-details', '')} "
          f"elapsed {float(status.get('elapsed', 0)):.0f} s", flush=True)
    return 0 if status["status"] == "finished:completed" else 1


def simulate_inprocess(app: str | Path = ".", run_config: list[str] | None = None, preset: str | None = None) -> int:
    """The same run config as ``simulate``, run through the in-process transport
    (``ftis_fed.commands.inprocess``: same engine, same participants, no Flower); 0 when every round
    completed."""
    import logging

    from ftis_fed.commands.inprocess import run_inprocess

    if not logging.getLogger().handlers:            # the engine's round lines, as flwr run's log has them
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    app = Path(app).resolve()
    overrides = launch_overrides(app, layered_overrides(app, list(run_config or []), preset))
    cfg = merged_run_config(app, overrides)
    print(f"[ftis-fed] in-process run: results in {overrides['output-dir']}", flush=True)
    from ftis_fed.engine.core import RewardFunctionFailed

    try:
        done = run_inprocess(cfg, explicit=overrides)              # validates and parses it, once
    except RewardFunctionFailed as e:               # task-reward-errors = stop: one whole line, exit 1
        print(f"ftis-fed sim: the run failed: {e}", file=sys.stderr, flush=True)
        return 1
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
