"""Re-run the first rounds of a committed grid cell from the command line and compare its train rows
with the committed ones, figure by figure.

    python -m sims.rerun_cell docs/results/research-w/cells/F-TIS__vertical__s0            # 2 rounds
    python -m sims.rerun_cell docs/results/research-w-ood/cells/F-TIS+shadow__vertical__s2 --rounds 25

The cell runs as its grid ran it (the suite's command for it, ``sims.suite.cell_command``: the grid's
preset, items, metric and the cell's variant from ``grid.json``), through ``ftis-fed grid`` in a
temporary folder, with ``num-rounds`` cut to ``--rounds``: the same seeds give the same prompts and
samples, so every figure of those rounds that does not depend on the machine (rewards, lengths,
losses, gradient norms, every off-policy statistic) must come out equal. ``ftis-fed grid`` pins the
CPU kernels (docs/models.md); a cell that ran on an AVX-512 machine before the pin reruns with
``ATEN_CPU_CAPABILITY=avx512`` set. Exit status 0 when every figure is equal, 1 naming the first that
differ, 2 when the rerun itself fails.
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("cell", type=Path, help="a committed cell folder, docs/results/<grid>/cells/<cell>")
    ap.add_argument("--rounds", type=int, default=2, help="rounds to run and compare (default 2)")
    ap.add_argument("--keep", type=Path, default=None, help="run into this folder and keep it")
    a = ap.parse_args(argv)
    if a.rounds < 1:
        ap.error(f"--rounds={a.rounds}: must be >= 1")
    cell_dir = a.cell.resolve()
    ref = train_rows(cell_dir, a.rounds)
    if not ref:
        ap.error(f"{a.cell}: no train rows of rounds 1-{a.rounds} in its run/metrics.jsonl.gz")
    out = a.keep or Path(tempfile.mkdtemp(prefix="rerun-"))
    try:
        try:
            cmd = grid_command(cell_dir, a.rounds, out)
        except ValueError as e:
            ap.error(str(e))
        print("+ " + " ".join(cmd), flush=True)
        done = subprocess.run(cmd, cwd=suite.ROOT)
        new_dir = out / "cells" / cell_dir.name
        if done.returncode != 0 or not (new_dir / "done.json").exists():
            print(f"the rerun failed (exit {done.returncode}); its log: {new_dir / 'run.log'}", file=sys.stderr)
            return 2
        kernels = json.loads((new_dir / "done.json").read_text()).get("kernels", "?")
        committed = json.loads((cell_dir / "done.json").read_text()).get("kernels", "not recorded")
        compared, diffs = differences(ref, train_rows(new_dir, a.rounds))
        print(f"{cell_dir.name}, rounds 1-{a.rounds}: {compared} figures compared; kernels {kernels} "
              f"(committed: {committed})")
        if diffs:
            print(f"{len(diffs)} differ, the first:\n  " + "\n  ".join(diffs[:10]))
            return 1
        print("every figure equal")
        return 0
    finally:
        if a.keep is None:
            shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
