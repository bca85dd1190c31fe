"""The round engine at scale: N lightweight participants that sign and verify real frames, no model.

    ftis-fed bench swarm --participants 256 1024 --rounds 4 --peers-per-round 4 --fraction-train 1.0

Each :class:`LightParticipant` is the engine's counterpart of a real one without a policy: it answers
hello with a real proof of possession, generates a valid batch (random token ids, log-probs and
rewards; real Ed25519 signature, real codec) and, when it learns, verifies every peer frame it gets
with its own ``Inbox`` (signature, replay guard, validation), as a real receiver does before
training. It persists the rejoin counters (``ftis_fed.participant_state``) like a real participant,
so restarts can be tested through the in-process transport.

The engine runs everything the product runs (admission, sampling, relay, verification, replay guard,
metrics rows, CSV, plots, ``server_state.json``) over ``InProcessTransport``. **Server CPU** per round
is the process CPU time of the round minus the CPU time the participants' ``handle`` calls spent
(thread CPU clocks): what the engine and the transport cost (``plot_cpu_s``: the part of it that
redraws the PNGs). RSS is the whole process's (server and participants). One JSON line per N, then
the slope (least squares over the Ns: server CPU seconds, RSS and relayed bytes per participant);
files of those lines from separate processes (one N each, so RSS is not carried over) are combined
with ``--slope FILE ...`` (``run_swarm``; the command line is ``bench/cli.py``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import tempfile
import threading
import time
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import psutil

from ftis_fed import participant_state
from ftis_fed.config.federation import FederationConfig
from ftis_fed.engine.core import Engine
from ftis_fed.engine.inprocess import InProcessTransport
from ftis_fed.trust.inbox import Inbox, InboxConfig
from ftis_fed.trust.signing import (KeyDirectory, ReplayGuard, fingerprint, generate_keypair, load_key_directory, run_name_of,
                                    load_private_key, key_paths, sign_batch, sign_challenge)
from ftis_fed.tasks.suite import task_at
from ftis_fed.wire.batch import BatchValidationError, CompletionBatch, make_group

#: the run's default sampling (what the server's and receivers' bounds expect of a run left at its defaults)
SAMPLING = FederationConfig().sampling
#: the default families' first (its train split: a task every node resolves)
FAMILY = FederationConfig().task.families[0]


class LightParticipant:
    """A participant without a model (module docstring). ``cpu``: thread CPU seconds spent in handle."""

    def __init__(self, name: str, key, keys: KeyDirectory, run: str, state_dir: str | Path | None = None,
                 run_key: str = "", prompts: int = 2, group: int = 4, tokens: int = 8, seed: int = 0):
        self.name, self.key, self.run, self.run_key = name, key, run, run_key
        self.state_dir = Path(state_dir) if state_dir is not None else None
        self.prompts, self.group, self.tokens = prompts, group, tokens
        self.rng = np.random.default_rng([seed, len(name), sum(map(ord, name))])
        self.seq, self.trained_round, self.guard = 0, 0, ReplayGuard()
        got = participant_state.load(self.state_dir, run_key) if self.state_dir is not None else None
        if got is not None:                              # a restart within the run: continue
            self.seq, self.trained_round, self.guard = got.seq, got.trained_round, got.guard
        self.inbox = Inbox(keys, InboxConfig(run_id=run), self.guard)
        self.cpu = 0.0
        self.trained: list[int] = []                     # rounds this instance trained on
        self.signed: list[int] = []                      # sequence numbers this instance signed
        self.accepted: dict[int, list[str]] = {}         # round -> senders of the peer frames it accepted
        self._lock = threading.Lock()

    def handle(self, action: str, request: dict) -> dict:
        t0 = time.thread_time()
        try:
            return self._handle(action, request)
        finally:
            with self._lock:
                self.cpu += time.thread_time() - t0

    def _handle(self, action: str, r: dict) -> dict:
        if action == "hello":
            if run_name_of(r["run"]) == self.run and r["run"] != self.run:      # this run's id (run name@nonce)
                self.run = r["run"]
                self.inbox.config = dataclasses.replace(self.inbox.config, run_id=self.run)
            return {"info": {"participant": self.name, "model_id": "light", "tokenizer_fp": "light-tok",
                             "vocab_size": 1000, "key_fp": fingerprint(self.key), "completed_round": self.trained_round,
                             "proof": sign_challenge(self.key, r["run"], r["node"], self.name, r["challenge"])}}
        if action == "generate":
            return {"frames": [self._frame(int(r["round"]))], "metrics": {"reward/mean": 0.5, "gen/tokens": 1.0}}
        if action == "learn":
            return {"metrics": self._learn(int(r["round"]), list(r["frames"]), int(r["round"]))}
        if action == "exchange":
            frame = self._frame(int(r["round"]))
            return {"frames": [frame], "metrics": self._learn(int(r["round"]), list(r["frames"]), int(r["round"]) - 1)}
        if action == "evaluate":
            return {"metrics": {"eval/id/accuracy": 0.0}}
        if action == "finish":
            return {"info": {"stopped": True}}
        raise ValueError(f"unknown action {action!r}")

    def _frame(self, rnd: int) -> bytes:
        self.seq = max(self.seq + 1, rnd << 16)
        self.signed.append(self.seq)
        self._save()
        groups = []
        for p in range(self.prompts):
            comps = [self.rng.integers(3, 1000, size=self.tokens).tolist() for _ in range(self.group)]
            lps = [(-self.rng.random(self.tokens) * 2).tolist() for _ in range(self.group)]
            rewards = [float(x) for x in self.rng.integers(0, 2, size=self.group)]
            task = task_at(FAMILY, "train", 0, rnd * self.prompts + p)       # a real train task of the run's
            groups.append(make_group([1, 2, 3, 4 + p], comps, lps, rewards, task.task_id, task.reference))
        batch = CompletionBatch(sender=self.name, run_id=self.run, round=rnd, seq=self.seq, model_id="light",
                                tokenizer_fp="light-tok", vocab_size=1000, sampling=SAMPLING, groups=tuple(groups))
        return sign_batch(batch, self.key)

    def _learn(self, rnd: int, frames: list[bytes], peer_round: int) -> dict:
        if rnd <= self.trained_round:                    # trained on it before a restart: never twice
            return {"train/already_trained": 1.0}
        got = []
        for f in frames:
            try:
                got.append(self.inbox.accept(f, expected_round=peer_round).batch.sender)
            except BatchValidationError:
                pass
        self.accepted[rnd] = got
        self.trained.append(rnd)
        self.trained_round = rnd
        self._save()
        return {"train/peer_samples": float(len(got) * self.prompts * self.group), "train/loss": 0.0,
                "offpolicy/accepted": float(len(got))}

    def _save(self) -> None:
        if self.state_dir is not None:
            participant_state.save(self.state_dir, self.run_key, self.seq, self.trained_round, self.guard)


def light_federation(out: Path, n: int, *, prefix: str = "p", run: str = "swarm", run_key: str = "",
                     state: bool = False) -> tuple[dict[str, LightParticipant], KeyDirectory]:
    """``n`` light participants with fresh keys in ``out/keys``; their state dirs under
    ``out/participants`` when ``state``."""
    names = [f"{prefix}{i:04d}" for i in range(n)]
    for name in names:
        generate_keypair(name, out / "keys")
    keys = load_key_directory(out / "keys" / "public")
    parts = {name: LightParticipant(name, load_private_key(key_paths(name, out / "keys").private), keys, run,
                                    out / "participants" / name if state else None, run_key, seed=i)
             for i, name in enumerate(names)}
    return parts, keys


def measure(n: int, rounds: int, peers: int, fraction: float, out: Path, plots: bool = True,
            plot_every: int = 1) -> dict:
    """One run of ``n`` light participants. ``plot_every`` = 1: the plots drawn in this process after
    every round, their CPU measured (``plot_cpu_s``: what they cost where drawn in the round); any
    other value: as the run-config key, the engine's own background redraws (``plot_cpu_s`` 0)."""
    parts, keys = light_federation(out, n)
    t_admit = {}
    fed = FederationConfig(num_rounds=rounds, min_participants=min(n, 2), wait_for_participants_s=60,
                           round_timeout_s=600, run_name="swarm", output_dir=str(out), eval_every=0,
                           peers_per_round=peers, fraction_train=fraction, min_train_participants=2,
                           progress_every_s=0, plot_every=plot_every)
    proc = psutil.Process()
    per_round: list[dict] = []
    engine = Engine(fed, keys, out, InProcessTransport(parts), plots=plots, log=lambda *a, **k: None)
    marks = {"cpu": time.process_time(), "wall": time.perf_counter(),
             "part": sum(p.cpu for p in parts.values())}
    orig_save = engine._save_state

    def save_and_mark(rnd: int) -> None:                 # after the round, its state and before plots
        orig_save(rnd)
        p0 = time.process_time()
        if plots and plot_every == 1:
            engine.writer.plot()
        plot_cpu = time.process_time() - p0
        cpu, wall, part = time.process_time(), time.perf_counter(), sum(p.cpu for p in parts.values())
        fed_row = [r for r in engine.writer.rows() if r["round"] == rnd and r["participant"] == "_federation"][-1]
        if rnd == 1:
            t_admit["cpu_s"] = admit_cpu["s"]
        per_round.append({"round": rnd, "server_cpu_s": (cpu - marks["cpu"]) - (part - marks["part"]),
                          "plot_cpu_s": plot_cpu,
                          "participants_cpu_s": part - marks["part"], "wall_s": wall - marks["wall"],
                          "rss_mb": proc.memory_info().rss / 2**20,
                          "bytes_relayed": fed_row.get("fed/bytes_relayed", 0.0),
                          "frames_relayed": fed_row.get("fed/frames_relayed", 0.0),
                          "state_bytes": engine.state_path.stat().st_size})
        marks.update(cpu=time.process_time(), wall=time.perf_counter(), part=part)   # the bench's reading: not the next round's

    admit_cpu = {"s": 0.0}
    orig_admit = engine.admit

    def timed_admit(*args, **kwargs):
        c0, p0 = time.process_time(), sum(p.cpu for p in parts.values())
        try:
            return orig_admit(*args, **kwargs)
        finally:
            admit_cpu["s"] = (time.process_time() - c0) - (sum(p.cpu for p in parts.values()) - p0)
            marks.update(cpu=time.process_time(), wall=time.perf_counter(), part=sum(p.cpu for p in parts.values()))

    engine.admit = timed_admit
    engine._save_state = save_and_mark
    engine.plots = plots and plot_every != 1             # plot_every 1: plotted inside the measured round above
    engine.run()
    steady = per_round[1:] or per_round                  # round 1 also pays for the first plots/CSV
    mean = lambda k: float(np.mean([r[k] for r in steady]))  # noqa: E731
    return {"participants": n, "rounds": rounds, "peers_per_round": peers, "fraction_train": fraction,
            "server_cpu_s_per_round": mean("server_cpu_s"), "plot_cpu_s_per_round": mean("plot_cpu_s"),
            "participants_cpu_s_per_round": mean("participants_cpu_s"),
            "wall_s_per_round": mean("wall_s"), "rss_mb_end": per_round[-1]["rss_mb"],
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "bytes_relayed_per_round": mean("bytes_relayed"), "frames_relayed_per_round": mean("frames_relayed"),
            "server_state_bytes": per_round[-1]["state_bytes"], "admission_server_cpu_s": t_admit.get("cpu_s"),
            "rss_mb_growth_per_round": float(np.polyfit([r["round"] for r in steady], [r["rss_mb"] for r in steady], 1)[0])
            if len(steady) > 1 else float("nan"), "plot_every": plot_every, "load": os.getloadavg(),
            "per_round": per_round}


