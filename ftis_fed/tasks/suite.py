"""The task suite: deterministic task instances, disjoint splits, per-participant partitions.

Every instance is a ``Prompt(task_id, text, reference)`` and is a pure function of
``(family, split, seed, index)``; its task id is ``"{family}/{split}/{seed}/{index}"``.

Splits are disjoint **by content**: a problem's split is a hash of its family and content key
(``split_of``), and an instance of split s is drawn by rejection sampling until the drawn problem
belongs to s. So no eval question is ever a train question, whatever seeds or indices anyone uses.
``Family.eval_percent`` of each family's problem space is held out (20 % ID, 50 % OOD).

Partitions decide which *mixture* of in-distribution sub-families each participant trains on:

- ``iid``: every participant draws from the uniform mixture of ``families``.
- ``expertise``: participant p is the expert of ``families[p % len(families)]``: a share ``skew`` of
  its prompts come from that sub-family, the rest uniformly from the others (``skew=1``: only its own).
- ``dirichlet``: mixture weights ~ Dirichlet(alpha), seeded per participant (the usual non-IID
  federated benchmark; small alpha = more skewed).
- ``shared``: every participant gets the *same* prompts each round (the paper's "horizontal" mode,
  where each participant generates its share of every prompt's group).
- ``auto`` (the run-config default): ``shared`` when the run's ``advantage-groups`` is
  ``horizontal``, else ``iid``; ``FederationConfig`` resolves it, so a run never sees ``auto``
  (a bare ``TaskSpec("auto")`` draws like ``iid``).

Within a round, participants never share an instance (except under ``shared``), and no instance
repeats across rounds: the train index of prompt j of participant p in round r is
``(r * num_partitions + p) * k + j``.

``task-source = gsm8k | math500`` trains on a local benchmark file instead (``benchmarks.train_pool``):
the pool in a fixed ``task-seed`` order, slot ``r * P + p`` (``iid``) or ``r`` (``shared``), k items per
slot, wrapping around when the pool is used up; only ``iid`` and ``shared`` apply.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from dataclasses import dataclass, replace
from functools import lru_cache

import numpy as np

from ftis_fed.knobs import knob
from ftis_fed.tasks.prompt import Prompt
from ftis_fed.tasks.benchmarks import BENCHMARKS, train_pool
from ftis_fed.tasks.families import ID_FAMILIES, OOD_FAMILIES, Problem, get_family
from ftis_fed.tasks.rewards import Verifier, default_rules
from ftis_fed.tasks.user import USER, UserTask, user_task

SPLITS = ("train", "eval")
SCHEMES = ("auto", "iid", "expertise", "dirichlet", "shared", "listed")
#: ``task-source`` values: the procedural families, a benchmark file, or your own task (``tasks.user``).
SOURCES = ("procedural", *BENCHMARKS, "user")
#: ``task-reward-errors``: what a reward function's error does to the run.
REWARD_ERRORS = ("stop", "drop")

#: Rejection-sampling budget per instance (the eval split accepts ~1 draw in 5).
_MAX_DRAWS = 10_000


def _stable_int(*parts: object) -> int:
    """A 64-bit integer hash of ``parts``, identical on every machine and Python run."""
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "big")


def split_of(family: str, key: tuple) -> str:
    """The split a problem with content ``key`` belongs to (``train`` or ``eval``)."""
    return "eval" if _stable_int("split", family, key) % 100 < get_family(family).eval_percent else "train"


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split={split!r}: must be one of {SPLITS}")


def _check_nonneg(name: str, value: int) -> None:
    if isinstance(value, bool) or int(value) != value or value < 0:
        raise ValueError(f"{name}={value!r}: must be an integer >= 0")


def task_id(family: str, split: str, seed: int, index: int) -> str:
    return f"{family}/{split}/{seed}/{index}"


def _draw(family: str, split: str, seed: int, index: int) -> Problem:
    """The problem behind ``task_at``: rejection-sample ``family`` until the draw is in ``split``."""
    fam = get_family(family)
    _check_split(split)
    _check_nonneg("seed", seed)
    _check_nonneg("index", index)
    rng = random.Random(_stable_int("task", family, split, int(seed), int(index)))
    for _ in range(_MAX_DRAWS):
        p = fam.make(rng)
        if split_of(family, p.key) == split:
            return p
    raise RuntimeError(f"family {family!r}: no {split} problem in {_MAX_DRAWS} draws (problem space too small)")


def task_at(family: str, split: str, seed: int, index: int) -> Prompt:
    """Instance ``index`` of ``family``'s ``split`` under ``seed``: a pure function of the four."""
    p = _draw(family, split, seed, index)
    return Prompt(task_id(family, split, seed, index), f"{p.question} {get_family(family).instruction}", str(p.answer))


