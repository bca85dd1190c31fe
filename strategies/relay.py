"""RelayStrategy: schedules collaborative-GRPO rounds and relays signed completion batches.

It subclasses Flower's ``Strategy`` and implements its per-round hooks (``configure_train`` builds
each participant's phase-2 message with its peers' batches, ``aggregate_train`` collects metrics,
``configure_evaluate`` / ``aggregate_evaluate`` run held-out evaluation). ``start`` is overridden:
the base loop is "send model arrays, train, evaluate" with one timeout, while a round here has a
generation phase whose replies decide what every participant receives next, there are no model
arrays at all (weights never leave a participant), replies may come from a subset, and the state
must be saved for resume.

One round (``scheme = sync``, the paper's):
    1. ``query.generate`` to every participant -> one signed frame each (within round-timeout-s)
    2. verify every frame (signature by the participant the node said hello as, run, round, replay,
       validation); count rejections by reason
    3. ``train`` to every participant with its peers' verified frames (peer budget, whole frames)
    4. write metrics (JSONL/CSV/PNG) and the server state
``scheme = pipelined``: one ``train`` per round carrying peers' frames of the previous round; the
reply brings this round's frame.

A participant that errors or misses the timeout is dropped for that phase; the round finishes with
the replies it has (at least ``min-participants`` for it to count as complete).
"""

from __future__ import annotations

import base64
import json
import time
from collections import Counter
from logging import INFO, WARNING
from pathlib import Path
from typing import Callable, Iterable

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy
from flwr.supercore import log

from ftis_fed.batch import BatchValidationError
from ftis_fed.config import FederationConfig, to_jsonable
from ftis_fed.flower_io import frames_to_record, get_frames
from ftis_fed.inbox import Inbox, InboxConfig
from ftis_fed.metrics import FEDERATION, MetricsWriter, summarize_sources
from ftis_fed.signing import KeyDirectory, ReplayGuard, fingerprint
from ftis_fed.wire import parse_header

from .relay_utils import VerifiedFrame, is_eval_round, select_for_receiver, texts_needed


