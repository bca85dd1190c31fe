"""``ftis-fed bench micro``: what docs/models.md reports for the research tier's models, measured.

For each model (default: every ``policies.micro.MICRO_MODELS`` name) one JSON line with its
architecture, tokenizer, size, warm-up, the CPU time of its build (when this call built it), and
greedy pass@1 (``learn.evaluation.evaluate``, 16 new tokens, fp32) on the held-out sets: ``id`` (the
project's ID set, ``heldout_sets``), each ID family on its own (``add30``, ``sub30``: n held-out
problems each, so a specialist's two sides show) and every OOD family.

    ftis-fed bench micro --n 64                       # every micro model (builds the missing ones)
    ftis-fed bench micro --models micro-llama-s --n 128

The round time of a research cell is ``ftis-fed bench step --model <name> --sides ours ...``
(docs/models.md gives the command and the figures).
"""

from __future__ import annotations

import json
import time


def measure(name: str, n: int = 64, seed: int = 0, max_new_tokens: int = 16) -> dict:
    """One model's facts and held-out accuracies (builds it first when it is not cached)."""
    import resource

    from ftis_fed.learn.evaluation import evaluate, heldout_sets
    from ftis_fed.policies import PolicyConfig, build_policy
    from ftis_fed.policies.micro import MICRO_MODELS
    from ftis_fed.policies.models import cache_root, resolve_model
    from ftis_fed.tasks.families import ID_FAMILIES
    from ftis_fed.tasks.suite import make_tasks

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


def add_cli(subparsers) -> None:
    p = subparsers.add_parser("micro", help="the research tier's models: size, build time, held-out accuracy")
    p.add_argument("--models", default="", help="comma-separated names (default: every micro model)")
    p.add_argument("--n", type=int, default=64, help="held-out prompts per set")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=16)

    def run(a) -> int:
        from ftis_fed.policies.micro import MICRO_MODELS

        for name in [m for m in a.models.split(",") if m] or list(MICRO_MODELS):
            print(json.dumps(measure(name, a.n, a.seed, a.max_new_tokens), sort_keys=True), flush=True)
        return 0

    p.set_defaults(func=run)
