"""Two grid cells' metric records compared figure by figure: how "value for value" is counted in
docs/RESULTS.md.

    python -m sims.compare_cells docs/results/research-w-spec/cells/F-TIS+shadowx__vertical__s2 \\
        docs/results/research-w-spec/cells/F-TIS+shadowxz__vertical__s2

Rows are matched by (participant, round, phase) (the federation's own rows under ``_federation``);
every figure both rows of a pair have is compared, exactly, except those that depend on the machine
or the process rather than on the run's arithmetic (``machine_figure``: timings, the relay's and the
wire's byte counts, worker and memory figures, the weights' fingerprint). A row that only one cell has
is counted, not compared (an alone cell has no peers' rows; a cell that made the grid's evaluation
before round 1 has its round-0 rows). Exit status 0 when every compared figure is equal, 1 when some
differ (the first are listed, by round), 2 when a folder is not a finished cell.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Iterable

from ftis_fed.grid.records import cell_rows

#: figure-name prefixes that depend on the machine or the process, not on the run's arithmetic
PROCESS = ("fed/", "worker/", "mem/", "wire/", "model_weights")


def machine_figure(name: str) -> bool:
    """Whether figure ``name`` is a timing or a process figure (``PROCESS``), left out of comparisons."""
    return "seconds" in name or name.startswith(PROCESS)


def keyed_rows(rows: Iterable[dict], rounds: int | None = None,
               participants: Iterable[str] | None = None) -> dict[tuple[str, int, str, int], dict]:
    """(participant, round, phase, n-th such row) -> row, of rounds <= ``rounds`` (all when None) and of
    ``participants`` (all when None)."""
    keep = set(participants) if participants else None
    out: dict[tuple[str, int, str, int], dict] = {}
    for r in rows:
        p, rnd, phase = str(r.get("participant")), int(r.get("round", -1)), str(r.get("phase"))
        if (rounds is not None and rnd > rounds) or (keep is not None and p not in keep):
            continue
        n = 0
        while (p, rnd, phase, n) in out:
            n += 1
        out[(p, rnd, phase, n)] = r
    return out


def compare(a: dict, b: dict) -> dict:
    """Counts of ``keyed_rows`` ``a`` against ``b``: rows in both / only in a / only in b, figures compared
    and equal, and the differences as (key, figure, value in a, value in b), by round."""
    both = sorted(set(a) & set(b), key=lambda k: (k[1], k[0], k[2], k[3]))
    compared, diffs = 0, []
    for key in both:
        ra, rb = a[key], b[key]
        for name in ra.keys() & rb.keys():
            if name in ("participant", "round", "phase") or machine_figure(name):
                continue
            compared += 1
            if ra[name] != rb[name]:
                diffs.append((key, name, ra[name], rb[name]))
    return {"rows": len(both), "only_a": len(set(a) - set(b)), "only_b": len(set(b) - set(a)),
            "compared": compared, "equal": compared - len(diffs), "diffs": diffs}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("a", type=Path, help="a finished cell folder (done.json, run/metrics.jsonl[.gz])")
    ap.add_argument("b", type=Path, help="the cell to compare it with")
    ap.add_argument("--rounds", type=int, default=None, help="compare rounds <= this one only")
    ap.add_argument("--participant", action="append", default=None,
                    help="compare this participant's rows only (repeatable; `_federation` for the relay's)")
    ap.add_argument("--show", type=int, default=10, help="differences listed (default 10)")
    args = ap.parse_args(argv)
    if args.rounds is not None and args.rounds < 0:
        ap.error(f"--rounds={args.rounds}: must be >= 0")
    keyed = []
    for cell in (args.a, args.b):
        rows = cell_rows(cell) if (cell / "done.json").exists() else []
        if not rows:
            print(f"{cell}: not a finished cell (no done.json or no metrics rows)", file=sys.stderr)
            return 2
        keyed.append(keyed_rows(rows, args.rounds, args.participant))
    c = compare(*keyed)
    print(f"{args.a.name} vs {args.b.name}: {c['rows']:,} rows in both ({c['only_a']} only in the first, "
          f"{c['only_b']} only in the second); {c['compared']:,} figures compared, {c['equal']:,} equal")
    if not c["diffs"]:
        return 0
    rounds = sorted({k[1] for k, *_ in c["diffs"]})
    print(f"{len(c['diffs']):,} differ, in {len(rounds)} rounds from round {rounds[0]}; the first:")
    for (p, rnd, phase, _), name, va, vb in c["diffs"][:args.show]:
        print(f"  {p} round {rnd} {phase} {name}: {va!r} / {vb!r}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
