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
import json
from pathlib import Path


def family_scores(records: list[dict], rnd: int) -> dict[str, tuple[float, float]]:
    """ID family -> (greedy pass@1, sampled pass@1) of the participant's evaluation at round ``rnd``
    (``grid.records.prompt_vectors``, the grid's own reading of the records)."""
    from ftis_fed.grid.metric import GREEDY, SAMPLED
    from ftis_fed.grid.records import prompt_vectors

    greedy, sampled = (next(iter(prompt_vectors(records, rnd, metric=m).values())) for m in (GREEDY, SAMPLED))
    return {k[3:]: (float(greedy[k][1].mean()), float(sampled[k][1].mean()))
            for k in sorted(greedy) if k.startswith("id:")}


def run_row(folder: Path) -> dict:
    """One run's reward curve (means over sixths of its rounds) and its evaluations by family."""
    from ftis_fed.grid.records import read_rows

    rows = read_rows(folder / "metrics.jsonl")
    rewards = [r["reward/mean"] for r in rows if r.get("phase") == "train" and "reward/mean" in r]
    step = max(1, len(rewards) // 6)
    curve = [sum(rewards[i:i + step]) / len(rewards[i:i + step]) for i in range(0, len(rewards), step)]
    records = read_rows(folder / "eval_prompts.jsonl")
    evals = {rnd: family_scores(records, rnd) for rnd in sorted({int(r["round"]) for r in records})}
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
