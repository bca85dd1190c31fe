"""Two methods of one grid compared per participant: the paired per-prompt difference A − B of the final
held-out greedy pass@1 over the seeds both finished, with the grid's own interval (``grid.stats``:
pigeonhole bootstrap over seeds and prompts, and the paired t over seeds), from the committed cells only.

For a comparison the grid's claims do not make (e.g. two variants of one method):

    python -m sims.paired docs/results/research-mixed-gspo F-TIS+gspo F-TIS+seq
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from ftis_fed.grid.records import prompt_records, prompt_vectors
from ftis_fed.grid.stats import paired_interval


def seed_vectors(grid: Path, mode: str, grouping: str, key: str) -> dict[int, dict[str, np.ndarray]]:
    """seed -> participant -> per-prompt solved flags of ``mode``'s cells (``key``: ``id``, ``ood``, ...)."""
    out: dict[int, dict[str, np.ndarray]] = {}
    for cell in sorted((grid / "cells").glob(f"{mode}__{grouping}__s*")):
        if not (cell / "done.json").exists():
            continue
        seed = int(cell.name.rsplit("__s", 1)[1])
        vecs = prompt_vectors(prompt_records(cell))
        out[seed] = {p: sets[key][1] for p, sets in vecs.items() if key in sets}
    return out


def compare(grid: Path, a: str, b: str, grouping: str = "vertical", key: str = "id") -> list[dict]:
    """One row per participant: ``paired_interval`` of A − B over the seeds both finished, in points."""
    va, vb = seed_vectors(grid, a, grouping, key), seed_vectors(grid, b, grouping, key)
    seeds = sorted(set(va) & set(vb))
    rows = []
    for p in sorted(set.intersection(*(set(va[s]) & set(vb[s]) for s in seeds)) if seeds else set()):
        d = np.stack([va[s][p] - vb[s][p] for s in seeds])                           # (S, N)
        r = paired_interval(d, f"{grid.name}/{a}-{b}/{p}/{key}")
        wins = int(sum(row.mean() > 0 for row in d)), int(sum(row.mean() < 0 for row in d))
        rows.append({"participant": p, "set": key, "seeds": seeds, "diff": round(100 * r["diff"], 1),
                     "lo": round(100 * r["lo"], 1), "hi": round(100 * r["hi"], 1),
                     "t_lo": round(100 * r["t_lo"], 1), "t_hi": round(100 * r["t_hi"], 1), "seeds_won": wins})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("grid", help="a grid's output folder (cells/ inside)")
    ap.add_argument("a", help="method A, as in the cells' names (e.g. F-TIS+gspo)")
    ap.add_argument("b", help="method B")
    ap.add_argument("--grouping", default="vertical")
    ap.add_argument("--set", default="id", help="id, ood, id:<family> or ood:<family>")
    args = ap.parse_args(argv)
    for row in compare(Path(args.grid), args.a, args.b, args.grouping, args.set):
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
