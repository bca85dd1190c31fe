"""The task's part of a run's identity: the run id batches are signed for, bound to the task digest.

A task read from node-local files (a benchmark file, a user data set and its reward functions) has a
digest (``TaskSpec.digest``); participants sign their batches for ``signed_run_id(run-name, digest)``
and receivers accept only their own, so a batch made on another copy of the task never counts
(``task_mismatch``, naming both digests). Procedural tasks are defined by the run config alone:
their digest is ``''`` and the run id is the run name.
"""

from __future__ import annotations

from ftis_fed.trust.signing import run_name_of

#: Separates the run name from the task digest in a signed run id.
TASK_SEP = "@task:"
#: Hex digits of the task digest kept in the run id (64 bits).
DIGEST_CHARS = 16


def signed_run_id(run_name: str, task_digest: str) -> str:
    """``run-name@task:<first 16 hex digits of the digest>``, or the run name for ``task_digest = ''``."""
    return f"{run_name}{TASK_SEP}{task_digest[:DIGEST_CHARS]}" if task_digest else run_name


def split_run_id(run_id: str) -> tuple[str, str]:
    """``signed_run_id``'s inverse: (run name, digest prefix or '')."""
    name, sep, digest = run_id.rpartition(TASK_SEP)
    return (name, digest) if sep else (run_id, "")


def task_mismatch(sender_run_id: str, own_run_id: str) -> str | None:
    """A one-line explanation when the two run ids name the same run with different tasks, else None
    (the run's nonce, ``trust.signing.new_run_id``'s suffix, is not part of the comparison)."""
    (theirs, their_task) = split_run_id(run_name_of(sender_run_id))
    (ours, our_task) = split_run_id(run_name_of(own_run_id))
    if theirs != ours or their_task == our_task:
        return None
    return (f"task digest {their_task or '(procedural)'}, this receiver's is {our_task or '(procedural)'}: "
            "another data file, split, column or reward function (docs/own-task.md)")
