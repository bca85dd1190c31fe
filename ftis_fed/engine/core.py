"""The round engine: admission, rounds, evaluation, metrics and resume; nothing of Flower.

Why ~650 lines: the engine's state (members, pending frames, guard, stats) is one object that its
phases share; the per-phase policy lives elsewhere (``schedules/``, ``relay.py``, ``membership.py``,
``sampling.py``, ``validation.py``), what is left here is the state and its bookkeeping.

    Engine(fed, keys, out_dir, transport, declared=[...]).run()

1. **Admission** (``hello``): wait until ``min-participants`` addresses are connected; send each a
   fresh random challenge bound to the run id (``run-name@nonce``, drawn at start, kept by a
   resume) and its address; admit a node only when it names a participant of the key directory,
   with that participant's key fingerprint, *and* a valid Ed25519 signature of its challenge by
   that key (proof of possession). A second node claiming an admitted participant is refused. Only
   admitted nodes count: while fewer than ``min-participants`` are, nodes that connect later are
   said hello to, until ``wait-for-participants-s``; when every connected node was refused with an
   error or for its key and nobody else can join, the run stops at once with each node's whole
   reason. In a simulation (admitted nodes report how many
   SuperNodes the simulation has) with fewer SuperNodes than declared participants the run stops
   (:class:`TooFewSupernodes`).
2. **Rounds**: the schedule registered under ``scheme`` (``schedules/``) decides who is asked what;
   the engine's steps do the asking through the :class:`~ftis_fed.engine.boundary.Boundary`
   (every reply checked once), verify frames (signature by the participant the node said hello as,
   replay, the run's own receive bounds and the sender's hello tokenizer before decompressing:
   nothing a receiver would refuse is relayed; each refusal charged to its sender, quarantined
   after ``reverify-quarantine-after``), apply the peer budgets and write one metrics row per participant plus the
   federation row (``fed/...``).
3. **Evaluation** (``evaluate``) on the rounds ``eval-every`` names; **state** after every round
   (``server_state.json``: replay guard, pipelined frames) for ``resume``; ``finish`` at the end.

A participant that errors, hangs past the deadline or sends a bad reply is dropped for that phase
with a named reason (``fed/dropped/<reason>``); the round goes on with the others.
"""

from __future__ import annotations

import base64
import dataclasses
import gc
import json
import logging
import secrets
import time
from collections import Counter
from dataclasses import dataclass, field
from logging import INFO, WARNING
from pathlib import Path
from typing import Any, Callable, Mapping

from ftis_fed.atomic import atomic_write
from ftis_fed.wire.batch import BatchValidationError
from ftis_fed.config.federation import FederationConfig, to_jsonable
from ftis_fed.tasks.reward_funcs import REWARD_ERROR
from ftis_fed.trust.run_id import signed_run_id
from ftis_fed.trust.bounds import ReceiveBounds
from ftis_fed.trust.inbox import Inbox, InboxConfig
from ftis_fed.receive.frames import resolve_task, run_tasks
from ftis_fed.metrics.writer import FEDERATION, MetricsWriter, phase_summary, summarize_sources
from ftis_fed.metrics.sinks import open_sinks, parse_report_to
from ftis_fed.trust.signing import KeyDirectory, ReplayGuard, fingerprint, new_run_id, verify_challenge, verify_frame
from ftis_fed.wire.codec import parse_header
from ftis_fed.engine.boundary import Boundary
from ftis_fed.engine.draw import Draws, commitment
from ftis_fed.engine.membership import PERMANENT, Membership, Roster
from ftis_fed.engine.metric_names import MetricNames
from ftis_fed.engine.progress import PhaseProgress, name_list, spread
from ftis_fed.engine.relay import (VerifiedFrame, is_eval_round, receiver_needs_texts, select_for_receiver, text_variants,
                    texts_differ)
from ftis_fed.engine.sampling import credit, peer_plan, reach, sample_participants, seed_draw
from ftis_fed.engine.schedules import get_schedule
from ftis_fed.engine.transport import Address, Failure, Transport
from ftis_fed.engine.validation import Reply, ReplyLimits, max_frame_bytes_for

LogFn = Callable[..., None]
#: above this many participants the console prints aggregates and extremes, not one line each
CONSOLE_ROWS = 8


def _order(addr: Address) -> tuple[str, Any]:
    """Addresses in their natural order (Flower node ids numerically), whatever their type."""
    return (type(addr).__name__, addr)


class AdmissionError(RuntimeError):
    """Too few participants could be admitted (or connected) to start the run."""


class TooFewSupernodes(AdmissionError):
    """A simulation with fewer SuperNodes than the participants the run config declares."""


def eval_line(m: Mapping[str, Any]) -> str:
    """A participant's evaluation on the console: ``ID 0.250`` and ``OOD 0.125`` only where measured
    (a run without OOD families prints no ``OOD nan``)."""
    parts = [f"{label} {float(m[key]):.3f}" for label, key in (("ID", "eval/id/accuracy"), ("OOD", "eval/ood/accuracy"))
             if isinstance(m.get(key), (int, float))]
    return "  ".join(parts) or "(no accuracy reported)"


def per_function_line(row: Mapping[str, Any]) -> str:
    """``  rewards correct 0.500±0.52 format 0.750±0.46``: each reward function's mean ± std of the
    round (TRL's ``rewards/<name>/mean|std``), '' for built-in tasks."""
    names = [k[len("rewards/"):-len("/mean")] for k in row if k.startswith("rewards/") and k.endswith("/mean")]
    if not names:
        return ""
    return "  rewards " + " ".join(f"{n} {float(row[f'rewards/{n}/mean']):.3f}±{float(row.get(f'rewards/{n}/std', 0.0)):.2f}"
                                   for n in names[:6])


class RewardFunctionFailed(RuntimeError):
    """A participant's reward function failed and ``task-reward-errors = stop``: the run ends as
    failed (nothing more is trained or exported), with the function's whole message."""


def reward_error_of(detail: str) -> str | None:
    """The reward function error a failure's text carries (``REWARD_ERROR`` to the end of its line,
    whole), or None: the same text whatever wrapped it (a worker's traceback, Flower's error reason)."""
    at = detail.rfind(REWARD_ERROR)
    if at < 0:
        return None
    return detail[at:].split("\n", 1)[0].strip().removesuffix("'>").strip()


def too_few_supernodes_message(supernodes: int, declared: list[str]) -> str:
    """One line: what is wrong and the exact commands that fix it."""
    n = len(declared)
    return (f"the run config declares {n} participants ({', '.join(declared)}) but this simulation has "
            f"{supernodes} SuperNodes, so {n - supernodes} would silently not take part: run `ftis-fed sim` "
            f"(or `flwr run . local-sim` with the project's flower.toml), or "
            f"`flwr run . --federation-config \"num-supernodes={n}\"`")


