"""The one metrics writer: JSONL (append, one row per participant per round, plus a federation row),
CSV (rewritten with the union of columns) and PNG plots a person would look at.

Row keys: ``round``, ``participant`` (``_federation`` for the server's own row), ``phase``
(``train``/``eval``), then namespaced metrics (``reward/...``, ``offpolicy/...``, ``train/...``,
``eval/...``, ``fed/...``, ``wire/...``).
"""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
from datetime import datetime, timezone
from collections import defaultdict
from pathlib import Path
from typing import Any

from ftis_fed.atomic import atomic_path

FEDERATION = "_federation"
#: above this many participants a plot shows their mean and min-max band, not one line each
PLOT_LINES = 8

#: plot file -> (title, [(metric key, y label)]); one line per participant.
PLOTS: dict[str, tuple[str, list[tuple[str, str]]]] = {
    "reward.png": ("Reward by round (own samples)", [("reward/mean", "mean reward"),
                                                    ("reward/solved_frac", "solved fraction")]),
    "accuracy.png": ("Held-out greedy pass@1", [("eval/id/accuracy", "ID accuracy"),
                                               ("eval/ood/accuracy", "OOD accuracy")]),
    "offpolicy.png": ("Off-policy diagnostics (all sources)", [("offpolicy/filtered_frac", "filtered fraction"),
                                                               ("offpolicy/truncated_frac", "truncated fraction"),
                                                               ("offpolicy/ratio_mean", "mean ratio pi/pi_gen")]),
    "training.png": ("Training", [("train/loss", "loss"), ("train/grad_norm", "grad norm")]),
}


def per_function_plot(rows: list[dict[str, Any]]) -> dict[str, tuple[str, list[tuple[str, str]]]]:
    """``rewards.png``: one panel per reward function (TRL's ``rewards/<name>/mean``), when a user
    task's functions reported them; {} otherwise."""
    keys = sorted({k for r in rows for k in r if k.startswith("rewards/") and k.endswith("/mean")})
    if not keys:
        return {}
    return {"rewards.png": ("Reward per function (own samples)",
                            [(k, f"{k[len('rewards/'):-len('/mean')]} (mean)") for k in keys[:6]])}


def summarize_sources(metrics: dict[str, float], self_name: str) -> dict[str, float]:
    """Add ``offpolicy/<stat>`` (over peers' samples, weighted by samples / tokens) to a
    participant's metrics that hold per-source ``offpolicy/<source>/<stat>``."""
    per: dict[str, dict[str, float]] = defaultdict(dict)
    for k, v in metrics.items():
        parts = k.split("/")
        if len(parts) == 3 and parts[0] == "offpolicy" and parts[1] not in ("rejected",):
            per[parts[1]][parts[2]] = v
    peers = {s: m for s, m in per.items() if s != self_name and "samples" in m}
    out = dict(metrics)
    if peers:
        n_s = sum(m["samples"] for m in peers.values())
        n_t = sum(m.get("tokens", 0.0) for m in peers.values())
        out["offpolicy/filtered_frac"] = sum(m.get("filtered_frac", 0) * m["samples"] for m in peers.values()) / max(n_s, 1)
        out["offpolicy/kl_mean"] = sum(m.get("kl_mean", 0) * m["samples"] for m in peers.values()) / max(n_s, 1)
        if n_t:
            out["offpolicy/truncated_frac"] = sum(m.get("truncated_frac", 0) * m.get("tokens", 0)
                                                  for m in peers.values()) / n_t
            out["offpolicy/ratio_mean"] = sum(m.get("ratio_mean", 0) * m.get("tokens", 0) for m in peers.values()) / n_t
    return out


