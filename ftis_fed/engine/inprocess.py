"""In-process transport: every participant in this Python process, called directly.

Used by fast engine tests, for stepping through a round in a debugger, and by the research tier's
cells (``ftis-fed sim/grid --transport inprocess``, ``commands/inprocess.py``, which serialises the
participants and gives each its own torch RNG so that seeded runs equal ``flwr run``'s). The product
path for a federation is ``flwr run`` (simulation or deployment), through ``strategies/`` and
``clients/``.

Each request runs ``participant.handle(action, request)`` on its own daemon thread; the call
waits until every thread is done or the deadline passes. A participant still running at the
deadline is reported as ``Failure("timeout")`` and left behind (its thread cannot be killed; a
hung participant stays hung, as a hung worker process would). Like the worker process, a
participant handles one request at a time: a new request waits for the previous one, within the
same deadline.
"""

from __future__ import annotations

import contextlib
import threading
import time
import traceback
from typing import Any, Callable, Mapping, Protocol

from ftis_fed.engine.transport import Address, Delivered, Failure


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
        threads = []
        for addr, req in requests.items():
            if addr not in self.participants:
                results[addr] = Failure("unknown_node", f"no participant at {addr!r}")
                continue
            t = threading.Thread(target=self._call, args=(addr, action, req, results, on_reply), daemon=True,
                                 name=f"ftis-inprocess-{addr}-{action}")
            t.start()
            threads.append((addr, t))
        deadline = time.monotonic() + timeout
        for addr, t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        out = {}
        for addr in requests:
            got = results.get(addr)
            out[addr] = got if got is not None else Failure("timeout", f"no reply within {timeout:.1f} s")
        return out

    def _call(self, addr: Address, action: str, req: dict, results: dict, on_reply=None) -> None:
        with self._locks[addr]:
            try:
                results[addr] = Delivered(addr, self.participants[addr].handle(action, dict(req)))
            except Exception as e:                              # noqa: BLE001 - an error reply
                results[addr] = Failure("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}")
        if on_reply is not None:
            with contextlib.suppress(Exception):                # progress only: never fails a reply
                on_reply(addr)
