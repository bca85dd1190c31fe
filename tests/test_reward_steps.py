"""``task-reward-steps``: on the worked families a training reply earns its reward only when it is the
worked solution (its steps checked), on senders and receivers alike; held-out evaluation still scores
the answer alone (docs/RESULTS.md: the subtraction specialist's rewarded replies were mostly right
answers through wrong steps)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ftis_fed.tasks.suite import TaskSpec, task_at, worked_reply, worked_solution

ROOT = Path(__file__).resolve().parents[1]


def test_only_the_worked_solution_earns_the_reward_with_steps_checked():
    task = TaskSpec(families=("add99", "sub99"), reward_steps=True)
    steps, answer_only = task.verifier(), task.verifier(steps=False)
    p = task_at("sub99", "train", 3, 1)
    worked = worked_reply("sub99", "train", 3, 1)
    assert worked_solution(p.task_id) == worked and worked.endswith(f"so {p.reference}")
    steps_part, last = worked.rsplit(";", 1)
    wrong_steps = "9" + steps_part.lstrip("0123456789") + ";" + last if not steps_part.startswith("9") else \
        "8" + steps_part.lstrip("0123456789") + ";" + last
    assert wrong_steps != worked and wrong_steps.endswith(f"so {p.reference}")
    assert steps.reward(p.task_id, worked, p.reference) == 1.0 == answer_only.reward(p.task_id, worked, p.reference)
    assert steps.reward(p.task_id, f"  {worked}\n", p.reference) == 1.0                  # stripped
    assert answer_only.reward(p.task_id, wrong_steps, p.reference) == 1.0                # the answer alone
    assert steps.reward(p.task_id, wrong_steps, p.reference) == 0.0                      # the steps checked
    assert steps.reward(p.task_id, f"so {p.reference}", p.reference) == 0.0
    assert TaskSpec(families=("add99",)).verifier().reward(p.task_id, wrong_steps, p.reference) == 1.0  # default off
    for bad in ("sub99/train/3", "sub99/nope/3/1", "sub99/train/-1/1", "sub99/train/x/1"):   # names no task:
        assert worked_solution(bad) == "" and steps.reward(bad, worked, p.reference) == 0.0  # nothing earns
    assert worked_solution("nofamily/train/3/1") == ""


def test_families_without_worked_replies_are_refused_by_name():
    with pytest.raises(ValueError, match="task.reward_steps.*add30"):
        TaskSpec(families=("add99", "add30"), reward_steps=True)


@pytest.mark.slow
def test_a_run_with_steps_checked_agrees_between_senders_and_receivers(tmp_path):
    """The learning tier's model (micro-llama-w250: ~30 % of its sampled replies right) in two
    participants in process: some replies earn the steps-checked reward, every peer batch's claimed
    rewards equal the receiver's own re-scoring under the same rule, and held-out accuracy is the
    answer's alone (before training, the same as in a run without the steps checked)."""
    import json

    from ftis_fed.commands.sim import simulate_inprocess

    items = [f'output-dir="{tmp_path}"', "num-rounds=2", "task-reward-steps=true", "eval-every=2", "eval-size=32",
             "eval-samples=2", "prompts-per-round=8", "updates-per-round=1"]
    assert simulate_inprocess(ROOT, items, "research-w") == 0
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["phase"] == "train" and r["participant"] in ("full", "lora")]
    assert len(train) == 4 and all(r["offpolicy/accepted"] == 1 for r in train)
    assert sum(r["reward/mean"] for r in train) > 0 and all(r["reward/peer_disagreements"] == 0 for r in train)
    key = "eval/id/sampled_accuracy"                           # sampled replies: right answers, wrong steps
    before = {r["participant"]: r[key] for r in rows if r["phase"] == "eval" and r["round"] == 0}
    plain = tmp_path / "plain"                                  # the same models scored without the steps
    assert simulate_inprocess(ROOT, [f'output-dir="{plain}"', "num-rounds=1", "eval-every=1", *items[4:]],
                              "research-w") == 0
    rows = [json.loads(x) for x in (plain / "metrics.jsonl").read_text().splitlines()]
    assert before and before == {r["participant"]: r[key] for r in rows if r["phase"] == "eval" and r["round"] == 0}
