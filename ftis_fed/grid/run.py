"""Running a grid's cells: the resumable loop with progress, and compacting a finished cell to its
metrics. A cell is run by a ``Runner``; the two the command line uses (``ftis-fed sim`` in a
subprocess, or the in-process transport in this process) are ``ftis_fed.commands.cells``."""

from __future__ import annotations

import gzip
import json
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable, Sequence

from ftis_fed.grid.plan import Cell
from ftis_fed.grid.records import cell_defects, cell_rows, final_eval, initial_eval
from ftis_fed.policies.store import run_kernels

Runner = Callable[[Cell, Path, Path], int]
"""runner(cell, cell_dir, log_path) -> exit status (0 = the run completed)."""


def run_grid(cells: Sequence[Cell], out: Path, runner: Runner, echo: Callable[[str], None] = print,
             clock: Callable[[], float] = time.monotonic, shared_initial: bool = False, jobs: int = 1,
             compact: bool = True) -> list[Cell]:
    """Run every cell that has no ``done.json``; returns the cells that failed. Progress: cell k of
    n, elapsed, and an estimate of the rest from the mean time of the cells run so far.

    shared_initial: every cell starts from the same models, so the evaluation before round 1 (greedy,
    the same held-out prompts) is the same in every cell: only the first cell run while no finished
    cell in ``out`` has one evaluates before round 1 (``eval-initial``), the others skip it;
    ``initial_eval`` reads it back for the summary and the curves.
    jobs: cells run at once (each its own subprocess); with ``shared_initial`` the cell that carries
    the initial evaluation runs first, alone.
    compact: a finished cell keeps only its metrics (``compact_cell``): no checkpoints, keys or plots.
    """
    import threading
    from concurrent.futures import ThreadPoolExecutor

    out.mkdir(parents=True, exist_ok=True)
    todo = [c for c in cells if not (out / "cells" / c.name / "done.json").exists()]
    if len(todo) < len(cells):
        echo(f"[grid] {len(cells) - len(todo)} of {len(cells)} cells already done: skipped")
    t0, failed, started, lock = clock(), [], [0], threading.Lock()

    def one(cell: Cell) -> None:
        cell_dir = out / "cells" / cell.name
        if cell_dir.exists():                            # interrupted earlier: keep it aside, rerun
            aside = cell_dir.with_name(f"{cell.name}.interrupted-{int(time.time())}")
            cell_dir.rename(aside)
            echo(f"[grid] {cell.name}: an unfinished earlier attempt moved to {aside.name}")
        cell_dir.mkdir(parents=True)
        if shared_initial:
            cell = replace(cell, eval_initial=not initial_eval(out))
        with lock:
            started[0] += 1
            k = started[0]
            elapsed = clock() - t0
        eta = f", about {elapsed / (k - 1) * (len(todo) - k + 1) / 60 / max(1, jobs):.0f} min left" if k > 1 else ""
        echo(f"[grid] cell {k}/{len(todo)} {cell.name} (elapsed {elapsed / 60:.1f} min{eta})")
        load0 = os.getloadavg()[0]
        c0 = clock()
        status = runner(cell, cell_dir, cell_dir / "run.log")
        seconds = clock() - c0
        rows = cell_rows(cell_dir)
        defects = cell_defects(rows)
        if status != 0 or not final_eval(rows) or defects:
            with lock:
                failed.append(cell)
            echo(f"[grid] {cell.name}: FAILED (exit {status}, {len(rows)} metric rows"
                 + (f"; {'; '.join(defects)}" if defects else "") + f"); see {cell_dir / 'run.log'}")
            return
        if compact:
            compact_cell(cell_dir)
        (cell_dir / "done.json").write_text(json.dumps({"cell": cell.name, "seconds": round(seconds, 1),
                                                        "status": status, "eval_initial": cell.eval_initial,
                                                        "load1_start": round(load0, 2),
                                                        "load1_end": round(os.getloadavg()[0], 2),
                                                        "kernels": run_kernels()}))
        echo(f"[grid] {cell.name}: done in {seconds / 60:.1f} min (load {load0:.1f} -> {os.getloadavg()[0]:.1f})")

    rest = list(todo)
    if shared_initial and rest and jobs > 1 and not initial_eval(out):
        one(rest.pop(0))                           # the cell that carries the shared evaluation: alone
    if jobs <= 1:
        for c in rest:
            one(c)
    else:
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            list(pool.map(one, rest))
    return [c for c in cells if any(f.name == c.name for f in failed)]


#: What ``compact_cell`` keeps of a finished cell's run folder (everything else is removed).
KEPT = ("metrics.jsonl.gz", "eval_prompts.jsonl.gz", "unchosen_eval_prompts.jsonl.gz", "train_prompts.jsonl.gz",
        "config.json")


def _gzip_file(src: Path, dst: Path) -> None:
    """``dst`` = gzip of ``src`` with no name or time in the header (the same bytes on every machine)."""
    with open(dst, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as f:
        f.write(src.read_bytes())


def compact_cell(cell_dir: Path) -> None:
    """Keep a finished cell's metrics, drop the rest: ``run/metrics.jsonl`` -> ``metrics.jsonl.gz``; the
    participants' per-prompt evaluation records and training prompts (``participant.EVAL_PROMPTS``,
    ``participant.UNCHOSEN_EVAL_PROMPTS`` where a shadow ran, ``participant.TRAIN_PROMPTS``, in their state
    folders) -> one ``run/<name>`` each (participants in name order); ``config.json`` kept;
    checkpoints, exported models, keys, plots and server state removed; ``run.log`` gzipped."""
    import shutil

    run = cell_dir / "run"
    if (run / "metrics.jsonl").exists():
        _gzip_file(run / "metrics.jsonl", run / "metrics.jsonl.gz")
    for name in ("eval_prompts.jsonl.gz", "unchosen_eval_prompts.jsonl.gz", "train_prompts.jsonl.gz"):
        records = sorted(run.glob(f"participants/*/{name}"), key=lambda p: p.parent.name)
        if records:
            text = b"".join(gzip.decompress(p.read_bytes()) for p in records)
            (run / name).write_bytes(gzip.compress(text, mtime=0))
    for item in run.iterdir() if run.exists() else ():
        if item.name not in KEPT:
            shutil.rmtree(item) if item.is_dir() else item.unlink()
    log = cell_dir / "run.log"
    if log.exists():
        _gzip_file(log, cell_dir / "run.log.gz")
        log.unlink()

