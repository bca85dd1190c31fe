"""The learning tier's suite (issue #27): every committed grid of the calibration and of the learning
tier, the commands that re-run it, and what it cost, all read from the grid's own files.

    python -m sims.suite                                   # per grid: its commands, cells, cell-hours
    python -m sims.suite --run --out outputs/suite --jobs 2   # run the whole suite (resumable)

A grid's commands come from its ``grid.json`` (preset, transport, metric, run-config items, variants)
and its finished cells (which methods ran on which seeds): one ``ftis-fed grid`` command per set of
methods that share their seeds, so re-running them gives the same cells. Its cost is the sum of its
cells' ``done.json`` seconds (wall time of each cell, at the load recorded beside it), and the
suite's wall time at ``--jobs`` cells at once is at least that sum divided by the jobs.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

from ftis_fed.grid.metric import recorded_metric
from ftis_fed.grid.plan import VARIANTS, discover_cells
from sims.results_tables import DECIDED

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"
#: the calibration's grids (its other sweeps are single runs: docs/results/calibration/README.md)
CALIBRATION = ("calibration/sweep-1", "calibration/worked-1", "calibration/alone-5")
SUITE = (*CALIBRATION, *DECIDED)


def _seed_args(seeds: list[int]) -> list[list[str]]:
    """``--seeds`` / ``--seed-from`` arguments covering ``seeds``: one pair per contiguous run."""
    runs, start = [], seeds[0]
    for prev, cur in zip(seeds, [*seeds[1:], None]):
        if cur != prev + 1:
            n = prev - start + 1
            runs.append(["--seeds", str(n)] + (["--seed-from", str(start)] if start else []))
            start = cur
    return runs


def commands(grid: Path, out: Path | None = None) -> list[list[str]]:
    """The ``ftis-fed grid`` commands that make ``grid``'s finished cells, in ``out`` (default: ``grid``)."""
    meta = json.loads((grid / "grid.json").read_text())
    seeds: dict[tuple[str, str], list[int]] = defaultdict(list)
    for c in discover_cells(grid):
        seeds[(c.label, c.groups)].append(c.seed)
    by_seeds: dict[tuple[tuple[int, ...], str], list[str]] = defaultdict(list)
    for (label, groups), s in seeds.items():
        by_seeds[(tuple(sorted(s)), groups)].append(label)
    common = ["--preset", meta["preset"], "--transport", meta.get("transport", "inprocess")]
    for item in meta.get("run_config", []):
        key, _, value = item.partition("=")
        common += ["--eval-seed", value] if key == "eval-seed" else ["--run-config", item]
    common += ["--metric", recorded_metric(grid), "--out", str(out or grid)]
    cmds = []
    for (s, groups), labels in sorted(by_seeds.items(), key=lambda kv: -len(kv[0][0])):   # plan order within
        variants = sorted({lab.partition("+")[2] for lab in labels} - {""} - set(VARIANTS))
        var_args = []
        for v in variants:
            items = ",".join(f"{k}={val}" for k, val in meta["variants"][v].items())
            var_args += ["--variant", f"{v}:{items}"]
        for seed_args in _seed_args(list(s)):
            cmds.append(["ftis-fed", "grid", *common, "--modes", ",".join(labels), "--groups", groups,
                         *var_args, *seed_args])
    return cmds


def cost(grid: Path) -> dict:
    """Cells, their summed wall seconds (``done.json``) and the mean 1-minute load at their starts."""
    done = [json.loads(p.read_text()) for p in sorted((grid / "cells").glob("*/done.json"))]
    loads = [d["load1_start"] for d in done if "load1_start" in d]
    return {"cells": len(done), "seconds": sum(float(d.get("seconds", 0)) for d in done),
            "load": sum(loads) / len(loads) if loads else None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", action="store_true", help="run every command (a finished cell is skipped)")
    ap.add_argument("--out", default="", help="with --run: the folder the grids go to (one sub-folder each)")
    ap.add_argument("--jobs", type=int, default=2, help="cells at once (--run), and the wall-time estimate's")
    a = ap.parse_args(argv)
    if a.run and not a.out:
        ap.error("--run needs --out (the committed grids stay as they are)")
    total_s, total_cells = 0.0, 0
    print(f"| grid | cells | cell-hours | mean load at a cell's start | commands |\n|---|---|---|---|---|")
    for name in SUITE:
        grid = RESULTS / name
        out = Path(a.out) / name if a.out else None
        cmds = commands(grid, out)
        c = cost(grid)
        total_s, total_cells = total_s + c["seconds"], total_cells + c["cells"]
        load = f"{c['load']:.1f}" if c["load"] is not None else "–"
        shown = "<br>".join(f"`{shlex.join(cmd)}`" for cmd in cmds).replace(str(ROOT) + "/", "")
        print(f"| `{name}` | {c['cells']} | {c['seconds'] / 3600:.2f} | {load} | {shown} |")
        if a.run:
            for cmd in cmds:
                rc = subprocess.run([sys.executable, "-m", "ftis_fed.commands.cli", *cmd[1:], "--jobs", str(a.jobs)],
                                    cwd=ROOT).returncode
                if rc:
                    print(f"[suite] {name}: exit {rc}", file=sys.stderr)
                    return rc
    print(f"\n{total_cells} cells, {total_s / 3600:.1f} cell-hours: at least {total_s / 3600 / a.jobs:.1f} h of wall "
          f"time at {a.jobs} cells at once (the cells' own wall times, at the loads above)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
