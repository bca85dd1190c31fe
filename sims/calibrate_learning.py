"""Calibration of the learning tier (issue #27): how competent a micro model starts.

For a micro model — a registered one (``--model micro-llama-s``) or one built here from a shape, task
families and a warm-up length (``--size s --families add99,sub99 --steps 200 --worked``) — prints one
JSON line per ID family of its held-out set: greedy pass@1, pass@1 at temperature 1 (the mean over k
samples) and pass@k. RL sharpens pass@k into pass@1 only where pass@k is well above pass@1, so a
learning tier wants a start of 15–40 % greedy with pass@k far above it.

    python -m sims.calibrate_learning --model micro-llama-s --families add30,sub30 --max-new-tokens 8
    python -m sims.calibrate_learning --size s --families add99,sub99 --steps 200 --worked --out runs/w200
    python -m sims.calibrate_learning --arch qwen2 --tokenizer char --families sub99 --steps 200 --worked

Built models go to ``--out`` (default: a folder under the system's temporary directory named after the
spec); nothing is downloaded. ``--jsonl FILE`` appends the line to FILE too.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np


def probe(model: str, families: tuple[str, ...], n: int = 64, k: int = 8, max_new_tokens: int = 40,
          seed: int = 0, temperature: float = 1.0) -> dict:
    """Greedy pass@1, pass@1 at ``temperature`` (key ``pass1_T1`` at 1, else ``pass1_T<t>``) and pass@k per
    ID family on ``n`` held-out prompts (eval-seed ``seed``)."""
    from ftis_fed.learn.evaluation import greedy_replies, sampled_eval, solved
    from ftis_fed.policies import PolicyConfig, build_policy
    from ftis_fed.tasks.rewards import Verifier
    from ftis_fed.tasks.suite import eval_sets
    from ftis_fed.wire.batch import SamplingParams

    pol = build_policy(PolicyConfig(model=model, micro_batch=64))
    v = Verifier()
    prompts = eval_sets(n, seed, families, ())["id"]
    greedy = greedy_replies(pol, prompts, max_new_tokens)
    ok_g = solved(prompts, greedy, v)
    counts: dict[str, list[int]] = {}
    sampled_eval(pol, {"id": prompts}, k, SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens), seed,
                 verifier=v, per_prompt=counts)
    c = np.asarray(counts["id"])                                                      # (n,) solved of k
    out = {"model": model, "n": len(prompts), "k": k, "max_new_tokens": max_new_tokens,
           "reply_tokens": float(np.mean([len(pol.tokenizer(x, add_special_tokens=False)["input_ids"]) for x in greedy])),
           "example": greedy[0]}
    for f in families:
        sel = [i for i, p in enumerate(prompts) if p.task_id.split("/")[0] == f]
        out[f] = {"greedy": float(np.mean([ok_g[i] for i in sel])), f"pass1_T{temperature:g}": float(c[sel].mean() / k),
                  f"pass{k}": float((c[sel] > 0).mean())}
    return out


def main(argv: list[str] | None = None) -> int:
    from ftis_fed.policies import micro

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="", help="a registered or local model (else one is built from the spec below)")
    ap.add_argument("--size", choices=("t", "s", "m", "l"), default="s",
                    help="micro shape: 0.11 M / 0.33 M / 1.2 M / 3.6 M")
    ap.add_argument("--arch", choices=("llama", "qwen2"), default="llama", help="the built model's architecture")
    ap.add_argument("--tokenizer", choices=("bpe", "char"), default="bpe", help="the built model's tokenizer")
    ap.add_argument("--families", default="add99,sub99", help="ID families (warm-up and evaluation)")
    ap.add_argument("--steps", type=int, default=200, help="warm-up steps of 64 problems")
    ap.add_argument("--lr", type=float, default=3e-3, help="warm-up peak learning rate")
    ap.add_argument("--worked", action="store_true", help="the warm-up teaches the worked replies")
    ap.add_argument("--n", type=int, default=64, help="held-out prompts (ID set, families alternating)")
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=40)
    ap.add_argument("--temperature", type=float, default=1.0, help="sampling temperature of pass@1 and pass@k")
    ap.add_argument("--out", default="", help="folder of the built model")
    ap.add_argument("--jsonl", default="", help="also append the line to this file")
    a = ap.parse_args(argv)
    families = tuple(f for f in a.families.split(",") if f)
    built = {}
    model = a.model
    if not model:
        shape = {"t": micro._TINY, "s": micro._SMALL, "m": micro._MEDIUM, "l": micro._LARGE}[a.size]
        spec = micro.MicroSpec(a.arch, a.tokenizer, **shape, families=families, steps=a.steps, lr=a.lr, batch=64,
                               worked=a.worked)
        out = Path(a.out or Path(tempfile.gettempdir()) / f"ftis-micro-{a.arch}-{a.tokenizer}-{a.size}-"
                   f"{'-'.join(families)}-{a.steps}"
                   f"-{a.lr}{'-worked' if a.worked else ''}")
        t0 = time.process_time()
        if not (out / "config.json").exists():
            micro.build_micro(out, spec, log=False)
        built = {"arch": a.arch, "tokenizer": a.tokenizer, "size": a.size, "steps": a.steps, "lr": a.lr,
                 "worked": a.worked,
                 "build_cpu_s": round(time.process_time() - t0, 1)}
        model = str(out)
    line = json.dumps({**built, **probe(model, families, a.n, a.k, a.max_new_tokens, temperature=a.temperature)})
    print(line, flush=True)
    if a.jsonl:
        with open(a.jsonl, "a") as f:
            f.write(line + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