@dataclass
class RoundStats:
    """What one round collects: per-participant rows, the federation row, rejections, drops."""

    rnd: int
    rows: dict[str, dict] = field(default_factory=dict)
    fed: dict[str, float] = field(default_factory=dict)
    rejected: Counter = field(default_factory=Counter)
    dropped: Counter = field(default_factory=Counter)

    def row(self, name: str) -> dict:
        return self.rows.setdefault(name, {"round": self.rnd, "participant": name, "phase": "train"})


def wire_metrics(sent: Mapping[bool, list[tuple[int, int]]]) -> dict[str, float]:
    """``wire/bytes_per_token``: bytes relayed per completion token, per receiver (its peers' frames
    WITHOUT texts: what a receiver with the senders' tokenizer gets), averaged over the receivers
    that got any; ``wire/bytes_per_token_texts``: the same for the frames WITH texts (receivers with
    another tokenizer, or everyone under wire-texts=always). Absent when no receiver got that kind."""
    out = {}
    for variant, name in ((False, "wire/bytes_per_token"), (True, "wire/bytes_per_token_texts")):
        got = [b / t for b, t in sent.get(variant, []) if t]
        if got:
            out[name] = sum(got) / len(got)
    return out


#: Longest string (characters) or bytes value a hello may carry: its model id and tokenizer
#: fingerprint go into every metrics row and log line (a frame's own header strings have the same limit).
MAX_HELLO_VALUE = 256
#: Most fields a hello may carry, and the longest field name (the engine reads about 16)
MAX_HELLO_FIELDS = 64
MAX_HELLO_NAME = 64


def hello_too_long(info: Mapping[str, Any]) -> str:
    """'' when a hello is within its bounds, else what is not: at most ``MAX_HELLO_FIELDS`` fields,
    names of at most ``MAX_HELLO_NAME`` characters, str/bytes values of at most ``MAX_HELLO_VALUE``,
    and every str value printable (no newline, no ANSI escape: they reach logs and metrics rows)."""
    if len(info) > MAX_HELLO_FIELDS:
        return f"hello info has {len(info)} fields: limit {MAX_HELLO_FIELDS}"
    for k, v in info.items():
        if len(str(k)) > MAX_HELLO_NAME:
            return f"hello info field name {str(k)[:64]!r}... has {len(str(k))} characters: limit {MAX_HELLO_NAME}"
        if isinstance(v, (str, bytes)) and len(v) > MAX_HELLO_VALUE:
            return f"hello info[{str(k)[:64]!r}] has {len(v)} characters: limit {MAX_HELLO_VALUE}"
        if isinstance(v, str) and not v.isprintable():
            return f"hello info[{str(k)[:64]!r}] = {v[:64]!r}: must be printable (no newline, tab or escape)"
    return ""


#: refusals that no later hello changes while the node stays as it is: an error in its hello (a
#: model that cannot load, a device it lacks) or its key
FATAL = PERMANENT | {"error", "internal_error"}
#: the longest refusal reason kept and printed (a traceback's head and tail)
MAX_REASON = 4000


def clip_reason(text: str, limit: int = MAX_REASON) -> str:
    """``text`` whole when at most ``limit`` characters, else its head and tail around an ellipsis."""
    if len(text) <= limit:
        return text
    head = limit // 4
    return f"{text[:head]} ... [{len(text) - limit} characters] ... {text[-(limit - head):]}"


def short_reach(got: Mapping[str, int], senders: list[str], receivers: list[str], k: int) -> list[str]:
    """Senders whose frame reached fewer than min(k, the other receivers) receivers (k <= 0: all of them)."""
    rset = set(receivers)
    others = {s: len(rset) - (s in rset) for s in senders}           # the receivers but itself: O(1) each
    return sorted(s for s in senders if got.get(s, 0) < (others[s] if k <= 0 else min(k, others[s])))


