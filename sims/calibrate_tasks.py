"""Measure how often a model solves each task family, sampled (T = 0.7) and greedy.

A family gives GRPO a learning signal only when the model sometimes, but not always, solves it; this
script checks the suite's families against the embedded SmolLM2-135M-Instruct (or any model
``resolve_model`` knows). It prints one JSON object and writes a CSV with one row per
(family, decoding).

    python -m sims.calibrate_tasks                      # all families, 64 prompts each
    python -m sims.calibrate_tasks --families add30 word_add --n 32 --csv runs/cal.csv

Prompts come from each family's ``--split`` (default ``train``: what participants train on) and are
scored with the default ``Verifier`` (last number in the reply for procedural families).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
import time
from pathlib import Path

from ftis_fed.learn.evaluation import TextGenerator
from ftis_fed.tasks.rewards import FORMATS, Verifier
from ftis_fed.tasks.families import FAMILIES
from ftis_fed.tasks.suite import make_tasks


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95 % Wilson score interval of k successes in n trials."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    c = (p + z * z / (2 * n)) / (1 + z * z / n)
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, c - h), min(1.0, c + h)


def measure(gen: TextGenerator, family: str, split: str, n: int, seed: int, temperature: float,
            max_new_tokens: int, verifier: Verifier) -> dict:
    prompts = make_tasks(family, split, n, seed, distinct=False)
    t0 = time.time()
    replies = gen.generate_texts([p.text for p in prompts], max_new_tokens, temperature, seed)
    solved = sum(verifier.check(p.task_id, r, p.reference)[0] for p, r in zip(prompts, replies))
    formatted = sum(FORMATS[verifier.rule_for(p.task_id).format](r) for p, r in zip(prompts, replies))
    lo, hi = wilson(solved, n)
    return {"family": family, "kind": FAMILIES[family].kind, "decoding": "greedy" if temperature == 0 else f"T={temperature}",
            "n": n, "correct": solved, "accuracy": solved / n, "ci_low": lo, "ci_high": hi,
            "format_ok": formatted / n,
            "seconds": round(time.time() - t0, 1), "example": f"{prompts[0].text!r} -> {replies[0]!r}"}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--families", nargs="*", default=list(FAMILIES))
    ap.add_argument("--split", default="train", choices=("train", "eval"))
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--csv", default="runs/calibrate_tasks.csv")
    args = ap.parse_args(argv)

    gen = TextGenerator(args.model, batch_size=args.batch_size)
    verifier = Verifier()
    rows = []
    for fam in args.families:
        for temp in (args.temperature, 0.0):
            rows.append(measure(gen, fam, args.split, args.n, args.seed, temp, args.max_new_tokens, verifier))
            r = rows[-1]
            print(f"{fam:>10} {r['decoding']:>7}: {r['correct']:>3}/{r['n']} = {r['accuracy']:.3f} "
                  f"[{r['ci_low']:.2f}, {r['ci_high']:.2f}] ({r['seconds']} s)  {r['example']}",
                  file=sys.stderr, flush=True)
    Path(args.csv).parent.mkdir(parents=True, exist_ok=True)
    with open(args.csv, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    result = {"model": args.model, "split": args.split, "n": args.n, "seed": args.seed,
              "max_new_tokens": args.max_new_tokens, "csv": args.csv,
              "accuracy": {f"{r['family']}/{r['decoding']}": round(r["accuracy"], 3) for r in rows}}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
