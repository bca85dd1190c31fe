"""Whether a deployment worker's run still goes on, asked of the SuperLink.

In deployment the process that ties a worker to its run (its anchor, ``clients.worker``) is the
SuperNode side, which outlives runs. A run that ends without ``query.finish`` reaching the worker
(``flwr stop``: Flower revokes the ServerApp's token before it could send anything; a ServerApp
killed or ended by SIGTERM; a SuperLink that went down) would leave the worker holding its model and
device memory until ``worker-idle-timeout-s``. So a worker with no request for ``CHECK_EVERY_S``
asks the SuperLink for its run's status, as ``flwr ls`` does (the Control API's ``ListRuns``), and
ends itself once the run is ``finished:*`` (stopped, failed or completed) or unknown there (a
SuperLink restarted without its ``--database``). A resumed run is a new Flower run: it starts its own
workers from the checkpoints on disk, so nothing is kept for it.

Where the SuperLink is: the SuperNode's own command line (``--superlink``, ``--root-certificates`` or
``--insecure``), found from the worker's anchor (Flower's SuperExec names the SuperNode with
``--parent-pid``). A worker that cannot find it (simulation: the anchor is a Ray actor that ends with
the simulation anyway), or cannot reach the SuperLink (down, another port, account authentication),
keeps going as before and asks again later; it says so once.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

#: Ask the SuperLink after this long without a request, and at most this often.
CHECK_EVERY_S = 15.0
SUPERNODE = "flower-supernode"


@dataclass(frozen=True)
class SuperLink:
    """The SuperLink as the SuperNode reaches it (Flower 1.42 serves the Control API on that port too)."""

    address: str
    root_certificates: str | None = None     # None with TLS: the system's CAs, as the SuperNode uses
    insecure: bool = False


def _cmdline(pid: int) -> list[str]:
    try:
        return [a.decode(errors="replace") for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if a]
    except OSError:
        return []


def _option(argv: list[str], name: str) -> str | None:
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(name + "="):
            return a[len(name) + 1:]
    return None


def _parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def superlink_of(argv: list[str]) -> SuperLink:
    """The SuperLink a ``flower-supernode`` command line connects to."""
    from flwr.supercore.constant import SUPERLINK_DEFAULT_CLIENT_ADDRESS

    return SuperLink(_option(argv, "--superlink") or SUPERLINK_DEFAULT_CLIENT_ADDRESS,
                     _option(argv, "--root-certificates"), "--insecure" in argv)


def find_superlink(pid: int, hops: int = 6) -> SuperLink | None:
    """From ``pid`` (the worker's anchor) up to the ``flower-supernode`` process that started it,
    following Flower's ``--parent-pid`` or the parent process; None when there is none."""
    for _ in range(hops):
        if pid <= 1:
            return None
        argv = _cmdline(pid)
        if any(Path(a).name == SUPERNODE for a in argv[:2]):
            return superlink_of(argv)
        named = _option(argv, "--parent-pid")
        pid = int(named) if named and named.isdigit() else _parent(pid)
    return None


class RunGone(Exception):
    """The SuperLink says the run is over (``str()``: how it says so)."""


def check_run(link: SuperLink, run_id: int) -> str:
    """The run's status at the SuperLink (``running``, ...); RunGone when it is ``finished:*`` or
    unknown there; any other exception when the SuperLink cannot tell (unreachable, refused)."""
    import httpx
    from flwr.proto.control_pb2 import ListRunsRequest  # pylint: disable=E0611
    from flwr.supercore.control.control_http_client import ControlHttpClient

    # no runtime-version interceptor: on a version mismatch it would end this process (flwr_exit)
    client = ControlHttpClient.from_server_address(
        server_address=link.address, insecure=link.insecure,
        root_certificates=None if link.insecure else link.root_certificates, interceptors=[])
    try:
        try:
            res = client.ListRuns(ListRunsRequest(run_id=run_id))
        except httpx.HTTPStatusError as e:        # Flower: 404 {"detail": "Run ID not found."}
            if e.response.status_code == 404 and "run id not found" in e.response.text.lower():
                raise RunGone(f"unknown at the SuperLink {link.address}") from None
            raise
    finally:
        client.close()
    run = res.run_dict.get(run_id)
    if run is None:
        raise RunGone(f"unknown at the SuperLink {link.address}")
    status = run.status.status + (f":{run.status.sub_status}" if run.status.sub_status else "")
    if run.status.status == "finished":
        raise RunGone(f"{status} at the SuperLink {link.address}")
    return status


def describe(link: SuperLink) -> str:
    how = "insecure" if link.insecure else f"CA {link.root_certificates}" if link.root_certificates else "system CAs"
    return f"{link.address} ({how})"