def worked_reply(family: str, split: str, seed: int, index: int) -> str:
    """The reply a supervised warm-up teaches for ``task_at(family, split, seed, index)``: the family's
    worked solution (``Problem.solution``), or the bare answer where it has none."""
    p = _draw(family, split, seed, index)
    return p.solution or str(p.answer)


def worked_solution(task_id_: str) -> str:
    """The worked solution of the task ``task_id_`` names (``family/split/seed/index``); "" (which no
    correct reply equals) for an id that names none: receivers resolve a peer's task ids before
    scoring, so this is a guard, not a check."""
    try:
        family, split, seed, index = task_id_.split("/")
        return worked_reply(family, split, int(seed), int(index))
    except (ValueError, KeyError):
        return ""


def content_key(family: str, split: str, seed: int, index: int) -> tuple:
    """The content key of ``task_at(family, split, seed, index)`` (for disjointness checks)."""
    return _draw(family, split, seed, index).key


def make_tasks(family: str, split: str, n: int, seed: int = 0, distinct: bool = True) -> list[Prompt]:
    """``n`` instances of ``family``'s ``split``, scanning indices 0, 1, 2, ... under ``seed``.

    distinct: skip instances whose question repeats an earlier one (what evaluation sets want);
        a ValueError says so when the family's split has fewer than ``n`` distinct problems.
    """
    _check_nonneg("n", n)
    out: list[Prompt] = []
    seen: set[str] = set()
    index = 0
    while len(out) < n:
        p = task_at(family, split, seed, index)
        index += 1
        if distinct and p.text in seen:
            if index > 50 * (n + 10):
                raise ValueError(f"n={n}: family {family!r} has only {len(out)} distinct {split} problems "
                                 f"(found within {index} draws); ask for fewer")
            continue
        seen.add(p.text)
        out.append(p)
    return out


# ----------------------------------------------------------------------------- partitions

