"""Rollouts -> rewarded prompt groups: the one path from what a policy generated to what a batch
carries (participants, ``ftis-fed bench step`` and ``bench wire`` all use it)."""

from __future__ import annotations

from typing import Sequence

from ftis_fed.wire.batch import PromptGroup, make_group
from ftis_fed.policies.base import Rollout
from ftis_fed.tasks.rewards import Verifier
from ftis_fed.tasks.scores import GroupScores


def scored_groups(rollouts: Sequence[Rollout], verifier: Verifier) -> list[PromptGroup]:
    """One PromptGroup per rollout, every completion rewarded by ``verifier`` against the task's own
    reference (texts and the prompt's text included: the wire decides whether to send them)."""
    return scored_groups_with_scores(rollouts, verifier)[0]


def scored_groups_with_scores(rollouts: Sequence[Rollout],
                              verifier: Verifier) -> tuple[list[PromptGroup], list[GroupScores]]:
    """``scored_groups`` and, per group, its :class:`GroupScores` (solved flags, per-function rewards)."""
    groups, scores = [], []
    for r in rollouts:
        s = verifier.group_scores(r.prompt.task_id, r.completion_texts, r.prompt.reference, r.prompt.text,
                                  r.completion_ids)
        groups.append(make_group(r.prompt_ids, r.completion_ids, r.logprobs, list(s.rewards), r.prompt.task_id,
                                 r.prompt.reference, r.prompt.text, r.completion_texts))
        scores.append(s)
    return groups, scores
