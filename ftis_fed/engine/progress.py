"""Live progress of a phase in the run's console: who has replied, who the engine still waits for.

    with PhaseProgress("round 2 generate", {addr: "alice", ...}, log, every_s=15.0) as p:
        transport.send(..., on_reply=p.replied)      # a transport that reports replies as they come

Every ``every_s`` seconds while the phase runs (``progress-every-s``; 0 = off), one plain log line
(no carriage returns, so a console redirected to a file gets one line per interval, never a
spinner), e.g. ``round 2 generate: 2/3 replied (alice 14 s, bob 20 s); waiting for carol (45 s)``.
A transport that cannot report replies one by one gets ``waiting for replies from ...`` instead.
"""

from __future__ import annotations

import threading
import time
from logging import INFO
from typing import Callable, Hashable, Mapping


def name_list(names: list[str], limit: int = 8) -> str:
    """``a, b, c`` or, past ``limit`` names, the first ones and ``... (+N more)``: console lines stay
    short at hundreds of participants."""
    names = list(names)
    if len(names) <= limit:
        return ", ".join(names)
    return ", ".join(names[:limit]) + f" ... (+{len(names) - limit} more)"


def spread(values: Mapping[str, float], fmt: str = "{:.3f}") -> str:
    """``mean 0.41 [min 0.10 bob, max 0.90 carol]``: aggregates and the extremes of a per-participant value."""
    items = [(v, n) for n, v in values.items() if v == v]                   # drop NaN
    if not items:
        return "n/a"
    lo, hi = min(items), max(items)
    mean = sum(v for v, _ in items) / len(items)
    return (f"mean {fmt.format(mean)} [min {fmt.format(lo[0])} {lo[1]}, max {fmt.format(hi[0])} {hi[1]}]")


class PhaseProgress:
    def __init__(self, label: str, names: Mapping[Hashable, str], log: Callable[..., None], every_s: float,
                 clock: Callable[[], float] = time.monotonic, tracked: bool = True):
        self.label, self.names, self.log, self.every_s = label, dict(names), log, every_s
        self.clock, self.tracked = clock, tracked
        self.t0 = clock()
        self.done: dict[Hashable, float] = {}           # address -> seconds after the start
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def replied(self, addr: Hashable) -> None:
        """Called by the transport (any thread) when ``addr``'s reply arrives."""
        with self._lock:
            self.done.setdefault(addr, self.clock() - self.t0)

    def line(self) -> str:
        """The progress line now (pure apart from the clock)."""
        with self._lock:
            done = dict(self.done)
        elapsed = self.clock() - self.t0
        waiting = [self.names[a] for a in self.names if a not in done]
        if not self.tracked:
            return f"{self.label}: {elapsed:.0f} s, waiting for replies from {name_list(sorted(waiting))}"
        got = name_list([f"{self.names.get(a, a)} {s:.0f} s" for a, s in sorted(done.items(), key=lambda kv: kv[1])])
        return (f"{self.label}: {len(done)}/{len(self.names)} replied" + (f" ({got})" if got else "")
                + (f"; waiting for {name_list(sorted(waiting))}" if waiting else "") + f" ({elapsed:.0f} s)")

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.log(INFO, "%s", self.line())

    def __enter__(self) -> "PhaseProgress":
        if self.every_s > 0 and self.names:
            self._thread = threading.Thread(target=self._run, daemon=True, name=f"ftis-progress-{self.label}")
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(1.0)
