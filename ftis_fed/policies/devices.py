"""Which device a participant runs on, which GPUs its worker process sees, and how participants
share one card (~500 lines: selection, visibility and shares are one set of rules read together). Pure functions of strings and numbers (no torch import), so they test anywhere; the
few that look at the machine (``nvidia_driver``, ``cuda_probe``, ``card_lock``) take what they read
as arguments where a test needs to fake it.

Selection (the participant key ``device``):

- ``auto``: a visible CUDA device chosen by the participant's index (its simulation partition id,
  or the SuperNode's ``partition-id``): ``cuda:(index mod count)``, so participants spread over the
  visible GPUs deterministically; ``cpu`` only when the machine has no NVIDIA GPU (a GPU that torch
  cannot use is an error saying why: ``cuda_problem``);
- ``cuda`` = ``cuda:0``; ``cuda:N``: the N-th *visible* device (an index into
  ``CUDA_VISIBLE_DEVICES`` when it is set, as in torch); an error names the key, the value and the
  visible devices when N is out of range or none is visible;
- ``cpu``.

Pass-through. In simulation the ClientApps run in Ray actors, and Ray sets
``CUDA_VISIBLE_DEVICES=""`` for every actor that asks for no GPU; a worker started from there would
see no GPU. So the launcher records what *it* sees before Ray starts (``launcher_env``: the
variable ``FTIS_FED_VISIBLE_DEVICES`` = its ``CUDA_VISIBLE_DEVICES``, or ``all`` when unset), the
variable travels through the SuperLink, the simulation process and Ray's actors unchanged, and
``worker_env`` rebuilds the worker's ``CUDA_VISIBLE_DEVICES`` from it, never from the masked value.
A worker then narrows its own view to the one device it runs on (``pin_env``), so inside the worker
the participant's device is always ``cuda:0`` (torch and vLLM's engine processes agree on it).
Under a plain ``flwr run`` (no launcher variable) a worker started from a Ray actor takes the
devices from the actor's *start* environment (``start_environment``: Ray masks
``CUDA_VISIBLE_DEVICES`` in the actor's ``os.environ`` at run time, after the process started).

Honesty. ``nvidia_driver`` reads what the driver shows (``nvidia-smi -q``, else
``/proc/driver/nvidia``), whatever ``CUDA_VISIBLE_DEVICES`` says; ``cuda_problem`` turns "the
machine has GPUs but torch sees none" into one line naming the cause (the variable hides them, a
CPU-only torch, a driver too old for torch's CUDA build). ``card_lock`` serialises engine start-up
on one card (vLLM's start-up memory profiling miscounts when another process allocates meanwhile).

Memory shares. Several participants may share a card: each gets a share of it (a fraction of the
card's total memory): an explicit one (``gpu-memory-share``) or, unset (0), an equal part of what
the explicit ones leave of ``budget`` (default 0.9: some memory is always taken by the CUDA
context and the allocator). A vLLM participant's engine gets ``engine_fraction`` of its share as
``gpu_memory_utilization`` (vLLM reserves that fraction of the *whole* card for weights + KV cache);
the rest of the share is its trainer's (weights, optimizer state, activations).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Mapping

#: Set by the launcher (before Ray starts) to the CUDA_VISIBLE_DEVICES it saw, or ``all``.
VISIBLE_ENV = "FTIS_FED_VISIBLE_DEVICES"
#: Value of ``VISIBLE_ENV`` when the launcher's CUDA_VISIBLE_DEVICES was unset (every GPU visible).
ALL = "all"
CUDA_ENV = "CUDA_VISIBLE_DEVICES"

#: Default fraction of a card the participants on it may use together.
BUDGET = 0.9
#: Default part of a vLLM participant's share given to its engine (the rest: its HF trainer).
ENGINE_FRACTION = 0.4
#: Smallest derived share accepted (a participant with less cannot even hold a small model).
MIN_SHARE = 0.05


class DeviceError(ValueError):
    """A device setting that cannot be satisfied (the message names the key and what is visible)."""


# ----------------------------------------------------------------------------- selection

def parse_device(value: str, key: str = "device") -> str:
    """Normalise a ``device`` setting: ``auto``, ``cpu`` or ``cuda:N`` (``cuda`` -> ``cuda:0``)."""
    v = str(value).strip().lower()
    if v in ("auto", "cpu"):
        return v
    if v == "cuda":
        return "cuda:0"
    m = re.fullmatch(r"cuda:(\d+)", v)
    if m:
        return f"cuda:{int(m.group(1))}"
    raise DeviceError(f"{key}={value!r}: must be 'auto', 'cpu', 'cuda' or 'cuda:N' (N >= 0)")


def visible_ids(env: Mapping[str, str]) -> list[str] | None:
    """The ids in ``CUDA_VISIBLE_DEVICES`` (None when unset: the driver shows every GPU)."""
    if CUDA_ENV not in env:
        return None
    return [t.strip() for t in env[CUDA_ENV].split(",") if t.strip()]


def _describe_visible(count: int, env: Mapping[str, str] | None) -> str:
    names = ", ".join(f"cuda:{i}" for i in range(count)) or "none"
    cvd = "unset" if env is None or CUDA_ENV not in env else repr(env[CUDA_ENV])
    hint = ""
    if env is not None and env.get(CUDA_ENV) == "" and VISIBLE_ENV not in env:
        hint = (f"; CUDA_VISIBLE_DEVICES is empty, which is how Ray hides GPUs from actors: start the "
                f"run with `ftis-fed sim` (it passes the launcher's GPUs on in {VISIBLE_ENV})")
    return f"visible CUDA devices: {names} (CUDA_VISIBLE_DEVICES {cvd}){hint}"


def select_device(value: str, cuda_count: int, key: str = "device",
                  env: Mapping[str, str] | None = None, index: int = 0) -> str:
    """The device a participant runs on, given ``cuda_count`` visible CUDA devices.

    ``auto`` is ``cuda:(index mod cuda_count)`` (``index``: the participant's partition id, >= 0),
    so participants spread over the cards; ``cpu`` without CUDA. Returns ``cpu`` or ``cuda:N``;
    raises :class:`DeviceError` (naming ``key``, the value and the visible devices) for an index
    that is not visible.
    """
    v = parse_device(value, key)
    if index < 0:
        raise DeviceError(f"{key}: participant index {index}: must be >= 0")
    if v == "cpu":
        return v
    if v == "auto":
        return f"cuda:{index % cuda_count}" if cuda_count > 0 else "cpu"
    n = int(v.split(":")[1])
    if n >= cuda_count:
        raise DeviceError(f"{key}={value!r}: not visible; {_describe_visible(cuda_count, env)}")
    return v


_PROBE = ("import json, warnings\n"
          "with warnings.catch_warnings(record=True) as w:\n"
          "    warnings.simplefilter('always')\n"
          "    import torch\n"
          "    ok = torch.cuda.is_available()\n"
          "    n = torch.cuda.device_count() if ok else 0\n"
          "print(json.dumps({'count': n, 'torch': torch.__version__, 'cuda': torch.version.cuda,\n"
          "                  'warning': ' '.join(str(x.message).splitlines()[0] for x in w if str(x.message))[:400]}))")


def cuda_probe(env: Mapping[str, str], python: str | None = None) -> dict:
    """What torch sees in a child process started with ``env`` (the caller never initialises CUDA):
    ``{"count", "torch", "cuda" (torch.version.cuda, None for a CPU build), "warning" (what torch
    warned while initialising CUDA, e.g. a driver too old)}``."""
    r = subprocess.run([python or sys.executable, "-c", _PROBE], env=dict(env), capture_output=True, text=True,
                       timeout=300)
    if r.returncode != 0:
        raise DeviceError(f"counting CUDA devices failed: {r.stderr.strip()[-500:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def count_visible(env: Mapping[str, str], python: str | None = None, ask_child: bool = False) -> int:
    """CUDA devices a process started with ``env`` would see. Without asking anyone when the answer
    is certain (``CUDA_VISIBLE_DEVICES`` empty; no NVIDIA driver device node on Linux), else asked in
    a child process (``cuda_probe``), so the caller never initialises CUDA and can still narrow its
    own view with ``pin_env``. ``ask_child`` forces the child process."""
    if not ask_child:
        if visible_ids(env) == []:
            return 0
        if sys.platform.startswith("linux") and not os.path.exists("/dev/nvidiactl"):
            return 0
    return int(cuda_probe(env, python)["count"])


def no_gpu_refusal(setting: str, cuda_count: int, requires_gpu: bool = False, key: str = "device",
                   env: Mapping[str, str] | None = None) -> str | None:
    """One line saying why a participant with device ``setting`` must not start with ``cuda_count``
    visible CUDA devices, or None: ``cuda`` / ``cuda:N`` with none visible, or ``auto`` with none
    visible when the run says ``requires-gpu = true`` (a GPU preset). ``cpu`` is never refused."""
    v = parse_device(setting, key)
    if cuda_count > 0 or v == "cpu" or (v == "auto" and not requires_gpu):
        return None
    why = ("requires-gpu = true (this run needs a GPU)" if v == "auto"
           else "names a CUDA device")
    return (f"{key}={setting!r}: {why}, but no CUDA device is visible on this machine "
            f"({_describe_visible(0, env)}); set {key}='cpu' to run on the CPU")


def worker_device(setting: str, env: Mapping[str, str], key: str = "device",
                  count: int | None = None, index: int = 0,
                  driver: Driver | None = None, probe: dict | None = None,
                  requires_gpu: bool = False) -> tuple[dict[str, str], str, str]:
    """Everything a participant worker does about its device, before anything initialises CUDA:
    select it among the devices ``env`` shows (``count`` asked with ``count_visible`` when None;
    ``auto`` spread by ``index``), then narrow the view to it. Returns (environment to apply, device
    inside the process, device in the launcher's numbering).

    A setting that wants CUDA (``auto``, ``cuda:N``) on a machine whose driver shows GPUs
    (``driver``, read with ``nvidia_driver`` when None) that this process cannot use raises
    :class:`DeviceError` with one line saying why (``cuda_problem``; ``probe``: ``cuda_probe``'s
    answer, asked when None): a GPU machine never runs such a participant on the CPU silently. On a
    machine without GPUs, ``cuda:N`` and (with ``requires_gpu``) ``auto`` raise it too
    (``no_gpu_refusal``).
    """
    if parse_device(setting, key) == "cpu":
        n = 0
    else:
        n = count_visible(env) if count is None else count
        if n == 0:
            driver = nvidia_driver() if driver is None else driver
            if driver.gpus:
                if probe is None:
                    probe = ({"count": 0, "torch": "", "cuda": "", "warning": ""} if visible_ids(env) == []
                             else cuda_probe(env))
                why = cuda_problem(driver, probe, env)
                if why:
                    raise DeviceError(f"{key}={setting!r}: {why}; set {key.split(': ')[-1]}='cpu' to run on the CPU")
            refusal = no_gpu_refusal(setting, 0, requires_gpu, key, env)
            if refusal:
                raise DeviceError(refusal)
    chosen = select_device(setting, n, key=key, env=env, index=index)
    pinned, local = pin_env(env, chosen)
    return pinned, local, chosen


# ----------------------------------------------------------------------------- what the driver shows

#: Oldest Linux driver for each CUDA major version (NVIDIA's CUDA toolkit release notes, "minor
#: version compatibility"); used when nvidia-smi does not say which CUDA the driver supports.
MIN_DRIVER = {13: "580.65.06", 12: "525.60.13", 11: "450.80.02"}


@dataclass(frozen=True)
class Driver:
    """What the NVIDIA driver shows, whatever CUDA_VISIBLE_DEVICES says. gpus: product names;
    version: the driver version ('' unknown); cuda: the newest CUDA it supports ('' unknown)."""

    gpus: tuple[str, ...] = ()
    version: str = ""
    cuda: str = ""


def _field(text: str, name: str) -> str:
    m = re.search(rf"^\s*{name}\s*:\s*(.+?)\s*$", text, re.M)
    return m.group(1) if m else ""


def nvidia_driver(smi: str | None = None, proc: str | Path = "/proc/driver/nvidia") -> Driver:
    """The GPUs the driver shows: ``nvidia-smi -q`` (names, driver version, its CUDA version) when
    it runs, else ``/proc/driver/nvidia`` (``gpus/*/information``, ``version``); none without a
    driver."""
    exe = smi or shutil.which("nvidia-smi")
    if exe:
        try:
            r = subprocess.run([exe, "-q"], capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.SubprocessError):
            r = None
        if r is not None and r.returncode == 0:
            names = tuple(re.findall(r"^\s*Product Name\s*:\s*(.+?)\s*$", r.stdout, re.M))
            return Driver(names, _field(r.stdout, "Driver Version"), _field(r.stdout, "CUDA Version"))
    proc = Path(proc)
    gpus = sorted((proc / "gpus").glob("*/information")) if (proc / "gpus").is_dir() else []
    names = tuple(_field(g.read_text(errors="replace"), "Model") or "NVIDIA GPU" for g in gpus)
    version = ""
    with contextlib.suppress(OSError):
        m = re.search(r"Kernel Module\s+([\d.]+)", (proc / "version").read_text())
        version = m.group(1) if m else ""
    return Driver(names, version, "")


def _major(v: str | None) -> int | None:
    m = re.match(r"(\d+)", v or "")
    return int(m.group(1)) if m else None


def _version_tuple(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v))


def cuda_problem(driver: Driver, probe: Mapping[str, object], env: Mapping[str, str] | None = None) -> str | None:
    """One line saying why torch (``probe``: ``cuda_probe``'s answer) sees no GPU on a machine whose
    driver shows some, or None when there is nothing to say (no GPU, or torch sees them)."""
    if not driver.gpus or int(probe.get("count") or 0) > 0:
        return None
    n = len(driver.gpus)
    names = ", ".join(sorted(set(driver.gpus)))
    drv = f"driver {driver.version or '?'}" + (f", CUDA {driver.cuda}" if driver.cuda else "")
    head = f"this machine has {n} NVIDIA GPU{'s' if n > 1 else ''} ({names}; {drv}) but "
    env = env or {}
    if visible_ids(env) == []:
        return head + f"CUDA_VISIBLE_DEVICES='' hides {'them' if n > 1 else 'it'} from this process"
    tv, tc = str(probe.get("torch") or "?"), probe.get("cuda")
    if not tc:
        return head + f"torch {tv} is a CPU-only build (install a CUDA build of torch)"
    need = _major(str(tc))
    have = _major(driver.cuda)
    if have is None and driver.version and need in MIN_DRIVER:
        too_old = _version_tuple(driver.version) < _version_tuple(MIN_DRIVER[need])
    else:
        too_old = have is not None and need is not None and have < need
    if too_old:
        return head + (f"torch {tv} is built for CUDA {tc}, which needs a driver for CUDA {need} "
                       f"(>= {MIN_DRIVER.get(need, '?')}): update the NVIDIA driver or install a torch "
                       f"built for CUDA {driver.cuda or 'your driver'}")
    said = str(probe.get("warning") or "").strip()
    return head + f"torch {tv} (CUDA {tc}) sees none" + (f": {said}" if said else " (torch.cuda.is_available() is False)")


def launcher_cuda(env: Mapping[str, str], driver: Driver | None = None) -> tuple[str | None, int]:
    """(``cuda_problem``, visible CUDA device count) for a process started with ``env``, asked in a
    child only when the driver shows GPUs (so it costs nothing on a machine without them)."""
    driver = nvidia_driver() if driver is None else driver
    if not driver.gpus:
        return None, 0
    probe = {"count": 0} if visible_ids(env) == [] else cuda_probe(env)
    return cuda_problem(driver, probe, env), int(probe.get("count") or 0)


def launcher_cuda_problem(env: Mapping[str, str], driver: Driver | None = None) -> str | None:
    """``cuda_problem`` for a process started with ``env`` (asked in a child only when the driver
    shows GPUs, so it costs nothing on a machine without them)."""
    driver = nvidia_driver() if driver is None else driver
    if not driver.gpus:
        return None
    probe = {"count": 0} if visible_ids(env) == [] else cuda_probe(env)
    return cuda_problem(driver, probe, env)


# ----------------------------------------------------------------------------- pass-through

def launcher_env(env: Mapping[str, str]) -> dict[str, str]:
    """The launcher's environment plus ``FTIS_FED_VISIBLE_DEVICES`` = what it sees now (its
    ``CUDA_VISIBLE_DEVICES``, or ``all`` when unset). Call before anything starts Ray. A value already
    set (an outer launcher) is kept."""
    out = dict(env)
    if VISIBLE_ENV not in out:
        out[VISIBLE_ENV] = out[CUDA_ENV] if CUDA_ENV in out else ALL
    return out


def start_environment(path: str | Path = "/proc/self/environ") -> dict[str, str] | None:
    """This process's environment as it was when the process started (Linux ``/proc``), before
    anything changed ``os.environ``; None where it cannot be read."""
    try:
        data = Path(path).read_bytes()
    except OSError:
        return None
    out = {}
    for item in data.split(b"\0"):
        k, sep, v = item.partition(b"=")
        if sep:
            out[k.decode(errors="replace")] = v.decode(errors="replace")
    return out


#: Set in a worker's environment when its devices were taken back from its starter's start
#: environment (a Ray actor under a plain ``flwr run``): where they came from, for the log line.
FROM_ENV = "FTIS_FED_DEVICES_FROM"


def worker_env(parent_env: Mapping[str, str], start_env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment a participant worker starts with: the parent's (the ClientApp's, inside a
    Ray actor in simulation), with ``CUDA_VISIBLE_DEVICES`` restored from the launcher's
    ``FTIS_FED_VISIBLE_DEVICES`` -- never the value Ray masked. Without that variable (a plain
    ``flwr run``), when the parent's ``CUDA_VISIBLE_DEVICES`` is empty but was not when the parent
    started (``start_env``: ``start_environment()`` of a Ray actor, whose variable Ray set at run
    time), the start value is restored. Otherwise (a deployed SuperNode) the parent's
    ``CUDA_VISIBLE_DEVICES`` is what the user set: kept."""
    env = dict(parent_env)
    if VISIBLE_ENV in env:
        saved = env[VISIBLE_ENV]
    elif start_env is not None and env.get(CUDA_ENV) == "" and start_env.get(CUDA_ENV) != "":
        saved = start_env.get(CUDA_ENV, ALL)
        env[FROM_ENV] = f"the starting environment of pid {os.getpid()} (CUDA_VISIBLE_DEVICES masked since)"
    else:
        return env
    if saved == ALL:
        env.pop(CUDA_ENV, None)
    else:
        env[CUDA_ENV] = saved
    # Ray's own switch (if set) would otherwise let a Ray-aware library re-mask devices later
    env.pop("RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES", None)
    return env


def pin_env(env: Mapping[str, str], device: str) -> tuple[dict[str, str], str]:
    """Narrow a process's view to the one device it runs on: returns (environment, device inside it).

    ``cuda:N`` -> ``CUDA_VISIBLE_DEVICES`` = the N-th visible id (N itself when unset), device
    ``cuda:0``; ``cpu`` -> ``CUDA_VISIBLE_DEVICES=""`` (the process never creates a CUDA context),
    device ``cpu``. Must be applied before CUDA is initialised in that process (torch initialises
    lazily, so before the first CUDA call; vLLM's engine processes inherit it).
    """
    out = dict(env)
    d = parse_device(device)
    if d == "auto":
        raise DeviceError("pin_env: resolve 'auto' with select_device first")
    if d == "cpu":
        out[CUDA_ENV] = ""
        return out, "cpu"
    n = int(d.split(":")[1])
    ids = visible_ids(env)
    if ids is None:
        out[CUDA_ENV] = str(n)
    elif n < len(ids):
        out[CUDA_ENV] = ids[n]
    else:
        raise DeviceError(f"device={device!r}: not visible; {_describe_visible(len(ids), env)}")
    return out, "cuda:0"


# ----------------------------------------------------------------------------- one start-up per card

def card_of(env: Mapping[str, str]) -> str | None:
    """The card a process started with ``env`` puts its work on: the first id of
    ``CUDA_VISIBLE_DEVICES`` (``0`` when unset), None when it hides every GPU."""
    ids = visible_ids(env)
    if ids is None:
        return "0"
    return ids[0] if ids else None


def lock_folder(env: Mapping[str, str] | None = None) -> Path:
    """The private (0700) folder of this user's ftis-fed runtime files (worker sockets, card
    locks): ``FTIS_FED_RUNTIME``, default ``/tmp/ftis-fed-<uid>``."""
    env = os.environ if env is None else env
    d = Path(env.get("FTIS_FED_RUNTIME", f"/tmp/ftis-fed-{os.getuid()}"))
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(d, 0o700)
    return d


@contextlib.contextmanager
def card_lock(what: str, env: Mapping[str, str] | None = None,
              log: Callable[[str], None] = lambda m: print(m, file=sys.stderr, flush=True)) -> Iterator[str | None]:
    """Hold this user's lock of the card ``env`` (default ``os.environ``) puts work on, for an engine
    start-up: a second start-up on the same card waits until the first has allocated its memory
    (vLLM measures free memory and profiles its peak at start-up; another process allocating
    meanwhile makes it refuse or mis-size its KV cache: vLLM issues 9198, 17979). A flock on
    ``<lock_folder>/gpu-<id>.lock``, released when the block ends or the process dies. Yields the
    card id (None: no GPU visible, nothing locked). ``what`` is written into the lock file for the
    waiting message."""
    env = os.environ if env is None else env
    card = card_of(env)
    if card is None:
        yield None
        return
    path = lock_folder(env) / f"gpu-{re.sub(r'[^A-Za-z0-9._-]', '_', card)}.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "another process"
            log(f"[ftis-fed] {what}: waiting for GPU {card}: {holder} is starting on it ({path})")
            fcntl.flock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} ({what})".encode(), 0)
        try:
            yield card
        finally:
            os.ftruncate(fd, 0)
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------- memory shares

@dataclass(frozen=True)
class Share:
    """A participant's part of its card.

    device: ``cuda:N`` (launcher numbering). share: fraction of the card's total memory for the whole
    participant. engine: vLLM ``gpu_memory_utilization`` for its engine (0 for an HF participant).
    explicit: whether ``share`` was set rather than derived.
    """

    device: str
    share: float
    engine: float
    explicit: bool


def memory_shares(devices: Mapping[str, str], explicit: Mapping[str, float] | None = None,
                  engines: Iterable[str] = (), budget: float = BUDGET,
                  engine_fraction: float = ENGINE_FRACTION, min_share: float = MIN_SHARE,
                  key: str = "gpu-memory-share") -> dict[str, Share]:
    """Memory shares of the participants on CUDA devices.

    devices: participant -> resolved device (``cpu`` participants get no share). explicit:
    participant -> share in (0, 1) (0 or missing = derive). engines: participants with a vLLM engine.
    On each card the explicit shares must sum to at most ``budget``; the participants without one
    share what is left equally, and each derived share must be at least ``min_share``. Errors name
    the key, the card, the participants and the sum.
    """
    explicit = {p: float(s) for p, s in (explicit or {}).items() if s}
    engines = set(engines)
    if not 0 < budget <= 1:
        raise DeviceError(f"budget={budget}: must be in (0, 1]")
    if not 0 < engine_fraction <= 1:
        raise DeviceError(f"engine_fraction={engine_fraction}: must be in (0, 1]")
    for p, s in explicit.items():
        if not 0 < s < 1:
            raise DeviceError(f"{p}: {key}={s}: must be in (0, 1) (0 = derived from the participants on the card)")
    by_card: dict[str, list[str]] = {}
    for p, d in devices.items():
        if parse_device(d) == "auto":
            raise DeviceError(f"{p}: device 'auto' must be resolved (select_device) before sharing memory")
        if d.startswith("cuda"):
            by_card.setdefault(parse_device(d), []).append(p)
    out: dict[str, Share] = {}
    for card, ps in sorted(by_card.items()):
        fixed = [p for p in ps if p in explicit]
        total = sum(explicit[p] for p in fixed)
        if total > budget + 1e-9:
            parts = " + ".join(f"{p} {explicit[p]:g}" for p in fixed)
            raise DeviceError(f"{key} oversubscribes {card}: {parts} = {total:.3g} > {budget:g} "
                              "(the most the participants on one card may use together)")
        free = [p for p in ps if p not in explicit]
        each = (budget - total) / len(free) if free else 0.0
        if free and each < min_share:
            raise DeviceError(f"{card}: {', '.join(free)} would get {each:.3g} of the card each "
                              f"(< {min_share:g}) after the explicit {key} of {', '.join(fixed) or 'none'} "
                              f"({total:.3g} of {budget:g}); lower those shares or move participants")
        for p in ps:
            s = explicit.get(p, each)
            out[p] = Share(card, s, s * engine_fraction if p in engines else 0.0, p in explicit)
    return out
