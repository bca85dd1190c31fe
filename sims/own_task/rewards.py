"""TRL-style reward functions for the own-task example (``sims/own_task/data.jsonl``).

Plain TRL reward functions: ``f(prompts, completions, completion_ids, **columns) -> list[float |
None]``, the same code ``trl.GRPOTrainer(reward_funcs=[...])`` takes. The data set's columns
(``answer``, ``op``) arrive as keyword lists, one value per completion. Nothing here imports
ftis-fed: the run config names these functions (``task-rewards``), every participant imports this
file by path, and every receiver re-scores its peers' completions with the same functions.
"""

from __future__ import annotations

import re

_NUMBER = re.compile(r"-?\d+")


def _text(completion) -> str:
    """TRL passes a string (standard prompts) or a list of chat messages (conversational ones)."""
    return completion if isinstance(completion, str) else completion[0]["content"]


def correct_answer(prompts, completions, answer, **kwargs) -> list[float | None]:
    """1.0 when the last number in the reply equals ``answer``, 0.0 otherwise; None (no opinion,
    as TRL's own accuracy_reward does for an unparsable gold answer) for rows without one."""
    out: list[float | None] = []
    for completion, gold in zip(completions, answer):
        if not str(gold).strip():
            out.append(None)
            continue
        numbers = _NUMBER.findall(_text(completion))
        out.append(1.0 if numbers and numbers[-1] == str(gold).strip() else 0.0)
    return out


def just_the_number(completions, **kwargs) -> list[float]:
    """1.0 when the whole reply is one number (what the prompts ask for), else 0.0."""
    return [1.0 if re.fullmatch(r"\s*-?\d+\.?\s*", _text(c)) else 0.0 for c in completions]
