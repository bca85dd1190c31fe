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

from ftis_fed.learn.modes import MODES                 # the loss modes, in the paper's order
REFERENCE = "F-TIS"
METRICS = ("eval/id/accuracy", "eval/ood/accuracy")
#: Training diagnostics the summary averages over rounds and seeds (what each method did to the peers'
#: samples: how much of the own reward signal there was, how far the peers' samples were, what the
#: filter dropped).
DIAGNOSTICS = ("reward/mean", "reward/groups_with_signal", "offpolicy/kl_mean", "offpolicy/ratio_mean",
               "offpolicy/filtered_frac")
#: variant name -> extra run-config items of its cells (``MODE+NAME`` in ``--modes``).
VARIANTS: dict[str, dict] = {"adapt": {"source-adapt": "kl"}}


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
        """The cell's run-config items on top of the preset. Horizontal cells also take the shared
        prompts (``task-scheme = "shared"``): the paper's horizontal mode has every participant
        complete the same prompts, so a preset's partition (e.g. ``expertise`` in ``paper``) holds
        for its vertical cells only (a horizontal run with another scheme is a config error)."""
        rc = {**dict(self.extra), "loss-mode": self.mode, "advantage-groups": self.groups, "seed": self.seed,
              "output-dir": str(out_dir)}
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


def run_grid(cells: Sequence[Cell], out: Path, runner: Runner, echo: Callable[[str], None] = print,
             clock: Callable[[], float] = time.monotonic, shared_initial: bool = False) -> list[Cell]:
    """Run every cell that has no ``done.json``; returns the cells that failed. Progress: cell k of
    n, elapsed, and an estimate of the rest from the mean time of the cells run so far.

    shared_initial: every cell starts from the same models, so the evaluation before round 1 (greedy,
    the same held-out prompts) is the same in every cell: only the first cell run while no finished
    cell in ``out`` has one evaluates before round 1 (``eval-initial``), the others skip it;
    ``initial_eval`` reads it back for the summary and the curves.
    """
    out.mkdir(parents=True, exist_ok=True)
    todo = [c for c in cells if not (out / "cells" / c.name / "done.json").exists()]
    if len(todo) < len(cells):
        echo(f"[grid] {len(cells) - len(todo)} of {len(cells)} cells already done: skipped")
    t0, failed = clock(), []
    for k, cell in enumerate(todo, 1):
        cell_dir = out / "cells" / cell.name
        if cell_dir.exists():                            # interrupted earlier: keep it aside, rerun
            aside = cell_dir.with_name(f"{cell.name}.interrupted-{int(time.time())}")
            cell_dir.rename(aside)
            echo(f"[grid] {cell.name}: an unfinished earlier attempt moved to {aside.name}")
        cell_dir.mkdir(parents=True)
        if shared_initial:
            cell = replace(cell, eval_initial=not initial_eval(out))
        elapsed = clock() - t0
        eta = f", about {elapsed / (k - 1) * (len(todo) - k + 1) / 60:.0f} min left" if k > 1 else ""
        echo(f"[grid] cell {k}/{len(todo)} {cell.name} (elapsed {elapsed / 60:.1f} min{eta})")
        c0 = clock()
        status = runner(cell, cell_dir, cell_dir / "run.log")
        seconds = clock() - c0
        rows = read_rows(cell_dir / "run" / "metrics.jsonl")
        defects = cell_defects(rows)
        if status != 0 or not final_eval(rows) or defects:
            failed.append(cell)
            echo(f"[grid] {cell.name}: FAILED (exit {status}, {len(rows)} metric rows"
                 + (f"; {'; '.join(defects)}" if defects else "") + f"); see {cell_dir / 'run.log'}")
            continue
        (cell_dir / "done.json").write_text(json.dumps({"cell": cell.name, "seconds": seconds, "status": status,
                                                        "eval_initial": cell.eval_initial}))
        echo(f"[grid] {cell.name}: done in {seconds / 60:.1f} min")
    return failed


# ----------------------------------------------------------------------------- summarising

def read_rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


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


def _pm(mean: float, sd: float) -> str:
    return "–" if not math.isfinite(mean) else f"{mean:.3f} ± {sd:.3f}"


