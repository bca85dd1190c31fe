"""``ftis-fed grid``: the paper's comparison — every method × advantage grouping × seed — through
``flwr run``, resumable, with a summary computed from the cells' own metrics files.

One *cell* is one federation run (``ftis-fed sim``) of a preset with ``loss-mode``,
``advantage-groups`` and ``seed`` set; everything else (prompts, budgets, evaluation sets) is the
preset's, identical across cells. Cells live in ``<out>/cells/<cell>/`` (the run's output folder,
its ``run.log`` and, once the run completed, ``done.json``). A finished cell is skipped when the
command is run again; an interrupted one is moved aside and rerun from scratch.

    ftis-fed grid --preset grid-small --modes alone,noIS,VIS,TIS,F-noIS,F-VIS,F-TIS --seeds 3

A *variant* is a method plus extra run-config items, written ``MODE+VARIANT`` in ``--modes``:
``F-TIS+adapt`` is F-TIS with ``source-adapt = "kl"`` (``VARIANTS``; ``--variant NAME:key=value,...``
defines more). Variants are compared with their base method's reference like any other method.

Outputs in ``<out>`` (default ``outputs/grid-<preset>``):

- ``cells.csv``: one row per cell × participant: final held-out ID / OOD pass@1 and their sizes;
- ``summary.csv`` / ``summary.md``: mean ± sd over seeds per method × grouping × participant, and
  paired differences (same seeds) between the reference method (F-TIS) and every other;
- ``final_accuracy.png`` (bars with sd) and ``curves.png`` (held-out ID pass@1 and own reward by
  round, mean over seeds, one panel per participant).

Noise: a pass@1 measured on ``n`` prompts has a binomial standard error ``sqrt(p (1 - p) / n)``;
``min_eval_size`` gives the ``n`` at which a difference ``delta`` between two methods is
``z`` standard errors apart (independent sets; the same prompts for both methods — as here — make
the paired difference's error smaller, so this is conservative). ``summary.md`` states the standard
error that the cells' evaluation sizes give.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np

from ftis_fed.learn.modes import MODES                 # the loss modes, in the paper's order
REFERENCE = "F-TIS"
METRICS = ("eval/id/accuracy", "eval/ood/accuracy")
#: Training diagnostics the summary averages over rounds and seeds (what each method did to the peers'
#: samples: how much of the own reward signal there was, how far the peers' samples were, what the
#: filter dropped).
DIAGNOSTICS = ("reward/mean", "reward/groups_with_signal", "offpolicy/kl_mean", "offpolicy/ratio_mean",
               "offpolicy/truncated_frac", "offpolicy/filtered_frac", "train/seconds")
#: variant name -> extra run-config items of its cells (``MODE+NAME`` in ``--modes``).
VARIANTS: dict[str, dict] = {"adapt": {"source-adapt": "kl"}, "guard": {"source-adapt": "guard"}}


@dataclass(frozen=True)
class Cell:
    """One run of the grid: a method (``loss-mode``, optionally a named variant carrying extra
    run-config items), an advantage grouping and a seed."""

    mode: str
    groups: str
    seed: int
    variant: str = ""
    extra: tuple[tuple[str, object], ...] = ()
    #: ``eval-initial`` of this run (None: the preset's). Set by ``run_grid`` when the grid shares one
    #: initial evaluation; not part of the cell's identity (name, equality).
    eval_initial: bool | None = field(default=None, compare=False)

    @property
    def label(self) -> str:
        """``mode`` or ``mode+variant``."""
        return f"{self.mode}+{self.variant}" if self.variant else self.mode

    @property
    def name(self) -> str:
        return f"{self.label}__{self.groups}__s{self.seed}"

    @property
    def method(self) -> str:
        """The method as tables show it: the label, suffixed ``/h`` for horizontal groups."""
        return self.label if self.groups == "vertical" else f"{self.label}/h"

    def run_config(self, out_dir: Path) -> dict:
        """The cell's run-config items on top of the preset: the method, the grouping, and the seed as
        both the sampling ``seed`` and the ``task-seed`` (each seed trains on other prompts; the
        held-out sets stay fixed: the grid sets ``eval-seed``). Horizontal cells also take the shared
        prompts (``task-scheme = "shared"``): the paper's horizontal mode has every participant
        complete the same prompts, so a preset's partition (e.g. ``expertise`` in ``paper``) holds
        for its vertical cells only (a horizontal run with another scheme is a config error)."""
        rc = {**dict(self.extra), "loss-mode": self.mode, "advantage-groups": self.groups, "seed": self.seed,
              "task-seed": self.seed, "output-dir": str(out_dir)}
        if self.groups == "horizontal":
            rc["task-scheme"] = "shared"
        if self.eval_initial is not None:
            rc["eval-initial"] = self.eval_initial
        return rc


def parse_variant(spec: str) -> tuple[str, dict]:
    """``NAME:key=value,key=value`` (values as TOML scalars: 1.5, true, or bare strings) -> (NAME, items)."""
    import tomllib

    name, sep, body = spec.partition(":")
    if not sep or not name.strip() or "+" in name or "__" in name:
        raise ValueError(f"--variant {spec!r}: must be NAME:key=value[,key=value] (NAME without '+' or '__')")
    items = {}
    for item in filter(None, (x.strip() for x in body.split(","))):
        k, eq, v = item.partition("=")
        if not eq or not k.strip():
            raise ValueError(f"--variant {spec!r}: {item!r} is not key=value")
        try:
            items[k.strip()] = tomllib.loads(f"v = {v.strip()}")["v"]
        except tomllib.TOMLDecodeError:
            items[k.strip()] = v.strip()
    if not items:
        raise ValueError(f"--variant {spec!r}: no key=value items")
    return name.strip(), items


def plan(modes: Sequence[str], seeds: int, groups: Sequence[str] = ("vertical",),
         horizontal_modes: Sequence[str] | None = None, variants: dict[str, dict] | None = None) -> list[Cell]:
    """The cells in run order: seed-major, so an interrupted grid has whole seeds to compare.

    modes: loss modes, or ``MODE+VARIANT`` for a mode with a variant's extra run-config items.
    horizontal_modes: the modes also run with ``advantage-groups=horizontal`` when ``groups``
    includes it (default: all of ``modes``).
    variants: name -> extra items (default ``VARIANTS``).
    """
    variants = VARIANTS if variants is None else variants
    bad = [m for m in modes if m.partition("+")[0] not in MODES]
    if bad:
        raise ValueError(f"--modes: {bad[0]!r} is not a loss mode (one of {', '.join(MODES)})")
    unknown = [m for m in modes if m.partition("+")[2] and m.partition("+")[2] not in variants]
    if unknown:
        raise ValueError(f"--modes: {unknown[0]!r}: no variant {unknown[0].partition('+')[2]!r} "
                         f"(known: {', '.join(variants) or 'none'}; define one with --variant NAME:key=value)")
    if seeds < 1:
        raise ValueError(f"--seeds={seeds}: must be >= 1")
    for g in groups:
        if g not in ("vertical", "horizontal"):
            raise ValueError(f"--groups: {g!r} must be vertical or horizontal")
    hmodes = set(modes if horizontal_modes is None else horizontal_modes)
    cells = []
    for s in range(seeds):
        for g in groups:
            for m in modes:
                if g == "horizontal" and m not in hmodes:
                    continue
                mode, _, var = m.partition("+")
                cells.append(Cell(mode, g, s, var, tuple(sorted(variants.get(var, {}).items())) if var else ()))
    return cells


def min_eval_size(delta: float, p: float = 0.5, z: float = 2.0) -> int:
    """Prompts per evaluation set so that two independent pass@1 estimates that differ by ``delta``
    are ``z`` standard errors of their difference apart: ``n = 2 p (1 - p) (z / delta)^2``."""
    if not 0 < delta < 1 or not 0 < p < 1:
        raise ValueError(f"delta={delta}, p={p}: both must lie in (0, 1)")
    return math.ceil(2 * p * (1 - p) * (z / delta) ** 2)


# ----------------------------------------------------------------------------- running

Runner = Callable[[Cell, Path, Path], int]
"""runner(cell, cell_dir, log_path) -> exit status (0 = the run completed)."""


def sim_runner(app: Path, preset: str, extra: Sequence[str] = (), sim_args: Sequence[str] = ()) -> Runner:
    """The product path: ``ftis-fed sim --preset <preset> [sim_args] --run-config ...`` in a subprocess,
    its output going to the cell's ``run.log``. The subprocess runs in ``app`` with ``app`` first on
    PYTHONPATH, so the grid's cells run the code of the tree the grid was started from."""

    def run(cell: Cell, cell_dir: Path, log_path: Path) -> int:
        items = [f"{k}={json.dumps(v)}" for k, v in cell.run_config(cell_dir / "run").items()]
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

        items = [*extra, *(f"{k}={json.dumps(v)}" for k, v in cell.run_config(cell_dir / "run").items())]
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
        rows = read_rows(cell_dir / "run" / "metrics.jsonl")
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
                                                        "load1_end": round(os.getloadavg()[0], 2)}))
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
KEPT = ("metrics.jsonl.gz", "eval_prompts.jsonl.gz", "config.json")


