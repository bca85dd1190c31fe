"""The grid's cell runners (``grid.run.Runner``): ``ftis-fed sim`` in a subprocess (the product path),
or the in-process transport called in this process. They live with the commands because they run
one (``commands.sim``); ``ftis_fed.grid`` only plans, loops, reads and reports."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Sequence

from ftis_fed.grid.plan import Cell
from ftis_fed.grid.run import Runner


def sim_runner(app: Path, preset: str, extra: Sequence[str] = (), sim_args: Sequence[str] = ()) -> Runner:
    """The product path: ``ftis-fed sim --preset <preset> [sim_args] --run-config ...`` in a subprocess,
    its output going to the cell's ``run.log``. The subprocess runs in ``app`` with ``app`` first on
    PYTHONPATH, so the grid's cells run the code of the tree the grid was started from."""

    def run(cell: Cell, cell_dir: Path, log_path: Path) -> int:
        items = cell.run_config_items(cell_dir / "run")
        cmd = [sys.executable, "-m", "ftis_fed.commands.cli", "sim", "--app", str(app), "--preset", preset, *sim_args]
        for item in [*extra, *items]:
            cmd += ["--run-config", item]
        with open(log_path, "ab") as log:
            log.write(("+ " + " ".join(cmd) + "\n").encode())
            log.flush()
            path = os.pathsep.join([str(app), *filter(None, [os.environ.get("PYTHONPATH")])])
            return subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=app,
                                  env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path}).returncode

    return run


def inprocess_runner(app: Path, preset: str, extra: Sequence[str] = ()) -> Runner:
    """``ftis-fed sim --transport inprocess`` called in this process (no interpreter start-up and
    imports per cell: ~9 CPU-s each on this machine), its output and log lines going to the cell's
    ``run.log``. Each cell builds its participants afresh (``commands.inprocess``); an exception is
    the cell's failure, written to its log."""

    def run(cell: Cell, cell_dir: Path, log_path: Path) -> int:
        import contextlib
        import logging
        import traceback

        from ftis_fed.commands.sim import simulate_inprocess

        items = [*extra, *cell.run_config_items(cell_dir / "run")]
        with open(log_path, "a") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            handler = logging.StreamHandler(log)
            handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
            root = logging.getLogger()
            old_level = root.level
            root.addHandler(handler)
            root.setLevel(logging.INFO)
            try:
                print("+ ftis-fed sim --transport inprocess --preset " + preset + "".join(
                    f" --run-config {i}" for i in items), flush=True)
                return simulate_inprocess(app, items, preset)
            except Exception:                                    # noqa: BLE001 - the cell failed; say why
                traceback.print_exc(file=log)
                return 1
            finally:
                root.removeHandler(handler)
                root.setLevel(old_level)

    return run
