"""The participant ClientApp: unpack a Flower message, call the participant's worker, pack the reply.

Message types (sent by ``strategies.relay.RelayStrategy``):

    query.hello     -> ConfigRecord "info": participant, model, tokenizer and key fingerprints
    query.generate  -> phase 1: ConfigRecord "ftis-batches" with this round's signed frame, MetricRecord "metrics"
    train           -> phase 2 (sync): peers' frames in; metrics out.
                       pipelined: peers' previous-round frames in; new frame + metrics out
    evaluate        -> greedy pass@1 metrics
    query.finish    -> stop the worker (end of run)

The model lives in the worker process (``clients.worker``), started on first use and reused for
the whole run, in simulation and deployment alike.
"""

from __future__ import annotations

from pathlib import Path

from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from clients.worker import call, ensure_worker, existing_worker, kill_worker
from ftis_fed.config import absolute_paths, federation_from_run_config, participant_spec
from ftis_fed.flower_io import frames_to_record, get_frames

app = ClientApp()


def _spec(context: Context):
    run_config, node_config = absolute_paths(context.run_config, context.node_config)
    fed = federation_from_run_config(run_config)
    return run_config, node_config, participant_spec(run_config, node_config, fed)


def _worker(context: Context):
    """(connection to this participant's worker, seconds to wait for a round's answer)."""
    run_config, node_config, spec = _spec(context)
    fed = federation_from_run_config(run_config)
    concurrent = 1 if "participant" in node_config else int(node_config.get("num-partitions", 1))
    payload = {"run_config": run_config, "node_config": node_config, "concurrent": concurrent,
               "run_key": str(context.run_id)}
    conn = ensure_worker(str(context.run_id), spec.name, payload, Path(spec.state_dir) / "worker.log",
                         start_timeout=fed.wait_for_participants_s)
    # The server stops waiting after round-timeout-s; so does the ClientApp, which frees it (and a
    # simulation's actor) from a hung participant.
    return conn, fed.round_timeout_s


def _config(msg: Message) -> ConfigRecord:
    return msg.content["config"] if "config" in msg.content else ConfigRecord({})


def _reply(msg: Message, metrics: dict | None = None, frames: list[bytes] | None = None,
           info: dict | None = None) -> Message:
    content = RecordDict()
    if metrics is not None:
        content["metrics"] = MetricRecord({k: float(v) for k, v in metrics.items()})
    if frames is not None:
        content["ftis-batches"] = frames_to_record(frames)
    if info is not None:
        content["info"] = ConfigRecord(info)
    return Message(content, reply_to=msg)


@app.query("hello")
def hello(msg: Message, context: Context) -> Message:
    conn, timeout = _worker(context)
    return _reply(msg, info=call(conn, "hello", timeout=timeout))


@app.query("generate")
def generate(msg: Message, context: Context) -> Message:
    cfg = _config(msg)
    conn, timeout = _worker(context)
    frame, metrics = call(conn, "generate", timeout=timeout, round=int(cfg["round"]), texts=bool(cfg["texts"]))
    return _reply(msg, metrics=metrics, frames=[frame])


@app.train()
def train(msg: Message, context: Context) -> Message:
    cfg = _config(msg)
    frames = get_frames(msg.content)
    conn, timeout = _worker(context)
    if cfg.get("scheme", "sync") == "pipelined":
        frame, metrics = call(conn, "exchange", timeout=timeout, round=int(cfg["round"]), frames=frames,
                              texts=bool(cfg["texts"]))
        return _reply(msg, metrics=metrics, frames=[frame])
    return _reply(msg, metrics=call(conn, "learn", timeout=timeout, round=int(cfg["round"]), frames=frames))


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    conn, timeout = _worker(context)
    return _reply(msg, metrics=call(conn, "evaluate", timeout=timeout, round=int(_config(msg)["round"])))


@app.query("finish")
def finish(msg: Message, context: Context) -> Message:
    """End of run: stop the worker; one that does not answer (hung) is killed."""
    name = _spec(context)[2].name
    conn = existing_worker(str(context.run_id), name)
    if conn is None:
        return _reply(msg, info={"stopped": False})
    try:
        return _reply(msg, info=call(conn, "shutdown", timeout=30.0))
    except (TimeoutError, ConnectionError):
        return _reply(msg, info={"stopped": False, "killed": kill_worker(str(context.run_id), name)})