@dataclass(frozen=True)
class TaskSpec:
    """What a participant trains on; each field is a Flower run-config key (``knob``)."""

    scheme: str = knob("task-scheme", "auto", """
        how the ID sub-families are split among participants, one of ``SCHEMES``: iid, expertise,
        dirichlet, shared (every participant gets the same prompts each round), listed (each
        participant's families as ``task-mixtures`` lists them), or auto (shared with
        ``advantage-groups = horizontal``, else iid). Horizontal groups require shared prompts: any
        other explicit scheme with them is a config error.""")
    families: tuple[str, ...] = knob("task-families", ID_FAMILIES,
                                     'comma-separated in-distribution sub-families to mix ("" = all: ``ID_FAMILIES``).')
    skew: float = knob("task-skew", 1.0, """
        ``expertise`` only: share of a participant's prompts from its own sub-family, in [0, 1] (1.0:
        only its own; 1/len(families): IID).""")
    alpha: float = knob("task-alpha", 0.5, "``dirichlet`` only: concentration, > 0 (smaller = more skewed).")
    mixtures: str = knob("task-mixtures", "", """
        ``listed`` only: each participant's families, one entry per participant in partition order,
        separated by ``;`` (participant i takes entry i modulo their number), each a comma-separated list
        of ``task-families`` names, optionally weighted ``name:w`` (w > 0; normalised; default 1), e.g.
        ``"add99,sub99; sub99"``: the first participant draws both families alike, the second only
        sub99. Part of the run config, so every receiver knows every sender's mixture.""")
    seed: int = knob("task-seed", 0, "seeds instances and mixtures, >= 0.")
    prompts_per_round: int = knob("prompts-per-round", 4, "k, prompts a participant generates per round, >= 1.")
    source: str = knob("task-source", "procedural", """
        what participants train on: ``procedural`` (the task families above), ``gsm8k`` (the train
        file at ``gsm8k-data``; held-out ID set: its test file), ``math500`` (the train split of
        the file at ``math500-data``; held-out ID set: its eval split) or ``user`` (your own data set
        ``task-data`` scored by your reward functions ``task-rewards``; docs/own-task.md). Files
        take the iid or shared scheme; receivers rebuild every item from their own copy of the file.""")
    gsm8k_data: str = knob("gsm8k-data", "", """
        local GSM8K file or folder (``train.jsonl`` / ``test.jsonl``, rows with ``question`` and
        ``answer`` ending ``#### N``; or the hub repo's parquet layout); '' = none. Needed by
        ``task-source = gsm8k``; with another source it adds GSM8K test as an OOD set.""")
    math500_data: str = knob("math500-data", "", """
        local MATH-500 file or folder (``test.jsonl``, rows with ``problem`` and ``answer``); '' =
        none. Needed by ``task-source = math500``; with another source all of MATH-500 is an OOD
        set. Answers are compared with math-verify (``pip install 'ftis-fed[math]'``) except integer
        ones, which take the exact path.""")
    math500_eval_percent: int = knob("math500-eval-percent", 20, """
        ``task-source = math500``: share (percent, 1-99) of MATH-500 held out for evaluation, chosen
        by a hash of each problem's text (disjoint from the train split).""")

    data: str = knob("task-data", "", """
        ``task-source = user``: the data set, a local ``.jsonl`` / ``.json`` / ``.csv`` / ``.parquet``
        file or folder of them (read by ``datasets.load_dataset`` where installed, else by the
        standard library: the same rows), a ``datasets`` ``save_to_disk`` folder, or a hub id
        (``datasets`` extra; a reachable hub or its cache). Every node reads its own copy; '' = none.""")
    data_split: str = knob("task-data-split", "train", """
        the split of a hub data set or ``save_to_disk`` folder that ``task-data`` names, or of a
        folder whose file names carry split words (``train``, ``validation``, ``test``, as
        ``datasets`` names them); a single file has one.""")
    prompt_column: str = knob("task-prompt-column", "prompt", """
        the column holding each row's prompt: a string, or TRL's conversational form (a list with
        one user message).""")
    answer_column: str = knob("task-answer-column", "", """
        the column carried in batches as each row's reference answer ('' = none); every column
        reaches the reward functions anyway, as TRL passes them.""")
    rewards: str = knob("task-rewards", "", """
        comma-separated reward functions, ``module:function`` (on sys.path) or
        ``path/to/file.py:function``, with TRL's signature ``f(prompts, completions, completion_ids,
        **columns) -> list[float | None]`` (None: no reward for that sample); every receiver
        re-scores peers' completions with the same functions.""")
    reward_weights: str = knob("task-reward-weights", "", """
        comma-separated weights, one per function (TRL's ``reward_weights``; '' = 1.0 each): the
        reward is the weighted sum over the functions that scored the completion.""")
    reward_kwargs: str = knob("task-reward-kwargs", "", """
        keyword arguments of reward-function factories: a TOML table per function name of
        ``task-rewards``, e.g. ``"get_soft_overlong_punishment = {max_completion_len = 24,
        soft_punish_cache = 8}"`` with ``task-rewards = "trl.rewards:get_soft_overlong_punishment"``;
        that function is then ``factory(**kwargs)`` (TRL's ``reward_funcs=[factory(...)]``); '' = none.""")
    reward_errors: str = knob("task-reward-errors", "stop", """
        a reward function that raises or returns the wrong number of rewards (TRL raises at the
        first step): ``stop`` ends the run at once with the whole message and a non-zero exit, and
        no model is exported; ``drop`` drops that participant's batch for the round and goes on.""")
    solved_reward: str = knob("task-solved-reward", "", """
        ``task-source = user``: the reward function whose own reward defines "solved" (the
        ``reward/solved_frac`` of training and every ``eval/.../accuracy``), by function name;
        '' = the first function whose name contains ``accuracy`` or ``correct``, else the first.
        Built-in tasks: their verifier (a correct answer; a format bonus never counts).""")
    solved_threshold: float = knob("task-solved-threshold", 1.0, """
        ``task-source = user``: a completion is solved when the ``task-solved-reward`` function gave
        it at least this (its unweighted reward; None never solves).""")
    eval_percent: int = knob("task-eval-percent", 10, """
        ``task-source = user`` without ``task-eval-data``: share (percent, 0-99) of the rows held out
        for evaluation, chosen by a hash of each prompt's text (train and eval never share a prompt).""")
    eval_data: str = knob("task-eval-data", "", """
        ``task-source = user``: a separate held-out file or data set (same columns); then every row of
        ``task-data`` trains; '' = split ``task-data`` by ``task-eval-percent``.""")
    family_column: str = knob("task-family-column", "", """
        ``task-source = user``: a column whose values are the rows' families ('' = one family);
        see task-ood-families.""")
    reward_steps: bool = knob("task-reward-steps", False, """
        procedural families with worked replies (``add99``, ``sub99``, ...): a training reply earns its
        reward only when it is the family's worked solution (its steps checked, not only its last
        number), on senders and receivers alike; held-out evaluation still scores the answer alone.
        false (default): the answer alone.""")
    ood_families: tuple[str, ...] = knob("task-ood-families", (), """
        ``task-source = user``: comma-separated values of ``task-family-column`` held out whole (never
        trained on; one out-of-distribution evaluation set each, ``eval/ood/<family>/accuracy``).""")

    def __post_init__(self) -> None:
        if self.source == "user":
            if not self.data:
                raise ValueError("task.data='': task-source=user needs task-data (a data file, folder or hub id)")
            if not self.rewards:
                raise ValueError("task.rewards='': task-source=user needs task-rewards ('module:function' or "
                                 "'path/to/file.py:function', comma-separated)")
            if not 0 <= self.eval_percent <= 99:
                raise ValueError(f"task.eval_percent={self.eval_percent!r}: must be in [0, 99]")
            if self.ood_families and not self.family_column:
                raise ValueError(f"task.ood_families={','.join(self.ood_families)!r}: needs task-family-column (the "
                                 "column naming each row's family)")
            if not (isinstance(self.solved_threshold, (int, float)) and math.isfinite(self.solved_threshold)):
                raise ValueError(f"task.solved_threshold={self.solved_threshold!r}: must be a finite number")
        if self.reward_errors not in REWARD_ERRORS:
            raise ValueError(f"task.reward_errors={self.reward_errors!r}: must be one of {', '.join(REWARD_ERRORS)}")
        if self.scheme not in SCHEMES:
            raise ValueError(f"task.scheme={self.scheme!r}: must be one of {SCHEMES}")
        if not self.families:
            raise ValueError("task.families=(): need at least one family")
        for f in self.families:
            get_family(f)
        if len(set(self.families)) != len(self.families):
            raise ValueError(f"task.families={self.families!r}: names must be distinct")
        if not 0.0 <= self.skew <= 1.0:
            raise ValueError(f"task.skew={self.skew!r}: must be in [0, 1]")
        if not (math.isfinite(self.alpha) and self.alpha > 0):
            raise ValueError(f"task.alpha={self.alpha!r}: must be finite and > 0")
        if (self.scheme == "listed") != bool(str(self.mixtures).strip()):
            raise ValueError(f"task.mixtures={self.mixtures!r}: set it exactly when task-scheme=listed "
                             f"(task-scheme={self.scheme})")
        if self.scheme == "listed":
            _parse_mixtures(self.mixtures, self.families)
        _check_nonneg("task.seed", self.seed)
        if isinstance(self.prompts_per_round, bool) or int(self.prompts_per_round) != self.prompts_per_round \
                or self.prompts_per_round < 1:
            raise ValueError(f"task.prompts_per_round={self.prompts_per_round!r}: must be an integer >= 1")
        if self.source not in SOURCES:
            raise ValueError(f"task.source={self.source!r}: must be one of {', '.join(SOURCES)}")
        if not 1 <= self.math500_eval_percent <= 99:
            raise ValueError(f"task.math500_eval_percent={self.math500_eval_percent!r}: must be in [1, 99]")
        if self.reward_steps:
            plain = [f for f in self.families if not _draw(f, "train", 0, 0).solution]
            if self.source != "procedural" or plain:
                raise ValueError(f"task.reward_steps=True: needs task-source=procedural and families with worked "
                                 f"replies (task-source={self.source}; without one: {', '.join(plain) or 'none'})")
        if self.source != "procedural" and self.scheme in ("expertise", "dirichlet", "listed"):
            raise ValueError(f"task.scheme={self.scheme!r}: mixes procedural sub-families; with task-source="
                             f"{self.source} use iid or shared")

    @property
    def benchmark_path(self) -> str:
        """The data path of the benchmark trained on ('' for procedural)."""
        return {"gsm8k": self.gsm8k_data, "math500": self.math500_data}.get(self.source, "")

    @property
    def user(self) -> UserTask | None:
        """The user task (``task-source = user``; loaded once per process), else None."""
        if self.source != "user":
            return None
        return user_task(dict(data=self.data, data_split=self.data_split, prompt_column=self.prompt_column,
                              answer_column=self.answer_column, family_column=self.family_column,
                              ood_families=tuple(self.ood_families), eval_data=self.eval_data,
                              eval_percent=int(self.eval_percent), rewards=self.rewards,
                              reward_weights=self.reward_weights, reward_kwargs=self.reward_kwargs,
                              solved_reward=self.solved_reward, solved_threshold=float(self.solved_threshold)))

    def train_pool(self) -> tuple[Prompt, ...]:
        """The benchmark's or user task's train items (cached); () for procedural tasks. A user task
        loads its data and reward functions here (errors name the key)."""
        if self.source == "procedural":
            return ()
        if self.source == "user":
            self.user.load()
            return self.user.train_pool()
        return train_pool(self.source, self.benchmark_path, int(self.math500_eval_percent))

    def verifier(self, steps: bool | None = None) -> Verifier:
        """The reward rules of this task: the built-in ones, plus the user task's functions (family
        ``user``); with ``steps`` (None: ``task-reward-steps``) the run's worked families reward only
        their worked solution (``worked_solution``)."""
        if self.source == "user":
            return Verifier({**default_rules(), USER: self.user})
        if not (self.reward_steps if steps is None else steps):
            return Verifier()
        rules = default_rules()
        return Verifier({**rules, **{f: replace(rules[f], solution=worked_solution) for f in self.families}})

    def digest(self) -> str:
        """The task's identity where node-local files define it (``trust.run_id``): a user task's
        ``UserTask.digest``; a benchmark's train items; '' for procedural tasks (the run config alone)."""
        if self.source == "procedural":
            return ""
        if self.source == "user":
            return self.user.digest()
        h = hashlib.sha256(f"{self.source}\0{self.math500_eval_percent}".encode())
        for p in self.train_pool():
            h.update(json.dumps([p.task_id, p.text, p.reference]).encode())
        return h.hexdigest()

    def known_tasks(self) -> dict[str, Prompt]:
        """task id -> Prompt of every benchmark train item this node loaded (``TaskResolver.known``)."""
        return {p.task_id: p for p in self.train_pool()}

    def mixture(self, partition_id: int, num_partitions: int) -> dict[str, float]:
        """Participant ``partition_id``'s sampling weights over ``families`` (they sum to 1)."""
        _check_partition(partition_id, num_partitions)
        fams, F = self.families, len(self.families)
        if self.scheme in ("auto", "iid", "shared") or F == 1:
            w = np.full(F, 1.0 / F)
        elif self.scheme == "expertise":
            own = partition_id % F
            w = np.full(F, (1.0 - self.skew) / (F - 1))
            w[own] = self.skew
        elif self.scheme == "listed":
            entries = _parse_mixtures(self.mixtures, self.families)
            mine = entries[partition_id % len(entries)]
            w = np.array([mine.get(f, 0.0) for f in fams])
        else:  # dirichlet
            rng = np.random.default_rng([self.seed, partition_id, 0xD1])
            w = rng.dirichlet(np.full(F, self.alpha))
        return {f: float(x) for f, x in zip(fams, w)}

    def prompts_for_round(self, partition_id: int, num_partitions: int, round: int) -> list[Prompt]:
        """The k train prompts participant ``partition_id`` generates in server round ``round``."""
        _check_partition(partition_id, num_partitions)
        _check_nonneg("round", round)
        k = int(self.prompts_per_round)
        if self.source != "procedural":
            return self._benchmark_prompts(partition_id, num_partitions, round)
        weights = self.mixture(partition_id, num_partitions)
        fams, cdf = list(weights), np.cumsum(list(weights.values()))
        slot = round if self.scheme == "shared" else round * num_partitions + partition_id
        who = -1 if self.scheme == "shared" else partition_id
        out = []
        for j in range(k):
            u = random.Random(_stable_int("pick", self.seed, who, round, j)).random()
            fam = fams[min(int(np.searchsorted(cdf, u * cdf[-1], side="right")), len(fams) - 1)]
            out.append(task_at(fam, "train", self.seed, slot * k + j))
        return out

    def _benchmark_prompts(self, partition_id: int, num_partitions: int, round: int) -> list[Prompt]:
        """k items of the benchmark's train pool, in a fixed ``task-seed`` order; slot as for families
        (shared: the round; else round * P + p), wrapping around the pool when it is used up."""
        pool = _seeded_order(self.train_pool(), int(self.seed))
        k = int(self.prompts_per_round)
        slot = round if self.scheme == "shared" else round * num_partitions + partition_id
        return [pool[(slot * k + j) % len(pool)] for j in range(min(k, len(pool)))]


