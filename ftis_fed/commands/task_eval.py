"""``ftis-fed eval --model M --run-config ...``: a model scored on the task a run config defines (your own
task's held-out rows, its reward functions and ``solved`` rule), exactly as a run's evaluation scores
them. Lives with the commands because it reads a whole run config (``config``), which the learning
code below it does not import."""

from __future__ import annotations

import json
from typing import Mapping

from ftis_fed.learn.evaluation import GreedyGenerator, _policy_for, evaluate


def task_eval(policy: GreedyGenerator, run_config: Mapping, max_new_tokens: int = 32,
              batch_size: int = 32) -> dict:
    """Greedy pass@1 of ``policy`` on the held-out sets of the task ``run_config`` defines (any
    ``task-*`` keys, ``eval-size``, ``eval-ood-size``): for your own task its held-out rows, scored
    by its reward functions with its ``solved`` rule, exactly as a run's evaluation scores them."""
    from ftis_fed.config.keys import federation_from_run_config

    fed = federation_from_run_config(dict(run_config))
    fed.check_data()
    out = evaluate(policy, fed.eval_sets(), fed.task.verifier(), max_new_tokens, batch_size)
    return {"task-source": fed.task.source, "task_digest": fed.task.digest(), **out}


def run_task_eval_cli(model: str, run_config: Mapping, max_new_tokens: int = 32, backend: str = "hf",
                      dtype: str = "fp32", print_json: bool = True) -> dict:
    """``ftis-fed eval --model M --run-config ...``: ``task_eval`` of ``model`` (an export folder, an
    offline name, a hub id in the cache), printed as one JSON line."""
    result = {"model": model, "max_new_tokens": max_new_tokens, "dtype": dtype,
              **task_eval(_policy_for(model, backend, dtype), run_config, max_new_tokens)}
    if print_json:
        print(json.dumps(result, sort_keys=True))
    return result
