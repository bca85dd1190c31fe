"""A finished grid cell on disk, in the committed layout (``cells/<name>/run/metrics.jsonl`` and
``done.json``), for the tests that read grids without running one."""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable, Iterable
from pathlib import Path

from ftis_fed.grid.plan import Cell
from ftis_fed.grid.records import read_rows


def write_cell(out: Path, cell: Cell, rows: Iterable[dict] = (), *, done: dict | None = None,
               config: dict | None = None) -> Path:
    """Writes ``cell`` under ``out``: its metric rows, its ``config.json`` when given, and ``done.json``
    (``done``, ``{}`` by default). Returns the cell's ``run`` folder."""
    run = out / "cells" / cell.name / "run"
    run.mkdir(parents=True, exist_ok=True)
    rows = list(rows)
    if rows:
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if config is not None:
        (run / "config.json").write_text(json.dumps(config))
    (run.parent / "done.json").write_text(json.dumps(done if done is not None else {}))
    return run


def rewrite_metrics(cell_dir: Path, edit: Callable[[list[dict]], list[dict]]) -> None:
    """Rewrites the committed cell ``cell_dir``'s ``run/metrics.jsonl.gz`` with ``edit(rows)`` (its rows
    in file order; ``edit`` returns the rows to write)."""
    path = cell_dir / "run" / "metrics.jsonl.gz"
    rows = read_rows(path.with_suffix(""))                 # reads the .gz where the plain file is not there
    path.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in edit(rows)).encode()))
