"""The learning tier's suite (issue #27): every committed grid of the calibration and of the learning
tier, the commands that re-run it, and what it cost, all read from the grid's own files.

    python -m sims.suite                                   # per grid: its commands, cells, cell-hours
    python -m sims.suite --run --out outputs/suite --jobs 2   # run the whole suite (resumable)
    python -m sims.suite --check                           # today's presets still make the committed cells?
    python -m sims.suite --core --run --out outputs/core   # only the core: the main pair's alone and F-TIS

``--run`` then compares every cell it holds with the committed cell of the same name, figure for figure
(``sims.compare_cells``), and records the run in ``DIR/suite.json``: the command, the commit, its wall
and CPU seconds, the load, and per grid the cells done before it (a resumed run), those that equal the
committed ones and those that differ, and each cell's own seconds.

The core (``CORE``) is the part that decides the headline, sized to run in an afternoon: the main pair's
alone and F-TIS cells (``research-w``, 10 seeds), which decide alone's gain there (the calibration
table's first rows; ``calibration/alone-5`` is the same command's first five alone cells, equal figure
for figure) and claims 1 and 7; the other baselines, pairs and variants are the whole suite's.

A grid's commands come from its ``grid.json`` (preset, transport, metric, run-config items, variants)
and its finished cells (which methods ran on which seeds): one ``ftis-fed grid`` command per set of
methods that share their seeds, so re-running them gives the same cells. Its cost is the sum of its
cells' ``done.json`` seconds (wall time of each cell, at the load recorded beside it), and the
suite's wall time at ``--jobs`` cells at once is at least that sum divided by the jobs.

The commands name presets, so they make the committed cells only while each preset, with the grid's
items, still resolves to the run configuration its cells recorded: ``drift`` resolves it today for
one cell of each method and compares (``--check``; ``--run`` checks first and refuses on a drift).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import subprocess
import sys
import time
from collections import defaultdict
from datetime import datetime, timezone
from pathlib import Path

from ftis_fed.grid.metric import recorded_metric
from ftis_fed.grid.pack import PackError, check_config
from ftis_fed.grid.plan import VARIANTS, Cell, discover_cells
from ftis_fed.grid.records import cell_rows
from sims.compare_cells import compare, keyed_rows
from sims.results_tables import DECIDED

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"
#: the calibration's grids (its other sweeps are single runs: docs/results/calibration/README.md)
CALIBRATION = ("calibration/sweep-1", "calibration/worked-1", "calibration/alone-5")
SUITE = (*CALIBRATION, *DECIDED)
#: the core: each grid's methods (None: all of them) that decide alone's gain and the main pair's claims 1
#: and 7 (F-TIS against alone), the part of the suite a reader re-runs first
CORE: dict[str, tuple[str, ...] | None] = {"research-w": ("alone", "F-TIS")}
#: run-config items a grid's cells ran with that its preset no longer holds (the preset moved on as the
#: calibration went): the suite's commands for that grid add them, so they make the committed cells.
PINNED: dict[str, tuple[str, ...]] = {
    "calibration/worked-1": ("prompts-per-round=16", "task-scheme=\"expertise\"", "eval-size=128", "eval-samples=8",
                             "threads=0"),
}


def _seed_args(seeds: list[int]) -> list[list[str]]:
    """``--seeds`` / ``--seed-from`` arguments covering ``seeds``: one pair per contiguous run."""
    runs, start = [], seeds[0]
    for prev, cur in zip(seeds, [*seeds[1:], None]):
        if cur != prev + 1:
            n = prev - start + 1
            runs.append(["--seeds", str(n)] + (["--seed-from", str(start)] if start else []))
            start = cur
    return runs


def _common_args(grid: Path, meta: dict, out: Path | None, pinned: tuple[str, ...]) -> list[str]:
    """The arguments every command of ``grid`` shares: preset, transport, the grid's items (its
    ``eval-seed`` as ``--eval-seed``), the ``pinned`` items, the metric and ``--out``."""
    common = ["--preset", meta["preset"], "--transport", meta.get("transport", "inprocess")]
    for item in meta.get("run_config", []):
        key, _, value = item.partition("=")
        common += ["--eval-seed", value] if key == "eval-seed" else ["--run-config", item]
    for item in pinned:
        common += ["--run-config", item]
    return common + ["--metric", recorded_metric(grid), "--out", str(out or grid)]


def _variant_args(meta: dict, labels: list[str]) -> list[str]:
    """``--variant`` arguments for the variants of ``labels`` that the grid defines (``grid.json``) and
    that are not built in with that definition (a built-in redefined with more items, as ``shadow`` with
    its validation batch, needs its own)."""
    defined, args = meta.get("variants") or {}, []
    for v in sorted({lab.partition("+")[2] for lab in labels} - {""}):
        if v not in VARIANTS or defined.get(v, VARIANTS[v]) != VARIANTS[v]:
            items = ",".join(f"{k}={val}" for k, val in defined[v].items())
            args += ["--variant", f"{v}:{items}"]
    return args


def _cells(grid: Path, labels: tuple[str, ...] | None) -> list[Cell]:
    """``grid``'s finished cells, only those of the methods ``labels`` unless it is None."""
    return [c for c in discover_cells(grid) if labels is None or c.label in labels]


