"""``ftis-fed bench ...``: the benchmarks' command lines, apart from the code they measure.

Each subcommand parses its options here and calls one function of its module (``loss.py``,
``micro.py``, ``step.py``, ``wire.py``, ``swarm.py``, ``wiredict_train.py``), which it imports only
when run, so that ``ftis-fed --help`` and every other command load no torch; the modules themselves
import what they need at their top. ``python -m ftis_fed.bench.cli <name> ...`` is the same as
``ftis-fed bench <name> ...``.
"""

from __future__ import annotations

import argparse
import json
import sys


def add_cli(subparsers) -> None:
    """Every benchmark as a subcommand of ``subparsers`` (``ftis-fed bench``); handler in ``func``."""
    for add in (_loss, _micro, _step, _wire, _swarm, _wiredict):
        add(subparsers)


# ----------------------------------------------------------------------------- loss

def _loss(sub) -> None:
    p = sub.add_parser("loss", help="F-TIS vs plain GRPO: loss + backward time ratio")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--completion-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)

    def run(a) -> int:
        from ftis_fed.bench import loss

        print(json.dumps(loss.run(model=a.model, rows=a.rows, completion_len=a.completion_len, repeats=a.repeats)),
              flush=True)
        return 0

    p.set_defaults(func=run)


# ----------------------------------------------------------------------------- micro

def _micro(sub) -> None:
    p = sub.add_parser("micro", help="the research tier's models: size, build time, held-out accuracy")
    p.add_argument("--models", default="", help="comma-separated names (default: every micro model)")
    p.add_argument("--n", type=int, default=64, help="held-out prompts per set (0: no evaluation)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--round-time", action="store_true", help="also time one research-cell round (round_time)")
    p.add_argument("--adapter", default="full", choices=["full", "lora"], help="--round-time: full or LoRA")
    p.add_argument("--rounds", type=int, default=5, help="--round-time: timed rounds")
    p.add_argument("--prompts", type=int, default=4, help="--round-time: prompts a round (x 8 completions)")
    p.add_argument("--micro-batch", default="8", help="--round-time: the update's micro-batch, or several "
                   "comma-separated (one line each)")

    def run(a) -> int:
        from ftis_fed.bench import micro

        for name in [m for m in a.models.split(",") if m] or list(micro.MICRO_MODELS):
            if a.n > 0:
                print(json.dumps(micro.measure(name, a.n, a.seed, a.max_new_tokens), sort_keys=True), flush=True)
            for mb in ([int(x) for x in a.micro_batch.split(",") if x] if a.round_time else []):
                print(json.dumps(micro.round_time(name, prompts=a.prompts, max_new_tokens=a.max_new_tokens,
                                                  rounds=a.rounds, adapter=a.adapter, seed=a.seed, micro_batch=mb),
                                 sort_keys=True), flush=True)
        return 0

    p.set_defaults(func=run)


# ----------------------------------------------------------------------------- step

def _step(sub) -> None:
    ap = sub.add_parser("step", help="one on-policy GRPO step: ours vs TRL GRPOTrainer (time, peak RSS)")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--dtype", choices=("auto", "fp32", "bf16"), default="auto",
                    help="our PolicyConfig.dtype; TRL's bf16 flag follows whether ours autocasts to bf16")
    ap.add_argument("--micro-batch", type=int, default=8,
                    help="our micro_batch = TRL's per_device_train_batch_size (rows per forward/backward)")
    ap.add_argument("--logit-chunk", type=int, default=32)
    ap.add_argument("--logit-graph-mb", type=float, default=256.0,
                    help="our policy key logit-graph-mb: LM-head log-softmax MiB a micro-batch keeps for backward "
                         "(no recompute; 8 rows x 64 tokens of SmolLM2: 96 MiB); 0 = recompute every chunk")
    ap.add_argument("--mode", default="F-TIS", help="our objective mode (alone, F-TIS, ...)")
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--repeats", type=int, default=2, help="fresh subprocesses per side, order alternated")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps per subprocess")
    ap.add_argument("--steps", type=int, default=1, help="timed steps per subprocess")
    ap.add_argument("--threads", type=int, default=0, help="torch threads per side (0 = torch default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--grad-checkpointing", dest="grad_checkpointing", action="store_true", default=False,
                    help="ours with decoder gradient checkpointing (the policy key grad-checkpointing: ~0.4 GB less "
                         "peak memory here, ~15 %% slower update); off by default, as on TRL's side")
    ap.add_argument("--no-grad-checkpointing", dest="grad_checkpointing", action="store_false",
                    help="ours without decoder gradient checkpointing (the default)")
    ap.add_argument("--no-share-prefix", dest="share_prefix", action="store_false",
                    help="ours scoring every row as prompt+completion (no shared prompt pass; policy key share-prefix)")
    ap.add_argument("--trl-gradient-checkpointing", action="store_true",
                    help="TRL with gradient checkpointing (its own default; slower, less memory)")
    ap.add_argument("--memory-sweep", action="store_true",
                    help="also: peak RSS of our update alone for several micro_batch / logit_chunk values")
    ap.add_argument("--sides", default="ours,trl", help="comma-separated subset of ours,trl")
    ap.add_argument("--verbose", action="store_true", help="progress on stderr")
    ap.set_defaults(func=run_step)


