"""In-process transport: every participant in this Python process, called directly.

Used by fast engine tests, for stepping through a round in a debugger, and by the research tier's
cells (``ftis-fed sim/grid --transport inprocess``, ``commands/inprocess.py``, which serialises the
participants and gives each its own torch RNG so that seeded runs equal ``flwr run``'s). The product
path for a federation is ``flwr run`` (simulation or deployment), through ``strategies/`` and
``clients/``.

Each request runs ``participant.handle(action, request)`` on a thread of its own send. A send
starts one bare ``_thread`` thread, which takes the send's requests one at a time (``deque.popleft``:
each request by exactly one thread) until none is left; whenever no request of the send ended for
``STALL_S`` (50 ms) while some are not yet taken, the send starts as many threads again as are
running (each may be stuck in a hung or slow participant), one at a time (each waits until the
previous one runs). So light participants are served by one thread in turn, without thousands of
threads contending for the GIL (a thread per request cost the server ~0.13 ms of CPU per request
to start and end, and the GIL hand-offs between them cost the participants' threads as much
again), while a hung participant holds up only its own thread: with H of them taken first, the
others are taken within about ``STALL_S`` x log2(H). The price: participants that wait (sleep, I/O)
for less than ``STALL_S`` per request are served in turn too, so such a send takes the sum of their
waits rather than the longest (the research tier's participants take turns anyway,
``commands/inprocess.py``; a wait of ``STALL_S`` or more brings more threads). The call waits until every request is done or
the deadline passes (counted from when the last request was taken). A participant still running
at the deadline is reported as ``Failure("timeout")`` and left behind (its thread cannot be
killed; a hung participant stays hung, as a hung worker process would). Like the worker process,
a participant handles one request at a time: a new request waits for the previous one, within the
same deadline.
"""

from __future__ import annotations

import _thread
import collections
import contextlib
import threading
import traceback
from typing import Any, Callable, Mapping, Protocol

from ftis_fed.engine.transport import Address, Delivered, Failure


#: a send starts more threads when none of its requests ended for this long (seconds): then as many
#: again as are running, each of which may be stuck in a hung participant
STALL_S = 0.05


def _take(todo: collections.deque) -> Address | None:
    """The next request no thread took yet (``popleft`` is atomic: each is taken once); None when none is left."""
    try:
        return todo.popleft()
    except IndexError:
        return None


class Handles(Protocol):
    def handle(self, action: str, request: dict) -> dict: ...


class InProcessTransport:
    """``participants``: address -> object with ``handle(action, request) -> reply``."""

    def __init__(self, participants: Mapping[Address, Handles]):
        self.participants = dict(participants)
        self._locks = {a: threading.Lock() for a in self.participants}

    def addresses(self) -> list[Address]:
        return list(self.participants)

    def connect(self, addr: Address, participant: Handles) -> None:
        """A node connecting (a late joiner, or a restarted participant at a new address)."""
        self._locks.setdefault(addr, threading.Lock())
        self.participants[addr] = participant

    def disconnect(self, addr: Address) -> None:
        """A node going away: no longer listed; a request to it fails with ``unknown_node``."""
        self.participants.pop(addr, None)

    def send(self, action: str, requests: Mapping[Address, dict], timeout: float,
             on_reply: Callable[[Address], None] | None = None) -> dict[Address, Any]:
        results: dict[Address, Any] = {}
        asked = []
        for addr in requests:
            if addr not in self.participants:
                results[addr] = Failure("unknown_node", f"no participant at {addr!r}")
            else:
                asked.append(addr)
        left = [len(asked)]
        all_done = _thread.allocate_lock()
        all_done.acquire()
        count = _thread.allocate_lock()

        def one_done() -> None:
            with count:
                left[0] -= 1
                if left[0] == 0:
                    all_done.release()

        todo = collections.deque(asked)                         # not yet taken by a thread
        running = [0]                                           # this send's threads not yet ended
        started = _thread.allocate_lock()
        started.acquire()                                       # released by each new thread once it runs

        def start(k: int) -> None:
            for _ in range(min(k, len(todo))):
                with count:
                    running[0] += 1
                _thread.start_new_thread(self._work, (todo, action, requests, results, on_reply, started, one_done,
                                                      running, count))
                started.acquire()                               # it runs (and took a request, if one was left)

        start(1)
        finished = False
        while todo:                                             # one thread while it gets through them ...
            before = left[0]
            if all_done.acquire(timeout=STALL_S):
                finished = True
                break
            if todo and left[0] == before:                      # ... and as many again whenever none ended
                start(max(1, running[0]))                       # a request for STALL_S: each may be stuck
        if asked and not finished:
            all_done.acquire(timeout=max(0.0, timeout))
        out = {}
        for addr in requests:
            got = results.get(addr)
            out[addr] = got if got is not None else Failure("timeout", f"no reply within {timeout:.1f} s")
        return out

    def _work(self, todo: collections.deque, action: str, requests: Mapping[Address, dict], results: dict, on_reply,
              started, one_done, running: list, count) -> None:
        """One thread of a ``send``: takes requests of this send that no thread took yet, one at a time,
        until none is left (a request is taken by exactly one thread: ``deque.popleft`` is atomic)."""
        try:
            addr = _take(todo)
            started.release()
            while addr is not None:
                self._call(addr, action, requests[addr], results, on_reply, one_done)
                addr = _take(todo)
        finally:
            with count:
                running[0] -= 1

    def _call(self, addr: Address, action: str, req: dict, results: dict, on_reply, one_done) -> None:
        try:
            with self._locks[addr]:
                try:
                    results[addr] = Delivered(addr, self.participants[addr].handle(action, dict(req)))
                except Exception as e:                          # noqa: BLE001 - an error reply
                    results[addr] = Failure("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}")
            if on_reply is not None:
                with contextlib.suppress(Exception):            # progress only: never fails a reply
                    on_reply(addr)
        finally:
            one_done()
