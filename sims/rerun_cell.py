"""Re-run the first rounds of a committed grid cell from the command line and compare its train rows
with the committed ones, figure by figure.

    python -m sims.rerun_cell docs/results/research-w/cells/F-TIS__vertical__s0            # 2 rounds
    python -m sims.rerun_cell docs/results/research-w-ood/cells/F-TIS+shadow__vertical__s2 --rounds 25
    python -m sims.rerun_cell docs/results/research-w/cells/VIS__vertical__s* --rounds 1   # one by one

The cell runs as its grid ran it (the suite's command for it, ``sims.suite.cell_command``: the grid's
preset, items, metric and the cell's variant from ``grid.json``), through ``ftis-fed grid`` in a
temporary folder, with ``num-rounds`` cut to ``--rounds``: the same seeds give the same prompts and
samples, so every figure of those rounds that does not depend on the machine (rewards, lengths,
losses, gradient norms, every off-policy statistic) must come out equal. ``ftis-fed grid`` pins the
CPU kernels (docs/models.md); a cell that ran on an AVX-512 machine before the pin reruns with
``ATEN_CPU_CAPABILITY=avx512`` set. Several cells run one after the other, each said as it ends, then
a tally naming those that differ or failed. Exit status 0 when every figure is equal, 1 naming the
first that differ, 2 when a rerun itself fails (or the folder is no finished cell).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from ftis_fed.grid.plan import discover_cells
from ftis_fed.grid.records import cell_rows, participant_rows
from sims import suite
from sims.compare_cells import compare, keyed_rows


def train_rows(cell_dir: Path, rounds: int) -> dict[tuple[str, int, str, int], dict]:
    """The participants' train rows of rounds 1..``rounds`` of the cell in ``cell_dir``, keyed as
    ``compare_cells.keyed_rows`` keys them."""
    return {k: r for k, r in keyed_rows(participant_rows(cell_rows(cell_dir), "train"), rounds).items()
            if k[1] >= 1}


def differences(ref: dict, new: dict) -> tuple[int, list[str]]:
    """(figures compared, the differences as lines): ``compare_cells.compare`` of the two cells' train
    rows (every figure both rows have, timings and process figures left out); a row missing from
    ``new`` is one difference."""
    c = compare(ref, new)
    missing = [f"{k[0]} round {k[1]}: no train row in the rerun" for k in sorted(set(ref) - set(new))]
    return c["compared"], missing + [f"{k[0]} round {k[1]} {name}: {vn!r} in the rerun, {vr!r} committed"
                                     for k, name, vr, vn in c["diffs"]]


def grid_command(cell_dir: Path, rounds: int, out: Path) -> list[str]:
    """The ``ftis-fed grid`` command that runs ``cell_dir``'s cell again for ``rounds`` rounds into ``out``:
    the suite's command for that cell (``suite.cell_command``) with ``num-rounds`` cut."""
    grid = cell_dir.parent.parent
    cell = next((c for c in discover_cells(grid) if c.name == cell_dir.name), None)
    if cell is None:
        raise ValueError(f"{cell_dir}: not a finished cell of {grid} (no done.json)")
    try:
        pinned = suite.PINNED.get(grid.relative_to(suite.RESULTS).as_posix(), ())
    except ValueError:                                   # a grid outside docs/results
        pinned = ()
    cmd = suite.cell_command(grid, cell, out, pinned)
    return [sys.executable, "-m", "ftis_fed.commands.cli", *cmd[1:], "--run-config", f"num-rounds={rounds}"]


def rerun(cell_dir: Path, rounds: int, out: Path) -> tuple[int, str]:
    """Run ``cell_dir``'s cell again for ``rounds`` rounds into ``out`` and compare: (0 every figure
    equal, 1 some differ, 2 the rerun failed; the lines that say so)."""
    ref = train_rows(cell_dir, rounds)
    if not ref:
        raise ValueError(f"{cell_dir}: no train rows of rounds 1-{rounds} in its run/metrics.jsonl.gz")
    cmd = grid_command(cell_dir, rounds, out)
    print("+ " + " ".join(cmd), flush=True)
    done = subprocess.run(cmd, cwd=suite.ROOT)
    new_dir = out / "cells" / cell_dir.name
    if done.returncode != 0 or not (new_dir / "done.json").exists():
        return 2, f"{cell_dir.name}: the rerun failed (exit {done.returncode}); its log: {new_dir / 'run.log'}"
    kernels = json.loads((new_dir / "done.json").read_text()).get("kernels", "?")
    committed = json.loads((cell_dir / "done.json").read_text()).get("kernels", "not recorded")
    compared, diffs = differences(ref, train_rows(new_dir, rounds))
    head = (f"{cell_dir.name}, rounds 1-{rounds}: {compared} figures compared; kernels {kernels} "
            f"(committed: {committed})")
    if diffs:
        return 1, f"{head}\n{len(diffs)} differ, the first:\n  " + "\n  ".join(diffs[:10])
    return 0, f"{head}\nevery figure equal"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("cells", type=Path, nargs="+", metavar="cell",
                    help="committed cell folders, docs/results/<grid>/cells/<cell> (one run each, in turn)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds to run and compare (default 2)")
    ap.add_argument("--keep", type=Path, default=None,
                    help="run into this folder and keep it (several cells: a sub-folder each)")
    a = ap.parse_args(argv)
    if a.rounds < 1:
        ap.error(f"--rounds={a.rounds}: must be >= 1")
    status: dict[str, int] = {}
    for i, cell in enumerate(a.cells):
        cell_dir = cell.resolve()
        if a.keep is None:
            out = Path(tempfile.mkdtemp(prefix="rerun-"))
        else:
            out = a.keep if len(a.cells) == 1 else a.keep / f"{i}-{cell_dir.name}"
        try:
            status[str(cell)], lines = rerun(cell_dir, a.rounds, out)
        except ValueError as e:                              # no finished cell, or no rows to compare
            status[str(cell)], lines = 2, str(e)
        finally:
            if a.keep is None:
                shutil.rmtree(out, ignore_errors=True)
        print(lines, file=sys.stderr if status[str(cell)] == 2 else sys.stdout, flush=True)
    if len(status) > 1:
        said = {0: "equal", 1: "differ", 2: "failed"}
        print(f"{len(status)} cells, rounds 1-{a.rounds}: "
              + ", ".join(f"{sum(v == k for v in status.values())} {said[k]}" for k in said)
              + "".join(f"\n  {said[v]}: {c}" for c, v in status.items() if v))
    return max(status.values())


if __name__ == "__main__":
    sys.exit(main())