@lru_cache(maxsize=64)
def _parse_mixtures(text: str, families: tuple[str, ...]) -> tuple[dict[str, float], ...]:
    """``task-mixtures`` as one {family: weight} per entry (weights summing to 1); ValueError naming
    the entry and the limit."""
    entries = []
    for i, entry in enumerate(str(text).split(";")):
        weights: dict[str, float] = {}
        for item in (x.strip() for x in entry.split(",")):
            if not item:
                continue
            name, _, w = item.partition(":")
            name = name.strip()
            try:
                weight = float(w) if w.strip() else 1.0
            except ValueError:
                weight = math.nan
            if name not in families:
                raise ValueError(f"task.mixtures entry {i} ({entry.strip()!r}): {name!r} is not one of "
                                 f"task-families ({', '.join(families)})")
            if not (math.isfinite(weight) and weight > 0) or name in weights:
                raise ValueError(f"task.mixtures entry {i} ({entry.strip()!r}): {item!r} needs a finite weight > 0 "
                                 "and each family once")
            weights[name] = weight
        if not weights:
            raise ValueError(f"task.mixtures entry {i}: empty (each participant needs at least one family)")
        total = sum(weights.values())
        entries.append({f: w / total for f, w in weights.items()})
    return tuple(entries)


@lru_cache(maxsize=16)
def _seeded_order(pool: tuple[Prompt, ...], seed: int) -> tuple[Prompt, ...]:
    return tuple(sorted(pool, key=lambda p: _stable_int("order", seed, p.task_id)))


