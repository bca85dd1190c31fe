"""The ``ftis-fed`` command line: benchmarks, evaluation, keys, models, and run launchers."""

from __future__ import annotations

import argparse
import os
import sys

from ftis_fed.bench import cli as bench_cli


def _bench(sub) -> None:
    p = sub.add_parser("bench", help="side-by-side benchmarks (one JSON line each)")
    bench_cli.add_cli(p.add_subparsers(dest="bench", required=True))     # their command lines: bench/cli.py


def _eval(sub) -> None:
    p = sub.add_parser("eval", help="greedy pass@1 of a model on held-out ID / OOD sets (one JSON line)")
    p.add_argument("--model", default="smollm2", help="offline name, local folder or hub id")
    p.add_argument("--split", default="id", choices=["id", "ood", "all"])
    p.add_argument("--n", type=int, default=64, help="prompts per set")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--gsm8k", default=None, help="GSM8K file/folder (official JSONL or parquet layout)")
    p.add_argument("--math500", default=None, help="MATH-500 file/folder (HuggingFaceH4 layout)")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "auto"])
    p.add_argument("--preset", default=None, help="score on a preset's task (sims/presets/NAME.toml), e.g. own-task")
    p.add_argument("--run-config", action="append", default=[],
                   help="score on the task these run-config items define (key=value items or a .toml file, as "
                        "ftis-fed sim takes them): your own task's held-out rows and reward functions, its "
                        "solved rule (task-solved-reward); eval-size / eval-ood-size set the sizes")
    p.add_argument("--app", default=".", help="the app folder whose pyproject.toml declares the keys (default: .)")

    def run(a):
        from ftis_fed.commands.task_eval import run_task_eval_cli
        from ftis_fed.learn.evaluation import run_eval_cli

        if a.preset or a.run_config:
            from pathlib import Path

            from ftis_fed.commands.sim import layered_overrides

            items = layered_overrides(Path(a.app).resolve(), a.run_config, preset=a.preset)
            run_task_eval_cli(a.model, items, max_new_tokens=a.max_new_tokens, dtype=a.dtype)
            return
        run_eval_cli(a.model, a.split, n=a.n, seed=a.seed, max_new_tokens=a.max_new_tokens, gsm8k=a.gsm8k,
                     math500=a.math500, dtype=a.dtype)

    p.set_defaults(func=run)


def build_parser() -> argparse.ArgumentParser:
    """The whole parser (no torch: bench/cli.py imports each benchmark only when it runs)."""
    parser = argparse.ArgumentParser(prog="ftis-fed", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _bench(sub)
    _eval(sub)
    from ftis_fed.commands import deploy, experiment as grid, models as hub, sim as launch
    from ftis_fed.trust import deploy_keys

    deploy_keys.add_cli(sub)
    hub.add_cli(sub)
    launch.add_cli(sub)
    deploy.add_cli(sub)
    grid.add_cli(sub)
    return parser


#: Commands that run participants: started from the command line, they restart themselves once with
#: the pinned float kernels (``policies.store.run_pin_env``; an exec replaces the process).
PINNED_COMMANDS = ("sim", "grid")


def main(argv: list[str] | None = None) -> int:
    if argv is None and sys.argv[1:2] and sys.argv[1] in PINNED_COMMANDS:  # before the parser's imports
        from ftis_fed.policies.store import run_pin_env

        if (env := run_pin_env()) is not None:              # the same interpreter and arguments, pinned
            os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
    args = build_parser().parse_args(argv)
    result = args.func(args)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