def commands(grid: Path, out: Path | None = None, pinned: tuple[str, ...] = (),
             labels: tuple[str, ...] | None = None) -> list[list[str]]:
    """The ``ftis-fed grid`` commands that make ``grid``'s finished cells (of the methods ``labels``, or
    all), in ``out`` (default: ``grid``), with ``pinned`` run-config items added (``PINNED``)."""
    meta = json.loads((grid / "grid.json").read_text())
    seeds: dict[tuple[str, str], list[int]] = defaultdict(list)
    for c in _cells(grid, labels):
        seeds[(c.label, c.groups)].append(c.seed)
    by_seeds: dict[tuple[tuple[int, ...], str], list[str]] = defaultdict(list)
    for (label, groups), s in seeds.items():
        by_seeds[(tuple(sorted(s)), groups)].append(label)
    common = _common_args(grid, meta, out, pinned)
    cmds = []
    for (s, groups), labels in sorted(by_seeds.items(), key=lambda kv: -len(kv[0][0])):   # plan order within
        for seed_args in _seed_args(list(s)):
            cmds.append(["ftis-fed", "grid", *common, "--modes", ",".join(labels), "--groups", groups,
                         *_variant_args(meta, labels), *seed_args])
    return cmds


def cell_command(grid: Path, cell: Cell, out: Path, pinned: tuple[str, ...] = ()) -> list[str]:
    """The ``ftis-fed grid`` command that makes ``cell`` of ``grid`` alone, in ``out`` (as ``commands``)."""
    meta = json.loads((grid / "grid.json").read_text())
    return ["ftis-fed", "grid", *_common_args(grid, meta, out, pinned), "--modes", cell.label, "--groups",
            cell.groups, *_variant_args(meta, [cell.label]), *_seed_args([cell.seed])[0]]


def today_config(grid: Path, cell: Cell, pinned: tuple[str, ...] = ()) -> dict:
    """The run configuration ``cell`` of ``grid`` would record if its command ran today: the grid's
    preset and items (``grid.json``), the ``pinned`` items, the variant's and the cell's own, resolved and
    parsed by the launcher's own parse (``commands.sim.checked_run_config``), without building a model."""
    from ftis_fed.commands.sim import checked_run_config, layered_overrides
    from ftis_fed.config.federation import to_jsonable

    meta = json.loads((grid / "grid.json").read_text())
    extra = {**VARIANTS, **(meta.get("variants") or {})}.get(cell.variant, {}) if cell.variant else {}
    cell = Cell(cell.mode, cell.groups, cell.seed, cell.variant, tuple(sorted(extra.items())))
    items = [*meta.get("run_config", []), *pinned, *cell.run_config_items(grid / "cells" / cell.name / "run")]
    _, _, fed = checked_run_config(ROOT, layered_overrides(ROOT, items, meta["preset"]))
    return to_jsonable(fed)


def drift(grid: Path, pinned: tuple[str, ...] = (), labels: tuple[str, ...] | None = None) -> list[str]:
    """Where ``grid``'s commands would no longer make its cells: for the first cell of each method (of
    ``labels``, or all), the settings in which today's resolution (``today_config``) differs from its
    recorded ``run/config.json``, compared as ``--pack`` compares two cells (``grid.pack.check_config``:
    a setting only one side records counts unless it holds today's default). Empty when none differs."""
    first: dict[str, Cell] = {}
    for c in _cells(grid, labels):
        first.setdefault(c.label, c)
    found = []
    for cell in first.values():
        recorded = json.loads((grid / "cells" / cell.name / "run" / "config.json").read_text())
        try:
            check_config(cell, recorded, cell, today_config(grid, cell, pinned), where="today's preset",
                         echo=lambda _: None)
        except PackError as e:
            found.append(str(e))
    return found


def cost(grid: Path, labels: tuple[str, ...] | None = None) -> dict:
    """Cells (of the methods ``labels``, or all), their summed wall seconds (``done.json``) and the mean
    1-minute load at their starts."""
    done = [json.loads((grid / "cells" / c.name / "done.json").read_text()) for c in _cells(grid, labels)]
    loads = [d["load1_start"] for d in done if "load1_start" in d]
    return {"cells": len(done), "seconds": sum(float(d.get("seconds", 0)) for d in done),
            "load": sum(loads) / len(loads) if loads else None}