def _gzip_file(src: Path, dst: Path) -> None:
    """``dst`` = gzip of ``src`` with no name or time in the header (the same bytes on every machine)."""
    with open(dst, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as f:
        f.write(src.read_bytes())


def compact_cell(cell_dir: Path) -> None:
    """Keep a finished cell's metrics, drop the rest: ``run/metrics.jsonl`` -> ``metrics.jsonl.gz``; the
    participants' per-prompt evaluation records (``participant.EVAL_PROMPTS``, in their state
    folders) -> one ``run/eval_prompts.jsonl.gz`` (participants in name order); ``config.json`` kept;
    checkpoints, exported models, keys, plots and server state removed; ``run.log`` gzipped."""
    import shutil

    run = cell_dir / "run"
    if (run / "metrics.jsonl").exists():
        _gzip_file(run / "metrics.jsonl", run / "metrics.jsonl.gz")
    records = sorted(run.glob("participants/*/eval_prompts.jsonl.gz"), key=lambda p: p.parent.name)
    if records:
        text = b"".join(gzip.decompress(p.read_bytes()) for p in records)
        (run / "eval_prompts.jsonl.gz").write_bytes(gzip.compress(text, mtime=0))
    for item in run.iterdir() if run.exists() else ():
        if item.name not in KEPT:
            shutil.rmtree(item) if item.is_dir() else item.unlink()
    log = cell_dir / "run.log"
    if log.exists():
        _gzip_file(log, cell_dir / "run.log.gz")
        log.unlink()


# ----------------------------------------------------------------------------- summarising

def read_rows(path: Path) -> list[dict]:
    """The JSON lines of ``path``, or of ``path.gz`` (a compacted cell) when ``path`` is not there."""
    gz = path.with_name(path.name + ".gz")
    if path.exists():
        text = path.read_text()
    elif gz.exists():
        text = gzip.decompress(gz.read_bytes()).decode()
    else:
        return []
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def participant_rows(rows: Iterable[dict], phase: str) -> list[dict]:
    """The rows of ``phase`` (``eval`` / ``train``) written by participants (not ``_federation``)."""
    return [r for r in rows if r.get("phase") == phase and not str(r.get("participant", "")).startswith("_")]


def final_eval(rows: Iterable[dict]) -> dict[str, dict]:
    """participant -> its evaluation row of the last evaluated round after training (round >= 1; the
    evaluation before round 1 is never a cell's result)."""
    last: dict[str, dict] = {}
    for r in participant_rows(rows, "eval"):
        p = r["participant"]
        if int(r.get("round", 0)) >= 1 and (p not in last or int(r["round"]) >= int(last[p]["round"])):
            last[p] = r
    return last


def cell_defects(rows: Sequence[dict]) -> list[str]:
    """Why a run that exited 0 is still not a result of its method (empty: none): a round in which a
    participant was dropped, failed, or had frames rejected (``_federation`` rows), or a participant
    that was evaluated but did not train, on samples, in every round. A run whose participants were
    all dropped still evaluates its untrained models — it must not count as a finished cell."""
    fed = [r for r in rows if r.get("phase") == "train" and r.get("participant") == "_federation"]
    out = []
    for r in fed:
        bad = {k: v for k, v in r.items()
               if (k.startswith("fed/dropped/") or k in ("fed/generate_failures", "fed/train_failures", "fed/rejected"))
               and _num(v) > 0}
        if "fed/complete" in r and _num(r["fed/complete"]) == 0:
            bad["fed/complete"] = r["fed/complete"]
        if bad:
            out.append(f"round {r.get('round')}: " + ", ".join(f"{k}={v}" for k, v in sorted(bad.items())))
    rounds = sorted({int(r["round"]) for r in fed})
    trained = {(r["participant"], int(r["round"])) for r in participant_rows(rows, "train")
               if _num(r.get("train/samples")) > 0}
    for p in sorted({r["participant"] for r in participant_rows(rows, "eval")}):
        missing = [k for k in rounds if (p, k) not in trained]
        if missing or not rounds:
            out.append(f"{p} did not train in round(s) {missing or 'any'}")
    return out


def initial_eval(out: Path) -> dict[str, dict]:
    """participant -> its evaluation row before round 1, from the first finished cell in ``out``
    (any grouping or method: the models before training are the same) that has one; {} if none."""
    for done in sorted((out / "cells").glob("*/done.json")):
        rows = [r for r in participant_rows(read_rows(done.parent / "run" / "metrics.jsonl"), "eval")
                if int(r.get("round", -1)) == 0]
        if rows:
            return {r["participant"]: r for r in rows}
    return {}


def cell_results(cells: Sequence[Cell], out: Path) -> list[dict]:
    """One row per finished cell × participant: the final held-out accuracies, read from the cell's
    metrics.jsonl (nothing is typed in)."""
    table = []
    for c in cells:
        done = out / "cells" / c.name / "done.json"
        if not done.exists():
            continue
        seconds = _num(json.loads(done.read_text()).get("seconds"))
        for p, r in sorted(final_eval(read_rows(out / "cells" / c.name / "run" / "metrics.jsonl")).items()):
            row = {"cell": c.name, "method": c.method, "mode": c.mode, "groups": c.groups, "seed": c.seed,
                   "participant": p, "round": int(r["round"]), "cell_seconds": seconds}
            for m in METRICS:
                row[m] = _num(r.get(m))
            row["eval/id/n"] = _num(r.get("eval/id/n"))
            table.append(row)
    return table


def _num(v) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return float("nan")


def _mean_sd(xs: Sequence[float]) -> tuple[float, float]:
    xs = [x for x in xs if math.isfinite(x)]
    if not xs:
        return float("nan"), float("nan")
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def summarize(results: Sequence[dict], reference: str = REFERENCE) -> tuple[list[dict], list[dict]]:
    """(per method × participant: mean ± sd over seeds of each metric;
        per method × participant: paired difference reference − method over the seeds both have)."""
    by = defaultdict(dict)                               # (method, participant) -> seed -> row
    for r in results:
        by[(r["method"], r["participant"])][r["seed"]] = r
    summary = []
    for (method, p), seeds in sorted(by.items()):
        row = {"method": method, "participant": p, "seeds": len(seeds)}
        for m in METRICS:
            row[m + ":mean"], row[m + ":sd"] = _mean_sd([s[m] for s in seeds.values()])
        summary.append(row)
    paired = []
    for (method, p), seeds in sorted(by.items()):
        ref_method = reference + ("/h" if method.endswith("/h") else "")
        ref = by.get((ref_method, p))
        if ref is None or method == ref_method:
            continue
        common = sorted(set(seeds) & set(ref))
        if not common:
            continue
        row = {"method": method, "reference": ref_method, "participant": p, "seeds": len(common)}
        for m in METRICS:
            diffs = [ref[s][m] - seeds[s][m] for s in common]
            row[m + ":diff_mean"], row[m + ":diff_sd"] = _mean_sd(diffs)
            row[m + ":ref_wins"] = sum(d > 0 for d in diffs if math.isfinite(d))
            row[m + ":ref_losses"] = sum(d < 0 for d in diffs if math.isfinite(d))
        paired.append(row)
    return summary, paired


def train_diagnostics(cells: Sequence[Cell], out: Path) -> list[dict]:
    """Per method × participant: each ``DIAGNOSTICS`` key averaged over the training rounds of a cell,
    then mean ± sd over the finished cells (seeds); read from the metrics files."""
    per: dict[tuple[str, str], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for c in cells:
        if not (out / "cells" / c.name / "done.json").exists():
            continue
        rows = participant_rows(read_rows(out / "cells" / c.name / "run" / "metrics.jsonl"), "train")
        for p in sorted({r["participant"] for r in rows}):
            for k in DIAGNOSTICS:
                vs = [_num(r.get(k)) for r in rows if r["participant"] == p]
                vs = [v for v in vs if math.isfinite(v)]
                if vs:
                    per[(c.method, p)][k].append(statistics.fmean(vs))
    table = []
    for (method, p), ks in sorted(per.items(), key=lambda kv: (_method_order(kv[0][0]), kv[0][1])):
        row = {"method": method, "participant": p}
        for k in DIAGNOSTICS:
            row[k + ":mean"], row[k + ":sd"] = _mean_sd(ks.get(k, []))
        table.append(row)
    return table


def _write_csv(path: Path, rows: Sequence[dict]) -> None:
    cols = list(dict.fromkeys(k for r in rows for k in r))
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        w.writerows(rows)


# ----------------------------------------------------------------------------- per-prompt statistics

#: The method of the beyond-the-paper claim (6), as ``--modes`` names it; the first variant of F-TIS
#: present in a grid when this one is not.
BEYOND = "F-TIS+guard"
BASELINE = "alone"


def prompt_records(cell_dir: Path) -> list[dict]:
    """The per-prompt evaluation records of a cell (``participant.EVAL_PROMPTS``, compacted into
    ``run/eval_prompts.jsonl.gz``, or still in the participants' folders)."""
    run = cell_dir / "run"
    paths = [run / "eval_prompts.jsonl.gz"] if (run / "eval_prompts.jsonl.gz").exists() else \
        sorted(run.glob("participants/*/eval_prompts.jsonl.gz"), key=lambda p: p.parent.name)
    out = []
    for path in paths:
        out += [json.loads(x) for x in gzip.decompress(path.read_bytes()).decode().splitlines() if x.strip()]
    return out


def prompt_vectors(records: Sequence[dict], rnd: int | None = None) -> dict[str, dict[str, tuple[tuple, np.ndarray]]]:
    """participant -> set key -> (task ids, solved (N,) float) of one evaluation: round ``rnd``, or each
    participant's last evaluation after training (``None``). Set keys: ``id`` and ``ood`` (every OOD
    family, in name order: its mean is ``eval/ood/accuracy`` when the families' sets are equally
    large), ``id:<family>`` per ID family (from the task ids) and ``ood:<family>``."""
    last: dict[str, int] = {}
    for r in records:
        k = int(r["round"])
        if (rnd is None and k >= 1) or k == rnd:
            last[r["participant"]] = max(last.get(r["participant"], -1), k)
    by: dict[str, dict[str, tuple[list, list]]] = defaultdict(dict)
    for r in records:
        p = r["participant"]
        if p not in last or int(r["round"]) != last[p]:
            continue
        ids, ok = list(r["ids"]), [c == "1" for c in r["solved"]]
        name = r["set"]
        sets = by[p]
        if name == "id":
            sets["id"] = (ids, ok)
            for fam in dict.fromkeys(t.split("/")[0] for t in ids):
                sel = [i for i, t in enumerate(ids) if t.split("/")[0] == fam]
                sets[f"id:{fam}"] = ([ids[i] for i in sel], [ok[i] for i in sel])
        else:
            sets[f"ood:{name}"] = (ids, ok)
    out: dict[str, dict[str, tuple[tuple, np.ndarray]]] = {}
    for p, sets in by.items():
        oods = sorted(k for k in sets if k.startswith("ood:"))
        if oods:
            sets["ood"] = ([t for k in oods for t in sets[k][0]], [o for k in oods for o in sets[k][1]])
        out[p] = {k: (tuple(ids), np.asarray(ok, dtype=np.float64)) for k, (ids, ok) in sorted(sets.items())}
    return out


def _final_vectors(cells: Sequence[Cell], out: Path) -> dict[tuple[str, str, int], dict]:
    """(method, participant, seed) -> set key -> (ids, solved) of every finished cell."""
    got = {}
    for c in cells:
        if (out / "cells" / c.name / "done.json").exists():
            for p, sets in prompt_vectors(prompt_records(out / "cells" / c.name)).items():
                got[(c.method, p, c.seed)] = sets
    return got


def comparisons(methods: Sequence[str]) -> list[tuple[str, str]]:
    """(A, B) pairs read as A − B: the reference F-TIS against every other method of its grouping,
    every other method against training alone, and the horizontal F-TIS against the vertical one."""
    have, pairs = set(methods), []
    for suffix in ("", "/h"):
        ref, base = REFERENCE + suffix, BASELINE + suffix
        for m in methods:
            if m.endswith("/h") == bool(suffix) and m != ref and ref in have:
                pairs.append((ref, m))
        for m in methods:
            if m.endswith("/h") == bool(suffix) and m not in (ref, base) and base in have:
                pairs.append((m, base))
    if REFERENCE in have and REFERENCE + "/h" in have:
        pairs.append((REFERENCE + "/h", REFERENCE))
    return list(dict.fromkeys(pairs))


def paired_prompt_table(cells: Sequence[Cell], out: Path) -> list[dict]:
    """One row per comparison (``comparisons``) × participant × set key: the paired per-prompt
    difference A − B over the seeds both finished, with the pigeonhole-bootstrap and paired-t 95 %
    intervals (``grid_stats.paired_interval``). Prompts are aligned by task id."""
    from ftis_fed.commands.grid_stats import paired_interval

    vec = _final_vectors(cells, out)
    methods = sorted({m for m, _, _ in vec}, key=_method_order)
    participants = sorted({p for _, p, _ in vec})
    rows = []
    for a, b in comparisons(methods):
        for p in participants:
            seeds = sorted({s for m, q, s in vec if m == a and q == p} & {s for m, q, s in vec if m == b and q == p})
            if not seeds:
                continue
            keys = sorted(set.intersection(*[set(vec[(a, p, s)]) & set(vec[(b, p, s)]) for s in seeds]),
                          key=lambda k: (k not in ("id", "ood"), k))
            for key in keys:
                ids = vec[(a, p, seeds[0])][key][0]
                if any(vec[(m, p, s)][key][0] != ids for m in (a, b) for s in seeds):
                    continue                                   # not the same prompts: not paired
                A = np.stack([vec[(a, p, s)][key][1] for s in seeds])                        # (S,N)
                B = np.stack([vec[(b, p, s)][key][1] for s in seeds])                        # (S,N)
                st = paired_interval(A - B, f"{a}|{b}|{p}|{key}")
                rows.append({"a": a, "b": b, "participant": p, "set": key, "a_acc": float(A.mean()),
                             "b_acc": float(B.mean()), **st,
                             "a_wins": int(((A - B).mean(axis=1) > 0).sum()),
                             "b_wins": int(((A - B).mean(axis=1) < 0).sum())})
    return rows


def family_table(cells: Sequence[Cell], out: Path) -> list[dict]:
    """Final accuracy per method × participant × ID / OOD family: mean ± sd over seeds (from the
    per-prompt records)."""
    vec = _final_vectors(cells, out)
    acc: dict[tuple[str, str, str], list[float]] = defaultdict(list)
    for (m, p, _), sets in sorted(vec.items()):
        for key, (_, ok) in sets.items():
            if ":" in key:
                acc[(m, p, key)].append(float(ok.mean()))
    rows = []
    for (m, p, key), vs in sorted(acc.items(), key=lambda kv: (_method_order(kv[0][0]), kv[0][1], kv[0][2])):
        mean, sd = _mean_sd(vs)
        rows.append({"method": m, "participant": p, "set": key, "seeds": len(vs), "mean": mean, "sd": sd})
    return rows


def stronger_participant(initial: dict[str, dict]) -> str | None:
    """The participant with the highest ID accuracy before training; None when none was measured or
    the best two tie (no stronger partner)."""
    scored = sorted(((-_num(r.get("eval/id/accuracy")), p) for p, r in initial.items()
                     if math.isfinite(_num(r.get("eval/id/accuracy")))))
    if not scored or (len(scored) > 1 and scored[0][0] == scored[1][0]):
        return None
    return scored[0][1]


def verdicts(paired: Sequence[dict], participants: Sequence[str], stronger: str | None,
             beyond: str | None) -> list[dict]:
    """The verdict table: one row per claim of the paper (and the beyond-the-paper goal), each held /
    not held / inconclusive from the pigeonhole-bootstrap 95 % intervals of ``paired_prompt_table``
    (``grid_stats``: at_least, greater_than, less_than, all_of, any_of). Margins: 1 point where the
    claim states one ("≥ Alone − 1 point"). A participant for which neither method solved a single
    prompt of the set (0 for both: a floor at which the claim cannot show) counts as inconclusive."""
    from ftis_fed.commands.grid_stats import INCONCLUSIVE, MISSING, all_of, any_of, at_least, greater_than, less_than

    by = {(r["a"], r["b"], r["participant"], r["set"]): r for r in paired}

    def parts(a: str, b: str, key: str, rule, ps=participants) -> tuple[list[str], str]:
        vs, texts = [], []
        for p in ps:
            r = by.get((a, b, p, key))
            if r is None:
                vs.append(MISSING)
                texts.append(f"{p}: –")
                continue
            floor = r["a_acc"] == 0 and r["b_acc"] == 0          # nothing solved by either: untestable
            vs.append(INCONCLUSIVE if floor else rule(r["lo"], r["hi"]))
            texts.append(f"{p}: " + ("0 % for both (floor)" if floor else
                                     f"{100 * r['diff']:+.1f} [{100 * r['lo']:+.1f}, {100 * r['hi']:+.1f}]")
                         + f" ({r['seeds']} seed{'s' if r['seeds'] != 1 else ''})")
        return vs, "; ".join(texts)

    rows = []

    def claim(n: str, text: str, a: str, b: str, key: str, rule, combine, ps=participants, how: str = "") -> None:
        vs, interval = parts(a, b, key, rule, ps)
        rows.append({"claim": n, "statement": text, "comparison": f"{a} − {b}, {key.upper()}",
                     "verdict": combine(vs), "interval": interval, "rule": how})

    ge = lambda lo, hi: at_least(lo, hi, -0.01)                    # noqa: E731
    claim("1", "F-TIS final ID ≥ Alone − 1 point, for every participant", REFERENCE, BASELINE, "id", ge, all_of,
          how="held: every lower bound ≥ −1; not held: some upper bound < −1")
    for n, x in (("2a", "noIS"), ("2b", "VIS")):
        claim(n, f"{x} degrades or collapses relative to F-TIS (ID, some participant)", REFERENCE, x, "id",
              greater_than, any_of, how="held: some lower bound > 0; not held: every upper bound ≤ 0")
    claim("3", "the filter contributes: F-TIS > TIS (ID, some participant)", REFERENCE, "TIS", "id", greater_than,
          any_of, how="held: some lower bound > 0; not held: every upper bound ≤ 0")
    claim("4", "F-TIS gains OOD accuracy over Alone (some participant)", REFERENCE, BASELINE, "ood", greater_than,
          any_of, how="held: some lower bound > 0; not held: every upper bound ≤ 0")
    claim("5", f"the stronger partner ({stronger or 'none: the participants tie before training'}) loses OOD "
          "accuracy with F-TIS vs Alone", REFERENCE,
          BASELINE, "ood", less_than, all_of, ps=[stronger] if stronger else ["?"],
          how="held: upper bound < 0; not held: lower bound ≥ 0")
    claim("6", f"beyond the paper ({beyond or 'none run'}): no partner loses OOD vs Alone (≥ −1 point)",
          beyond or "?", BASELINE, "ood", ge, all_of,
          how="held: every lower bound ≥ −1; not held: some upper bound < −1")
    if any(r["a"] == REFERENCE + "/h" and r["b"] == BASELINE + "/h" for r in paired):
        claim("h", "horizontal groups: F-TIS/h ID ≥ Alone/h − 1 point (Alone/h: the full group of the shared "
              "prompts), every participant", REFERENCE + "/h", BASELINE + "/h", "id", ge, all_of,
              how="as claim 1")
    return rows


def _pm(mean: float, sd: float) -> str:
    return "–" if not math.isfinite(mean) else f"{mean:.3f} ± {sd:.3f}"


def _ci(r: dict) -> str:
    return f"{100 * r['diff']:+.1f} [{100 * r['lo']:+.1f}, {100 * r['hi']:+.1f}]"


def summary_markdown(summary: Sequence[dict], paired: Sequence[dict], results: Sequence[dict],
                     title: str, initial: dict[str, dict] | None = None,
                     diagnostics: Sequence[dict] = (), prompt_paired: Sequence[dict] = (),
                     families: Sequence[dict] = (), verdict_rows: Sequence[dict] = ()) -> str:
    from ftis_fed.commands.grid_stats import paired_eval_size

    initial = initial or {}
    ns = sorted({int(r["eval/id/n"]) for r in results if math.isfinite(r["eval/id/n"])})
    secs = {r["cell"]: r.get("cell_seconds", float("nan")) for r in results}
    secs_ok = [v for v in secs.values() if math.isfinite(v)]
    seeds = sorted({r["seed"] for r in results})
    lines = [f"# {title}", "", f"{len({r['cell'] for r in results})} finished cells, seeds {seeds}"
             + (f" ({statistics.fmean(secs_ok) / 60:.1f} min wall per cell on average, "
                f"{sum(secs_ok) / 3600:.2f} h of cell time in all)" if secs_ok else "")
             + "; final held-out greedy pass@1"
             + ("; *before training*: the shared evaluation before round 1 (the same models in every cell)."
                if initial else "."), ""]
    if prompt_paired:
        lines += ["Intervals: paired per-prompt differences A − B (points) over the seeds both methods finished "
                  "(same held-out prompts in every cell, other training prompts and sampling per seed), 95 % "
                  "pigeonhole bootstrap (seeds and prompts resampled independently, 4000 replicates, "
                  "`ftis_fed/commands/grid_stats.py`); *t*: the paired t interval over the per-seed means.", ""]
    if verdict_rows:
        lines += ["## Verdicts", "", "| claim | statement | comparison | verdict | difference [95 % CI], points | rule |",
                  "|---|---|---|---|---|---|"]
        for v in verdict_rows:
            lines.append(f"| {v['claim']} | {v['statement']} | {v['comparison']} | **{v['verdict']}** | "
                         f"{v['interval']} | {v['rule']} |")
        lines.append("")
    if ns:
        qs = [r["discord"] for r in prompt_paired if r["set"] == "id" and math.isfinite(r["discord"])]
        q = max(qs) if qs else 0.3
        S = max(len(seeds), 1)
        lines += [f"ID evaluation set: {', '.join(map(str, ns))} prompts. The prompt part of a paired difference's "
                  f"95 % half-width is 1.96 sqrt(q / (n S)); at the largest measured discordance q = {q:.2f} and "
                  f"S = {S} seeds a 3-point half-width needs n ≥ {paired_eval_size(0.03, max(q, 1e-3), S)} "
                  "(`grid_stats.paired_eval_size`); the seed part does not shrink with n.", ""]
    participants = sorted({r["participant"] for r in summary})
    methods = list(dict.fromkeys(r["method"] for r in sorted(summary, key=lambda r: _method_order(r["method"]))))
    for m in METRICS:
        lines += [f"## {m} (mean ± sd over seeds)", "", "| method | " + " | ".join(participants) + " |",
                  "|---|" + "---|" * len(participants)]
        cell = {(r["method"], r["participant"]): r for r in summary}
        if initial:
            lines.append("| *before training* | " + " | ".join(
                f"{_num(initial[p].get(m)):.3f}" if p in initial else "–" for p in participants) + " |")
        for meth in methods:
            vals = [_pm(cell[(meth, p)][m + ":mean"], cell[(meth, p)][m + ":sd"]) if (meth, p) in cell else "–"
                    for p in participants]
            lines.append(f"| {meth} | " + " | ".join(vals) + " |")
        lines.append("")
    if families:
        keys = sorted({r["set"] for r in families}, key=lambda k: (not k.startswith("id:"), k))
        fam = {(r["method"], r["participant"], r["set"]): r for r in families}
        lines += ["## Accuracy per task family (mean ± sd over seeds)", "",
                  "| method | participant | " + " | ".join(keys) + " |", "|---|---|" + "---|" * len(keys)]
        for meth in methods:
            for p in participants:
                if any((meth, p, k) in fam for k in keys):
                    lines.append(f"| {meth} | {p} | " + " | ".join(
                        _pm(fam[(meth, p, k)]["mean"], fam[(meth, p, k)]["sd"]) if (meth, p, k) in fam else "–"
                        for k in keys) + " |")
        lines.append("")
    if prompt_paired:
        keys = [k for k in ("id", "ood") if any(r["set"] == k for r in prompt_paired)]
        fams = sorted({r["set"] for r in prompt_paired if r["set"].startswith("id:")})
        lines += ["## Paired differences A − B (points, 95 % pigeonhole-bootstrap CI; t interval; seeds won by A/B)", "",
                  "| A − B | participant | seeds | " + " | ".join(k.upper() for k in keys) + " | ID t-CI | "
                  + " | ".join(fams) + " |", "|---|---|---|" + "---|" * (len(keys) + 1 + len(fams))]
        by = {(r["a"], r["b"], r["participant"], r["set"]): r for r in prompt_paired}
        for a, b, p in dict.fromkeys((r["a"], r["b"], r["participant"]) for r in prompt_paired):
            row = [f"{a} − {b}", p, str(by.get((a, b, p, "id"), {}).get("seeds", "–"))]
            for k in keys:
                r = by.get((a, b, p, k))
                row.append(f"{_ci(r)} {r['a_wins']}/{r['b_wins']}" if r else "–")
            r = by.get((a, b, p, "id"))
            row.append(f"[{100 * r['t_lo']:+.1f}, {100 * r['t_hi']:+.1f}]" if r and math.isfinite(r["t_lo"]) else "–")
            row += [_ci(by[(a, b, p, k)]) if (a, b, p, k) in by else "–" for k in fams]
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")
    if diagnostics:
        lines += ["## Training diagnostics (per round, mean ± sd over seeds; offpolicy/*: the peers' samples at "
                  "this receiver)", "",
                  "| method | participant | " + " | ".join(DIAGNOSTICS) + " |",
                  "|---|---|" + "---|" * len(DIAGNOSTICS)]
        for r in diagnostics:
            lines.append(f"| {r['method']} | {r['participant']} | "
                         + " | ".join(_pm(r[k + ':mean'], r[k + ':sd']) for k in DIAGNOSTICS) + " |")
        lines.append("")
    return "\n".join(lines)


def _method_order(method: str) -> tuple[int, str]:
    base = method.removesuffix("/h").partition("+")[0]
    return (list(MODES).index(base) if base in MODES else len(MODES), method)


#: PNG metadata: none (no software version in the files: the figures depend only on the metrics).
PNG_META = {"Software": None}


def _finish(plt, fig, axes, legend_size: int, title: str, path: Path, dpi: int) -> Path:
    """Legend on the first panel, title, layout; saved without metadata (reproducible bytes); closed."""
    axes[0][0].legend(fontsize=legend_size, ncol=2)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi, metadata=PNG_META)
    plt.close(fig)
    return path


def plot(summary: Sequence[dict], cells: Sequence[Cell], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    participants = sorted({r["participant"] for r in summary})
    methods = list(dict.fromkeys(r["method"] for r in sorted(summary, key=lambda r: _method_order(r["method"]))))
    colors = {m: plt.get_cmap("tab20")(i % 20) for i, m in enumerate(methods)}
    if participants:
        fig, axes = plt.subplots(1, len(METRICS), figsize=(6 * len(METRICS), 3.8), squeeze=False)
        cell = {(r["method"], r["participant"]): r for r in summary}
        width = 0.8 / max(1, len(methods))
        for ax, m in zip(axes[0], METRICS):
            for j, meth in enumerate(methods):
                xs = [i + j * width for i in range(len(participants))]
                ys = [cell.get((meth, p), {}).get(m + ":mean", float("nan")) for p in participants]
                es = [cell.get((meth, p), {}).get(m + ":sd", 0.0) for p in participants]
                ax.bar(xs, ys, width, yerr=es, capsize=2, label=meth, color=colors[meth])
            ax.set_xticks([i + 0.4 - width / 2 for i in range(len(participants))], participants, fontsize=8)
            ax.set_ylabel(m.replace("eval/", "").replace("/accuracy", " pass@1"))
            ax.grid(alpha=0.3, axis="y")
        written.append(_finish(plt, fig, axes, 7, "Final held-out accuracy (mean ± sd over seeds)",
                               out / "final_accuracy.png", 110))
    curves = _curves(cells, out)
    if curves:
        keys = ("eval/id/accuracy", "eval/ood/accuracy", "reward/mean")
        fig, axes = plt.subplots(len(keys), len(participants) or 1, figsize=(5 * max(1, len(participants)), 9),
                                 squeeze=False)
        for i, key in enumerate(keys):
            for j, p in enumerate(participants):
                ax = axes[i][j]
                for meth in methods:
                    pts = curves.get((meth, p, key))
                    if pts:
                        xs = [x for x, _, _, _ in pts]
                        mu = np.array([y for _, y, _, _ in pts])
                        sd = np.array([e for _, _, e, _ in pts])
                        ax.plot(xs, mu, marker="o" if len(xs) < 12 else None, ms=3, label=meth, color=colors.get(meth))
                        if any(n > 1 for _, _, _, n in pts):
                            ax.fill_between(xs, mu - sd, mu + sd, alpha=0.15, color=colors.get(meth), lw=0)
                ax.set_title(p, fontsize=9)
                ax.set_xlabel("round")
                ax.set_ylabel(key)
                ax.grid(alpha=0.3)
        written.append(_finish(plt, fig, axes, 6, "Learning curves: mean over seeds, band ± 1 sd over seeds",
                               out / "curves.png", 100))
    return written


def _curves(cells: Sequence[Cell], out: Path) -> dict[tuple[str, str, str], list[tuple[int, float, float, int]]]:
    """(method, participant, key) -> [(round, mean over seeds, sd over seeds, seeds)]; a cell without
    its own evaluation before round 1 gets the grid's shared one (``initial_eval``) as its round-0 point."""
    acc: dict[tuple[str, str, str, int], list[float]] = defaultdict(list)
    initial = list(initial_eval(out).values())
    for c in cells:
        if not (out / "cells" / c.name / "done.json").exists():
            continue
        rows = read_rows(out / "cells" / c.name / "run" / "metrics.jsonl")
        if not any(r.get("phase") == "eval" and int(r.get("round", -1)) == 0 for r in rows):
            rows = initial + rows
        for r in rows:
            if str(r.get("participant", "")).startswith("_"):
                continue
            for key in ("eval/id/accuracy", "eval/ood/accuracy", "reward/mean"):
                v = _num(r.get(key))
                if math.isfinite(v):
                    acc[(c.method, r["participant"], key, int(r["round"]))].append(v)
    curves: dict[tuple[str, str, str], list[tuple[int, float, float, int]]] = defaultdict(list)
    for (meth, p, key, rnd), vs in sorted(acc.items()):
        mean, sd = _mean_sd(vs)
        curves[(meth, p, key)].append((rnd, mean, sd, len(vs)))
    return curves


def discover_cells(out: Path) -> list[Cell]:
    """The finished cells in ``out/cells`` (``<label>__<groups>__s<seed>`` with a ``done.json``), in
    plan order (seed, grouping, method): what ``--summary-only`` summarises."""
    cells = []
    for done in (out / "cells").glob("*/done.json"):
        label, groups, seed = done.parent.name.split("__")
        mode, _, var = label.partition("+")
        cells.append(Cell(mode, groups, int(seed.removeprefix("s")), var))
    return sorted(cells, key=lambda c: (c.seed, c.groups != "vertical", _method_order(c.label)))


def write_summary(cells: Sequence[Cell], out: Path, title: str) -> dict:
    """cells.csv, summary.csv, summary.md and the figures, all from the cells' metrics files."""
    results = cell_results(cells, out)
    summary, paired = summarize(results)
    initial = initial_eval(out)
    diagnostics = train_diagnostics(cells, out)
    prompt_paired = paired_prompt_table(cells, out)
    families = family_table(cells, out)
    methods = {c.method for c in cells}
    beyond = BEYOND if BEYOND in methods else next((m for m in sorted(methods) if m.startswith(REFERENCE + "+")), None)
    participants = sorted({r["participant"] for r in summary})
    verdict_rows = verdicts(prompt_paired, participants, stronger_participant(initial), beyond) if prompt_paired else []
    _write_csv(out / "cells.csv", results)
    _write_csv(out / "summary.csv", [{**r, "kind": "mean_sd"} for r in summary] +
               [{**r, "kind": "paired_diff"} for r in paired] +
               [{"method": "before-training", "participant": p, "seeds": 1, "kind": "initial",
                 **{m + ":mean": _num(r.get(m)) for m in METRICS}} for p, r in sorted(initial.items())] +
               [{**r, "kind": "train_diagnostics"} for r in diagnostics] +
               [{**r, "kind": "paired_prompts"} for r in prompt_paired] +
               [{**r, "kind": "family"} for r in families] +
               [{**r, "kind": "verdict"} for r in verdict_rows])
    (out / "summary.md").write_text(summary_markdown(summary, paired, results, title, initial, diagnostics,
                                                     prompt_paired, families, verdict_rows))
    plot(summary, cells, out)
    return {"results": results, "summary": summary, "paired": paired, "initial": initial,
            "diagnostics": diagnostics, "prompt_paired": prompt_paired, "families": families,
            "verdicts": verdict_rows}


# ----------------------------------------------------------------------------- CLI

def main(a: argparse.Namespace) -> int:
    app = Path(a.app).resolve()
    if a.summary_only:
        return summary_only(Path(a.out or f"outputs/grid-{Path(a.preset or 'grid').stem}").resolve())
    if not a.preset:
        print("ftis-fed grid: error: --preset is required (except with --summary-only)", file=sys.stderr)
        return 2
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    groups = [g.strip() for g in a.groups.split(",") if g.strip()]
    hmodes = [m.strip() for m in a.horizontal_modes.split(",") if m.strip()] if a.horizontal_modes else None
    variants = dict(VARIANTS)
    for spec in a.variant:
        name, items = parse_variant(spec)
        variants[name] = items
    cells = plan(modes, a.seeds, groups, hmodes, variants)
    out = Path(a.out or f"outputs/grid-{Path(a.preset).stem}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    extra = [f"eval-seed={a.eval_seed}", *a.run_config]
    (out / "grid.json").write_text(json.dumps({"preset": a.preset, "modes": modes, "groups": groups,
                                               "seeds": a.seeds, "run_config": extra, "transport": a.transport,
                                               "variants": {k: variants[k] for k in sorted(variants)},
                                               "cells": [c.name for c in cells]}, indent=1))
    print(f"[grid] {len(cells)} cells ({len(modes)} modes × {len(groups)} groupings × {a.seeds} seeds) "
          f"of preset {a.preset} through {a.transport} -> {out}", flush=True)
    if a.transport == "inprocess" and a.jobs <= 1:
        runner = inprocess_runner(app, a.preset, extra)
    elif a.transport == "inprocess":                         # several at once: one process each
        runner = sim_runner(app, a.preset, extra, ["--transport", "inprocess"])
    else:
        runner = sim_runner(app, a.preset, extra, ["--keep-superlink"] + (["--address", a.address] if a.address else []))
    try:
        failed = run_grid(cells, out, runner, echo=lambda s: print(s, flush=True),
                          shared_initial=a.initial_eval == "once", jobs=a.jobs, compact=not a.keep_cell_outputs)
    finally:
        if a.transport == "flwr":
            _stop_kept_superlink(app, a.address)
    summary_only(out)
    if failed:
        print(f"[grid] {len(failed)} cells failed: {', '.join(c.name for c in failed)}; run the same command "
              "again to retry them", file=sys.stderr)
        return 1
    return 0


def summary_only(out: Path) -> int:
    """(Re)write the summary of every finished cell in ``out`` (``discover_cells``): cells.csv,
    summary.csv, summary.md, final_accuracy.png, curves.png — from the cells' files alone."""
    cells = discover_cells(out)
    if not cells:
        print(f"ftis-fed grid: error: no finished cell (cells/*/done.json) in {out}", file=sys.stderr)
        return 2
    meta = json.loads((out / "grid.json").read_text()) if (out / "grid.json").exists() else {}
    write_summary(cells, out, f"Grid: preset {meta.get('preset', '?')}")
    print(f"[grid] summary of {len(cells)} cells: {out / 'summary.md'} "
          "(+ summary.csv, cells.csv, final_accuracy.png, curves.png)")
    return 0


def _stop_kept_superlink(app: Path, address: str | None) -> None:
    """Stop the simulation SuperLink the cells kept running between them (``--keep-superlink``: one
    start per grid instead of one per cell), by the pid its launcher recorded."""
    import signal

    from ftis_fed.commands.sim import load_flower_toml, own_superlink

    flower = load_flower_toml(app)
    conn = flower["superlink"].get(flower["superlink"]["default"], {})
    address = address or conn.get("address")
    if not conn.get("ftis-managed") or not address:
        return
    home = Path(os.environ.get("FLWR_HOME", app / ".flwr")).resolve()
    pid = own_superlink(home, address)
    if pid is not None:
        try:
            os.killpg(pid, signal.SIGTERM)
            print(f"[grid] stopped the SuperLink the cells shared (pid {pid}, {address})", flush=True)
        except ProcessLookupError:
            pass


def add_cli(sub) -> None:
    p = sub.add_parser("grid", help="every method x seed of a preset through flwr run; resumable; summary + plots")
    p.add_argument("--preset", default=None, help="NAME of sims/presets/NAME.toml, or a .toml path (required "
                                                  "except with --summary-only)")
    p.add_argument("--transport", choices=("flwr", "inprocess"), default="flwr",
                   help="how a cell runs: flwr (ftis-fed sim: flwr run on a kept SuperLink) or inprocess (ftis-fed "
                        "sim --transport inprocess: the same engine and participants without Flower)")
    p.add_argument("--jobs", type=int, default=1, help="cells run at once (each its own process)")
    p.add_argument("--eval-seed", type=int, default=0,
                   help="eval-seed of every cell: the same held-out prompts in every cell (task-seed = the seed)")
    p.add_argument("--keep-cell-outputs", action="store_true",
                   help="keep each cell's checkpoints, keys and plots (default: only its metrics, compact_cell)")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated loss modes (default: all of {', '.join(MODES)})")
    p.add_argument("--seeds", type=int, default=3, help="seeds 0 .. n-1 (the run config's seed key)")
    p.add_argument("--groups", default="vertical", help="advantage groupings: vertical, horizontal or both")
    p.add_argument("--horizontal-modes", default="", help="modes also run horizontally (default: all)")
    p.add_argument("--run-config", action="append", default=[], help="extra key=value items for every cell")
    p.add_argument("--variant", action="append", default=[], metavar="NAME:key=value,...",
                   help="define variant NAME (extra run-config items) for MODE+NAME in --modes; built in: "
                        + ", ".join(f"{k} ({', '.join(f'{a}={b}' for a, b in v.items())})"
                                    for k, v in VARIANTS.items()))
    p.add_argument("--out", default=None, help="output folder (default outputs/grid-<preset>)")
    p.add_argument("--app", default=".", help="the Flower app folder (default: .)")
    p.add_argument("--address", default=None,
                   help="HOST:PORT of the simulation SuperLink the cells share (default: flower.toml's; "
                        "another one when a federation already runs on that port)")
    p.add_argument("--initial-eval", choices=("once", "every"), default="once",
                   help="evaluate before round 1 in one cell only (once: every cell starts from the same "
                        "models, so the others skip it; the summary and curves use it) or in every cell")
    p.add_argument("--summary-only", action="store_true",
                   help="only (re)write the summary of the finished cells in --out (every cells/*/done.json)")
    p.set_defaults(func=main)