def _int_or_none(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def server_usage(cpu0: float) -> dict[str, float]:
    """``fed/server_cpu_s``: this process's CPU seconds since ``cpu0`` (the round; in-process
    transports include the participants'), ``fed/server_rss_mb``: its resident memory now."""
    import psutil

    return {"fed/server_cpu_s": time.process_time() - cpu0,
            "fed/server_rss_mb": psutil.Process().memory_info().rss / 2**20}


def _loaded(info: Mapping[str, Any]) -> str:
    """`` (model loaded in X s)`` from a hello's ``load_seconds``, if it carries a number."""
    s = info.get("load_seconds")
    return f" (model loaded in {s:.1f} s)" if isinstance(s, (int, float)) and not isinstance(s, bool) else ""


def budget_rejections(rows: list[dict]) -> dict[str, int]:
    """Per participant of a round's rows: the peer batches it dropped past its time budget
    (``offpolicy/rejected/time_budget``), those with any."""
    out = {}
    for r in rows:
        n = r.get("offpolicy/rejected/time_budget", 0)
        if isinstance(n, (int, float)) and n > 0:
            out[str(r.get("participant"))] = int(n)
    return out


#: added to the run seed for the evaluation sample's tie-breaking draw (another order than the training
#: sample's; the evaluation sample need not be unsteerable: nothing a participant sends depends on it)
EVAL_SAMPLE_SALT = 0x65766C


def plot_due(round: int, num_rounds: int, every: int) -> bool:
    """Redraw the plots after ``round``? Every ``every``-th round (``plot-every``) and after the last;
    ``every`` = 0: after the last only."""
    return round >= num_rounds or (every > 0 and round % every == 0)


def freeze_startup_objects() -> bool:
    """Move every object alive after admission (the libraries, the keys, the roster: ~115,000 at 4,096
    participants) out of the cyclic garbage collector's reach until the run ends (``gc.freeze``;
    ``Engine.run`` calls ``gc.unfreeze`` then). A round keeps O(N) objects alive until it ends (replies,
    batches, rows), which the collector promotes to its oldest generation; each full collection it
    then starts (~2 a round at 4,096) walked the whole heap, startup objects included: ~0.1 s each.
    Frozen, they are not walked; they are still freed by reference counting as ever, only garbage
    cycles among them wait for the end of the run (so what waits is at most what was alive at
    admission: a participant replaced later, say, is freed when the run ends). A collection of the
    young generations first (0 and 1: what admission and its messages left behind), so that no young
    garbage is frozen; an old garbage cycle waits for the run's end like every frozen object. Not a
    full collection: in a process that imported torch and transformers (the in-process transport, a
    test process) it walks ~500,000 objects, 0.3–0.5 s a run start on this machine's CPU.
    False (nothing done) where the collector is disabled: the process decides its own collection."""
    if not gc.isenabled():
        return False
    gc.collect(1)
    gc.freeze()
    return True


class Engine:
    """See the module docstring.

    fed: the run's FederationConfig. keys: the run's public keys. out_dir: metrics + state.
    transport: Flower's Grid adapter or the in-process one. declared: participant names the run
    config declares (simulation; [] = no check). budgets: per-participant peer-budget overrides.
    limits: reply limits (default: one frame per reply, frame size from max-batch-tokens).
    log: ``log(level, msg, *args)`` (the Flower adapter passes Flower's logger).
    plots: draw the PNG plots, every ``plot-every`` rounds and at the end (False: JSONL/CSV only, e.g. fast tests).
    """

    def __init__(self, fed: FederationConfig, keys: KeyDirectory, out_dir: str | Path, transport: Transport,
                 declared: list[str] | None = None, budgets: Mapping[str, int] | None = None,
                 limits: ReplyLimits | None = None, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep, log: LogFn | None = None, plots: bool = True,
                 entropy: Callable[[int], bytes] = secrets.token_bytes):
        self.fed = fed
        self.keys = keys
        self.out_dir = Path(out_dir)
        self.declared = list(declared or [])
        self.io = Boundary(transport, limits or ReplyLimits(max_frame_bytes=max_frame_bytes_for(fed.max_batch_tokens)))
        self.transport = transport
        self.clock, self.sleep = clock, sleep
        self.log: LogFn = log or logging.getLogger("ftis_fed.engine").log
        self.schedule = get_schedule(fed.scheme)
        self.state_path = self.out_dir / "server_state.json"
        self.guard = ReplayGuard()
        self.task_digest = fed.task.digest()            # the task's identity (trust.run_id): hello must match
        # this run's identity, bound to the task and to a fresh nonce; a resume reuses the saved one
        self.run_id = new_run_id(signed_run_id(fed.run_name, self.task_digest))
        # the run's own receive bounds (no vocabulary: the server scores nothing; G per group, the
        # largest share any receiver takes): what every receiver would refuse is never relayed
        self.inbox = Inbox(keys, InboxConfig(run_id=self.run_id, max_tokens=fed.max_batch_tokens,
                                             bounds=ReceiveBounds.from_run(fed, None)), self.guard)
        self.nodes: Roster = Roster()                   # admitted address -> hello info (indexed by name)
        self.refused: dict[Address, str] = {}           # address -> reason it was not admitted
        self.refusals: dict[Address, str] = {}          # address -> the whole reason (bounded: MAX_REASON)
        self.silent_at_start: set[Address] = set()      # no usable hello at the start (engine.membership)
        self.node_names: dict[Address, str] = {}        # address -> who runs it, as the transport knows it
        self.claimed: dict[Address, str] = {}           # address -> the participant its last hello named
        self.budgets = dict(budgets or {})
        self.metric_names = MetricNames()               # bounded metric names per participant
        self.tasks = run_tasks(fed)                     # the run's train tasks, as receivers resolve them
        self.partitions = 0                             # horizontal groups: the participants' num-partitions
        self.texts = False                              # whether any batch carries texts
        self.variants: dict[str, tuple[bool, ...]] = {}  # sender -> frame variants it signs (relay.text_variants)
        self.pending: list[VerifiedFrame] = []          # pipelined: last round's verified frames
        self.start_round = 1
        self.completed_round = 0
        self.writer: MetricsWriter | None = None
        self.plots = plots
        self.fps: dict[str, str] = {}                   # participant -> tokenizer fingerprint (admitted ones)
        self.vocab_pinned: dict[str, int] = {}          # hello without vocab_size: its first verified frame's
        self.num_partitions: int | None = None          # the participants' num-partitions (late joiners too)
        self.members = Membership(self)                 # sampling, late joiners, rejoiners, retirement
        self.eval_lags: dict[str, float] = {}              # evaluation sampling (fraction-evaluate): fair share minus asks
        self.draws = Draws(entropy)                     # the rounds' committed seeds (engine.draw)
        self.draw = b""                                 # this round's seed (revealed in its row)

    # ------------------------------------------------------------------ the run
    def run(self) -> int:
        """Admit, run the rounds, finish. Returns the last completed round."""
        fed = self.fed
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / "config.json").write_text(json.dumps(to_jsonable(fed), indent=1))
        if fed.resume:
            self._load_state()
        sinks = open_sinks(parse_report_to(fed.report_to), self.out_dir, fed.run_name, to_jsonable(fed))
        self.writer = MetricsWriter(self.out_dir, append=fed.resume, sinks=sinks)
        for old, new in self.writer.moved:
            self.log(INFO, "output folder already held %s (no resume): moved it to %s", old.name, new.name)
        self.log(INFO, "ftis-fed engine: scheme=%s, rounds=%d, G=%d, loss=%s, output=%s", fed.scheme,
                 fed.num_rounds, fed.group_size, fed.objective.mode, self.out_dir)
        self.log(INFO, "round %d's draw (participant and peer sampling) commits to %s", self.start_round,
                 self.draws.committed)
        self._at_round(self.start_round)
        self.admit()
        self.members.start()
        frozen = freeze_startup_objects()
        try:
            if self.start_round == 1 and fed.eval_initial and is_eval_round(0, fed.num_rounds, fed.eval_every):
                self.evaluate(0)
            for rnd in range(self.start_round, fed.num_rounds + 1):
                self.run_round(rnd)
                if is_eval_round(rnd, fed.num_rounds, fed.eval_every):
                    self.evaluate(rnd)
                self._save_state(rnd)
                if self.plots and rnd < fed.num_rounds and plot_due(rnd, fed.num_rounds, fed.plot_every):
                    self.writer.plot_in_background()    # off the rounds' path and out of the server's memory
            self.writer.wait_plots()
            if self.plots:                              # after the last round, in this process
                self.writer.plot()
        finally:
            self.finish()
            self.writer.close()                         # waits for a background redraw
            if frozen:
                gc.unfreeze()
        self.log(INFO, "Results: %s (metrics.jsonl, metrics.csv, *.png)", self.out_dir)
        return self.completed_round

    def _at_round(self, rnd: int) -> None:
        """Tell a transport that wants to know (``at_round``: simulated churn, ``strategies.churn``) which
        round the next listing and messages belong to."""
        hook = getattr(self.transport, "at_round", None)
        if callable(hook):
            hook(rnd)

    def run_round(self, rnd: int) -> RoundStats:
        t0, cpu0 = self.clock(), time.process_time()
        self._at_round(rnd)
        stats = RoundStats(rnd)
        self.draw = self.draws.take()
        stats.fed.update(self.members.begin_round(rnd, boundary=rnd > self.start_round, draw=self.draw))
        self.schedule(self, rnd, stats)
        self.members.end_round()
        stats.fed.update({"fed/participants": float(len(self.nodes)),
                          "fed/rejected": float(sum(stats.rejected.values())),
                          "fed/round_seconds": self.clock() - t0,
                          **server_usage(cpu0),
                          "fed/complete": float(stats.fed.get("fed/replies", 0.0) >= self.fed.min_participants)})
        stats.fed.update({f"fed/rejected/{k}": float(v) for k, v in stats.rejected.items()})
        stats.fed.update({f"fed/dropped/{k}": float(v) for k, v in stats.dropped.items()})
        fed_row: dict[str, Any] = {"round": rnd, "participant": FEDERATION, "phase": "train", **stats.fed}
        if self.fed.fraction_train < 1 or self.fed.peers_per_round > 0:    # the draw decides something: audit it
            fed_row.update({"fed/draw_seed": self.draw.hex(), "fed/draw_commit": commitment(self.draw),
                            "fed/draw_commit_next": self.draws.committed})
        rows = list(stats.rows.values())
        self.writer.write(rows + [fed_row])
        self._log_round(rnd, rows, fed_row, stats)
        self.completed_round = rnd
        return stats

    # ------------------------------------------------------------------ admission
    def wait_for_addresses(self, deadline: float, asked: frozenset | set = frozenset()) -> list[Address]:
        """Connected addresses, once at least ``min-participants`` are and one is not in ``asked``
        (said hello to already); AdmissionError at ``deadline``. Every ``progress-every-s`` while it
        waits, one line naming who is connected and who was refused, by organisation."""
        start, said = self.clock(), self.clock()
        while True:
            try:
                addrs = sorted(self.transport.addresses(), key=_order)
            except Exception as e:                          # noqa: BLE001 - retried until the deadline
                self.log(WARNING, "listing connected nodes failed: %s", e)
                addrs = []
            if len(addrs) >= self.fed.min_participants and any(a not in asked for a in addrs):
                return addrs
            if self.clock() > deadline:
                self.refresh_node_names()
                raise AdmissionError(f"min-participants={self.fed.min_participants}: only {len(self.nodes)} "
                                     f"admitted of {len(addrs)} connected ({self.label_list(addrs)}) after "
                                     f"wait-for-participants-s={self.fed.wait_for_participants_s:.0f}; refused: "
                                     + self.refusal_list())
            if self.fed.progress_every_s > 0 and self.clock() - said >= self.fed.progress_every_s:
                said = self.clock()
                self.refresh_node_names()
                self.log(INFO, "waiting for participants: %d connected (%s), %d admitted, min-participants=%d; "
                         "refused: %s (%.0f s of wait-for-participants-s=%.0f)", len(addrs), self.label_list(addrs),
                         len(self.nodes), self.fed.min_participants, self.refusal_list(), said - start,
                         self.fed.wait_for_participants_s)
            self.sleep(1.0)

    def refresh_node_names(self) -> None:
        """Ask the transport who runs each connected node (``node_names``: a Flower node's registered
        name or its SuperNode key's organisation); a transport without it, or an error, changes nothing."""
        names = getattr(self.transport, "node_names", None)
        if names is None:
            return
        try:
            self.node_names.update({a: str(n) for a, n in names().items() if n})
        except Exception:                                   # noqa: BLE001 - names only label lines
            pass

    def label(self, addr: Address) -> str:
        """A node as the console names it: ``alice (node 1234)``, the participant admitted there, else
        the name its SuperNode key was registered under (or the key's organisation), else the
        participant whose key its hello proved (a node refused for its key is not named by its claim:
        the reason says what it claimed); ``node 1234`` when none is known (in-process: the address)."""
        info = self.nodes.get(addr)
        name = info["participant"] if info else self.node_names.get(addr) or self.claimed.get(addr, "")
        plain = f"node {addr}" if isinstance(addr, int) else str(addr)
        return plain if not name or name == str(addr) else f"{name} ({plain})"

    def label_list(self, addrs) -> str:
        return name_list([self.label(a) for a in sorted(addrs, key=_order)]) or "none"

    def admit(self) -> None:
        """Hello with proof of key possession (see the module docstring). Only admitted nodes count:
        while fewer than ``min-participants`` are, newly connected nodes are said hello to until
        ``wait-for-participants-s`` (a refused node never takes a real participant's place)."""
        start = self.clock()
        deadline = start + self.fed.wait_for_participants_s
        asked: set[Address] = set()
        while len(self.nodes) < self.fed.min_participants:
            new = [a for a in self.wait_for_addresses(deadline, asked) if a not in asked]
            asked.update(new)
            if new:
                self._hello(new, max(1.0, deadline - self.clock()))
                self._check_supernodes()
                self._stop_if_all_refused(asked)
        self._check_partitions()
        self.roster_changed()
        self.log(INFO, "admission: %d admitted of %d said hello to in %.1f s", len(self.nodes), len(asked),
                 self.clock() - start)
        for node, info in sorted(self.nodes.items(), key=lambda kv: kv[1]["participant"])[:16]:
            self.log(INFO, "participant %-12s node %s model %-22s tokenizer %s key %s%s", info["participant"], node,
                     info["model_id"], info["tokenizer_fp"], info["key_fp"], _loaded(info))
        if len(self.nodes) > 16:
            self.log(INFO, "... and %d more participants (models: %s)", len(self.nodes) - 16,
                     ", ".join(f"{m} x{c}" for m, c in Counter(i["model_id"] for i in self.nodes.values()).items()))
        self.log(INFO, "completion texts (wire-texts=%s) only to receivers with another tokenizer: %s",
                 self.fed.wire_texts, name_list([f"{n} signs {'+'.join('texts' if t else 'no-texts' for t in v)}"
                                                 for n, v in sorted(self.variants.items())]))

    def refusal_list(self) -> str:
        """Every refused node with its whole reason ('none' when none)."""
        return "; ".join(f"{self.label(a)}: {self.refused[a]}: {self.refusals.get(a, '')}"
                         for a in sorted(self.refused, key=_order)) or "none"

    def _stop_if_all_refused(self, asked: set) -> None:
        """Every connected node said hello to and refused with an error or for its key, none admitted
        (or a simulation whose every SuperNode answered): nobody can still come, so the run stops now
        with each node's whole reason instead of waiting out ``wait-for-participants-s``."""
        try:
            connected = set(self.transport.addresses())
        except Exception:                                   # noqa: BLE001 - the wait goes on
            return
        refused = {a for a in connected if a not in self.nodes}
        if not connected or not connected <= asked or len(self.nodes) >= self.fed.min_participants:
            return
        if any(self.refused.get(a) not in FATAL for a in refused):
            return                                          # a time-out, a duplicate, ...: may still change
        counts = [i["supernodes"] for i in self.nodes.values() if _int_or_none(i.get("supernodes")) is not None]
        if self.nodes and not (counts and min(counts) <= len(connected)):
            return                                          # others may still connect (deployment)
        msg = (f"min-participants={self.fed.min_participants}: {len(refused)} of {len(connected)} connected node(s) "
               f"refused ({len(self.nodes)} admitted), nobody else can join: " + self.refusal_list())
        self.log(logging.ERROR, "%s", msg)
        self.finish_nodes(list(self.nodes))
        raise AdmissionError(msg)

    def roster_changed(self) -> None:
        """After admission (at the start or at a round boundary): peer budgets, tokenizers, text variants."""
        for info in self.nodes.values():
            own = info.get("peer_budget")                   # a participant may ask for fewer peers' samples
            ok = isinstance(own, int) and not isinstance(own, bool) and own >= 0
            if ok and self.fed.peer_budget > 0 and not 0 < own <= self.fed.peer_budget:
                own = self.fed.peer_budget                  # never more than the run's (0 = all)
            self.budgets.setdefault(info["participant"], own if ok else self.fed.peer_budget)
        self.fps = fps = {i["participant"]: i["tokenizer_fp"] for i in self.nodes.values()}
        count = Counter(fps.values())                       # the receivers' distinct tokenizers, O(N)
        self.variants = {n: text_variants(self.fed.wire_texts, fp, [f for f in count if f != fp or count[f] > 1])
                         for n, fp in fps.items()}
        self.texts = any(True in v for v in self.variants.values())
        said = {i["participant"]: (i["tokenizer_fp"], _int_or_none(i.get("vocab_size"))
                                   or self.vocab_pinned.get(i["participant"])) for i in self.nodes.values()}
        self.inbox.config = dataclasses.replace(self.inbox.config, tokenizers=said)

    def hello_requests(self, addrs: list[Address]) -> tuple[dict[Address, bytes], dict[Address, dict]]:
        """(a fresh 32-byte challenge per node, the hello request carrying it, the run id and the node)."""
        challenges = {a: secrets.token_bytes(32) for a in addrs}
        return challenges, {a: {"run": self.run_id, "node": str(a), "challenge": challenges[a]} for a in addrs}

    def _hello(self, addrs: list[Address], timeout: float) -> None:
        """Say hello to ``addrs`` (fresh challenges) and admit the nodes whose proofs hold."""
        challenges, requests = self.hello_requests(addrs)
        self.refresh_node_names()
        with PhaseProgress("hello (participants loading their models)", {a: self.label(a) for a in addrs}, self.log,
                           self.fed.progress_every_s, self.clock, tracked=self.io.reports_replies) as progress:
            replies, dropped = self.io.send("hello", requests, timeout, on_reply=progress.replied)
        for a, why in dropped.items():
            self._refuse(a, why.reason, why.detail)
            self.silent_at_start.add(a)
        for a in sorted(replies, key=_order):
            self._admit_one(a, replies[a].info, challenges[a])

    def _check_supernodes(self) -> None:
        """A simulation with fewer SuperNodes than declared participants stops (only ADMITTED nodes'
        word counts: a node that could not prove its key has no say)."""
        counts = [i["supernodes"] for i in self.nodes.values()
                  if isinstance(i.get("supernodes"), int) and not isinstance(i.get("supernodes"), bool)]
        if counts and self.declared and min(counts) < len(self.declared):
            msg = too_few_supernodes_message(min(counts), self.declared)
            self.log(logging.ERROR, "%s", msg)
            self.finish_nodes(list(self.nodes))
            raise TooFewSupernodes(msg)

    def _check_partitions(self) -> None:
        """Every admitted participant must split the prompts into the same number of partitions (its
        node config's ``num-partitions``): with different numbers their prompt partitions overlap and,
        with horizontal groups, they accept different shares of a group and refuse each other's."""
        said = {i["participant"]: i["num_partitions"] for i in self.nodes.values()
                if _int_or_none(i.get("num_partitions")) is not None}
        if len(set(said.values())) > 1:
            self.finish_nodes(list(self.nodes))
            raise AdmissionError("participants were configured with different num-partitions ("
                                 + ", ".join(f"{n}: {k}" for n, k in sorted(said.items()))
                                 + "): set the same num-partitions in every node config (default: min-participants)")
        if said:
            self.num_partitions = next(iter(said.values()))
        if said and self.fed.objective.advantage_groups == "horizontal":   # the receivers' share, and prompts
            self.partitions = next(iter(said.values()))
            bounds = dataclasses.replace(self.inbox.config.bounds,
                                         max_group_size=self.fed.completions_per_prompt(self.partitions))
            self.inbox.config = dataclasses.replace(self.inbox.config, bounds=bounds)

    def _admit_one(self, addr: Address, info: dict, challenge: bytes) -> None:
        name = info["participant"]
        if name not in self.keys:
            return self._refuse(addr, "unknown_participant", f"says it is {name[:64]!r}, which has no public key")
        if fingerprint(self.keys[name]) != info["key_fp"]:
            return self._refuse(addr, "key_mismatch", f"key of {name!r} does not match the key directory")
        if self.keys.is_revoked(name):
            where = self.keys.revocations.path if self.keys.revocations is not None else "revoked.txt"
            return self._refuse(addr, "revoked_key", f"the key of {name!r} is revoked ({where})")
        if not verify_challenge(self.keys[name], self.run_id, str(addr), name, challenge, info["proof"]):
            return self._refuse(addr, "bad_proof", f"claims {name!r} but cannot sign its challenge with {name!r}'s key")
        self.claimed[addr] = name                       # proven: it holds that participant's key
        if str(info.get("task_digest", "")) != self.task_digest:
            return self._refuse(addr, "task_mismatch", f"participant {name!r} announces task digest "
                                f"{str(info.get('task_digest', ''))[:16] or '(procedural)'}, this run's is "
                                f"{self.task_digest[:16] or '(procedural)'}: another data file, split, column or "
                                "reward function (docs/own-task.md)")
        if self.nodes.address_of(name) is not None:
            return self._refuse(addr, "duplicate_participant", f"participant {name!r} is already connected")
        long = hello_too_long(info)
        if long:
            return self._refuse(addr, "bad_hello", long)
        parts = _int_or_none(info.get("num_partitions"))
        if self.num_partitions is not None and parts is not None and parts != self.num_partitions:
            return self._refuse(addr, "num_partitions_mismatch", f"participant {name!r} was configured with "
                                f"num-partitions={parts}, this run's participants with {self.num_partitions}: "
                                "set the same num-partitions in every node config")
        self.nodes[addr] = info

    def _refuse(self, addr: Address, reason: str, detail: str) -> None:
        detail = clip_reason(str(detail))
        self.refused[addr] = reason
        self.refusals[addr] = detail
        self.log(WARNING, "%s not admitted (%s): %s", self.label(addr), reason, detail)

    # ------------------------------------------------------------------ steps the schedules use
    def name(self, addr: Address) -> str:
        return self.nodes[addr]["participant"]

    def texts_request(self, addr: Address) -> bool | list[bool]:
        """The ``texts`` field of a generate/exchange request: one variant as a bool, two as a list
        (the frame without texts, then the one with them)."""
        v = self.variants.get(self.name(addr), (self.texts,))
        return v[0] if len(v) == 1 else list(v)

    def _needs_texts(self, receiver: str, sender: str) -> bool:
        fp = self.fps
        return receiver_needs_texts(self.fed.wire_texts, fp.get(sender, ""), fp.get(receiver, ""))

    def ask(self, action: str, requests: Mapping[Address, dict], stats: RoundStats | None,
            timeout: float | None = None) -> tuple[dict[Address, Reply], dict[Address, Failure]]:
        """Send through the boundary; log and count every drop (``fed/dropped/<reason>``)."""
        label = f"round {stats.rnd} {action}" if stats is not None else action
        names = {a: self.nodes.get(a, {}).get("participant", str(a)) for a in requests}
        with PhaseProgress(label, names, self.log, self.fed.progress_every_s, self.clock,
                           tracked=self.io.reports_replies) as progress:
            replies, dropped = self.io.send(action, requests, self.fed.round_timeout_s if timeout is None else timeout,
                                            on_reply=progress.replied)
        for addr, why in dropped.items():
            self.log(WARNING, "participant %s dropped from this phase (%s): %s: %s",
                     self.nodes.get(addr, {}).get("participant", addr), action, why.reason,
                     reward_error_of(why.detail) or why.detail[-300:])
            if stats is not None:
                stats.dropped[why.reason] += 1
        if stats is not None:
            self.members.record(dropped)
        self._stop_on_reward_error(action, dropped)
        return replies, dropped

    def _stop_on_reward_error(self, action: str, dropped: Mapping[Address, Failure]) -> None:
        """``task-reward-errors = stop``: a participant whose reward function failed ends the run now
        (TRL raises at the first step), naming each such participant and its function's whole message."""
        if self.fed.task.reward_errors != "stop":
            return
        errors = {self.nodes.get(a, {}).get("participant", str(a)): reward_error_of(f.detail) for a, f in dropped.items()}
        errors = {n: e for n, e in errors.items() if e}
        if not errors:
            return
        msg = (f"{action}: the reward function failed, so the run stops (task-reward-errors = \"stop\"; "
               "\"drop\" drops that batch and goes on): "
               + "; ".join(f"participant {n}: {e}" for n, e in sorted(errors.items())))
        self.log(logging.ERROR, "%s", msg)
        raise RewardFunctionFailed(msg)

    def generate(self, rnd: int, stats: RoundStats) -> list[VerifiedFrame]:
        """Every admitted participant generates and signs its batch of round ``rnd``; returns the
        verified frames (the participants' generate metrics go to their rows)."""
        replies, failed = self.ask("generate", {a: {"round": rnd, "texts": self.texts_request(a)}
                                                for a in self.members.round_nodes}, stats)
        stats.fed["fed/generate_failures"] = float(len(failed))
        for addr, r in replies.items():
            stats.row(self.name(addr)).update(self._kept_metrics(addr, r, stats))
        self._log_phase(rnd, "generate", replies)
        return self.verify(replies, rnd, stats)

    def relay(self, action: str, frames: list[VerifiedFrame], rnd: int, stats: RoundStats) -> dict[Address, Reply]:
        """Send each participant its peers' ``frames`` (within its peer budget) with ``action``;
        their metrics go to their rows. Returns the checked replies."""
        requests = {}
        sent: dict[bool, list[tuple[int, int]]] = {False: [], True: []}   # variant -> per receiver (bytes, tokens)
        receivers = sorted(self.members.round_nodes, key=_order)
        by_sender: dict[str, list[VerifiedFrame]] = {}
        for f in frames:
            by_sender.setdefault(f.sender, []).append(f)
        k = self.fed.peers_per_round
        plan = peer_plan(list(by_sender), [self.name(a) for a in receivers], k, self.fed.seed, rnd, draw=self.draw)
        for i, addr in enumerate(receivers):
            name = self.name(addr)
            chosen = select_for_receiver([f for s in plan[name] for f in by_sender[s]], name,
                                         self.budgets.get(name, self.fed.peer_budget), rotation=rnd + i)
            out, tally = [], {False: [0, 0], True: [0, 0]}
            for f in chosen:
                frame, has_texts = f.for_receiver(self._needs_texts(name, f.sender))
                out.append(frame)
                t = tally[has_texts]
                t[0] += len(frame)
                t[1] += f.tokens
            for variant, (nbytes, ntok) in tally.items():
                if ntok:
                    sent[variant].append((nbytes, ntok))
            requests[addr] = {"round": rnd, "texts": self.texts_request(addr), "frames": out}
        replies, failed = self.ask(action, requests, stats)
        stats.fed.update({"fed/replies": float(len(replies)), "fed/train_failures": float(len(failed)),
                          "fed/bytes_relayed": float(sum(len(f) for q in requests.values() for f in q["frames"])),
                          "fed/frames_relayed": float(sum(len(q["frames"]) for q in requests.values()))})
        stats.fed.update(wire_metrics(sent))
        got = reach(plan)
        short = short_reach(got, list(by_sender), list(plan), k)
        stats.fed.update({"fed/peers_per_receiver": float(sum(map(len, plan.values())) / max(1, len(plan))),
                          "fed/sender_reach_min": float(min((got.get(s, 0) for s in by_sender), default=0)),
                          "fed/sender_reach_max": float(max((got.get(s, 0) for s in by_sender), default=0)),
                          "fed/sender_reach_short": float(len(short))})
        if short:
            self.log(WARNING, "round %d %s: %d verified frame(s) reached fewer receivers than peers-per-round=%d "
                              "asks: %s", rnd, action, len(short), k, name_list(short))
        self._log_phase(rnd, action, replies)
        for addr, r in list(replies.items()):
            name = self.name(addr)
            kept = self._kept_metrics(addr, r, stats)
            try:
                per_source = summarize_sources(kept, name)
            except Exception as e:                              # noqa: BLE001 - a reply never ends the run
                self.log(WARNING, "participant %s: metrics unusable (%s: %s)", name, type(e).__name__, e)
                stats.dropped["internal_error"] += 1
                per_source = kept
            row = stats.row(name)
            row.update(per_source)
            row["model_id"] = self.nodes[addr]["model_id"]
            row["model_weights"] = self.nodes[addr].get("weights_fp", "")
        return replies

    def _kept_metrics(self, addr: Address, reply: Reply, stats: RoundStats | None) -> dict[str, float]:
        """A reply's metrics with the names ``MetricNames`` keeps (``fed/metrics_dropped`` counts the rest)."""
        kept, dropped = self.metric_names.admit(self.name(addr), reply.metrics)
        if dropped:
            self.log(WARNING, "participant %s: %d metric names dropped (too long or too many new ones)",
                     self.name(addr), dropped)
            if stats is not None:
                stats.fed["fed/metrics_dropped"] = stats.fed.get("fed/metrics_dropped", 0.0) + dropped
        return kept

    def _log_phase(self, rnd: int, action: str, replies: Mapping[Address, Reply]) -> None:
        """One console line when a phase ends: per participant its seconds and tokens/s."""
        if len(replies) > CONSOLE_ROWS:
            secs = {self.name(a): float(r.metrics.get("gen/seconds", 0.0)) + float(r.metrics.get("train/seconds", 0.0))
                    for a, r in replies.items()}
            self.log(INFO, "round %d %s done: %d replies, seconds %s", rnd, action, len(replies), spread(secs, "{:.1f}"))
            return
        parts = [phase_summary(self.name(a), r.metrics) for a, r in sorted(replies.items(), key=lambda kv: self.name(kv[0]))]
        if parts:
            self.log(INFO, "round %d %s done: %s", rnd, action, "; ".join(parts))

    def verify(self, replies: Mapping[Address, Reply], rnd: int, stats: RoundStats) -> list[VerifiedFrame]:
        """Each reply's frames as the server sees them: the header must name the participant the
        node said hello as (checked *before* anything is committed to the replay guard), then
        signature with that participant's key, run, round, replay and content (``Inbox``)."""
        out = []
        for addr in sorted(replies, key=_order):
            name = self.name(addr)
            frames = replies[addr].frames
            texts_variant = None
            if len(self.variants.get(name, ())) > 1 and len(frames) == 2:
                frames, texts_variant = frames[:1], frames[1]   # the boundary checked their order and headers
            for frame in frames:
                try:
                    acc = self.inbox.accept(frame, expected_round=rnd, expected_sender=name)
                    self._check_tasks(acc.batch)
                except Exception as e:                          # noqa: BLE001 - never let a frame end the run
                    self._refused_frame(name, rnd, stats, e)
                    continue
                self._pin_vocab(name, acc.header.vocab_size)
                with_texts = self._verify_texts_variant(texts_variant, acc.batch, rnd, stats) if texts_variant else None
                out.append(VerifiedFrame(acc.header, frame, with_texts))
        stats.fed["fed/quarantined"] = float(len(self.inbox.quarantined))
        return out

    def _pin_vocab(self, name: str, vocab_size: int) -> None:
        """A sender whose hello named no vocabulary size is held to its first verified frame's: a later
        frame declaring another is refused (``wrong_tokenizer``), as with a hello that named one."""
        said = (self.inbox.config.tokenizers or {}).get(name)
        if said is None or said[1] is not None:
            return
        self.vocab_pinned[name] = vocab_size
        tokenizers = dict(self.inbox.config.tokenizers)
        tokenizers[name] = (said[0], vocab_size)
        self.inbox.config = dataclasses.replace(self.inbox.config, tokenizers=tokenizers)

    def _check_tasks(self, batch) -> None:
        """Every group's task id names a train task of this run, once per batch (what every receiver
        checks first: ``eval_task``, ``unknown_task``, ``duplicate_task``; horizontal groups: one of
        the round's shared prompts, ``unshared_task``); with texts, the prompt text is the task's
        (``prompt_mismatch``, as a receiver with another tokenizer checks it)."""
        seen: set[str] = set()
        shared = None
        if self.partitions:                             # horizontal: the round's shared prompts only
            shared = frozenset(p.task_id for p in self.fed.task.prompts_for_round(0, self.partitions, batch.round))
        for gi, g in enumerate(batch.groups):
            task = resolve_task(g.task_id, f"groups[{gi}]", self.tasks, seen, shared)
            if g.prompt_text and g.prompt_text != task.text:
                raise BatchValidationError("prompt_mismatch", f"groups[{gi}].prompt_text: not the text of task "
                                                              f"{g.task_id[:64]!r}")

    def _refused_frame(self, name: str, rnd: int, stats: RoundStats, e: Exception, what: str = "batch") -> None:
        """Count and log a refused frame of participant ``name``'s reply; charge ``name`` with it (the
        reply came from the node that proved it is ``name``: whatever its frames hold, it sent them)
        and quarantine it after ``reverify-quarantine-after`` charges."""
        reason = e.reason if isinstance(e, BatchValidationError) else "internal_error"
        stats.rejected[reason] += 1
        detail = str(e) if isinstance(e, BatchValidationError) else f"{type(e).__name__}: {e}"
        self.log(WARNING, "round %d: %s from %s rejected: %s", rnd, what, name, detail[:300])
        if self.inbox.charge(name, reason, self.fed.reverify.quarantine_after):
            self.log(WARNING, "participant %s quarantined by the server after %d refused frames: its frames are "
                              "no longer relayed", name, self.inbox.strikes[name])

    def _verify_texts_variant(self, frame: bytes, plain, rnd: int, stats: RoundStats) -> bytes | None:
        """The texts variant of a verified batch: signed by the same sender (its seq is already used
        by the variant without texts, so it bypasses the replay guard, not the signature), within the
        run's bounds (checked as the variant without texts was: declared sizes before decompressing),
        and the same batch apart from its texts. None (counted as ``variant_mismatch`` or the
        frame's own reason, charged to the sender) when not; the variant without texts is relayed
        to everyone then."""
        try:
            h, body = verify_frame(frame, self.keys, self.inbox.config.limits)
            if h.sender != plain.sender:
                raise BatchValidationError("variant_mismatch", f"the texts variant is signed by {h.sender[:64]!r}")
            batch = self.inbox.decode_checked(h, body, self.inbox.config.bounds)
            self._check_tasks(batch)
            diff = texts_differ(plain, batch)
            if diff:
                raise BatchValidationError("variant_mismatch", f"the texts variant differs in {diff}")
            return frame
        except Exception as e:                                  # noqa: BLE001 - never let a frame end the run
            self._refused_frame(plain.sender, rnd, stats, e, "texts variant")
        return None

    def evaluate(self, rnd: int) -> None:
        """Ask the evaluation round's sample (``fraction-evaluate``, ``min-evaluate-participants``;
        every admitted participant at 1.0) to evaluate, and write their rows."""
        fed = self.fed
        names = [self.name(a) for a in self.nodes]
        chosen = set(sample_participants(names, fed.fraction_evaluate, fed.min_evaluate_participants, self.eval_lags,
                                         seed_draw(fed.seed + EVAL_SAMPLE_SALT, rnd)))
        if len(chosen) < len(names):                     # the evaluation's own fair shares (engine.sampling.credit)
            self.eval_lags = credit(self.eval_lags, names, sorted(chosen))
        asked = [a for a in self.nodes if self.name(a) in chosen]
        if len(asked) < len(self.nodes):
            self.log(INFO, "eval r%d: %d of %d participants sampled (fraction-evaluate=%g, min %d)", rnd, len(asked),
                     len(self.nodes), fed.fraction_evaluate, fed.min_evaluate_participants)
        replies, _ = self.ask("evaluate", {a: {"round": rnd} for a in asked}, None)
        rows = []
        for addr in sorted(replies, key=lambda a: self.name(a)):
            name, m = self.name(addr), self._kept_metrics(addr, replies[addr], None)
            rows.append({"round": rnd, "participant": name, "phase": "eval", **m})
            if len(replies) <= CONSOLE_ROWS:
                self.log(INFO, "  eval r%d %-12s %s", rnd, name, eval_line(m))
        if len(replies) > CONSOLE_ROWS:
            for key in ("eval/id/accuracy", "eval/ood/accuracy"):
                vals = {r["participant"]: float(r[key]) for r in rows if isinstance(r.get(key), (int, float))}
                if vals:                                 # no OOD families: no OOD line
                    self.log(INFO, "  eval r%d %s over %d participants: %s", rnd, key, len(vals), spread(vals))
        self.writer.write(rows)

    def finish(self) -> None:
        """Stop every participant (short deadline: it only acknowledges), retired ones still connected too."""
        self.finish_nodes(list(self.nodes) + [a for a in self.members.retired_nodes if a not in self.nodes])

    def finish_nodes(self, addrs: list[Address]) -> None:
        try:
            self.io.send("finish", {a: {} for a in addrs}, min(60.0, self.fed.round_timeout_s))
        except Exception as e:                                  # noqa: BLE001 - best effort at the end
            self.log(WARNING, "finish: %s", e)

    def _log_round(self, rnd: int, rows: list[dict], fed_row: dict, stats: RoundStats) -> None:
        self.log(INFO, "round %d/%d: %d replies, %d dropped, %d rejected, %.0f bytes relayed, %.1f s", rnd,
                 self.fed.num_rounds, int(fed_row.get("fed/replies", 0)), sum(stats.dropped.values()),
                 int(fed_row["fed/rejected"]), fed_row.get("fed/bytes_relayed", 0.0), fed_row["fed/round_seconds"])
        late = budget_rejections(rows)
        if late:
            self.log(WARNING, "round %d: receivers dropped %d peer batches past their time budget "
                     "(reverify-time-budget-s = %g s; slow reward functions?): %s", rnd, sum(late.values()),
                     self.fed.reverify.time_budget_s, ", ".join(f"{p} {n}" for p, n in sorted(late.items())[:8]))
        if len(rows) > CONSOLE_ROWS:                     # many participants: aggregates and the extremes
            for key, label in (("reward/mean", "reward"), ("train/loss", "loss"), ("train/peer_samples", "peers"),
                               ("offpolicy/ratio_mean", "ratio")):
                vals = {r["participant"]: float(r[key]) for r in rows if isinstance(r.get(key), (int, float))}
                if vals:
                    self.log(INFO, "  %-7s over %d participants: %s", label, len(vals), spread(vals))
            return
        for row in sorted(rows, key=lambda r: r["participant"]):
            self.log(INFO, "  %-12s reward %.3f  solved %.2f  loss %+.4f  peers %3d  filtered %.2f  ratio %.3f%s",
                     row["participant"], row.get("reward/mean", float("nan")),
                     row.get("reward/solved_frac", float("nan")), row.get("train/loss", float("nan")),
                     int(row.get("train/peer_samples", 0)), row.get("offpolicy/filtered_frac", 0.0),
                     row.get("offpolicy/ratio_mean", float("nan")), per_function_line(row))

    # ------------------------------------------------------------------ state
    def _save_state(self, rnd: int) -> None:
        state: dict[str, Any] = {
            "completed_round": rnd, "run_name": self.fed.run_name, "run_id": self.run_id,
            "guard": self.guard.to_json(),
            "draw_next": self.draws.to_json(), "lags": self.members.lags,
            "pending": [{"sender": f.sender, "round": f.round, "completions": f.completions, "tokens": f.tokens,
                         "frame": base64.b64encode(f.frame).decode(),
                         "frame_texts": base64.b64encode(f.frame_texts).decode() if f.frame_texts else None}
                        for f in self.pending]}
        atomic_write(self.state_path, json.dumps(state))

    def _load_state(self) -> None:
        if not self.state_path.exists():
            self.log(INFO, "resume: no %s yet, starting at round 1", self.state_path)
            return
        state = json.loads(self.state_path.read_text())
        if state["run_name"] != self.fed.run_name:
            raise ValueError(f"resume: {self.state_path} belongs to run {state['run_name']!r}, "
                             f"not {self.fed.run_name!r}")
        self.guard = ReplayGuard.from_json(state["guard"])
        self.run_id = str(state.get("run_id") or self.fed.run_name)     # a state saved before run ids had nonces
        self.inbox = Inbox(self.keys, dataclasses.replace(self.inbox.config, run_id=self.run_id), self.guard)
        frames = [(base64.b64decode(p["frame"]), base64.b64decode(p["frame_texts"]) if p.get("frame_texts") else None)
                  for p in state["pending"]]
        self.pending = [VerifiedFrame(parse_header(f, self.inbox.config.limits), f, t) for f, t in frames]
        if state.get("draw_next"):                      # the committed seed of the next round, kept (engine.draw)
            self.draws = Draws.from_json(state["draw_next"], self.draws.entropy)
        self.members.lags = {str(k): float(v) for k, v in (state.get("lags") or {}).items()}
        self.completed_round = int(state["completed_round"])
        self.start_round = self.completed_round + 1
        self.log(INFO, "resume: round %d done, continuing at round %d", self.start_round - 1, self.start_round)
