"""The one interface between the round engine and whatever carries its messages.

A transport delivers one action to a set of addresses and gives back, per address, what came
back by the deadline::

    send(action, {address: request}, timeout_s) -> {address: Delivered | Failure}

``address`` is the transport's own name for a participant's endpoint (a Flower node id, or a
participant name in-process). ``request`` is a plain dict (``round``, ``texts``, ``frames``, ...);
``Delivered.content`` is the raw reply as plain data, *not yet checked*: every reply goes through
:mod:`ftis_fed.engine.validation` (in :class:`ftis_fed.engine.boundary.Boundary`) before the
engine looks at it. A transport never raises for one participant's sake: an error reply, a
missing reply or one after the deadline is a :class:`Failure` with a short reason.

Actions, one name end to end (engine -> transport -> participant entry point
``Participant.handle(action, request)``), with their request and reply fields and Flower message
types: the action table, :data:`ftis_fed.actions.ACTIONS`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Hashable, Mapping, Protocol

Address = Hashable

#: Failure reasons that say the node itself went away (not that its participant failed): Flower
#: reported it unavailable (its heartbeat lapsed: ``node_unavailable``), or the in-process transport
#: no longer lists it (``unknown_node``). Such a node is said hello again when it is back
#: (``ftis_fed.engine.membership``): with SuperNode authentication a restarted SuperNode comes back
#: with the same node id (Flower binds the id to its key), as a new process.
NODE_GONE = frozenset({"node_unavailable", "unknown_node"})


@dataclass(frozen=True)
class Failure:
    """No usable reply from one address: ``reason`` is a short metric-safe name (``timeout``,
    ``error``, ``no_reply``, ...), ``detail`` a human-readable explanation for the log."""

    reason: str
    detail: str = ""


@dataclass(frozen=True)
class Delivered:
    """A raw reply: ``src`` is who the transport says sent it (checked against the address it
    was sent to), ``content`` maps field names (``info``, ``frames``, ``metrics``) to raw values."""

    src: Address
    content: Mapping[str, Any]


class Transport(Protocol):
    """What the engine needs from a transport (Flower's Grid, or in-process for tests)."""

    def addresses(self) -> list[Address]:
        """Currently connected endpoints."""
        ...

    def send(self, action: str, requests: Mapping[Address, dict], timeout: float) -> dict[Address, Any]:
        """Deliver ``action`` to each address; per address a :class:`Delivered` or :class:`Failure`
        (addresses missing from the result count as ``no_reply``). A transport may also accept
        ``on_reply: Callable[[Address], None]``, called as each reply arrives (live progress)."""
        ...

    # Optional: ``node_names() -> {address: name}``, who runs each connected node as the transport
    # knows it before any hello (Flower: the name a SuperNode key was registered under). The engine
    # names nodes by it in its wait lines and refusals (``Engine.label``); a transport without it
    # gets node ids there.
    # Optional: ``at_round(rnd)``, called before the admission (with the first round) and before each
    # round's boundary: a transport that simulates churn (``strategies.churn``) lists the nodes
    # connected in that round.
