"""``ftis-fed bench micro``: what docs/models.md reports for the research tier's models, measured.

For each model (default: every ``policies.micro.MICRO_MODELS`` name) one JSON line with its
architecture, tokenizer, size, warm-up, the CPU time of its build (when this call built it), and
greedy pass@1 (``learn.evaluation.evaluate``, 16 new tokens, fp32) on the held-out sets: ``id`` (the
project's ID set, ``heldout_sets``), each ID family on its own (``add30``, ``sub30``: n held-out
problems each, so a specialist's two sides show) and every OOD family.

    ftis-fed bench micro --n 64                       # every micro model (builds the missing ones)
    ftis-fed bench micro --models micro-llama-s --n 128

``--round-time`` adds what one participant's round costs in a research cell (``round_time``):
generate k prompts x G completions of up to T new tokens at T = 1.0 (stopping at EOS, as in a run),
reward them (``Verifier``), build the batch and take one F-TIS update (``Trainer.step``), all through
the participant's code path; medians over ``--rounds`` rounds after one untimed round, wall and
process CPU time (one torch thread), and how many rows the updates back-propagated.

    ftis-fed bench micro --models micro-llama-s,micro-llama-l --round-time --adapter full

The command line is ``bench/cli.py``.
"""

from __future__ import annotations

import resource
import statistics
import time

import torch

from ftis_fed.learn.evaluation import evaluate, heldout_sets
from ftis_fed.learn.objective import ObjectiveConfig
from ftis_fed.learn.rollouts import scored_groups
from ftis_fed.learn.training import Trainer, samples_from_batches
from ftis_fed.policies import PolicyConfig, build_policy
from ftis_fed.policies.micro import MICRO_MODELS
from ftis_fed.policies.models import cache_root, resolve_model
from ftis_fed.tasks.families import ID_FAMILIES
from ftis_fed.tasks.rewards import Verifier
from ftis_fed.tasks.suite import TaskSpec, make_tasks
from ftis_fed.wire.batch import CompletionBatch, SamplingParams


def measure(name: str, n: int = 64, seed: int = 0, max_new_tokens: int = 16) -> dict:
    """One model's facts and held-out accuracies (builds it first when it is not cached)."""
    spec = MICRO_MODELS[name]
    cached = (cache_root() / "models" / name / "config.json").exists()
    c0, w0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    resolve_model(name)
    c1, w1 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    pol = build_policy(PolicyConfig(model=name, micro_batch=64))
    sets = heldout_sets("all", n, seed)
    sets.update({f: make_tasks(f, "eval", n, seed) for f in ID_FAMILIES})
    acc = evaluate(pol, sets, max_new_tokens=max_new_tokens)
    row = {"model": name, "arch": spec.arch, "tokenizer": spec.tokenizer, "vocab": len(pol.tokenizer),
           "parameters": sum(p.numel() for p in pol.model.parameters()), "hidden": spec.hidden,
           "layers": spec.layers, "warmup_families": list(spec.families), "warmup_problems": spec.steps * spec.batch,
           "seed": spec.seed, "n": n, "max_new_tokens": max_new_tokens}
    if not cached:
        row["build_cpu_s"] = round(c1.ru_utime + c1.ru_stime - c0.ru_utime - c0.ru_stime, 1)
        row["build_wall_s"] = round(w1 - w0, 1)
    row.update({k: round(v, 4) for k, v in acc.items() if k.endswith("/accuracy")})
    return row


def round_time(name: str, prompts: int = 4, group_size: int = 8, max_new_tokens: int = 16, rounds: int = 5,
               adapter: str = "full", seed: int = 0, micro_batch: int = 8) -> dict:
    """Median generate / update / round times of one participant running ``name`` (see the module
    docstring); prompts are the ID families' train split, a fresh set each round."""
    torch.set_num_threads(1)
    pol = build_policy(PolicyConfig(model=name, adapter=adapter, micro_batch=micro_batch))
    trainer, verifier = Trainer(pol, ObjectiveConfig(mode="F-TIS")), Verifier()
    sampling = SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens)
    tasks = TaskSpec(scheme="iid", seed=seed, prompts_per_round=prompts)
    t: dict[str, list[float]] = {k: [] for k in ("generate_s", "update_s", "generate_cpu_s", "update_cpu_s")}
    backward_rows, tokens, rewards = [], [], []
    for r in range(rounds + 1):
        w0, c0 = time.perf_counter(), time.process_time()
        rolls = pol.generate(tasks.prompts_for_round(0, 1, r), group_size, sampling, seed=seed + r)
        w1, c1 = time.perf_counter(), time.process_time()
        groups = scored_groups(rolls, verifier)
        batch = CompletionBatch("bench", "bench-micro", r, r, pol.model_id, pol.tokenizer_fp, pol.vocab_size, sampling,
                                tuple(groups)).validate()
        m = trainer.step(samples_from_batches([batch], "bench", pol.tokenizer_fp, trainer.objective), sampling)
        w2, c2 = time.perf_counter(), time.process_time()
        if r == 0:
            continue                                                  # untimed: allocations, first kernels
        for k, v in (("generate_s", w1 - w0), ("update_s", w2 - w1), ("generate_cpu_s", c1 - c0),
                     ("update_cpu_s", c2 - c1)):
            t[k].append(v)
        backward_rows.append(prompts * group_size - int(m.get("train/no_backward_rows", 0)))
        tokens.append(batch.num_completion_tokens)
        rewards.append(float(sum(float(x) for g in groups for x in g.rewards)) / (prompts * group_size))
    out = {"model": name, "adapter": adapter, "prompts": prompts, "group_size": group_size, "micro_batch": micro_batch,
           "max_new_tokens": max_new_tokens, "rounds": rounds, "threads": 1,
           "backward_rows": backward_rows, "completion_tokens": tokens, "reward_mean": [round(x, 3) for x in rewards]}
    out.update({f"median_{k}": round(statistics.median(v), 4) for k, v in t.items()})
    out["median_round_cpu_s"] = round(statistics.median(g + u for g, u in zip(t["generate_cpu_s"], t["update_cpu_s"])), 4)
    return out
