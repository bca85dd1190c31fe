"""``ftis-fed grid``: the paper's comparison — every method × advantage grouping × seed — through
``flwr run``, resumable, with a summary computed from the cells' own metrics files.

One *cell* is one federation run (``ftis-fed sim``) of a preset with ``loss-mode``,
``advantage-groups`` and ``seed`` set; everything else (prompts, budgets, evaluation sets) is the
preset's, identical across cells. Cells live in ``<out>/cells/<cell>/`` (the run's output folder,
its ``run.log`` and, once the run completed, ``done.json``). A finished cell is skipped when the
command is run again; an interrupted one is moved aside and rerun from scratch. One grid process
per folder (``--jobs`` runs cells at once within it); a grid run again into its folder with more
methods or seeds keeps and describes the cells already there, and refuses a folder holding another
preset or other run-config items.

    ftis-fed grid --preset grid-small --modes alone,noIS,VIS,TIS,F-noIS,F-VIS,F-TIS --seeds 3

More seeds elsewhere, then joined (``ftis_fed.grid.pack``: every cell checked to belong first):

    ftis-fed grid --preset grid-small --modes alone,F-TIS --seeds 5 --seed-from 3 --out outputs/more
    ftis-fed grid --pack outputs/more --out outputs/grid-grid-small

A *variant* is a method plus extra run-config items, written ``MODE+VARIANT`` in ``--modes``:
``F-TIS+adapt`` is F-TIS with ``source-adapt = "kl"`` (``VARIANTS``; ``--variant NAME:key=value,...``
defines more). Variants are compared with their base method's reference like any other method.

Outputs in ``<out>`` (default ``outputs/grid-<preset>``):

- ``cells.csv``: one row per cell × participant: final held-out ID / OOD pass@1 and their sizes;
- ``summary.csv`` / ``summary.md``: mean ± sd over seeds per method × grouping × participant, and
  paired differences (same seeds) between the reference method (F-TIS) and every other;
- ``final_accuracy.png`` (bars with sd) and ``curves.png`` (held-out ID pass@1 and own reward by
  round, mean over seeds, one panel per participant).

Every table, curve and verdict reads one metric, ``--metric`` (``ftis_fed.grid.metric``): ``greedy``
(the default: greedy pass@1) or ``sampled`` (pass@1 at the sampling temperature estimated from the
``eval-samples = k`` completions per prompt; the cells must have been run with ``eval-samples`` >= 1).
The metric is recorded in ``grid.json``; ``--summary-only`` reads it from there (an older grid.json
without it: greedy), and a ``--metric`` given with ``--summary-only`` replaces the recorded one.

Noise: a pass@1 measured on ``n`` prompts has a binomial standard error ``sqrt(p (1 - p) / n)``;
``min_eval_size`` gives the ``n`` at which a difference ``delta`` between two methods is
``z`` standard errors apart (independent sets; the same prompts for both methods — as here — make
the paired difference's error smaller, so this is conservative). ``summary.md`` states the standard
error that the cells' evaluation sizes give.

The machinery lives in ``ftis_fed.grid`` (plan, run, records, metric, stats, tables, claims, report); this
module is the command line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from ftis_fed.grid.metric import BY_NAME as METRIC_NAMES, MissingMetric, metric as metric_named, recorded_metric
from ftis_fed.grid.pack import PackError, grid_json, merged_meta, pack
from ftis_fed.grid.plan import VARIANTS, discover_cells, parse_variant, plan, plan_order
from ftis_fed.grid.records import MixedWeights
from ftis_fed.grid.report import write_summary
from ftis_fed.commands.cells import inprocess_runner, sim_runner
from ftis_fed.grid.run import run_grid
from ftis_fed.learn.modes import MODES

# ----------------------------------------------------------------------------- CLI

def runs_this_code(app: Path) -> bool:
    """Whether a cell run in this process runs ``app``'s code: ``app`` has no ``ftis_fed`` package of
    its own, or it is the one this process imported. Otherwise (a worktree of another commit, say)
    the in-process runner would run this process's code under ``app``'s name, so the grid starts
    each cell as a process with ``app`` first on its path instead (``cells.sim_runner``)."""
    import ftis_fed

    own = app / "ftis_fed" / "__init__.py"
    return not own.exists() or own.resolve() == Path(ftis_fed.__file__).resolve()


def main(a: argparse.Namespace) -> int:
    app = Path(a.app).resolve()
    if a.summary_only:
        return summary_only(Path(a.out or f"outputs/grid-{Path(a.preset or 'grid').stem}").resolve(), a.metric)
    if a.pack:
        if not a.out:
            print("ftis-fed grid: error: --pack needs --out (the grid folder the cells join)", file=sys.stderr)
            return 2
        try:
            pack(Path(a.pack), Path(a.out))
        except (PackError, MixedWeights) as e:             # MixedStarts is a MixedWeights too
            print(f"ftis-fed grid: error: --pack: {e} (nothing was packed)", file=sys.stderr)
            return 2
        return summary_only(Path(a.out).resolve())
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
    out = Path(a.out or f"outputs/grid-{Path(a.preset).stem}").resolve()
    extra = [f"eval-seed={a.eval_seed}", *a.run_config]
    try:
        cells = plan(modes, a.seeds, groups, hmodes, variants, a.seed_from)
        metric = metric_named(a.metric or recorded_metric(out)).name
        if metric == "sampled":
            check_samples(app, a.preset, extra, cells)
        meta = grid_meta(out, {"preset": a.preset, "run_config": extra, "transport": a.transport, "metric": metric},
                         cells, {k: variants[k] for k in sorted(variants)})
    except (ValueError, FileNotFoundError) as e:
        print(f"ftis-fed grid: error: {e}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    (out / "grid.json").write_text(json.dumps(meta, indent=1))
    seeds = f"{a.seeds} seeds" + (f" from {a.seed_from}" if a.seed_from else "")
    print(f"[grid] {len(cells)} cells ({len(modes)} modes × {len(groups)} groupings × {seeds}) "
          f"of preset {a.preset} through {a.transport} -> {out}", flush=True)
    if a.transport == "inprocess" and a.jobs <= 1 and runs_this_code(app):
        runner = inprocess_runner(app, a.preset, extra)
    elif a.transport == "inprocess":                         # several at once, or another tree's code: a process each
        if a.jobs <= 1:
            print(f"[grid] {app} has its own ftis_fed: each cell runs it in a process of its own", flush=True)
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


def grid_meta(out: Path, fixed: dict, cells, variants: dict) -> dict:
    """grid.json for a run of ``cells`` into ``out``: ``fixed`` (preset, run-config items, transport,
    metric) and the cells planned, together with those ``out`` already holds (a grid run again with
    more seeds or methods describes them all). ValueError when ``out`` holds a grid of another
    experiment (another preset or run-config items): its cells would be mixed with these."""
    old = grid_json(out)                             # PackError (a ValueError) where another tool writes it
    for k in ("preset", "run_config"):
        if k in old and old[k] != fixed[k]:
            raise ValueError(f"{out} holds a grid with {k} {old.get(k)!r}, not {fixed[k]!r}: use another --out "
                             "(and --pack it into this one if it is the same experiment)")
    planned = {c.name: c for c in cells}
    union = sorted([*cells, *(c for c in discover_cells(out) if c.name not in planned)], key=plan_order)
    order = ("preset", "modes", "groups", "seeds", "run_config", "transport", "variants", "cells", "metric")
    meta = {k: None for k in order} | old | fixed
    meta["modes"] = list(dict.fromkeys([*(old.get("modes") or []), *(c.label for c in cells)]))
    return merged_meta(meta, union, variants)


def check_samples(app: Path, preset: str, extra: list[str], cells) -> None:
    """Before running a ``--metric sampled`` grid: every cell's run config (preset, ``--run-config``
    items, the cell's variant items) has ``eval-samples`` >= 1 (ValueError naming the cells)."""
    from ftis_fed.commands.sim import layered_overrides, merged_run_config

    base = merged_run_config(app, layered_overrides(app, extra, preset))
    bad = [c.name for c in cells if int({**base, **dict(c.extra)}.get("eval-samples", 0)) < 1]
    if bad:
        raise ValueError(f"--metric sampled: eval-samples is 0 for cell(s) {', '.join(bad)} (no sampled evaluation "
                         "to summarise); set it, e.g. --run-config eval-samples=8, or use --metric greedy")