class RelayStrategy(Strategy):
    """See the module docstring. ``keys``: the run's public keys; ``out_dir``: results + state."""

    def __init__(self, fed: FederationConfig, keys: KeyDirectory, out_dir: Path,
                 budgets: dict[str, int] | None = None, clock: Callable[[], float] = time.monotonic):
        self.fed = fed
        self.keys = keys
        self.out_dir = Path(out_dir)
        self.writer = MetricsWriter(self.out_dir)
        self.clock = clock
        self.state_path = self.out_dir / "server_state.json"
        self.guard = ReplayGuard()
        self.inbox = Inbox(keys, InboxConfig(run_id=fed.run_name, max_tokens=fed.max_batch_tokens), self.guard)
        self.nodes: dict[int, dict] = {}                 # node id -> hello info
        self.budgets = budgets or {}                     # participant -> peer budget override
        self.texts = False
        self.pending: list[VerifiedFrame] = []           # pipelined: last round's frames
        self.start_round = 1
        self.history: dict[int, MetricRecord] = {}
        self.eval_history: dict[int, MetricRecord] = {}
        self.phase_frames: dict[int, list[VerifiedFrame]] = {}

    # ------------------------------------------------------------------ Strategy API
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """Phase-2 messages: each participant gets its peers' verified frames (within its budget)."""
        frames = self.pending if self.fed.scheme == "pipelined" else self.phase_frames.get(server_round, [])
        msgs = []
        for i, (node, info) in enumerate(sorted(self.nodes.items())):
            name = info["participant"]
            chosen = select_for_receiver(frames, name, self.budgets.get(name, self.fed.peer_budget),
                                         rotation=server_round + i)
            content = RecordDict({"config": ConfigRecord({**config, "round": server_round,
                                                          "scheme": self.fed.scheme, "texts": self.texts})})
            content["ftis-batches"] = frames_to_record([f.frame for f in chosen])
            msgs.append(Message(content, node, "train", group_id=f"{server_round}-train"))
        return msgs

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Mean of the participants' numeric metrics (the per-participant rows go to the writer)."""
        ms = [r.content["metrics"] for r in replies if not r.has_error() and "metrics" in r.content]
        if not ms:
            return None, None
        keys = set().union(*[set(m) for m in ms])
        agg = MetricRecord({k: sum(float(m[k]) for m in ms if k in m) / sum(1 for m in ms if k in m) for k in keys})
        self.history[server_round] = agg
        return None, agg

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        return [Message(RecordDict({"config": ConfigRecord({**config, "round": server_round})}), node, "evaluate",
                        group_id=f"{server_round}-eval") for node in sorted(self.nodes)]

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        _, agg = self.aggregate_train(server_round, replies)
        if agg is not None:
            self.history.pop(server_round, None)
            self.eval_history[server_round] = agg
        return agg

    def summary(self) -> None:
        log(INFO, "\tRelayStrategy: scheme=%s, rounds=%d, G=%d, loss=%s, output=%s", self.fed.scheme,
            self.fed.num_rounds, self.fed.group_size, self.fed.objective.mode, self.out_dir)

    # ------------------------------------------------------------------ the schedule
    def start(self, grid: Grid, initial_arrays: ArrayRecord | None = None, num_rounds: int | None = None,
              timeout: float | None = None, train_config: ConfigRecord | None = None,
              evaluate_config: ConfigRecord | None = None, evaluate_fn=None) -> Result:
        """Run the federation. ``initial_arrays`` is ignored (no weights are shared); ``num_rounds``
        and ``timeout`` default to num-rounds and round-timeout-s."""
        fed = self.fed
        num_rounds = num_rounds or fed.num_rounds
        timeout = timeout or fed.round_timeout_s
        train_config = train_config or ConfigRecord({})
        evaluate_config = evaluate_config or ConfigRecord({})
        log(INFO, "Starting RelayStrategy")
        self.summary()
        self._save_config()
        if fed.resume:
            self._load_state()
        self._hello(grid, fed.wait_for_participants_s)
        if self.start_round == 1 and is_eval_round(0, num_rounds, fed.eval_every):
            self._evaluate(grid, 0, evaluate_config, timeout)
        for rnd in range(self.start_round, num_rounds + 1):
            t0 = self.clock()
            fed_row: dict = {"round": rnd, "participant": FEDERATION, "phase": "train"}
            rejected: Counter = Counter()
            gen_metrics: dict[str, dict] = {}
            if fed.scheme == "sync":
                replies, failed = self._send(grid, self._generate_messages(rnd), timeout)
                self.phase_frames[rnd] = self._verify_replies(replies, rnd, rejected, gen_metrics)
                fed_row["fed/generate_failures"] = float(len(failed))
                relay = self.phase_frames[rnd]
            else:
                relay = self.pending
            msgs = list(self.configure_train(rnd, ArrayRecord(), train_config, grid))
            bytes_relayed = sum(len(f) for m in msgs for f in get_frames(m.content))
            replies, failed = self._send(grid, msgs, timeout)
            if fed.scheme == "pipelined":
                self.pending = self._verify_replies(replies, rnd, rejected, gen_metrics)
            self.aggregate_train(rnd, replies)
            rows = self._participant_rows(rnd, replies, gen_metrics)
            fed_row.update({"fed/replies": float(len(replies)), "fed/train_failures": float(len(failed)),
                            "fed/participants": float(len(self.nodes)), "fed/bytes_relayed": float(bytes_relayed),
                            "fed/frames_relayed": float(sum(len(get_frames(m.content)) for m in msgs)),
                            "fed/frames_verified": float(len(relay)), "fed/rejected": float(sum(rejected.values())),
                            "fed/round_seconds": self.clock() - t0,
                            "fed/complete": float(len(replies) >= fed.min_participants)})
            fed_row.update({f"fed/rejected/{k}": float(v) for k, v in rejected.items()})
            self.writer.write(rows + [fed_row])
            self._log_round(rnd, num_rounds, rows, fed_row, failed)
            self.phase_frames.pop(rnd, None)
            if is_eval_round(rnd, num_rounds, fed.eval_every):
                self._evaluate(grid, rnd, evaluate_config, timeout)
            self._save_state(rnd)
            self.writer.plot()
        self._finish(grid)
        self.writer.plot()
        log(INFO, "Results: %s (metrics.jsonl, metrics.csv, *.png)", self.out_dir)
        return Result(train_metrics_clientapp=self.history, evaluate_metrics_clientapp=self.eval_history)

    # ------------------------------------------------------------------ steps
    def _wait_for_nodes(self, grid: Grid) -> list[int]:
        deadline = self.clock() + self.fed.wait_for_participants_s
        while True:
            nodes = sorted(grid.get_node_ids())
            if len(nodes) >= self.fed.min_participants:
                return nodes
            if self.clock() > deadline:
                raise TimeoutError(f"min-participants={self.fed.min_participants}: only {len(nodes)} connected "
                                   f"after wait-for-participants-s={self.fed.wait_for_participants_s:.0f}")
            time.sleep(1.0)

    def _hello(self, grid: Grid, timeout: float) -> None:
        """Meet every connected node: which participant it runs, checked against the key directory.
        The first message starts each participant's process and loads its model, hence its own
        timeout (wait-for-participants-s)."""
        nodes = self._wait_for_nodes(grid)
        msgs = [Message(RecordDict({"config": ConfigRecord({})}), n, "query.hello", group_id="hello") for n in nodes]
        replies, failed = self._send(grid, msgs, timeout)
        for r in replies:
            info = dict(r.content["info"])
            name = info["participant"]
            if name not in self.keys:
                log(WARNING, "node %s says it is %r, which has no public key: excluded", r.metadata.src_node_id, name)
                continue
            if fingerprint(self.keys[name]) != info["key_fp"]:
                log(WARNING, "node %s: key of %r does not match the key directory: excluded", r.metadata.src_node_id, name)
                continue
            if any(i["participant"] == name for i in self.nodes.values()):
                log(WARNING, "node %s: participant %r is already connected: excluded", r.metadata.src_node_id, name)
                continue
            self.nodes[r.metadata.src_node_id] = info
            self.budgets.setdefault(name, int(info.get("peer_budget", self.fed.peer_budget)))
        if len(self.nodes) < self.fed.min_participants:
            raise RuntimeError(f"only {len(self.nodes)} participants answered hello with a valid key "
                               f"(min-participants={self.fed.min_participants}); failures: {failed}")
        self.texts = texts_needed(self.fed.wire_texts, [i["tokenizer_fp"] for i in self.nodes.values()])
        for node, info in sorted(self.nodes.items(), key=lambda kv: kv[1]["participant"]):
            log(INFO, "participant %-12s node %s model %-22s tokenizer %s key %s", info["participant"], node,
                info["model_id"], info["tokenizer_fp"], info["key_fp"])
        log(INFO, "batches carry completion texts: %s (wire-texts=%s)", self.texts, self.fed.wire_texts)

    def _generate_messages(self, rnd: int) -> list[Message]:
        return [Message(RecordDict({"config": ConfigRecord({"round": rnd, "texts": self.texts})}), node,
                        "query.generate", group_id=f"{rnd}-generate") for node in sorted(self.nodes)]

    def _send(self, grid: Grid, msgs: list[Message], timeout: float) -> tuple[list[Message], dict[int, str]]:
        """Push, then pull until every reply is in or ``timeout`` passes. Returns (ok replies,
        {node: reason} for error replies and missing ones)."""
        ids = list(grid.push_messages(msgs))
        dst = {mid: m.metadata.dst_node_id for mid, m in zip(ids, msgs)}
        waiting, ok, failed = set(ids), [], {}
        deadline = self.clock() + timeout
        while waiting and self.clock() < deadline:
            for rep in grid.pull_messages(list(waiting)):
                mid = rep.metadata.reply_to_message_id
                waiting.discard(mid)
                if rep.has_error():
                    failed[dst[mid]] = f"error {rep.error.code}: {str(rep.error.reason)[-300:]}"
                else:
                    ok.append(rep)
            if waiting:
                time.sleep(0.2)
        for mid in waiting:
            failed[dst[mid]] = f"no reply within {timeout:.0f} s"
        for node, why in failed.items():
            who = self.nodes.get(node, {}).get("participant", node)
            log(WARNING, "participant %s dropped from this phase: %s", who, why)
        return ok, failed

    def _verify_replies(self, replies: list[Message], rnd: int, rejected: Counter,
                        gen_metrics: dict[str, dict]) -> list[VerifiedFrame]:
        """Verify each reply's frame as the server; keep only those signed by that node's participant."""
        out = []
        for r in replies:
            info = self.nodes.get(r.metadata.src_node_id)
            if info is None:
                rejected["unknown_node"] += 1
                continue
            if "metrics" in r.content:
                gen_metrics[info["participant"]] = dict(r.content["metrics"])
            for frame in get_frames(r.content):
                try:
                    acc = self.inbox.accept(frame, expected_round=rnd)
                except BatchValidationError as e:
                    rejected[e.reason] += 1
                    log(WARNING, "round %d: batch from %s rejected: %s", rnd, info["participant"], e)
                    continue
                if acc.batch.sender != info["participant"]:
                    rejected["sender_mismatch"] += 1
                    continue
                h = parse_header(frame)
                out.append(VerifiedFrame(acc.batch.sender, rnd, h.n_completions, h.n_completion_tokens, frame))
        return out

    def _participant_rows(self, rnd: int, replies: list[Message], gen_metrics: dict[str, dict]) -> list[dict]:
        rows = {}
        for name, m in gen_metrics.items():
            rows[name] = {"round": rnd, "participant": name, "phase": "train", **m}
        for r in replies:
            info = self.nodes.get(r.metadata.src_node_id)
            if info is None or "metrics" not in r.content:
                continue
            name = info["participant"]
            row = rows.setdefault(name, {"round": rnd, "participant": name, "phase": "train"})
            row.update(summarize_sources(dict(r.content["metrics"]), name))
            row["model_id"] = info["model_id"]
        return list(rows.values())

    def _evaluate(self, grid: Grid, rnd: int, config: ConfigRecord, timeout: float) -> None:
        replies, _ = self._send(grid, list(self.configure_evaluate(rnd, ArrayRecord(), config, grid)), timeout)
        self.aggregate_evaluate(rnd, replies)
        rows = []
        for r in replies:
            name = self.nodes[r.metadata.src_node_id]["participant"]
            rows.append({"round": rnd, "participant": name, "phase": "eval", **dict(r.content["metrics"])})
            m = r.content["metrics"]
            log(INFO, "  eval r%d %-12s ID %.3f  OOD %.3f", rnd, name, m.get("eval/id/accuracy", float("nan")),
                m.get("eval/ood/accuracy", float("nan")))
        self.writer.write(rows)

    def _finish(self, grid: Grid) -> None:
        """Stop every participant's worker process (short timeout: it only acknowledges)."""
        msgs = [Message(RecordDict({"config": ConfigRecord({})}), n, "query.finish", group_id="finish")
                for n in sorted(self.nodes)]
        self._send(grid, msgs, min(60.0, self.fed.round_timeout_s))

    def _log_round(self, rnd: int, num_rounds: int, rows: list[dict], fed_row: dict, failed: dict) -> None:
        log(INFO, "round %d/%d: %d replies, %d dropped, %d rejected, %.0f bytes relayed, %.1f s", rnd, num_rounds,
            int(fed_row["fed/replies"]), len(failed), int(fed_row["fed/rejected"]), fed_row["fed/bytes_relayed"],
            fed_row["fed/round_seconds"])
        for row in sorted(rows, key=lambda r: r["participant"]):
            log(INFO, "  %-12s reward %.3f  solved %.2f  loss %+.4f  peers %3d  filtered %.2f  ratio %.3f",
                row["participant"], row.get("reward/mean", float("nan")), row.get("reward/solved_frac", float("nan")),
                row.get("train/loss", float("nan")), int(row.get("train/peer_samples", 0)),
                row.get("offpolicy/filtered_frac", 0.0), row.get("offpolicy/ratio_mean", float("nan")))

    # ------------------------------------------------------------------ state
    def _save_config(self) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / "config.json").write_text(json.dumps(to_jsonable(self.fed), indent=1))

    def _save_state(self, rnd: int) -> None:
        state = {"completed_round": rnd, "run_name": self.fed.run_name, "guard": self.guard.to_json(),
                 "pending": [{"sender": f.sender, "round": f.round, "completions": f.completions, "tokens": f.tokens,
                              "frame": base64.b64encode(f.frame).decode()} for f in self.pending]}
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state))
        tmp.replace(self.state_path)

    def _load_state(self) -> None:
        if not self.state_path.exists():
            log(INFO, "resume: no %s yet, starting at round 1", self.state_path)
            return
        state = json.loads(self.state_path.read_text())
        if state["run_name"] != self.fed.run_name:
            raise ValueError(f"resume: {self.state_path} belongs to run {state['run_name']!r}, not {self.fed.run_name!r}")
        self.guard = ReplayGuard.from_json(state["guard"])
        self.inbox = Inbox(self.keys, self.inbox.config, self.guard)
        self.pending = [VerifiedFrame(p["sender"], p["round"], p["completions"], p["tokens"],
                                      base64.b64decode(p["frame"])) for p in state["pending"]]
        self.start_round = int(state["completed_round"]) + 1
        log(INFO, "resume: round %d done, continuing at round %d", self.start_round - 1, self.start_round)