def run_step(a: argparse.Namespace) -> int:
    """``ftis-fed bench step``: print ``step.run_bench_step``'s one JSON line."""
    from ftis_fed.bench import step

    log = (lambda m: print(m, file=sys.stderr, flush=True)) if a.verbose else None
    print(json.dumps(step.run_bench_step(
        model=a.model, prompts=a.prompts, group_size=a.group_size, max_new_tokens=a.max_new_tokens,
        temperature=a.temperature, dtype=a.dtype, micro_batch=a.micro_batch, logit_chunk=a.logit_chunk,
        mode=a.mode, lr=a.lr, repeats=a.repeats, warmup=a.warmup, steps=a.steps, threads=a.threads, seed=a.seed,
        grad_checkpointing=a.grad_checkpointing, trl_gradient_checkpointing=a.trl_gradient_checkpointing,
        share_prefix=a.share_prefix, logit_graph_mb=a.logit_graph_mb,
        memory_sweep=a.memory_sweep,
        sides=tuple(s for s in a.sides.split(",") if s), log=log)), flush=True)
    return 0


# ----------------------------------------------------------------------------- wire

def _wire(sub) -> None:
    ap = sub.add_parser("wire", help="bytes per token and throughput of signed completion batches")
    ap.add_argument("--source", choices=("policy", "synthetic", "transformers"), default="policy",
                    help="rollouts from the policy API (default), plain transformers, or synthetic")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--prompt-set", choices=("arithmetic", "tasks"), default="arithmetic",
                    help="bench arithmetic questions (default) or the default run's task prompts")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=20, help="timed encode/sign/verify/decode round trips")
    ap.add_argument("--rollouts-file", default=None,
                    help="JSON file of rollouts: reused when it exists, else written after generating")

    def run(a) -> int:
        from ftis_fed.bench import wire

        print(json.dumps(wire.run_bench_wire(a.source, a.prompts, a.group_size, a.max_new_tokens, a.temperature,
                                             a.seed, a.repeats, a.model, a.prompt_set, a.rollouts_file)))
        return 0

    ap.set_defaults(func=run)


# ----------------------------------------------------------------------------- swarm

def _swarm(sub) -> None:
    ap = sub.add_parser("swarm", help="the server at N light participants: CPU, memory, bytes per round (docs/scale.md)")
    ap.add_argument("--participants", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--peers-per-round", type=int, default=4)
    ap.add_argument("--fraction-train", type=float, default=1.0)
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--plot-every", type=int, default=1, help="as the run-config key (1: plots every round)")
    ap.add_argument("--out", default="", help="folder for the runs ('' = a temporary one)")
    ap.add_argument("--slope", nargs="+", default=[], help="only combine these files of JSON lines into the slope")

    def run(a) -> int:
        from ftis_fed.bench import swarm

        for line in swarm.run_swarm(a.participants, a.rounds, a.peers_per_round, a.fraction_train,
                                    plots=not a.no_plots, plot_every=a.plot_every, out=a.out, slope_files=a.slope):
            print(json.dumps(line), flush=True)
        return 0

    ap.set_defaults(func=run)


# ----------------------------------------------------------------------------- wiredict

def _wiredict(sub) -> None:
    ap = sub.add_parser("wiredict", help="make the wire dictionary: training rollouts, zstd training, the module "
                                         "(ftis_fed/bench/wiredict_train.py)")
    cmd = ap.add_subparsers(dest="cmd", required=True)
    t = cmd.add_parser("train", help="train a dictionary from saved rollouts")
    t.add_argument("out")
    t.add_argument("rollouts", nargs="+")
    t.add_argument("--size", type=int, default=8192)
    e = cmd.add_parser("embed", help="write a trained dictionary as a Python module (FABs carry no binary files)")
    e.add_argument("zdict")
    e.add_argument("module_file")
    e.add_argument("--name", default="wire-smollm2-v1")
    g = cmd.add_parser("rollouts", help="generate the training rollouts into a folder")
    g.add_argument("out_dir")

    def run(a) -> int:
        from ftis_fed.bench import wiredict_train

        if a.cmd == "rollouts":
            for path in wiredict_train.training_rollouts(a.out_dir):
                print(path)
        elif a.cmd == "embed":
            print(wiredict_train.embed_file(a.zdict, a.module_file, a.name))
        else:
            print(wiredict_train.train_file(a.out, a.rollouts, a.size))
        return 0

    ap.set_defaults(func=run)


def main(argv: list[str] | None = None) -> int:
    """``python -m ftis_fed.bench.cli <name> ...`` (the same as ``ftis-fed bench <name> ...``)."""
    ap = argparse.ArgumentParser(prog="ftis-fed bench", description=__doc__.split("\n")[0])
    add_cli(ap.add_subparsers(dest="bench", required=True))
    a = ap.parse_args(argv)
    return a.func(a)


if __name__ == "__main__":                               # pragma: no cover
    raise SystemExit(main())
