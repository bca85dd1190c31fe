"""The round engine's transport over Flower's ``Grid`` (simulation and deployment alike).

``send(action, {node_id: request}, timeout)``: one message per node (its type from the action
table, ``ftis_fed.actions``), pushed at once, then pulled until every reply is
in or the deadline passes. An error reply or a missing one is a ``Failure`` for that node
(``node_unavailable`` when the SuperLink answers for a node whose heartbeat lapsed); every
other reply is handed back unchecked (``Delivered``) for the engine's boundary to validate.

``node_names()``: who runs each connected node, as the SuperLink knows it before any hello: the
name its SuperNode key was registered under (``flwr supernode register ... --name alice``, Flower's
``NodeInfo.name``), else the organisation whose SuperNode public key it is among ``supernode_keys``
(the server's ``<keys-dir>/supernode/<p>.pub``, where the coordinator keeps them). The engine names
nodes by it in its wait lines and refusals.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any, Callable, Mapping

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from flwr.app import Message
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid

from ftis_fed.actions import message_type
from ftis_fed.engine.transport import Delivered, Failure
from ftis_fed.flower_io import content_to_reply, request_to_content
from ftis_fed.trust.deploy_keys import load_supernode_public_key, supernode_fingerprint


class GridTransport:
    def __init__(self, grid: Grid, clock: Callable[[], float] = time.monotonic, poll_s: float = 0.2,
                 supernode_keys: Mapping[str, str] | None = None):
        """``supernode_keys``: SuperNode key fingerprint (``SHA256:...``) -> organisation."""
        self.grid = grid
        self.clock = clock
        self.poll_s = poll_s
        self.supernode_keys = dict(supernode_keys or {})

    def addresses(self) -> list[int]:
        return sorted(self.grid.get_node_ids())

    def node_names(self) -> dict[int, str]:
        """node id -> its registered name or its key's organisation (see the module docstring);
        nodes with neither are left out. Never raises: names only label console lines."""
        try:
            infos = list(self.grid.get_nodes())
        except Exception:                                       # noqa: BLE001 - a Grid without node info
            return {}
        out = {}
        for info in infos:
            name = str(getattr(info, "name", "") or "")
            if not name and self.supernode_keys and getattr(info, "public_key", b""):
                name = self.supernode_keys.get(_fingerprint(info.public_key), "")
            if name:
                out[int(info.node_id)] = name[:64]
        return out

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
                # the last 8,000 characters: a worker's traceback ends with the exception's whole line
                # (the engine reads a reward function's error there, not a clipped fragment of it)
                return Failure(reason, f"error {rep.error.code}: {str(rep.error.reason)[-8000:]}")
            return Delivered(rep.metadata.src_node_id, content_to_reply(rep.content))
        except Exception as e:                                  # noqa: BLE001 - a reply never ends the run
            return Failure("internal_error", f"unpacking the reply: {type(e).__name__}: {e}")


def _fingerprint(pem: bytes) -> str:
    """``SHA256:...`` of the SuperNode public key Flower keeps (PEM); '' when it is none."""
    try:
        key = serialization.load_pem_public_key(pem)
    except Exception:                                           # noqa: BLE001 - not a key: no name
        return ""
    return supernode_fingerprint(key) if isinstance(key, ec.EllipticCurvePublicKey) else ""


def supernode_key_names(keys_dir: str | Path) -> dict[str, str]:
    """Fingerprint -> organisation of every ``<keys_dir>/supernode/<p>.pub`` ({} without that folder;
    a file that is not a SuperNode key is skipped with no word: it only names nodes)."""
    out = {}
    folder = Path(keys_dir) / "supernode"
    for pub in sorted(folder.glob("*.pub")) if folder.is_dir() else ():
        try:
            out[supernode_fingerprint(load_supernode_public_key(pub))] = pub.stem
        except Exception:                                       # noqa: BLE001
            continue
    return out
