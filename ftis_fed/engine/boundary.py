"""The transport boundary: the one place where replies are checked before the engine sees them.

``Boundary(transport, limits).send(action, requests, timeout) -> (replies, dropped)``:
``replies`` maps each address to a checked :class:`~ftis_fed.engine.validation.Reply`;
``dropped`` maps the others to a :class:`~ftis_fed.engine.transport.Failure` whose reason is
counted by the engine (``fed/dropped/<reason>``). Nothing a participant sends, and nothing a
transport raises, escapes from here: anything unexpected becomes ``internal_error``.
"""

from __future__ import annotations

import inspect
import logging
from typing import Callable, Mapping

from ftis_fed.actions import requested_variants
from ftis_fed.engine.transport import Address, Delivered, Failure, Transport
from ftis_fed.engine.validation import BadReply, Reply, ReplyLimits, check_reply

log = logging.getLogger("ftis_fed.engine")


class Boundary:
    def __init__(self, transport: Transport, limits: ReplyLimits = ReplyLimits()):
        self.transport = transport
        self.limits = limits
        try:
            self.reports_replies = "on_reply" in inspect.signature(transport.send).parameters
        except (TypeError, ValueError):
            self.reports_replies = False

    def send(self, action: str, requests: Mapping[Address, dict], timeout: float,
             on_reply: Callable[[Address], None] | None = None) -> tuple[dict[Address, Reply], dict[Address, Failure]]:
        """``on_reply(addr)``: passed to a transport that reports replies as they arrive (progress);
        ignored by one that does not (``reports_replies``)."""
        if not requests:
            return {}, {}
        try:
            extra = {"on_reply": on_reply} if on_reply is not None and self.reports_replies else {}
            raw = self.transport.send(action, dict(requests), timeout, **extra)
            raw = dict(raw) if isinstance(raw, Mapping) else {}
        except Exception as e:                                      # a transport bug: nobody replied
            log.warning("%s: transport raised %s: %s", action, type(e).__name__, e)
            raw = {a: Failure("internal_error", f"transport raised {type(e).__name__}: {e}") for a in requests}
        replies: dict[Address, Reply] = {}
        dropped: dict[Address, Failure] = {}
        for addr in requests:
            try:
                replies[addr] = self._check(action, addr, raw.get(addr), requests[addr])
            except BadReply as e:
                dropped[addr] = Failure(e.reason, e.detail)
            except Exception as e:                                  # noqa: BLE001 - never let a reply end the run
                dropped[addr] = Failure("internal_error", f"{type(e).__name__}: {e}")
        for addr in raw:
            if addr not in requests:
                log.warning("%s: reply from %r, which was not asked: ignored (unknown_node)", action, addr)
        return replies, dropped

    def _check(self, action: str, addr: Address, got, request: Mapping | None = None) -> Reply:
        if got is None:
            raise BadReply("no_reply", "the transport returned nothing for this address")
        if isinstance(got, Failure):
            raise BadReply(got.reason, got.detail)
        if not isinstance(got, Delivered):
            raise BadReply("internal_error", f"transport returned {type(got).__name__}")
        if got.src != addr:
            raise BadReply("wrong_node", f"reply to {addr!r} came from {got.src!r}")
        return check_reply(action, got.content, self.limits, requested_variants(request))
