"""``Prompt``: one task instance as tasks produce it and policies consume it (its own module, so the
task suite does not depend on the policies, nor on torch)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Prompt:
    """One task instance as a policy sees it.

    task_id: stable id of the instance; text: the user message (no chat template);
    reference: the reference answer (used by rewards, carried in batches).
    """

    task_id: str
    text: str
    reference: str
