"""The round engine's transport over Flower's ``Grid`` (simulation and deployment alike).

``send(action, {node_id: request}, timeout)``: one message per node (its type from the action
table, ``ftis_fed.actions``), pushed at once, then pulled until every reply is
in or the deadline passes. An error reply or a missing one is a ``Failure`` for that node
(``node_unavailable`` when the SuperLink answers for a node whose heartbeat lapsed); every
other reply is handed back unchecked (``Delivered``) for the engine's boundary to validate.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Mapping

from flwr.app import Message
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid

from ftis_fed.actions import message_type
from ftis_fed.engine.transport import Delivered, Failure
from ftis_fed.flower_io import content_to_reply, request_to_content


class GridTransport:
    def __init__(self, grid: Grid, clock: Callable[[], float] = time.monotonic, poll_s: float = 0.2):
        self.grid = grid
        self.clock = clock
        self.poll_s = poll_s

    def addresses(self) -> list[int]:
        return sorted(self.grid.get_node_ids())

    def send(self, action: str, requests: Mapping[int, dict], timeout: float,
             on_reply: Callable[[int], None] | None = None) -> dict[int, Any]:
        """``on_reply(node)`` as each reply arrives (the engine's progress line)."""
        nodes = list(requests)
        msgs = [Message(request_to_content(requests[n]), n, message_type(action),
                        group_id=f"{requests[n].get('round', '-')}-{action}") for n in nodes]
        ids = list(self.grid.push_messages(msgs))
        dst = dict(zip(ids, nodes))
        out: dict[int, Any] = {}
        waiting = set(ids)
        deadline = self.clock() + timeout
        while waiting and self.clock() < deadline:
            for rep in self.grid.pull_messages(list(waiting)):
                mid = rep.metadata.reply_to_message_id
                if mid not in waiting:
                    continue
                waiting.discard(mid)
                out[dst[mid]] = self._unpack(rep)
                if on_reply is not None:
                    with contextlib.suppress(Exception):        # progress only
                        on_reply(dst[mid])
            if waiting:
                time.sleep(self.poll_s)
        for mid in waiting:
            out[dst[mid]] = Failure("timeout", f"no reply within {timeout:.0f} s")
        return out

    @staticmethod
    def _unpack(rep: Message) -> Any:
        try:
            if rep.has_error():
                # the SuperLink's own error reply when the node's heartbeat lapsed (killed, cut off)
                reason = "node_unavailable" if rep.error.code == ErrorCode.NODE_UNAVAILABLE else "error"
                return Failure(reason, f"error {rep.error.code}: {str(rep.error.reason)[-4000:]}")   # the whole reason
            return Delivered(rep.metadata.src_node_id, content_to_reply(rep.content))
        except Exception as e:                                  # noqa: BLE001 - a reply never ends the run
            return Failure("internal_error", f"unpacking the reply: {type(e).__name__}: {e}")