def reproduced(ran: Path, committed: Path) -> dict:
    """Every finished cell of grid folder ``ran`` against the cell of the same name in ``committed``
    (``sims.compare_cells.compare``): cells, how many equal theirs in every figure both have, the
    figures compared, the cells that differ (name: figures differing) or that ``committed`` lacks, and
    each cell's own seconds (its ``done.json``)."""
    found = {"cells": 0, "equal": 0, "figures": 0, "differ": {}, "cell_seconds": {}}
    for cell in discover_cells(ran):
        found["cells"] += 1
        found["cell_seconds"][cell.name] = json.loads((ran / "cells" / cell.name / "done.json").read_text())["seconds"]
        theirs = committed / "cells" / cell.name
        if not (theirs / "done.json").exists():
            found["differ"][cell.name] = "not committed"
            continue
        c = compare(keyed_rows(cell_rows(ran / "cells" / cell.name)), keyed_rows(cell_rows(theirs)))
        found["figures"] += c["compared"]
        if c["diffs"]:
            found["differ"][cell.name] = f"{len(c['diffs'])} of {c['compared']} figures"
        else:
            found["equal"] += 1
    return found


def _commit() -> str | None:
    """The checkout's commit (None outside a git checkout)."""
    try:
        r = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    except OSError:                                                   # no git on this machine
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", action="store_true", help="run every command (a finished cell is skipped)")
    ap.add_argument("--out", default="", help="with --run: the folder the grids go to (one sub-folder each)")
    ap.add_argument("--jobs", type=int, default=2, help="cells at once (--run), and the wall-time estimate's")
    ap.add_argument("--check", action="store_true",
                    help="only check that today's presets resolve to the committed cells' configurations")
    ap.add_argument("--core", action="store_true",
                    help="only the core (CORE: research-w's alone and F-TIS cells, 10 seeds)")
    a = ap.parse_args(argv)
    chosen = CORE if a.core else dict.fromkeys(SUITE)
    if a.run and not a.out:
        ap.error("--run needs --out (the committed grids stay as they are)")
    if a.check or a.run:
        drifted = [(name, d) for name, labels in chosen.items()
                   for d in drift(RESULTS / name, PINNED.get(name, ()), labels)]
        for name, d in drifted:
            print(f"[suite] {name}: {d}", file=sys.stderr)
        print(f"[suite] {len(chosen) - len({n for n, _ in drifted})} of {len(chosen)} grids: today's presets "
              "resolve to their cells' recorded configurations", file=sys.stderr)
        if drifted:
            return 1
        if a.check:
            return 0
    total_s, total_cells = 0.0, 0
    record = {"command": ["python", "-m", "sims.suite", *(sys.argv[1:] if argv is None else argv)],
              "commit": _commit(), "started": _now(), "load1_start": round(os.getloadavg()[0], 2),
              "jobs": a.jobs, "grids": {}} if a.run else {}
    t0 = time.monotonic()
    print(f"| grid | cells | cell-hours | mean load at a cell's start | commands |\n|---|---|---|---|---|")
    for name, labels in chosen.items():
        grid = RESULTS / name
        out = Path(a.out) / name if a.out else None
        cmds = commands(grid, out, PINNED.get(name, ()), labels)
        c = cost(grid, labels)
        total_s, total_cells = total_s + c["seconds"], total_cells + c["cells"]
        load = f"{c['load']:.1f}" if c["load"] is not None else "–"
        shown = "<br>".join(f"`{shlex.join(cmd)}`" for cmd in cmds).replace(str(ROOT) + "/", "")
        print(f"| `{name}` | {c['cells']} | {c['seconds'] / 3600:.2f} | {load} | {shown} |")
        if a.run:
            before = len(discover_cells(out))
            for cmd in cmds:
                rc = subprocess.run([sys.executable, "-m", "ftis_fed.commands.cli", *cmd[1:], "--jobs", str(a.jobs)],
                                    cwd=ROOT).returncode
                if rc:
                    print(f"[suite] {name}: exit {rc}", file=sys.stderr)
                    return rc
            record["grids"][name] = found = {"done_before": before, **reproduced(out, grid)}
            print(f"[suite] {name}: {found['equal']} of {found['cells']} cells equal the committed ones in "
                  f"every figure ({found['figures']:,} compared)"
                  + "".join(f"; {cell}: {why}" for cell, why in found["differ"].items()), file=sys.stderr)
    if a.run:
        cpu = resource.getrusage(resource.RUSAGE_CHILDREN)
        record.update(ended=_now(), wall_seconds=round(time.monotonic() - t0, 1),
                      cpu_seconds=round(cpu.ru_utime + cpu.ru_stime, 1), load1_end=round(os.getloadavg()[0], 2))
        (Path(a.out) / "suite.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"\n{total_cells} cells, {total_s / 3600:.1f} cell-hours: at least {total_s / 3600 / a.jobs:.1f} h of wall "
          f"time at {a.jobs} cells at once (the cells' own wall times, at the loads above)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
