"""Two methods of one grid compared per participant: the paired per-prompt difference A − B of the final
held-out pass@1 (the metric the grid records in grid.json, greedy or sampled; ``--metric`` another)
over the seeds both finished, with the grid's own interval (``grid.tables.
paired_prompt_table``: pigeonhole bootstrap over seeds and prompts, and the paired t over seeds), from the
committed cells only.

For a comparison the grid's claims do not make (e.g. two variants of one method):

    python -m sims.paired docs/results/research-mixed-gspo F-TIS+gspo F-TIS+seq
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def compare(grid: Path, a: str, b: str, key: str = "id", metric: str | None = None) -> list[dict]:
    """One row per participant, points: A − B and its intervals over the seeds both finished, for
    ``metric`` (None: the one grid.json records, else greedy)."""
    from ftis_fed.grid.metric import metric as metric_named, recorded_metric
    from ftis_fed.grid.plan import discover_cells
    from ftis_fed.grid.tables import paired_prompt_table

    m = metric_named(metric or recorded_metric(grid))
    rows = paired_prompt_table(discover_cells(grid), grid, m, pairs=[(a, b)])
    return [{"participant": r["participant"], "set": r["set"], "metric": m.name, "seeds": r["seeds"],
             **{k: round(100 * r[k], 1) for k in ("diff", "lo", "hi", "t_lo", "t_hi")},
             "seeds_won": [r["a_wins"], r["b_wins"]]} for r in rows if r["set"] == key]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("grid", help="a grid's output folder (cells/ inside)")
    ap.add_argument("a", help="method A, as in the cells' names (e.g. F-TIS+gspo)")
    ap.add_argument("b", help="method B")
    ap.add_argument("--set", default="id", help="id, ood, id:<family> or ood:<family>")
    ap.add_argument("--metric", choices=("greedy", "sampled"), help="default: the one grid.json records")
    args = ap.parse_args(argv)
    for row in compare(Path(args.grid), args.a, args.b, args.set, args.metric):
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