def phase_summary(name: str, m: dict[str, float]) -> str:
    """``alice generate 14.2 s 240 tokens 16.9 tok/s, train 41.0 s`` from a reply's metrics."""
    out = [name]
    if "gen/seconds" in m:
        tok = m.get("gen/tokens", 0.0)
        rate = f" {tok / m['gen/seconds']:.1f} tok/s" if m["gen/seconds"] > 0 and tok else ""
        out.append(f"generate {m['gen/seconds']:.1f} s {tok:.0f} tokens{rate}")
    if "train/seconds" in m:
        out.append(f"train {m['train/seconds']:.1f} s")
    return " ".join(out[:1]) + (" " + ", ".join(out[1:]) if len(out) > 1 else "")


class MetricsWriter:
    """Rows of one run in ``out_dir``. ``append=False`` (a fresh run, no resume): metrics files
    left there by an earlier run are moved aside to ``metrics.<UTC time>.jsonl`` / ``.csv`` first,
    so plots never mix two runs; ``moved`` lists the (old, new) paths for the caller to report.
    ``append=True`` (resume) continues the existing files."""

    def __init__(self, out_dir: str | Path, append: bool = True, sinks: list | None = None):
        self.sinks = list(sinks or [])          # report-to: each also gets every written row (ftis_fed/metrics/sinks.py)
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.jsonl = self.dir / "metrics.jsonl"
        self.csv = self.dir / "metrics.csv"
        self.moved: list[tuple[Path, Path]] = [] if append else self._move_aside()
        self._csv_cols: list[str] | None = None        # the CSV's header, once read or written
        self._plotter: subprocess.Popen | None = None   # the child process drawing the plots, if any

    def _move_aside(self) -> list[tuple[Path, Path]]:
        old = [p for p in (self.jsonl, self.csv) if p.exists()]
        if not old:
            return []
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S")
        n = 0
        while any((self.dir / f"metrics.{stamp}{'-' + str(n) if n else ''}{p.suffix}").exists() for p in old):
            n += 1
        moved = []
        for p in old:
            new = self.dir / f"metrics.{stamp}{'-' + str(n) if n else ''}{p.suffix}"
            p.replace(new)
            moved.append((p, new))
        return moved

    def rows(self) -> list[dict[str, Any]]:
        if not self.jsonl.exists():
            return []
        return [json.loads(line) for line in self.jsonl.read_text().splitlines() if line.strip()]

    def write(self, rows: list[dict[str, Any]]) -> None:
        """Append rows to the JSONL, and to the CSV while they bring no new column (the CSV is
        rewritten from the JSONL when they do: a run's cost per round stays that round's rows)."""
        lines = [json.dumps({k: _clean(v) for k, v in r.items()}) for r in rows]
        with self.jsonl.open("a") as f:
            f.writelines(line + "\n" for line in lines)
        rows = [json.loads(line) for line in lines]            # what the CSV holds: the JSONL's values
        if self._csv_cols is None and self.csv.exists():
            with self.csv.open(newline="") as f:
                self._csv_cols = next(csv.reader(f), [])
        if self._csv_cols and {k for r in rows for k in r} <= set(self._csv_cols):
            with self.csv.open("a", newline="") as f:
                w = csv.DictWriter(f, fieldnames=self._csv_cols)
                for r in rows:
                    w.writerow({k: r.get(k, "") for k in self._csv_cols})
        else:
            self._write_csv(self.rows())
        for sink in self.sinks:
            sink.log(rows)

    def close(self) -> None:
        """Close the report-to sinks (the JSONL/CSV files need nothing); wait for a background redraw."""
        self.wait_plots()
        for sink in self.sinks:
            sink.close()
        self.sinks = []

    def _write_csv(self, rows: list[dict[str, Any]]) -> None:
        head = ["round", "participant", "phase"]
        cols = head + sorted({k for r in rows for k in r} - set(head))
        with atomic_path(self.csv) as tmp, tmp.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=cols)
            w.writeheader()
            for r in rows:
                w.writerow({k: r.get(k, "") for k in cols})
        self._csv_cols = cols

    def plot_in_background(self) -> bool:
        """Redraw the plots in a child process (``python -m ftis_fed.metrics.writer <dir>``), so the
        drawing costs the server neither its round's time nor memory (matplotlib's ~10-20 MB per redraw
        stays in the child); skipped while the previous one still draws. True when one started."""
        if self._plotter is not None and self._plotter.poll() is None:
            return False
        root = str(Path(__file__).resolve().parents[2])                 # the folder holding ftis_fed/
        env = {**os.environ, "PYTHONPATH": root + (os.pathsep + os.environ["PYTHONPATH"]
                                                   if os.environ.get("PYTHONPATH") else "")}
        self._plotter = subprocess.Popen([sys.executable, "-m", "ftis_fed.metrics.writer", str(self.dir)],
                                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                         stderr=subprocess.DEVNULL, env=env, cwd=root)
        return True

    def wait_plots(self, timeout: float = 120.0) -> None:
        """Wait for a background redraw to end (killed after ``timeout`` seconds)."""
        if self._plotter is not None:
            try:
                self._plotter.wait(timeout)
            except subprocess.TimeoutExpired:
                self._plotter.kill()
                self._plotter.wait()
            self._plotter = None

    def plot(self) -> list[Path]:
        """One PNG per entry of ``PLOTS`` (skipping metrics nobody reported) + fed.png; returns paths."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator

        rows = self.rows()
        written = []
        for fname, (title, series) in {**PLOTS, **per_function_plot(rows), "fed.png": ("Relay", [("fed/bytes_relayed", "bytes relayed"),
                                                                      ("fed/rejected", "rejected batches"),
                                                                      ("fed/replies", "replies"),
                                                                      ("fed/participants", "admitted"),
                                                                      ("fed/sampled", "sampled per round"),
                                                                      ("fed/round_seconds", "round seconds")])}.items():
            present = [(k, lab) for k, lab in series if any(k in r for r in rows)]
            if not present:
                continue
            fig, axes = plt.subplots(1, len(present), figsize=(5 * len(present), 3.6), squeeze=False)
            for ax, (key, label) in zip(axes[0], present):
                by_p: dict[str, list[tuple[int, float]]] = defaultdict(list)
                for r in rows:
                    if key in r and isinstance(r[key], (int, float)) and math.isfinite(r[key]):
                        by_p[r["participant"]].append((int(r["round"]), float(r[key])))
                if len(by_p) > PLOT_LINES:                # many participants: mean, and the min-max band
                    _plot_spread(ax, by_p)
                for name, pts in (sorted(by_p.items()) if len(by_p) <= PLOT_LINES else ()):
                    pts.sort()
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                            label=name.lstrip("_"))               # matplotlib hides "_..." labels
                ax.set_xlabel("round")
                ax.xaxis.set_major_locator(MaxNLocator(integer=True))
                ax.set_ylabel(label)
                ax.grid(alpha=0.3)
                if by_p:
                    ax.legend(fontsize=8)
            fig.suptitle(title)
            fig.tight_layout()
            path = self.dir / fname
            fig.savefig(path, dpi=110)
            plt.close(fig)
            written.append(path)
        return written


def _plot_spread(ax, by_p: dict[str, list[tuple[int, float]]]) -> None:
    """Per round over all participants: the mean line and the min-max band, the extremes named."""
    per_round: dict[int, list[tuple[float, str]]] = defaultdict(list)
    for name, pts in by_p.items():
        for rnd, v in pts:
            per_round[rnd].append((v, name))
    rounds = sorted(per_round)
    lo = [min(per_round[r])[0] for r in rounds]
    hi = [max(per_round[r])[0] for r in rounds]
    mean = [sum(v for v, _ in per_round[r]) / len(per_round[r]) for r in rounds]
    ax.fill_between(rounds, lo, hi, alpha=0.25, label=f"min-max over {len(by_p)} participants")
    ax.plot(rounds, mean, marker="o", label="mean")
    last = rounds[-1]
    for v, name in (min(per_round[last]), max(per_round[last])):
        ax.annotate(name.lstrip("_"), (last, v), fontsize=7, xytext=(3, 0), textcoords="offset points")


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


if __name__ == "__main__":                                # the background redraw (plot_in_background)
    MetricsWriter(sys.argv[1], append=True).plot()