def _check_partition(partition_id: int, num_partitions: int) -> None:
    if isinstance(num_partitions, bool) or int(num_partitions) != num_partitions or num_partitions < 1:
        raise ValueError(f"num_partitions={num_partitions!r}: must be an integer >= 1")
    if isinstance(partition_id, bool) or int(partition_id) != partition_id \
            or not 0 <= partition_id < num_partitions:
        raise ValueError(f"partition_id={partition_id!r}: must be an integer in [0, {num_partitions})")


def partition(num_partitions: int, scheme: str = "iid", seed: int = 0, **kwargs) -> list[dict[str, float]]:
    """Every participant's mixture weights under ``scheme`` (see ``TaskSpec`` for ``kwargs``)."""
    spec = TaskSpec(scheme=scheme, seed=seed, **kwargs)
    return [spec.mixture(p, num_partitions) for p in range(num_partitions)]


def prompts_for_round(partition_id: int, num_partitions: int, round: int, k: int, seed: int = 0,
                      scheme: str = "iid", **kwargs) -> list[Prompt]:
    """Shorthand for ``TaskSpec(scheme, seed=seed, prompts_per_round=k, **kwargs).prompts_for_round``."""
    spec = TaskSpec(scheme=scheme, seed=seed, prompts_per_round=k, **kwargs)
    return spec.prompts_for_round(partition_id, num_partitions, round)


def shard(prompts: list[Prompt], partition_id: int, num_partitions: int) -> list[Prompt]:
    """IID strided shard of a fixed pool (e.g. GSM8K train): items ``partition_id::num_partitions``."""
    _check_partition(partition_id, num_partitions)
    return list(prompts[partition_id::num_partitions])


def eval_sets(n: int, seed: int = 0, id_families: tuple[str, ...] = ID_FAMILIES,
              ood_families: tuple[str, ...] | None = None, n_ood: int | None = None) -> dict[str, list[Prompt]]:
    """Held-out sets: ``"id"`` (n distinct prompts, round-robin over ``id_families``) and one set of
    ``n_ood`` (default n) per OOD family, keyed by family name."""
    ood_families = OOD_FAMILIES if ood_families is None else ood_families
    per = [make_tasks(f, "eval", math.ceil(n / len(id_families)), seed) for f in id_families]
    id_set = [per[i % len(per)][i // len(per)] for i in range(n)]
    out = {"id": id_set}
    for f in ood_families:
        out[f] = make_tasks(f, "eval", n if n_ood is None else n_ood, seed)
    return out
