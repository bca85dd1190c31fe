"""Your own task: a data set with a prompt column, reward functions given by import path.

``task-source = "user"`` trains on the rows of ``task-data``: a local ``.jsonl`` / ``.json`` /
``.csv`` / ``.parquet`` file or a folder of them (read by ``datasets.load_dataset`` where
``datasets`` is installed, else by the standard library: the same canonical rows either way,
``tasks.rows``), a folder written by ``datasets``' ``save_to_disk``, or a hub id loaded with
``datasets.load_dataset`` (needs the ``data`` extra and a reachable hub or its local cache;
``task-data-split`` names the split). Each row gives one prompt
(``task-prompt-column``: a string, or TRL's conversational form, a list with one user message) and,
optionally, a reference answer (``task-answer-column``, carried in batches as the reference). Every
column of the row reaches the reward functions as TRL passes them (``tasks.reward_funcs``).

Held-out evaluation, the same way as the procedural suite:

- split by content: a row is held out when a hash of its prompt text falls below
  ``task-eval-percent`` (so train and eval never share a prompt, whatever the file order), or all
  rows of a separate ``task-eval-data`` file are, and then every row of ``task-data`` trains;
- families: ``task-family-column`` names a column whose values are families; the families named in
  ``task-ood-families`` are held out whole (evaluation only, out of distribution), the others train.

Task ids: ``user/train/{row}`` and ``user/eval/{row}`` (the row of its file). A receiver resolves a
peer's train id only to its own row (``known_tasks``) and refuses eval ids (``tasks.resolve``).

``digest()`` is the task's identity: the rows (canonical JSON of every column of every canonical
row, train file and eval file: never which reader read them), split, columns, families and the reward functions with their source and
version. Participants announce it in hello and sign their batches for the run id bound to it
(``trust.run_id.signed_run_id``), so a peer that reads another file or scores with another function is refused
by the server and by every receiver, by name (``task_mismatch``).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any, Mapping, Sequence

from ftis_fed.tasks.prompt import Prompt
from ftis_fed.tasks.reward_funcs import RewardFuncs, combine, file_stamp, is_file_spec, parse_specs
from ftis_fed.tasks.rows import LOCAL_SUFFIXES, canonical, read_datasets_source, read_local, rows_sha256
from ftis_fed.tasks.scores import GroupScores

#: Family prefix of every user-task id (what the Verifier keys its rule on).
USER = "user"
#: Bumped when what the digest covers changes (2: the rows in ``tasks.rows``' canonical form).
DIGEST_VERSION = 2


def load_rows(source: str, split: str = "train", key: str = "task-data") -> tuple[dict, ...]:
    """Every row of ``source`` in canonical form (``tasks.rows``), in file order; cached per process
    while the file is unchanged."""
    return _load_rows(source, split, key, file_stamp(source))


@lru_cache(maxsize=16)
def _load_rows(source: str, split: str, key: str, stamp: tuple[int, int]) -> tuple[dict, ...]:
    if not str(source).strip():
        raise ValueError(f"{key}='': task-source=user needs a data file, folder or hub id")
    where = f"{key}={source!r}"
    path = Path(source).expanduser()
    if path.is_file():
        if path.suffix not in LOCAL_SUFFIXES:
            raise ValueError(f"{where}: unsupported file type {path.suffix!r}; use {', '.join(LOCAL_SUFFIXES)}")
        rows = read_local(path, split, where)
    elif path.is_dir() and not (path / "dataset_info.json").exists() and not (path / "dataset_dict.json").exists():
        rows = read_local(path, split, where)
    elif path.is_dir() or (str(source).count("/") == 1 and not str(source).startswith((".", "/", "~"))):
        rows = read_datasets_source(str(source), split, where)
    else:
        raise ValueError(f"{where}: no such file or folder (and not a hub id 'owner/name')")
    if not rows:
        raise ValueError(f"{where}: no rows")
    return canonical(rows, where)


def prompt_text(value: Any, where: str) -> str:
    """A prompt cell as the user message a policy renders: a string, or TRL's conversational form
    with exactly one user message (the policies apply their own chat template, no system prompt)."""
    if isinstance(value, str) and value.strip():
        return value
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], dict) \
            and value[0].get("role") == "user" and isinstance(value[0].get("content"), str):
        return value[0]["content"]
    raise ValueError(f"{where}: a prompt must be a non-empty string or [{{'role': 'user', 'content': ...}}] "
                     f"(got {str(value)[:80]!r})")


def _eval_by_hash(text: str, percent: int) -> bool:
    h = int.from_bytes(hashlib.sha256(("user-split\0" + text.strip()).encode()).digest()[:8], "big")
    return h % 100 < percent


@dataclass(frozen=True)
class UserTask:
    """A user task as ``TaskSpec``'s ``task-*`` keys define it (see the module docstring)."""

    data: str
    data_split: str = "train"
    prompt_column: str = "prompt"
    answer_column: str = ""
    family_column: str = ""
    ood_families: tuple[str, ...] = ()
    eval_data: str = ""
    eval_percent: int = 10
    rewards: str = ""
    reward_weights: str = ""
    reward_kwargs: str = ""
    solved_reward: str = ""
    solved_threshold: float = 1.0

    @cached_property
    def reward_funcs(self) -> RewardFuncs:
        return RewardFuncs.from_config(self.rewards, self.reward_weights, self.reward_kwargs)

    @cached_property
    def solved_index(self) -> int:
        """Which function decides ``solved`` (``task-solved-reward``; '' = the first whose name has
        ``accuracy`` or ``correct`` in it, else the first function)."""
        funcs, names = self.reward_funcs.funcs, self.reward_funcs.names
        if self.solved_reward:
            for i, f in enumerate(funcs):
                if self.solved_reward in (names[i], f.spec, f.spec.rpartition(":")[2]):
                    return i
            raise ValueError(f"task-solved-reward={self.solved_reward!r}: not one of task-rewards' functions "
                             f"({', '.join(names)})")
        return next((i for i, n in enumerate(names) if "accuracy" in n.lower() or "correct" in n.lower()), 0)

    @property
    def solved_name(self) -> str:
        return self.reward_funcs.names[self.solved_index]

    @cached_property
    def _items(self) -> tuple[tuple[Prompt, dict, str, str], ...]:
        """(prompt, row, split, family) of every row of the data file(s)."""
        out = []
        files = [(self.data, "task-data")] + ([(self.eval_data, "task-eval-data")] if self.eval_data else [])
        for source, key in files:
            rows = load_rows(source, self.data_split, key)
            for col in (self.prompt_column, self.answer_column, self.family_column):
                if col and col not in rows[0]:
                    which = {self.prompt_column: "task-prompt-column", self.answer_column: "task-answer-column",
                             self.family_column: "task-family-column"}[col]
                    raise ValueError(f"{which}={col!r}: {key}={source!r} has no such column (columns: "
                                     f"{', '.join(map(str, rows[0]))})")
            for i, row in enumerate(rows):
                text = prompt_text(row.get(self.prompt_column), f"{key} row {i}, column {self.prompt_column!r}")
                family = str(row.get(self.family_column, "")) if self.family_column else ""
                if key == "task-eval-data":
                    split = "eval"
                elif family and family in self.ood_families:
                    split = "eval"
                else:
                    split = "eval" if not self.eval_data and _eval_by_hash(text, self.eval_percent) else "train"
                reference = "" if not self.answer_column or row.get(self.answer_column) is None \
                    else str(row[self.answer_column])
                out.append((Prompt(f"{USER}/{split}/{i}", text, reference), row, split, family))
        return tuple(out)

    @cached_property
    def rows_by_id(self) -> dict[str, dict]:
        """task id -> its row (every column, as the reward functions get them)."""
        return {p.task_id: row for p, row, _, _ in self._items}

    @cached_property
    def raw_prompt(self) -> dict[str, Any]:
        """task id -> the prompt cell as the data set holds it (what TRL passes as ``prompts``)."""
        return {p.task_id: row.get(self.prompt_column) for p, row, _, _ in self._items}

    def train_pool(self) -> tuple[Prompt, ...]:
        pool = tuple(p for p, _, split, _ in self._items if split == "train")
        if not pool:
            raise ValueError(f"task-data={self.data!r}: no train rows (task-eval-percent={self.eval_percent}, "
                             f"task-ood-families={','.join(self.ood_families)})")
        return pool

    def eval_sets(self, n: int, n_ood: int) -> dict[str, list[Prompt]]:
        """``id``: the first ``n`` held-out rows of the trained families; one set per OOD family
        (``ood/<family>``, at most ``n_ood`` rows). ValueError when fewer than ``n`` are held out."""
        held = [p for p, _, split, fam in self._items if split == "eval" and fam not in self.ood_families]
        if len(held) < n:
            raise ValueError(f"the user task's held-out set has {len(held)} rows, fewer than {n} (more rows, "
                             "a larger task-eval-percent, or a task-eval-data file)")
        sets = {"id": held[:n]}
        for fam in self.ood_families:
            rows = [p for p, _, _, f in self._items if f == fam][:n_ood]
            if not rows:
                raise ValueError(f"task-ood-families: family {fam!r} has no rows in column {self.family_column!r}")
            sets[f"ood/{fam}"] = rows
        return sets

    def check(self, completion: str, reference: str, task_id: str = "", prompt: str = "") -> tuple[bool, float]:
        """(solved, reward) of one completion, the ``RewardRule.check`` interface: solved when the
        solved function's own reward is >= ``task-solved-threshold`` (another function's reward, a
        format bonus, never counts), the reward the weighted sum."""
        s = self.group_scores(task_id, [completion])
        return s.solved[0], s.rewards[0]

    def load(self) -> None:
        """Load everything now (data, columns, splits, reward functions): errors name the key."""
        if self.ood_families and not self.family_column:
            raise ValueError("task-ood-families: needs task-family-column (the column naming each row's family)")
        self.train_pool()
        self.solved_index                           # loads the functions; a bad task-solved-reward names itself

    def digest(self) -> str:
        """sha256 of the task's definition (see the module docstring)."""
        definition = {
            "version": DIGEST_VERSION, "data_sha256": rows_sha256(load_rows(self.data, self.data_split)),
            "eval_data_sha256": rows_sha256(load_rows(self.eval_data, self.data_split, "task-eval-data"))
            if self.eval_data else "", "data_split": self.data_split, "prompt_column": self.prompt_column,
            "answer_column": self.answer_column, "family_column": self.family_column,
            "ood_families": list(self.ood_families), "eval_percent": self.eval_percent,
            "rewards": self.reward_funcs.identity(),
        }
        return hashlib.sha256(json.dumps(definition, sort_keys=True).encode()).hexdigest()

    def group_rewards(self, task_id: str, completions: Sequence[str],
                      completion_ids: Sequence[Sequence[int]] | None = None) -> list[float]:
        """The combined rewards of one task's completions (``group_scores``'s ``rewards``)."""
        return list(self.group_scores(task_id, completions, completion_ids).rewards)

    def group_scores(self, task_id: str, completions: Sequence[str],
                     completion_ids: Sequence[Sequence[int]] | None = None) -> GroupScores:
        """One task's completions scored TRL-style: the row's prompt as the data set holds it
        (conversational prompts get chat-message completions, as TRL gives them), every other
        column repeated per completion. ``rewards``: the weighted sum (NaN: no function scored that
        completion); ``per_function``: each function's own rewards by name; ``solved``: see ``check``."""
        row = self.rows_by_id.get(task_id)
        if row is None:
            raise KeyError(f"task_id={task_id!r}: not a row of this user task")
        n = len(completions)
        prompt = self.raw_prompt[task_id]
        chat = isinstance(prompt, list)
        comps = [[{"role": "assistant", "content": c}] for c in completions] if chat else list(completions)
        ids = [list(map(int, c)) for c in completion_ids] if completion_ids is not None else [[] for _ in range(n)]
        skip = {"prompt", "completion", "completion_ids", self.prompt_column}      # TRL's own arguments
        columns = {k: [v] * n for k, v in row.items() if k not in skip}
        funcs = self.reward_funcs
        per = funcs.per_function([prompt] * n, comps, ids, columns)
        rewards = combine(per, [f.weight for f in funcs.funcs])
        solved = tuple(bool(r >= self.solved_threshold) for r in per[self.solved_index])   # NaN: not solved
        return GroupScores(tuple(rewards), solved, dict(zip(funcs.names, map(tuple, per))))


def user_task(fields: Mapping[str, Any]) -> UserTask:
    """A cached UserTask per distinct definition (rows and functions are loaded once per process,
    again when one of its files changes)."""
    files = [fields.get("data", ""), fields.get("eval_data", "")]
    files += [s.rpartition(":")[0] for s in parse_specs(fields.get("rewards", "")) if is_file_spec(s)]
    return _cached_user_task(tuple(sorted(fields.items())), tuple(file_stamp(f) for f in files if f))


@lru_cache(maxsize=8)
def _cached_user_task(items: tuple, stamps: tuple) -> UserTask:
    return UserTask(**dict(items))