def slope(results: list[dict], key: str) -> float:
    """Least-squares slope of ``key`` against the number of participants."""
    x = np.asarray([r["participants"] for r in results], float)
    y = np.asarray([r[key] for r in results], float)
    return float(np.polyfit(x, y, 1)[0]) if len(x) > 1 else float("nan")


def run_swarm(participants: list[int], rounds: int, peers: int, fraction: float, plots: bool = True,
              plot_every: int = 1, out: str = "", slope_files: Sequence[str] = ()) -> Iterator[dict]:
    """``measure`` at each N of ``participants`` (in ``out``, '' = a temporary folder), or only the
    lines read from ``slope_files``; yields the lines to print as they come: one per N, then the
    slope per participant when there are two Ns or more."""
    results = [json.loads(line) for f in slope_files for line in Path(f).read_text().splitlines()
               if line.startswith('{"participants"')]
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(out or tmp)
        for n in [] if slope_files else participants:
            r = measure(n, rounds, peers, fraction, base / f"n{n}", plots=plots, plot_every=plot_every)
            results.append(r)
            yield {k: v for k, v in r.items() if k != "per_round"}
    if len(results) > 1:
        yield {"slope_per_participant": {
            k: slope(results, k) for k in ("server_cpu_s_per_round", "plot_cpu_s_per_round", "rss_mb_end", "bytes_relayed_per_round",
                                           "server_state_bytes")}, "load": os.getloadavg()}
