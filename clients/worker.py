"""The long-lived participant process: one per (run, participant), model loaded once.

Why ~590 lines: the server loop, its lifetime rules (idle time-out, parent gone, a newer run of the
same state dir, a run the SuperLink finished) and the client side that starts and reaches it must change together.

Flower starts a new ClientApp process for every message in deployment (and runs ClientApps in
shared Ray actors in simulation), so the model cannot live in the ClientApp. The ClientApp calls
``ensure_worker`` which connects to this participant's worker over a Unix socket in a private
runtime folder, starting it (detached) on first use; a request is ``{action, request}`` and is
forwarded to the one entry point ``Participant.handle(action, request)`` (frames as bytes). The
worker exits after answering ``finish`` (sent at the end of the run), after
``worker-idle-timeout-s`` without requests, when a worker of another run starts for its state dir
(``end_other_run_worker``: a resumed run), or when its state is unrecoverable; and within a
second of the process that anchors it to the run ending (``anchors``): in simulation the Ray actor
that started it, which lives exactly as long as the simulation (``flwr stop`` or a killed ServerApp
end it); in deployment the SuperNode-side process that started the ClientApp, which outlives runs,
so there an idle worker also asks the SuperLink whether its run goes on and ends itself once it is
finished (``flwr stop``, a ServerApp ended by a signal, a failed run: ``clients.run_status``). It then takes its
process group with it (vLLM's engine processes included), so no GPU memory is left behind.

A worker that cannot have the device its participant asked for (``devices.worker_device``: e.g. a
GPU machine whose GPUs torch cannot use) exits with one line saying why, which ``ensure_worker``
raises as the error of the ClientApp (and so the reason the server gives for refusing the node).

    python -m clients.worker --spec <json>     # normally started by ensure_worker
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import queue
import secrets
import signal
import subprocess
import sys
import threading
import time
import traceback
from multiprocessing.connection import Client, Listener
from pathlib import Path
from typing import Any, Mapping

from ftis_fed.metrics.writer import phase_summary

from ftis_fed.policies.devices import (CUDA_ENV, FROM_ENV, VISIBLE_ENV, DeviceError, count_visible, lock_folder,
                                       start_environment, worker_device, worker_env)
from ftis_fed.policies.store import with_pinned_kernels

#: Prefix of the line a worker prints before exiting because it cannot start (ensure_worker reads it).
START_ERROR = "FTIS_FED_WORKER_START_ERROR: "
#: How often the worker checks that its anchors are alive (seconds).
LIVENESS_EVERY_S = 0.5
#: While a worker builds its offline model (first use), it touches ``<wid>.building`` this often;
#: ``ensure_worker`` does not count that time against its start timeout while the file is fresh.
BUILDING_BEAT_S = 2.0
BUILDING_FRESH_S = 20.0

def runtime_dir() -> Path:
    """Private (0700) folder for sockets and auth keys (``FTIS_FED_RUNTIME``; the card locks live there too)."""
    return lock_folder()


# ----------------------------------------------------------------------------- the run's liveness

def process_start(pid: int) -> str | None:
    """An id of the process ``pid``'s start (its start time in ``/proc/<pid>/stat``), so a reused pid
    is not mistaken for it; None where unknown (not Linux, or no such process)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rpartition(")")[2].split()[19]


