"""The calibration screen's table (issue #27; docs/results/calibration/README.md, section 4).

A screen run is ONE participant training alone on the research-w preset through the in-process
transport, its overrides in ``<dir>/runs.jsonl`` (one line per run: name, rounds, run-config overrides):

    ftis-fed sim --preset research-w --transport inprocess --run-config \\
      'num-rounds=60 eval-every=30 eval-samples=4 loss-mode="alone" p1-model="" min-participants=1 threads=1 \\
       output-dir="runs/C" <overrides>'

(``threads=1``: on a loaded 2-core machine two torch threads per process made the same run 10-15x
slower.) This prints, per run, the training reward per sixth of the run and, at each evaluation, the
greedy and sampled (T = 0.7, mean of k) pass@1 per ID family, from the committed records only
(``metrics.jsonl.gz``, ``eval_prompts.jsonl.gz``):

    python -m sims.calibration_screen docs/results/calibration/sweep-2
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path


def family_scores(record: dict) -> dict[str, tuple[float, float]]:
    """family -> (greedy pass@1, sampled pass@1) of one ID evaluation record."""
    acc: dict[str, list[float]] = {}
    k = max(1, int(record.get("k", 1)))
    sampled = record.get("sampled") or [0] * len(record["ids"])
    for task, solved, count in zip(record["ids"], record["solved"], sampled):
        a = acc.setdefault(task.split("/")[0], [0.0, 0.0, 0])
        a[0] += solved == "1"
        a[1] += count / k
        a[2] += 1
    return {f: (a[0] / a[2], a[1] / a[2]) for f, a in sorted(acc.items())}


def run_row(folder: Path) -> dict:
    """One run's reward curve (means over sixths of its rounds) and its evaluations by family."""
    rows = [json.loads(x) for x in gzip.decompress((folder / "metrics.jsonl.gz").read_bytes()).decode().splitlines()]
    rewards = [r["reward/mean"] for r in rows if r.get("phase") == "train" and "reward/mean" in r]
    step = max(1, len(rewards) // 6)
    curve = [sum(rewards[i:i + step]) / len(rewards[i:i + step]) for i in range(0, len(rewards), step)]
    evals = {}
    path = folder / "eval_prompts.jsonl.gz"
    if path.exists():
        for x in gzip.decompress(path.read_bytes()).decode().splitlines():
            r = json.loads(x)
            if r["set"] == "id":
                evals[int(r["round"])] = family_scores(r)
    return {"rounds_trained": len(rewards), "reward_curve": curve, "evals": evals}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", help="a screen folder with runs.jsonl and one sub-folder per run")
    a = ap.parse_args(argv)
    root = Path(a.folder)
    for line in (root / "runs.jsonl").read_text().splitlines():
        spec = json.loads(line)
        row = run_row(root / spec["run"])
        curve = " ".join(f"{v:.2f}" for v in row["reward_curve"])
        evals = " | ".join(f"r{rnd}: " + ", ".join(f"{f} {g:.2f}/{s:.2f}" for f, (g, s) in fams.items())
                           for rnd, fams in sorted(row["evals"].items()))
        print(f"{spec['run']}: {spec['overrides']}\n  {row['rounds_trained']} updates; reward {curve}\n"
              f"  greedy/sampled {evals}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
