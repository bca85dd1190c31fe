"""The participant ClientApp: one generic forwarder from a Flower message to the participant's
entry point ``Participant.handle(action, request)`` in its worker process, and the reply back.

The action is the message type's, and the handlers are registered from the action table
(``ftis_fed.actions``: ``query.hello``, ``query.generate``, ``train`` = learn, ``train.exchange``,
``evaluate``, ``query.finish``); the request and reply are the engine's plain dicts
(``ftis_fed.flower_io`` packs them). The run config is parsed once per process and run (a
simulation's Ray actor serves many messages, and several nodes). Two things are
added here because only the ClientApp knows them: hello replies carry ``supernodes`` (the number
of simulated SuperNodes) in a simulation, so the server can refuse a simulation with fewer
SuperNodes than participants; and ``finish`` never starts a worker just to stop it (one that does
not answer is killed).

The model lives in the worker process (``clients.worker``), started on first use and reused for
the whole run, in simulation and deployment alike.
"""

from __future__ import annotations

from pathlib import Path

from flwr.app import ConfigRecord, Context, Error, Message, RecordDict
from flwr.common.constant import ErrorCode
from flwr.clientapp import ClientApp

from clients.worker import call, ensure_worker, existing_worker, kill_worker
from ftis_fed.actions import ACTIONS, action_of
from ftis_fed.config.churn import PROBE
from ftis_fed.config.federation import to_jsonable
from ftis_fed.config.keys import federation_from_run_config
from ftis_fed.config.participants import absolute_paths, participant_spec
from ftis_fed.flower_io import content_to_request, reply_to_content

app = ClientApp()

_PARSED: dict[tuple, tuple] = {}        # (run id, node id) -> (run config, node config, fed, spec)


def _spec(context: Context):
    """(run config, node config, FederationConfig, ParticipantSpec) of this node, parsed once."""
    key = (context.run_id, context.node_id, tuple(sorted(context.node_config.items())))
    if key not in _PARSED:
        run_config, node_config = absolute_paths(context.run_config, context.node_config)
        fed = federation_from_run_config(run_config)
        _PARSED[key] = run_config, node_config, fed, participant_spec(run_config, node_config, fed)
    return _PARSED[key]


def _worker(context: Context):
    """(connection to this participant's worker, seconds to wait for its answer)."""
    run_config, node_config, fed, spec = _spec(context)
    host, payload = worker_payload(run_config, node_config, fed, spec, str(context.run_id))
    conn = ensure_worker(str(context.run_id), host, payload, Path(spec.state_dir) / "worker.log",
                         start_timeout=fed.wait_for_participants_s)
    # The server stops waiting after round-timeout-s; so does the ClientApp, which frees it (and a
    # simulation's actor) from a hung participant.
    return conn, fed.round_timeout_s, (spec.name, node_config)


def worker_payload(run_config: dict, node_config: dict, fed, spec, run_key: str) -> tuple[str, dict]:
    """(the worker's host name, what it needs to build its participant): the run and node config,
    the resolved participant spec, how many participants it may serve at once, the run key."""
    host, per = worker_host(fed, spec, node_config)
    concurrent = 1 if "participant" in node_config else -(-int(node_config.get("num-partitions", 1)) // per)
    return host, {"run_config": run_config, "node_config": node_config, "participant": to_jsonable(spec),
                  "concurrent": concurrent, "run_key": run_key}


def worker_host(fed, spec, node_config) -> tuple[str, int]:
    """(the worker this participant lives in, participants per worker): its own (``spec.name``),
    or with ``participants-per-worker`` k > 1 in simulation worker i of W = ceil(N / k), which hosts
    partitions i, i + W, i + 2W, ... (at most k of them). Dealt round-robin, not in blocks of k
    consecutive ids: Flower's simulation hands the messages of a phase to its ClientApp actors in
    partition order, so the first W messages (the hello at the start too) reach W different workers,
    which start and answer in parallel; in blocks, every actor would wait on worker 0 first."""
    per = 1 if "participant" in node_config else fed.participants_per_worker
    if per <= 1:
        return spec.name, per
    workers = -(-max(1, spec.num_partitions) // per)
    return f"host{spec.partition_id % workers}-of-{per}", per


def _node_facts(context: Context) -> dict:
    """In a simulation (node config: partition-id / num-partitions, no participant): the number of
    simulated SuperNodes."""
    nc = context.node_config
    if "participant" not in nc and "num-partitions" in nc:
        return {"supernodes": int(nc["num-partitions"])}
    return {}


def forward(msg: Message, context: Context) -> Message:
    action = action_of(msg.metadata.message_type)
    if action == "finish":
        reply = _finish(context)
    elif (absent := _absent(action, msg, context)) is not None:
        return absent
    else:
        conn, timeout, (name, node_config) = _worker(context)
        reply = call(conn, action, content_to_request(msg.content), timeout=timeout, participant=name,
                     node_config=node_config)
        if action == "hello":
            reply["info"].update(_node_facts(context))
    return Message(reply_to_content(reply), reply_to=msg)


def _absent(action: str, msg: Message, context: Context) -> Message | None:
    """Simulated churn (the participant's ``churn`` schedule, ``ftis_fed.config.churn``): in a round its
    schedule has it absent or away, an error reply at once instead of its worker's answer, so the
    engine counts the round as missed (``fed/dropped/error``) without waiting out round-timeout-s."""
    if action in ("hello", "finish") or not _may_churn(context.run_config):
        return None
    _, _, _, spec = _spec(context)
    if not spec.churn:
        return None
    request = content_to_request(msg.content)
    rnd = request.get("round")
    if not isinstance(rnd, int) or spec.schedule.answers(rnd):
        return None
    return Message(Error(code=ErrorCode.UNKNOWN, reason=f"simulated churn: participant {spec.name!r} is absent in "
                                                        f"round {rnd} (churn = {spec.churn!r})"), reply_to=msg)


def _may_churn(run_config) -> bool:
    """Whether a simulated participant's ``churn`` can be set at all: by ``p<i>-churn`` or a population
    (a deployment's node config may not set it)."""
    return bool(str(run_config.get("population", "")).strip()) or any(
        k.endswith("-churn") and str(v).strip() for k, v in run_config.items())


@app.query(PROBE)
def churn_probe(msg: Message, context: Context) -> Message:
    """Which participant this node is (``strategies.churn``: the server's simulated churn), from the run
    config alone: the worker is not started for it."""
    _, _, _, spec = _spec(context)
    return Message(RecordDict({PROBE: ConfigRecord({"participant": spec.name})}), reply_to=msg)


def _finish(context: Context) -> dict:
    """End of run: stop the worker; one that does not answer (hung) is killed."""
    _, node_config, fed, spec = _spec(context)
    name = worker_host(fed, spec, node_config)[0]
    conn = existing_worker(str(context.run_id), name)
    if conn is None:
        return {"info": {"stopped": False}}
    try:
        return call(conn, "finish", {}, timeout=30.0)
    except (TimeoutError, ConnectionError):
        return {"info": {"stopped": False, "killed": kill_worker(str(context.run_id), name)}}


for _row in ACTIONS.values():                   # one handler per message type of the action table
    _category, _name = _row.route
    getattr(app, _category)(_name)(forward)
