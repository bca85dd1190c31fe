"""Which device a participant runs on, which GPUs its worker process sees, and how participants
share one card. Pure functions of strings and numbers (no torch import), so they test anywhere.

Selection (the participant key ``device``):

- ``auto``: the first visible CUDA device (``cuda:0``), else ``cpu``;
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

Memory shares. Several participants may share a card: each gets a share of it (a fraction of the
card's total memory): an explicit one (``gpu-memory-share``) or, unset (0), an equal part of what
the explicit ones leave of ``budget`` (default 0.9: some memory is always taken by the CUDA
context and the allocator). A vLLM participant's engine gets ``engine_fraction`` of its share as
``gpu_memory_utilization`` (vLLM reserves that fraction of the *whole* card for weights + KV cache);
the rest of the share is its trainer's (weights, optimizer state, activations).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Mapping

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
                  env: Mapping[str, str] | None = None) -> str:
    """The device a participant runs on, given ``cuda_count`` visible CUDA devices.

    Returns ``cpu`` or ``cuda:N``; raises :class:`DeviceError` (naming ``key``, the value and the
    visible devices) for an index that is not visible.
    """
    v = parse_device(value, key)
    if v == "cpu":
        return v
    if v == "auto":
        return "cuda:0" if cuda_count > 0 else "cpu"
    n = int(v.split(":")[1])
    if n >= cuda_count:
        raise DeviceError(f"{key}={value!r}: not visible; {_describe_visible(cuda_count, env)}")
    return v


def cuda_device_count() -> int:
    """Visible CUDA devices in this process (0 without torch or CUDA). Initialises CUDA here, after
    which this process's CUDA_VISIBLE_DEVICES no longer matters: use ``count_visible`` before pinning."""
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def count_visible(env: Mapping[str, str], python: str | None = None, ask_child: bool = False) -> int:
    """CUDA devices a process started with ``env`` would see. Without asking anyone when the answer
    is certain (``CUDA_VISIBLE_DEVICES`` empty; no NVIDIA driver device node on Linux), else asked in
    a child process, so the caller never initialises CUDA and can still narrow its own view with
    ``pin_env``. ``ask_child`` forces the child process."""
    import os
    import subprocess
    import sys

    if not ask_child:
        if visible_ids(env) == []:
            return 0
        if sys.platform.startswith("linux") and not os.path.exists("/dev/nvidiactl"):
            return 0
    code = "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)"
    r = subprocess.run([python or sys.executable, "-c", code], env=dict(env), capture_output=True, text=True,
                       timeout=300)
    if r.returncode != 0:
        raise DeviceError(f"counting CUDA devices failed: {r.stderr.strip()[-500:]}")
    return int(r.stdout.strip().splitlines()[-1])


def worker_device(setting: str, env: Mapping[str, str], key: str = "device",
                  count: int | None = None) -> tuple[dict[str, str], str, str]:
    """Everything a participant worker does about its device, before anything initialises CUDA:
    select it among the devices ``env`` shows (``count`` asked with ``count_visible`` when None),
    then narrow the view to it. Returns (environment to apply, device inside the process, device
    in the launcher's numbering)."""
    if parse_device(setting, key) == "cpu":
        n = 0
    else:
        n = count_visible(env) if count is None else count
    chosen = select_device(setting, n, key=key, env=env)
    pinned, local = pin_env(env, chosen)
    return pinned, local, chosen


# ----------------------------------------------------------------------------- pass-through

def launcher_env(env: Mapping[str, str]) -> dict[str, str]:
    """The launcher's environment plus ``FTIS_FED_VISIBLE_DEVICES`` = what it sees now (its
    ``CUDA_VISIBLE_DEVICES``, or ``all`` when unset). Call before anything starts Ray. A value already
    set (an outer launcher) is kept."""
    out = dict(env)
    if VISIBLE_ENV not in out:
        out[VISIBLE_ENV] = out[CUDA_ENV] if CUDA_ENV in out else ALL
    return out


def worker_env(parent_env: Mapping[str, str]) -> dict[str, str]:
    """The environment a participant worker starts with: the parent's (the ClientApp's, inside a
    Ray actor in simulation), with ``CUDA_VISIBLE_DEVICES`` restored from the launcher's
    ``FTIS_FED_VISIBLE_DEVICES`` -- never the value Ray masked. Without that variable (a deployed
    SuperNode started by hand), the parent's ``CUDA_VISIBLE_DEVICES`` is what the user set: kept."""
    env = dict(parent_env)
    if VISIBLE_ENV not in env:
        return env
    saved = env[VISIBLE_ENV]
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