def alive(pid: int, start: str | None = None) -> bool:
    """Whether process ``pid`` (started at ``start``, from ``process_start``) still runs; a zombie
    (exited, not yet reaped) or a reused pid is not alive."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return not sys.platform.startswith("linux")
    fields = stat.rpartition(")")[2].split()
    return fields[0] not in ("Z", "X") and (start is None or fields[19] == start)


def liveness_anchors(node_config: dict[str, Any]) -> list[list]:
    """The processes whose end means the run is over for this participant, as [pid, start] pairs:
    in simulation (no ``participant`` in the node config) this process, a Ray actor that lives as
    long as the simulation; in deployment, where Flower starts a ClientApp process per message,
    its parent (the SuperNode's SuperExec, or the SuperNode)."""
    pid = os.getpid() if "participant" not in node_config else os.getppid()
    return [[pid, process_start(pid)]] if pid > 1 else []


def end_process_group(code: int = 0) -> None:
    """Exit now, taking the process group along when this process leads it (a worker started with
    ``start_new_session``: vLLM's engine processes are in it), so nothing keeps its GPU memory."""
    sys.stdout.flush()
    if os.getpgrp() == os.getpid():
        os.killpg(os.getpid(), signal.SIGKILL)
    os._exit(code)


def worker_id(run_key: str, participant: str) -> str:
    return hashlib.sha256(f"{run_key}\0{participant}".encode()).hexdigest()[:20]


#: Fault injection for the end-to-end tests only (no run-config key; never set in a run):
#: ``<participant>=<raise|exit|hang|delay<seconds>>:<action>:<round>``, comma-separated, or
#: ``@<file>`` holding that (read at every request, so a test can lift a fault while the worker's
#: SuperNode keeps running). A worker serving that participant then raises, exits (as a crash
#: would), hangs, or waits that many seconds and then handles it, when that request arrives.
FAULT_ENV = "FTIS_FED_TEST_FAULT"


def inject_fault(participant: str, action: str, round: int, env: Mapping[str, str] = os.environ) -> None:
    spec = env.get(FAULT_ENV, "")
    if spec.startswith("@"):
        try:
            spec = Path(spec[1:]).read_text()
        except OSError:
            spec = ""
    for item in filter(None, (part.strip() for part in spec.split(","))):
        who, _, what = item.partition("=")
        kind, at_action, at_round = what.split(":")
        if who == participant and at_action == action and int(at_round) == round:
            if kind == "exit":
                os._exit(3)
            if kind == "hang":
                time.sleep(1e6)
            if kind.startswith("delay"):
                time.sleep(float(kind[len("delay"):]))
                continue
            raise RuntimeError(f"{participant}: injected fault at {action} round {round} ({FAULT_ENV})")


#: In a participant's state dir: the worker serving it ({run_key, pid, start}), written when one starts.
OWNER_FILE = "worker.json"


def record_owner(state_dir: str | Path, run_key: str, pid: int) -> None:
    """Note in ``state_dir`` that worker ``pid`` serves it for run ``run_key``."""
    Path(state_dir).mkdir(parents=True, exist_ok=True)
    tmp = Path(state_dir) / f".{OWNER_FILE}.{os.getpid()}"
    tmp.write_text(json.dumps({"run_key": run_key, "pid": pid, "start": process_start(pid)}))
    os.replace(tmp, Path(state_dir) / OWNER_FILE)


def end_other_run_worker(state_dir: str | Path, run_key: str | None, wait_s: float = 10.0) -> tuple[int, str] | None:
    """End (SIGKILL, with its process group) the worker ``state_dir`` records for *another* run, if it
    still runs; (its pid, its run key), or None. A new run of the participant in this state dir (a
    ``resume`` after the SuperLink or ServerApp went down) means that run is over for it; in
    deployment its worker would otherwise live on (its SuperNode, which anchors it, outlives the
    run) with its model and device memory, until ``worker-idle-timeout-s``. ``run_key`` None: the
    worker of whatever run (``ftis-fed deploy end-worker``: a stopped run that will not resume)."""
    try:
        rec = json.loads((Path(state_dir) / OWNER_FILE).read_text())
        pid, start, key = int(rec["pid"]), rec.get("start"), str(rec["run_key"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if (run_key is not None and key == run_key) or pid <= 1 or pid == os.getpid() or not alive(pid, start):
        return None
    try:
        os.killpg(pid, signal.SIGKILL)                      # a worker leads its process group
    except (ProcessLookupError, PermissionError):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + wait_s
    while alive(pid, start) and time.monotonic() < deadline:
        time.sleep(0.05)
    return pid, key


class WorkerError(RuntimeError):
    """The worker raised while handling a request (its traceback is in the message)."""


def _connect(sock: Path, authkey: bytes, timeout: float = 2.0):
    """Connect, or None when nobody listens there, or the worker closed the connection before the
    handshake was done (EOFError: it is exiting, e.g. a process-mate's ``finish`` ended it while
    this node's ``finish`` connected)."""
    if not sock.exists():
        return None
    try:
        return Client(str(sock), family="AF_UNIX", authkey=authkey)
    except (ConnectionRefusedError, FileNotFoundError, OSError, EOFError):
        return None


def existing_worker(run_key: str, participant: str):
    """A connection to the participant's running worker, or None (never starts one)."""
    rt = runtime_dir()
    wid = worker_id(run_key, participant)
    keyfile = rt / f"{wid}.key"
    return _connect(rt / f"{wid}.sock", keyfile.read_bytes()) if keyfile.exists() else None


def ensure_worker(run_key: str, participant: str, payload: dict[str, Any], log_path: Path,
                  start_timeout: float = 1800.0):
    """A connection to the participant's worker, starting it when none runs.

    payload: what the worker needs to build its Participant (run config, node config, the resolved
    participant spec as ``to_jsonable`` writes it, run key).
    Concurrent callers are serialised by a lock file, so a participant is started once.
    """
    rt = runtime_dir()
    wid = worker_id(run_key, participant)
    sock, keyfile, lockfile = rt / f"{wid}.sock", rt / f"{wid}.key", rt / f"{wid}.lock"
    with open(lockfile, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if keyfile.exists():
            conn = _connect(sock, keyfile.read_bytes())
            if conn is not None:
                return conn
        keyfile.write_bytes(secrets.token_bytes(32))
        os.chmod(keyfile, 0o600)
        with contextlib.suppress(FileNotFoundError):
            sock.unlink()
        spec_path = rt / f"{wid}.json"
        spec_path.touch(mode=0o600)
        os.chmod(spec_path, 0o600)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        payload = {**payload, "anchors": liveness_anchors(payload.get("node_config", {}))}
        spec_path.write_text(json.dumps({**payload, "socket": str(sock), "keyfile": str(keyfile)}))
        # the launcher's GPUs, not Ray's mask (under a plain `flwr run`: this Ray actor's start environment)
        env = worker_env(os.environ, start_environment() if "ray" in sys.modules else None)
        env = with_pinned_kernels(env)           # the kernels a run pins (docs/models.md), unless set already
        root = str(Path(__file__).resolve().parent.parent)          # the folder holding clients/, ftis_fed/
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        offset = log_path.stat().st_size if log_path.exists() else 0
        state_dir = (payload.get("participant") or {}).get("state_dir")
        ended = end_other_run_worker(state_dir, run_key) if state_dir else None
        with open(log_path, "ab") as log:
            if ended is not None:
                log.write(f"[worker {participant}] ended pid {ended[0]}, this state dir's worker of run {ended[1]}: "
                          f"run {run_key} starts\n".encode())
                log.flush()
            proc = subprocess.Popen([sys.executable, "-m", "clients.worker", "--spec", str(spec_path)],
                                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                    start_new_session=True, cwd=root)
        (rt / f"{wid}.pid").write_text(str(proc.pid))
        if state_dir:
            record_owner(state_dir, run_key, proc.pid)
        deadline = last = time.monotonic()
        deadline += start_timeout
        authkey = keyfile.read_bytes()
        built_s = 0.0
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise WorkerError(_start_failure(participant, proc.returncode, log_path, offset))
            conn = _connect(sock, authkey)
            if conn is not None:
                return conn
            time.sleep(0.2)
            now = time.monotonic()
            if building(rt / f"{wid}.building"):                # a first-use model build: not counted
                deadline += now - last
                built_s += now - last
            last = now
        raise WorkerError(f"participant {participant!r}: worker did not start within {start_timeout:.0f} s"
                          + (f" (besides {built_s:.0f} s building its model)" if built_s >= 1 else "")
                          + f"; log {log_path}")


def building(marker: Path, fresh_s: float = BUILDING_FRESH_S) -> bool:
    """Whether a worker is building its model now: its marker exists and was touched lately."""
    try:
        return time.time() - marker.stat().st_mtime < fresh_s
    except OSError:
        return False


@contextlib.contextmanager
def building_marker(marker: Path, beat_s: float = BUILDING_BEAT_S):
    """Touch ``marker`` every ``beat_s`` seconds while the block runs (a model being built), then
    remove it."""
    stop = threading.Event()

    def beat() -> None:
        while True:
            with contextlib.suppress(OSError):
                marker.touch()
            if stop.wait(beat_s):
                return

    t = threading.Thread(target=beat, daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join()
        with contextlib.suppress(OSError):
            marker.unlink()


def _start_failure(participant: str, code: int, log_path: Path, offset: int) -> str:
    """The error of a worker that exited while starting: its one-line reason when it gave one
    (``START_ERROR``), else the tail of what it wrote to its log in this start."""
    text = ""
    with contextlib.suppress(OSError):
        with open(log_path, "rb") as fh:
            fh.seek(offset)
            text = fh.read().decode(errors="replace")
    reasons = [line[len(START_ERROR):] for line in text.splitlines() if line.startswith(START_ERROR)]
    if reasons:
        return f"participant {participant!r}: {reasons[-1]} (worker log {log_path})"
    return f"participant {participant!r}: worker exited with code {code} while starting; log {log_path}:\n{text[-3000:]}"


def kill_worker(run_key: str, participant: str) -> bool:
    """SIGKILL the participant's worker (one that no longer answers); True if one was running."""
    pid_file = runtime_dir() / f"{worker_id(run_key, participant)}.pid"
    try:
        os.kill(int(pid_file.read_text()), signal.SIGKILL)
        return True
    except (FileNotFoundError, ValueError, ProcessLookupError):
        return False


def call(conn, action: str, request: dict | None = None, timeout: float | None = None, participant: str | None = None,
         node_config: dict | None = None) -> Any:
    """``Participant.handle(action, request)`` in the worker (of ``participant`` with its
    ``node_config`` when the worker hosts several: ``participants-per-worker``); raises WorkerError
    when it raised, ConnectionError when the worker died, TimeoutError when it did not answer within
    ``timeout`` seconds (it keeps running)."""
    try:
        conn.send({"action": action, "request": dict(request or {}), "participant": participant,
                   "node_config": node_config, "deadline": None if timeout is None else time.time() + timeout})
        if timeout is not None and not conn.poll(timeout):
            raise TimeoutError(f"worker did not answer {action!r} within {timeout:.0f} s")
        reply = conn.recv()
    except (EOFError, OSError) as e:
        raise ConnectionError(f"worker connection lost during {action!r}: {e}") from e
    finally:
        with contextlib.suppress(Exception):
            conn.close()
    if reply.get("error"):
        raise WorkerError(reply["error"])
    return reply["result"]


# ----------------------------------------------------------------------------- the worker process

class Worker:
    """Serves one Participant; single-threaded: requests are handled one at a time."""

    def __init__(self, spec: dict[str, Any]):
        import torch

        from ftis_fed.config.federation import spec_from_jsonable
        from ftis_fed.config.keys import federation_from_run_config
        from ftis_fed.participant import Participant

        self.run_config, self.node_config = spec["run_config"], spec["node_config"]
        fed = federation_from_run_config(self.run_config)       # once per process
        pspec = spec_from_jsonable(spec["participant"])          # resolved by the ClientApp
        parent_cvd = os.environ.get(CUDA_ENV, "<unset>")
        seen = dict(os.environ)
        key = "device" if "participant" in self.node_config else f"p{pspec.partition_id}-device"
        pinned, local, chosen = worker_device(pspec.policy.device, seen, key=key, index=pspec.partition_id,
                                              requires_gpu=fed.requires_gpu)
        os.environ.update(pinned)                                # before anything initialises CUDA
        if (pspec.policy.backend == "vllm" and chosen.startswith("cuda") and not pspec.policy.gpu_memory_share
                and "partition-id" in self.node_config):        # simulation: share the card with its peers
            from ftis_fed.config.gpu_shares import run_memory_share

            share = run_memory_share(self.run_config, pspec.name, count_visible(seen))
            pspec = dataclasses.replace(pspec, policy=dataclasses.replace(pspec.policy, gpu_memory_share=share))
        origin = os.environ.get(VISIBLE_ENV) or os.environ.get(FROM_ENV) or "<none>"
        print(f"[worker {pspec.name}] device {chosen} (in-process {local}); CUDA_VISIBLE_DEVICES at start "
              f"{parent_cvd!r}, restored from {origin!r}", flush=True)
        threads = fed.threads or max(1, (os.cpu_count() or 1) // max(1, int(spec.get("concurrent", 1))))
        torch.set_num_threads(threads)
        self.idle_timeout = fed.worker_idle_timeout_s
        self.last_request = time.monotonic()
        self.busy = False
        print(f"[worker {pspec.name}] pid {os.getpid()} loading {pspec.policy.label} "
              f"({threads} threads)", flush=True)
        t0 = time.perf_counter()
        build_first(pspec.policy.model, pspec.name, Path(spec["socket"]).with_suffix(".building"))
        self.participant = Participant(pspec, fed, run_key=str(spec.get("run_key", "")))
        print(f"[worker {pspec.name}] ready in {time.perf_counter() - t0:.1f} s", flush=True)
        self.fed, self.run_key = fed, str(spec.get("run_key", ""))
        self.hosted = {pspec.name: self.participant}     # participants-per-worker > 1: its process-mates
        self.link = self._superlink(spec)                # deployment: where to ask whether the run goes on

    def _superlink(self, spec: dict[str, Any]):
        """In deployment (a Flower run id, a ``participant`` node config), the SuperLink its SuperNode
        connects to (``clients.run_status``); None otherwise."""
        anchors = spec.get("anchors") or []
        if "participant" not in self.node_config or not self.run_key.isdigit() or not anchors:
            return None
        from clients.run_status import describe, find_superlink

        link = find_superlink(int(anchors[0][0]))
        print(f"[worker {self.participant.name}] " + (f"asks the SuperLink {describe(link)} for run {self.run_key}'s "
              "status when idle (ends itself once it is finished)" if link else
              "found no flower-supernode above its anchor: ends after worker-idle-timeout-s without a request"),
              flush=True)
        return link

    def handle(self, req: dict[str, Any]) -> Any:
        participant = self._participant(req)
        inject_fault(participant.name, req["action"], int(req["request"].get("round", -1)))
        with self._own_rng(participant.name):
            return participant.handle(req["action"], req["request"])

    @contextlib.contextmanager
    def _own_rng(self, name: str):
        """Each hosted participant draws from its own torch RNG stream, as in a process of its own
        (LoRA dropout; ``share-base``): swapped in for its request, kept after it. A process-mate's
        stream starts where a fresh process's does (``_participant``)."""
        import torch

        streams = self.__dict__.setdefault("rng_streams", {})
        if name not in streams:                              # the first participant: this process's stream
            streams[name] = torch.get_rng_state()
        torch.set_rng_state(streams[name])
        try:
            yield
        finally:
            streams[name] = torch.get_rng_state()

    def _participant(self, req: dict[str, Any]):
        """The request's participant: the first one, or a process-mate built on its first request
        (same device as the first; its own spec, keys, state dir and counters)."""
        name = req.get("participant") or self.participant.name
        if name not in self.hosted:
            from ftis_fed.config.participants import participant_spec
            from ftis_fed.participant import Participant

            pspec = participant_spec(self.run_config, req["node_config"], self.fed)
            if pspec.name != name:
                raise ValueError(f"request for participant {name!r} with the node config of {pspec.name!r}")
            t0 = time.perf_counter()
            import torch

            from ftis_fed.policies.shared_base import TORCH_DEFAULT_SEED

            outer = torch.get_rng_state()
            torch.manual_seed(TORCH_DEFAULT_SEED)                # as a fresh process starts
            try:
                self.hosted[name] = Participant(pspec, self.fed, run_key=self.run_key)
                self.__dict__.setdefault("rng_streams", {})[name] = torch.get_rng_state()
            finally:
                torch.set_rng_state(outer)
            print(f"[worker {self.participant.name}] also hosts {name} ({pspec.policy.label}, "
                  f"{time.perf_counter() - t0:.1f} s)", flush=True)
        return self.hosted[name]

    def serve(self, sock: str, authkey: bytes) -> None:
        """Accept (and authenticate) connections on a thread, so a client never blocks on a busy
        worker; handle their requests one at a time, in arrival order, skipping expired ones."""
        listener = Listener(sock, family="AF_UNIX", authkey=authkey)
        pending: queue.Queue = queue.Queue()

        def accept_loop() -> None:
            while True:
                try:
                    pending.put(listener.accept())
                except OSError:                         # listener closed: shutting down
                    return
                except Exception as e:                  # failed authentication, etc.: keep serving
                    print(f"[worker] rejected a connection: {e}", flush=True)

        threading.Thread(target=accept_loop, daemon=True).start()
        threading.Thread(target=self._watchdog, daemon=True).start()
        while True:
            conn = pending.get()
            self.last_request = time.monotonic()
            with conn:
                try:
                    req = conn.recv()
                except (EOFError, OSError):
                    continue
                what = (f"{req.get('action')} round {req.get('request', {}).get('round', '-')}"
                        + (f" for {req['participant']}" if len(self.hosted) > 1 and req.get("participant") else ""))
                if req.get("deadline") is not None and time.time() > req["deadline"]:
                    print(f"[worker {self.participant.name}] {what}: "
                          "skipped, its caller stopped waiting", flush=True)
                    continue
                t0 = time.perf_counter()
                self.busy = True
                try:
                    reply = {"result": self.handle(req)}
                except Exception:
                    reply = {"error": traceback.format_exc()}
                finally:
                    self.busy = False
                result = reply.get("result")
                summary = phase_summary("", result["metrics"]).strip() \
                    if isinstance(result, dict) and isinstance(result.get("metrics"), dict) else ""
                rate = f" ({summary})" if summary else ""
                print(f"[worker {self.participant.name}] {what}: "
                      f"{'error' if 'error' in reply else 'ok'} in {time.perf_counter() - t0:.1f} s{rate}", flush=True)
                with contextlib.suppress(OSError):
                    conn.send(reply)
                self.last_request = time.monotonic()
                if req.get("action") == "finish":
                    listener.close()
                    return

    def _watchdog(self) -> None:
        """Every 5 s: the idle time-out; in deployment, after ``CHECK_EVERY_S`` without a request
        (and at most that often), whether the SuperLink still runs this run (``clients.run_status``)."""
        from clients.run_status import CHECK_EVERY_S, RunGone, check_run

        checked, failing = 0.0, False
        while True:
            time.sleep(5)
            now = time.monotonic()
            if self.busy:
                continue
            if now - self.last_request > self.idle_timeout:
                print(f"[worker] idle for {self.idle_timeout:.0f} s: exiting", flush=True)
                end_process_group(0)
            if self.link is None or now - self.last_request < CHECK_EVERY_S or now - checked < CHECK_EVERY_S:
                continue
            checked = now
            try:
                check_run(self.link, int(self.run_key))
            except RunGone as e:
                print(f"[worker {self.participant.name}] run {self.run_key} is {e}: exiting", flush=True)
                end_process_group(0)
            except Exception as e:                      # noqa: BLE001 - cannot tell: ask again later
                if not failing:
                    print(f"[worker {self.participant.name}] cannot ask the SuperLink for run {self.run_key}'s "
                          f"status ({type(e).__name__}: {str(e)[:200]}); asking again every {CHECK_EVERY_S:.0f} s",
                          flush=True)
                failing = True
            else:
                if failing:
                    print(f"[worker {self.participant.name}] the SuperLink answers again: run {self.run_key} "
                          "goes on", flush=True)
                failing = False


def build_first(model: str, name: str, marker: Path) -> None:
    """An offline model not in the cache yet is built here, first, under ``marker`` (so the start
    timeout of ``ensure_worker`` does not run out while it builds), saying so and naming the command
    that builds it before a run."""
    from ftis_fed.policies.models import OFFLINE_MODELS, is_built, resolve_model

    if model not in OFFLINE_MODELS or is_built(model):
        return
    print(f"[worker {name}] building model {model} (first use; `ftis-fed models build {model}` builds it "
          "before a run) ...", flush=True)
    t0 = time.perf_counter()
    with building_marker(marker):
        resolve_model(model)
    print(f"[worker {name}] built model {model} in {time.perf_counter() - t0:.0f} s", flush=True)


def watch_anchors(anchors: list[tuple[int, str | None]], name: str = "") -> None:
    """Exit (with the process group) as soon as one of ``anchors`` has ended: the run is over, and
    nobody will send ``finish``. Runs on a thread for the worker's whole life."""
    while True:
        for pid, start in anchors:
            if not alive(pid, start):
                print(f"[worker {name}] pid {pid}, which ties this worker to its run, has ended: exiting", flush=True)
                end_process_group(0)
        time.sleep(LIVENESS_EVERY_S)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", required=True, help="JSON written by ensure_worker")
    a = ap.parse_args(argv)
    spec = json.loads(Path(a.spec).read_text())
    anchors = [(int(p), st) for p, st in spec.get("anchors", [])]
    threading.Thread(target=watch_anchors, args=(anchors, Path(a.spec).stem), daemon=True).start()
    try:
        worker = Worker(spec)
    except DeviceError as e:                                    # one line: ensure_worker raises it
        print(f"{START_ERROR}{' '.join(str(e).split())}", flush=True)
        return 3
    worker.serve(spec["socket"], Path(spec["keyfile"]).read_bytes())
    with contextlib.suppress(FileNotFoundError):
        Path(spec["socket"]).unlink()
    end_process_group(0)                                        # finished: no engine process outlives it
    return 0


if __name__ == "__main__":
    sys.exit(main())