def summary_markdown(summary: Sequence[dict], paired: Sequence[dict], results: Sequence[dict],
                     title: str, initial: dict[str, dict] | None = None,
                     diagnostics: Sequence[dict] = ()) -> str:
    initial = initial or {}
    ns = sorted({int(r["eval/id/n"]) for r in results if math.isfinite(r["eval/id/n"])})
    secs = {r["cell"]: r.get("cell_seconds", float("nan")) for r in results}
    secs_ok = [v for v in secs.values() if math.isfinite(v)]
    lines = [f"# {title}", "", f"{len({r['cell'] for r in results})} finished cells"
             + (f" ({statistics.fmean(secs_ok) / 60:.1f} min wall per cell on average, "
                f"{sum(secs_ok) / 3600:.2f} h in all)" if secs_ok else "")
             + "; final held-out greedy pass@1, mean ± sd over seeds"
             + ("; *before training*: the shared evaluation before round 1 (the same models in every cell)."
                if initial else "."), ""]
    if ns:
        se = math.sqrt(0.25 / ns[0])
        lines += [f"ID evaluation set: {', '.join(map(str, ns))} prompts: one cell's standard error is at most "
                  f"{se:.3f} (p = 0.5); a 5-point difference between two methods needs "
                  f"{min_eval_size(0.05)} prompts per set to be 2 standard errors apart in a single pair of "
                  "cells — averaging over seeds and reading paired differences narrows it.", ""]
    participants = sorted({r["participant"] for r in summary})
    methods = list(dict.fromkeys(r["method"] for r in sorted(summary, key=lambda r: _method_order(r["method"]))))
    for m in METRICS:
        lines += [f"## {m}", "", "| method | " + " | ".join(participants) + " |",
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
    if paired:
        lines += ["## Paired differences (reference − method, same seeds)", "",
                  "| method | participant | seeds | ID diff | ID wins/losses | OOD diff | OOD wins/losses |",
                  "|---|---|---|---|---|---|---|"]
        for r in sorted(paired, key=lambda r: (_method_order(r["method"]), r["participant"])):
            lines.append(f"| {r['reference']} − {r['method']} | {r['participant']} | {r['seeds']} | "
                         f"{_pm(r['eval/id/accuracy:diff_mean'], r['eval/id/accuracy:diff_sd'])} | "
                         f"{r['eval/id/accuracy:ref_wins']}/{r['eval/id/accuracy:ref_losses']} | "
                         f"{_pm(r['eval/ood/accuracy:diff_mean'], r['eval/ood/accuracy:diff_sd'])} | "
                         f"{r['eval/ood/accuracy:ref_wins']}/{r['eval/ood/accuracy:ref_losses']} |")
        lines.append("")
    if diagnostics:
        lines += ["## Training diagnostics (per round, mean ± sd over seeds)", "",
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


def plot(summary: Sequence[dict], cells: Sequence[Cell], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    participants = sorted({r["participant"] for r in summary})
    methods = list(dict.fromkeys(r["method"] for r in sorted(summary, key=lambda r: _method_order(r["method"]))))
    if participants:
        fig, axes = plt.subplots(1, len(METRICS), figsize=(6 * len(METRICS), 3.8), squeeze=False)
        cell = {(r["method"], r["participant"]): r for r in summary}
        width = 0.8 / max(1, len(methods))
        for ax, m in zip(axes[0], METRICS):
            for j, meth in enumerate(methods):
                xs = [i + j * width for i in range(len(participants))]
                ys = [cell.get((meth, p), {}).get(m + ":mean", float("nan")) for p in participants]
                es = [cell.get((meth, p), {}).get(m + ":sd", 0.0) for p in participants]
                ax.bar(xs, ys, width, yerr=es, capsize=2, label=meth)
            ax.set_xticks([i + 0.4 - width / 2 for i in range(len(participants))], participants, fontsize=8)
            ax.set_ylabel(m.replace("eval/", "").replace("/accuracy", " pass@1"))
            ax.grid(alpha=0.3, axis="y")
        axes[0][0].legend(fontsize=7, ncol=2)
        fig.suptitle("Final held-out accuracy (mean ± sd over seeds)")
        fig.tight_layout()
        fig.savefig(out / "final_accuracy.png", dpi=110)
        plt.close(fig)
        written.append(out / "final_accuracy.png")
    curves = _curves(cells, out)
    if curves:
        keys = ("eval/id/accuracy", "reward/mean")
        fig, axes = plt.subplots(len(keys), len(participants) or 1, figsize=(4 * max(1, len(participants)), 6.5),
                                 squeeze=False)
        for i, key in enumerate(keys):
            for j, p in enumerate(participants):
                ax = axes[i][j]
                for meth in methods:
                    pts = curves.get((meth, p, key))
                    if pts:
                        ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=meth)
                ax.set_title(p, fontsize=9)
                ax.set_xlabel("round")
                ax.set_ylabel(key)
                ax.grid(alpha=0.3)
        axes[0][0].legend(fontsize=7)
        fig.suptitle("Learning curves (mean over seeds)")
        fig.tight_layout()
        fig.savefig(out / "curves.png", dpi=110)
        plt.close(fig)
        written.append(out / "curves.png")
    return written


def _curves(cells: Sequence[Cell], out: Path) -> dict[tuple[str, str, str], list[tuple[int, float]]]:
    """(method, participant, key) -> [(round, mean over seeds)]; a cell without its own evaluation
    before round 1 gets the grid's shared one (``initial_eval``) as its round-0 point."""
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
            for key in ("eval/id/accuracy", "reward/mean"):
                v = _num(r.get(key))
                if math.isfinite(v):
                    acc[(c.method, r["participant"], key, int(r["round"]))].append(v)
    curves: dict[tuple[str, str, str], list[tuple[int, float]]] = defaultdict(list)
    for (meth, p, key, rnd), vs in sorted(acc.items()):
        curves[(meth, p, key)].append((rnd, statistics.fmean(vs)))
    return curves


def write_summary(cells: Sequence[Cell], out: Path, title: str) -> dict:
    """cells.csv, summary.csv, summary.md and the figures, all from the cells' metrics files."""
    results = cell_results(cells, out)
    summary, paired = summarize(results)
    initial = initial_eval(out)
    diagnostics = train_diagnostics(cells, out)
    _write_csv(out / "cells.csv", results)
    _write_csv(out / "summary.csv", [{**r, "kind": "mean_sd"} for r in summary] +
               [{**r, "kind": "paired_diff"} for r in paired] +
               [{"method": "before-training", "participant": p, "seeds": 1, "kind": "initial",
                 **{m + ":mean": _num(r.get(m)) for m in METRICS}} for p, r in sorted(initial.items())] +
               [{**r, "kind": "train_diagnostics"} for r in diagnostics])
    (out / "summary.md").write_text(summary_markdown(summary, paired, results, title, initial, diagnostics))
    plot(summary, cells, out)
    return {"results": results, "summary": summary, "paired": paired, "initial": initial,
            "diagnostics": diagnostics}


# ----------------------------------------------------------------------------- CLI

def main(a: argparse.Namespace) -> int:
    app = Path(a.app).resolve()
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
    (out / "grid.json").write_text(json.dumps({"preset": a.preset, "modes": modes, "groups": groups,
                                               "seeds": a.seeds, "run_config": a.run_config,
                                               "variants": {k: variants[k] for k in sorted(variants)},
                                               "cells": [c.name for c in cells]}, indent=1))
    print(f"[grid] {len(cells)} cells ({len(modes)} modes × {len(groups)} groupings × {a.seeds} seeds) "
          f"of preset {a.preset} -> {out}", flush=True)
    sim_args = ["--keep-superlink"] + (["--address", a.address] if a.address else [])
    try:
        failed = [] if a.summary_only else run_grid(cells, out, sim_runner(app, a.preset, a.run_config, sim_args),
                                                    echo=lambda s: print(s, flush=True),
                                                    shared_initial=a.initial_eval == "once")
    finally:
        if not a.summary_only:
            _stop_kept_superlink(app, a.address)
    write_summary(cells, out, f"Grid: preset {a.preset}")
    print(f"[grid] summary: {out / 'summary.md'} (+ summary.csv, cells.csv, final_accuracy.png, curves.png)")
    if failed:
        print(f"[grid] {len(failed)} cells failed: {', '.join(c.name for c in failed)}; run the same command "
              "again to retry them", file=sys.stderr)
        return 1
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
    p.add_argument("--preset", required=True, help="NAME of sims/presets/NAME.toml, or a .toml path")
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
    p.add_argument("--summary-only", action="store_true", help="only (re)write the summary of finished cells")
    p.set_defaults(func=main)
