"""Rollouts -> rewarded prompt groups: the one path from what a policy generated to what a batch
carries (participants, ``ftis-fed bench step`` and ``bench wire`` all use it)."""

from __future__ import annotations

from typing import Sequence

from ftis_fed.wire.batch import PromptGroup, make_group
from ftis_fed.policies.base import Rollout
from ftis_fed.tasks.rewards import Verifier


def scored_groups(rollouts: Sequence[Rollout], verifier: Verifier) -> list[PromptGroup]:
    """One PromptGroup per rollout, every completion rewarded by ``verifier`` against the task's own
    reference (texts and the prompt's text included: the wire decides whether to send them)."""
    groups = []
    for r in rollouts:
        rewards = verifier.group_rewards(r.prompt.task_id, r.completion_texts, r.prompt.reference, r.prompt.text,
                                         r.completion_ids)
        groups.append(make_group(r.prompt_ids, r.completion_ids, r.logprobs, rewards, r.prompt.task_id,
                                 r.prompt.reference, r.prompt.text, r.completion_texts))
    return groups
