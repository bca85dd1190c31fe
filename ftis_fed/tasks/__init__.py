"""Tasks: procedural families (``families``), instances / splits / partitions (``suite``), and
GSM8K / MATH-500 loaders (``benchmarks``). See docs/tasks.md."""

from ftis_fed.tasks.benchmarks import load_gsm8k, load_math500
from ftis_fed.tasks.resolve import TaskRefused, TaskResolver
from ftis_fed.tasks.families import FAMILIES, ID_FAMILIES, INSTRUCTION, OOD_FAMILIES, Family, Problem, get_family
from ftis_fed.tasks.suite import (
    SCHEMES,
    SPLITS,
    TaskSpec,
    eval_sets,
    make_tasks,
    partition,
    prompts_for_round,
    shard,
    split_of,
    task_at,
)

__all__ = ["FAMILIES", "ID_FAMILIES", "INSTRUCTION", "OOD_FAMILIES", "SCHEMES", "SPLITS", "Family", "Problem",
           "TaskRefused", "TaskResolver", "TaskSpec", "eval_sets", "get_family", "load_gsm8k", "load_math500", "make_tasks", "partition",
           "prompts_for_round", "shard", "split_of", "task_at"]