def summary_only(out: Path, metric: str | None = None) -> int:
    """(Re)write the summary of every finished cell in ``out`` (``discover_cells``): cells.csv,
    summary.csv, summary.md, final_accuracy.png, curves.png — from the cells' files alone, for
    ``metric`` (None: the one grid.json records, else greedy). A ``metric`` other than the recorded one
    is recorded in grid.json, so that the next ``--summary-only`` writes the same summary."""
    cells = discover_cells(out)
    if not cells:
        print(f"ftis-fed grid: error: no finished cell (cells/*/done.json) in {out}", file=sys.stderr)
        return 2
    path = out / "grid.json"
    try:
        meta = grid_json(out)
    except PackError as e:
        print(f"ftis-fed grid: error: {e}", file=sys.stderr)
        return 2
    recorded = recorded_metric(out)
    name = metric or recorded
    if name not in METRIC_NAMES:
        print(f"ftis-fed grid: error: {path}: metric {name!r} must be one of {', '.join(METRIC_NAMES)}", file=sys.stderr)
        return 2
    try:
        write_summary(cells, out, f"Grid: preset {meta.get('preset', '?')}", metric_named(name))
    except (MissingMetric, MixedWeights) as e:
        print(f"ftis-fed grid: error: {e}", file=sys.stderr)
        return 2
    if name != recorded:
        path.write_text(json.dumps({**meta, "metric": name}, indent=1))
        print(f"[grid] grid.json: metric = {name} (--summary-only reads it from there)")
    print(f"[grid] {name} summary of {len(cells)} cells: {out / 'summary.md'} "
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
    p.add_argument("--seed-from", type=int, default=0, metavar="K",
                   help="run seeds K .. K+n-1 instead (more seeds for a grid, e.g. in another --out to --pack)")
    p.add_argument("--pack", default=None, metavar="FROM",
                   help="add the finished cells of grid folder FROM that --out lacks to --out (the same preset, "
                        "run-config and metric; each cell's configuration, weights, first samples and initial "
                        "evaluation checked), then rewrite --out's summary; runs nothing")
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
    p.add_argument("--metric", choices=tuple(METRIC_NAMES), default=None,
                   help="the held-out pass@1 every table, curve and verdict reads: greedy (the default) or sampled "
                        "(estimated from the eval-samples = k completions per prompt; cells need eval-samples >= 1); "
                        "recorded in grid.json, which --summary-only reads (default there: the recorded one)")
    p.add_argument("--summary-only", action="store_true",
                   help="only (re)write the summary of the finished cells in --out (every cells/*/done.json)")
    p.set_defaults(func=main)
