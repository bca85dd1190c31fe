"""Simulated churn over Flower's Grid: nodes that arrive late, leave and come back, per the
participants' ``churn`` schedules (``ftis_fed.config.churn``; simulation only).

A Flower simulation's SuperNodes are all connected from the first round to the last, so the engine's
membership paths (late joiners, rejoiners, absences, retirement: ``ftis_fed.engine.membership``)
would never run through Flower. :class:`ChurnTransport` wraps the run's :class:`GridTransport` and,
in round r (``at_round``, called by the engine before each round's boundary and before admission),
lists a node to the engine only while its participant's schedule has it connected; a message to a
node that is not (an evaluation, say) fails at once with ``node_unavailable``, what Flower answers
for a node whose heartbeat lapsed. ``finish`` still reaches every node, so that every worker stops.

Which node is which participant: once, before the first listing, every node is asked ``query.churn``
(the ClientApp answers its participant's name from the run config without starting its worker).
The engine learns nothing from that answer: a node is admitted only by its hello's proof of key
possession, as always. Absent rounds (connected, not answering) are the ClientApp's own doing
(``clients.client_app``): the messages reach it through Flower and it answers each with an error.
"""

from __future__ import annotations

import time
from logging import INFO, WARNING
from typing import Any, Callable, Mapping

from flwr.app import ConfigRecord, Message, RecordDict

from ftis_fed.config.churn import PROBE, Churn
from ftis_fed.engine.transport import Failure

PROBE_TYPE = f"query.{PROBE}"


class ChurnTransport:
    """``inner``: the run's GridTransport; ``schedules``: participant -> its Churn (only those with one)."""

    def __init__(self, inner, schedules: Mapping[str, Churn], probe_timeout_s: float = 60.0,
                 log: Callable[..., None] | None = None):
        self.inner = inner
        self.schedules = dict(schedules)
        self.probe_timeout_s = probe_timeout_s
        self.log = log or (lambda *a, **k: None)
        self.round = 1
        self.who: dict[int, str] = {}                    # node id -> participant (probe)
        self.unknown: set[int] = set()                   # nodes that did not answer the probe: always listed

    def at_round(self, rnd: int) -> None:
        self.round = int(rnd)

    def connected(self, node: int) -> bool:
        """Whether ``node`` is connected in the current round by its participant's schedule."""
        name = self.who.get(node)
        return name is None or self.schedules.get(name, Churn()).connected(self.round)

    def addresses(self) -> list[int]:
        nodes = self.inner.addresses()
        self._probe([n for n in nodes if n not in self.who and n not in self.unknown])
        return [n for n in nodes if self.connected(n)]

    def send(self, action: str, requests: Mapping[int, dict], timeout: float,
             on_reply: Callable[[int], None] | None = None) -> dict[int, Any]:
        away = {n for n in requests if action != "finish" and not self.connected(n)}
        out: dict[int, Any] = {n: Failure("node_unavailable", f"simulated churn: participant {self.who[n]!r} is not "
                                                              f"connected in round {self.round} (its churn schedule)")
                               for n in away}
        rest = {n: r for n, r in requests.items() if n not in away}
        if rest:
            extra = {"on_reply": on_reply} if on_reply is not None else {}
            out.update(self.inner.send(action, rest, timeout, **extra))
        return out

    def _probe(self, nodes: list[int]) -> None:
        """Ask each of ``nodes`` which participant it is (``query.churn``), once."""
        if not nodes:
            return
        grid = self.inner.grid
        msgs = [Message(RecordDict({PROBE: ConfigRecord({})}), n, PROBE_TYPE) for n in nodes]
        ids = list(grid.push_messages(msgs))
        dst = dict(zip(ids, nodes))
        waiting = set(ids)
        deadline = time.monotonic() + self.probe_timeout_s
        while waiting and time.monotonic() < deadline:
            for rep in grid.pull_messages(list(waiting)):
                mid = rep.metadata.reply_to_message_id
                if mid not in waiting:
                    continue
                waiting.discard(mid)
                name = None
                if not rep.has_error() and PROBE in rep.content:
                    name = rep.content[PROBE].get("participant")
                if isinstance(name, str):
                    self.who[dst[mid]] = name
                else:
                    self.unknown.add(dst[mid])
            if waiting:
                time.sleep(0.1)
        self.unknown |= {dst[m] for m in waiting}
        if self.unknown:
            self.log(WARNING, "churn: %d node(s) did not say which participant they are: listed every round",
                     len(self.unknown))
        scheduled = sorted(n for n, name in self.who.items() if name in self.schedules)
        self.log(INFO, "churn: %d of %d node(s) follow a churn schedule (%s)", len(scheduled), len(self.who),
                 ", ".join(f"{self.who[n]}: {self.schedules[self.who[n]].text}" for n in scheduled[:8])
                 + (f" (+{len(scheduled) - 8} more)" if len(scheduled) > 8 else ""))
