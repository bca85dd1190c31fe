"""``ftis-fed sim --transport inprocess``: the same run as ``flwr run``, without Flower.

The same run config (``pyproject.toml`` < preset < ``--run-config``, checked whole by
``validate_run_config``, parsed once for the engine and every participant), the same ``Engine`` and the same ``Participant`` code, driven through
``engine.inprocess.InProcessTransport`` in this process: no SuperLink, no Ray, no worker processes,
no per-round Flower messaging. It exists for the research tier (many short rounds of small models),
where Flower's start-up (~65 s a cell) and per-message overhead dominate.

What a worker process gives each participant, and how this runner reproduces it:

- **its own torch RNG.** ``HFPolicy.generate`` seeds torch's *global* generator before sampling, and
  everything after it (e.g. dropout, if a model had any) draws from that generator. Participants in
  one process would share it, and two generating at once on the engine's threads would race. So
  every call runs under one lock (participants take turns, as on a 1-participant-per-core machine)
  and with that participant's own RNG state swapped in: the state a fresh worker process starts
  from (torch's default seed), carried from call to call. Seeded sampling then gives the same
  tokens as in a worker process.
- **its thread count.** ``threads`` (0 = cores / participants), as ``clients.worker`` sets it:
  same kernels, same reduction order.
- **the ClientApp's additions.** Hello replies carry ``supernodes`` (the simulation's node count).

Everything else — admission with proof of key possession, signed frames, the server's and the
receivers' verification, metrics rows — is the engine's and the participants' own code.
Participants take turns, so a cell uses one core; ``ftis-fed grid --jobs 2`` runs two cells at once.
The engine's per-round plot redraw is off (``plots=False``; the grid draws its own figures).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any, Collection

import torch

from ftis_fed.config.participants import absolute_paths, participant_names, participant_spec
from ftis_fed.config.validation import validate_run_config
from ftis_fed.engine.core import Engine
from ftis_fed.engine.inprocess import InProcessTransport
from ftis_fed.participant import Participant
from ftis_fed.policies.shared_base import TORCH_DEFAULT_SEED
from ftis_fed.trust.signing import generate_keypair, key_paths, load_key_directory



class OwnProcessState:
    """A participant as if it ran in its own worker process: calls serialised by ``lock`` (shared by
    the run's participants), each with the participant's own torch RNG state swapped in."""

    def __init__(self, make, lock: threading.Lock, supernodes: int):
        self.lock, self.supernodes = lock, supernodes
        with self.lock:
            outer = torch.get_rng_state()
            torch.manual_seed(TORCH_DEFAULT_SEED)
            try:
                self.participant = make()
                self.rng = torch.get_rng_state()
            finally:
                torch.set_rng_state(outer)

    def handle(self, action: str, request: dict) -> dict:
        with self.lock:
            outer = torch.get_rng_state()
            torch.set_rng_state(self.rng)
            try:
                reply = self.participant.handle(action, request)
            finally:
                self.rng = torch.get_rng_state()
                torch.set_rng_state(outer)
        if action == "hello":
            reply["info"]["supernodes"] = self.supernodes
        return reply


def simulation_keys(out: Path, names: list[str]) -> Path:
    """A key pair per participant in ``out/keys`` (kept when it exists), as the ServerApp makes them."""
    path = out / "keys"
    for name in names:
        if not key_paths(name, path).private.exists():
            generate_keypair(name, path)
    return path


def run_inprocess(run_config: dict[str, Any], run_key: str = "inprocess", explicit: Collection[str] = ()) -> int:
    """Run the federation of ``run_config`` (the merged run config; ``explicit``: the keys the user
    set, ``validate_run_config``) in this process, parsed once: the engine and every participant
    share the one ``FederationConfig``. Returns the last completed round."""
    rc, _ = absolute_paths(run_config, {})
    fed = validate_run_config(rc, explicit=explicit)
    if fed.keys_dir:
        raise ValueError(f"keys-dir={fed.keys_dir!r}: the in-process transport runs a simulation "
                         "(keys-dir = '', keys generated in output-dir/keys)")
    out = Path(fed.output_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    names = participant_names(rc)
    n = len(names)
    churned = [name for pid, name in enumerate(names)
               if participant_spec(rc, {"partition-id": pid, "num-partitions": n}, fed).churn]
    if churned:
        raise ValueError(f"churn (participants {', '.join(churned[:8])}): simulated churn runs through flwr run "
                         "(strategies/churn.py); the in-process transport asks every participant every round: drop "
                         "--transport inprocess, or the churn keys")
    keys = simulation_keys(out, names)
    torch.set_num_threads(fed.threads or max(1, (os.cpu_count() or 1) // n))
    lock = threading.Lock()
    parts = {}
    for pid in range(n):
        node = {"partition-id": pid, "num-partitions": n}

        def make(node=node):
            return Participant(participant_spec(rc, node, fed), fed, run_key=run_key)

        parts[pid + 1] = OwnProcessState(make, lock, n)
    return Engine(fed, load_key_directory(keys / "public"), out, InProcessTransport(parts), declared=names,
                  plots=False).run()
