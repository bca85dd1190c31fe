"""A task id -> the receiver's own copy of that task (text and reference), or a named refusal.

A receiver never takes a peer's word for what a task says or what its answer is: it rebuilds the
task from its id with its own code (``task_at``) or its own files, and scores the peer's
completions against that. ``TaskResolver.resolve`` raises :class:`TaskRefused` with a stable
``reason``:

- ``eval_task``: the id names held-out material: the ``eval`` split of a procedural family, an
  out-of-distribution family (evaluation only, any split), GSM8K ``test``, MATH-500's ``eval``
  split or unsplit MATH-500 ids (``math500/{unique_id}``, evaluation sets), a user task's
  ``user/eval/{row}`` (its held-out rows and families). Training on it would
  leak held-out items into training.
- ``unknown_task``: the id does not parse, names no known family, a family or task seed this run
  does not train on, a procedural task in a run that trains on a benchmark (``source``), or a
  benchmark item this receiver has not loaded itself.

Procedural ids are ``{family}/{split}/{seed}/{index}`` (canonical decimal, no sign or leading
zero, at most 18 digits): everything the task is made of follows from the id, so nothing is
trusted. GSM8K train items (``gsm8k/train/{row}``), MATH-500 train items
(``math500/train/{unique_id}``) and a user task's train rows (``user/train/{row}``) can only be
rebuilt from a file the receiver loaded itself (``known``: ``TaskSpec.known_tasks()``, from its
own ``gsm8k-data`` / ``math500-data`` / ``task-data``); it then
trusts its own file (text and reference), and that a row number means the same row for the sender
(the prompt-text / prompt-ids check catches a different file).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache

from ftis_fed.tasks.prompt import Prompt
from ftis_fed.tasks.families import FAMILIES
from ftis_fed.tasks.suite import task_at
from ftis_fed.tasks.user import USER

#: Longest task id a receiver parses (procedural ids are < 40 characters).
MAX_TASK_ID_CHARS = 128
_DECIMAL = re.compile(r"0|[1-9][0-9]{0,17}")


class TaskRefused(ValueError):
    """A task id the receiver will not train on; ``reason`` is ``eval_task`` or ``unknown_task``."""

    def __init__(self, reason: str, message: str):
        super().__init__(f"[{reason}] {message}")
        self.reason = reason


@dataclass(frozen=True)
class TaskResolver:
    """This receiver's tasks: the run's trainable families and task seed, plus benchmark items it loaded.

    families: the procedural families this run trains on (``task-families``).
    seed: the run's task seed (``task-seed``); honest senders draw every instance with it.
    known: task id -> Prompt for train items of file-based benchmarks this receiver loaded itself
        (e.g. ``{p.task_id: p for p in load_gsm8k(path, "train")}``); empty by default.
    source: the run's ``task-source``; a run that trains on a benchmark refuses procedural ids.
    """

    families: tuple[str, ...]
    seed: int
    known: Mapping[str, Prompt] = field(default_factory=dict)
    source: str = "procedural"

    def resolve(self, task_id: str) -> Prompt:
        """The receiver's own Prompt for ``task_id``; TaskRefused (``eval_task`` / ``unknown_task``) otherwise."""
        if not isinstance(task_id, str) or not task_id or len(task_id) > MAX_TASK_ID_CHARS:
            raise TaskRefused("unknown_task", f"task_id of {len(task_id) if isinstance(task_id, str) else '?'} "
                                              f"characters: must be 1-{MAX_TASK_ID_CHARS}")
        parts = task_id.split("/")
        family = parts[0]
        if family == "math500":
            if len(parts) < 3 or parts[1] != "train":
                raise TaskRefused("eval_task", f"task_id={task_id!r}: MATH-500 outside its train split is an "
                                               "evaluation set")
            if task_id in self.known:
                return self.known[task_id]
            raise TaskRefused("unknown_task", f"task_id={task_id!r}: this receiver has not loaded that "
                                              "benchmark item, so it cannot check it")
        if family == USER:
            if len(parts) != 3 or parts[1] != "train":
                raise TaskRefused("eval_task" if len(parts) == 3 and parts[1] == "eval" else "unknown_task",
                                  f"task_id={task_id!r}: only user/train/<row> ids are trained on (eval rows and "
                                  "held-out families are evaluation sets)")
            if task_id in self.known:
                return self.known[task_id]
            raise TaskRefused("unknown_task", f"task_id={task_id!r}: not a train row of this receiver's own "
                                              "task-data")
        if family == "gsm8k":
            if len(parts) == 3 and parts[1] == "test":
                raise TaskRefused("eval_task", f"task_id={task_id!r}: GSM8K test is an evaluation set")
            if task_id in self.known:
                return self.known[task_id]
            raise TaskRefused("unknown_task", f"task_id={task_id!r}: this receiver has not loaded that "
                                              "benchmark item, so it cannot check it")
        if family not in FAMILIES:
            raise TaskRefused("unknown_task", f"task_id={task_id!r}: family {family[:32]!r} is unknown")
        if self.source != "procedural":
            raise TaskRefused("unknown_task", f"task_id={task_id!r}: this run trains on {self.source}, not on "
                                              "procedural tasks")
        if len(parts) != 4 or not all(_DECIMAL.fullmatch(x) for x in parts[2:]):
            raise TaskRefused("unknown_task", f"task_id={task_id!r}: must be <family>/<split>/<seed>/<index> "
                                              "with decimal seed and index")
        split, seed, index = parts[1], int(parts[2]), int(parts[3])
        if split == "eval" or FAMILIES[family].kind == "ood":
            raise TaskRefused("eval_task", f"task_id={task_id!r}: held-out material ({FAMILIES[family].kind} "
                                           f"family, {split} split) is never trained on")
        if split != "train":
            raise TaskRefused("unknown_task", f"task_id={task_id!r}: split {split!r} is unknown")
        if family not in self.families:
            raise TaskRefused("unknown_task", f"task_id={task_id!r}: family {family!r} is not one of this run's "
                                              f"task-families {list(self.families)}")
        if seed != self.seed:
            raise TaskRefused("unknown_task", f"task_id={task_id!r}: seed {seed} is not this run's task-seed "
                                              f"{self.seed}")
        return _train_task(family, seed, index)


@lru_cache(maxsize=4096)
def _train_task(family: str, seed: int, index: int) -> Prompt:
    return task_at(family, "train", seed, index)
