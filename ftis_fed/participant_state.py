"""What a participant needs to continue after a restart within the same run (a rejoin).

A participant process that dies and starts again (a SuperNode restart with the same key: the same
node id under SuperNode authentication, a new one without) is admitted again at the next round
boundary (``ftis_fed.engine.membership``). To continue rather than start over it keeps, in its
state dir, ``rejoin.json`` (written atomically after every generate and every update, small: no
weights):

- ``seq``: the last sequence number it signed, so a restarted participant never signs a used one
  (every peer's replay guard, and the server's, would refuse it);
- ``trained_round``: the last round it trained on, so it is never trained twice on a round;
- ``guard``: its replay guard of peers' batches, so a replayed peer batch stays refused;
- ``run_key``: the run these belong to (the Flower run id), so a later run in the same state dir
  starts fresh.

It also keeps ``runs_served.json``: every run id (``run-name@nonce``) it said hello to, with the
Flower run it was served in. A participant that is not resuming refuses a hello naming a run it
served in another Flower run (:func:`replayed_run`): an operator re-announcing an earlier run's id
cannot make it accept, or sign for, that run's recorded frames again (docs/security.md).

The model and optimizer come from its last checkpoint (``participant.json`` + ``policy.pt``,
``checkpoint-every``) when that checkpoint is of the same run: with ``checkpoint-every = 1`` a
rejoiner loses nothing; with k > 1 the updates since its last checkpoint are lost, and the rounds
they came from are not trained again.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ftis_fed.atomic import atomic_write
from ftis_fed.trust.signing import ReplayGuard

FILE = "rejoin.json"
FORMAT = "ftis-fed/rejoin/v1"
SERVED = "runs_served.json"
#: run ids kept in ``runs_served.json`` (the oldest forgotten first)
MAX_SERVED = 4096


@dataclass
class Counters:
    seq: int
    trained_round: int
    guard: ReplayGuard


def load(state_dir: str | Path, run_key: str) -> Counters | None:
    """The counters saved by this participant earlier in run ``run_key``; None when there are none
    (first start, another run, or no run key: in-process tests)."""
    path = Path(state_dir) / FILE
    if not run_key or not path.exists():
        return None
    data = json.loads(path.read_text())
    if data.get("format") != FORMAT:
        raise ValueError(f"{path}: format must be {FORMAT!r}")
    if data.get("run_key") != run_key:
        return None
    return Counters(int(data["seq"]), int(data["trained_round"]), ReplayGuard.from_json(data["guard"]))


def save(state_dir: str | Path, run_key: str, seq: int, trained_round: int, guard: ReplayGuard) -> None:
    if not run_key:
        return
    Path(state_dir).mkdir(parents=True, exist_ok=True)
    atomic_write(Path(state_dir) / FILE, json.dumps({"format": FORMAT, "run_key": run_key, "seq": seq,
                                                     "trained_round": trained_round, "guard": guard.to_json()}))


def served_runs(state_dir: str | Path) -> dict[str, str]:
    """run id -> the Flower run (``run_key``) it was served in, as saved in ``state_dir``."""
    try:
        data = json.loads((Path(state_dir) / SERVED).read_text())
    except (OSError, ValueError):
        return {}
    return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}


def record_served(state_dir: str | Path, run_id: str, run_key: str) -> None:
    """Add ``run_id`` (served in Flower run ``run_key``) to ``runs_served.json``."""
    served = served_runs(state_dir)
    served.pop(run_id, None)
    served[run_id] = run_key
    kept = dict(list(served.items())[-MAX_SERVED:])
    Path(state_dir).mkdir(parents=True, exist_ok=True)
    atomic_write(Path(state_dir) / SERVED, json.dumps(kept))


def replayed_run(run_id: str, served_before: dict[str, str], run_key: str, resume: bool) -> str:
    """'' when a hello naming ``run_id`` may be answered, else why not: the participant served that
    run before this process started, in another Flower run (or without one: ``run_key`` ''), and is
    not resuming it. A worker restarted within the same Flower run, and a resumed run, are fine."""
    if resume or run_id not in served_before or (run_key and served_before[run_id] == run_key):
        return ""
    return (f"hello for run {run_id[:300]!r}: this participant served that run before (Flower run "
            f"{served_before[run_id][:64] or '(none)'}) and is not resuming it (resume = false): an earlier run's "
            "id is refused, so its recorded frames cannot be replayed into a new run")
