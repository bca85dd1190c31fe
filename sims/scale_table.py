"""One row per ``ftis-fed sim`` run measured with ``sims.mem_sample``: docs/scale.md's flwr-run table.

    python -m sims.scale_table --out flwr-run.csv NAME=LOG,MEM_SUMMARY,OUTPUT_DIR ...   # the launch's log,
                                                                 # mem_sample's summary line, output-dir
    python -m sims.scale_table --committed docs/results/scale        # the committed runs (n4 ... n256)

``--committed DIR`` reads the runs packed there (``<name>.log.gz``, ``<name>.summary.json``,
``<name>.config.json``, ``<name>.metrics.jsonl.gz``; docs/results/scale/README.md) and rewrites
``DIR/flwr-run.csv`` and ``.jsonl`` from them.

Per run: participants N, participants per worker and worker processes, the hello (the engine's
``admission: ... in X s`` line) with the CPU seconds every process of the launch had used by then
(``mem_sample``'s mark), round time (mean of the rounds after the first, from the engine's
``round r/R: ... X s`` lines), the ServerApp's CPU and RSS per round (``fed/server_cpu_s`` /
``fed/server_rss_mb``: the simulation process, which also runs Flower's simulation engine),
relayed bytes and frames per round, the peak memory by kind (RSS and USS), the wall time, the load
average over the run, and what the participants earned (mean training reward per round, evaluation
ID accuracy at the last round). Also writes the rows as JSON lines next to the CSV (``.jsonl``),
with the marks of each run.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import json
import re
import statistics
from pathlib import Path

ROUND = re.compile(r"round (\d+)/(\d+): .* ([0-9.]+) s$")
HELLO = re.compile(r"admission: (\d+) admitted of (\d+) said hello to in ([0-9.]+) s")


def _plain(line: str) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", line).strip()


def _text(path: Path) -> str:
    return gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text(errors="replace")


def row(name: str, log: Path, summary: Path, out: Path | None = None, *, config: Path | None = None,
        metrics: Path | None = None) -> dict:
    """One run's row: its log, mem_sample's summary line, and its output-dir (or its ``config.json``
    and ``metrics.jsonl``, either may be gzipped)."""
    config = config or out / "config.json"
    metrics = metrics or out / "metrics.jsonl"
    lines = [_plain(x) for x in _text(log).splitlines()]
    hello = next((HELLO.search(x) for x in lines if HELLO.search(x)), None)
    rounds = {int(m.group(1)): float(m.group(3)) for m in (ROUND.search(x) for x in lines) if m}
    s = json.loads(summary.read_text())
    cfg = json.loads(_text(config))
    rows = [json.loads(x) for x in _text(metrics).splitlines()]
    fed = {r["round"]: r for r in rows if r.get("participant") == "_federation" and r.get("phase") == "train"}
    later = [r for r in sorted(fed) if r > 1] or sorted(fed)
    train = [r for r in rows if r.get("phase") == "train" and "reward/mean" in r]
    last = max(fed)
    evals = [r["eval/id/accuracy"] for r in rows if r.get("phase") == "eval" and r.get("round") == last
             and "eval/id/accuracy" in r]
    mark = next((m for m in s.get("marks", []) if "admission:" in m["line"]), None)
    loads = [m["load1"] for m in s.get("marks", [])]
    peak = s["peak_by_kind"]
    n = int(hello.group(1)) if hello else len({r["participant"] for r in train})
    per = int(cfg.get("participants_per_worker", 1))
    return {
        "run": name, "participants": n, "per_worker": per, "workers": s["peak_total"]["procs"]["workers"],
        "sampled_per_round": statistics.mean(fed[r].get("fed/sampled", n) for r in later),
        "hello_s": float(hello.group(3)) if hello else None,
        "hello_cpu_s": mark["cpu_s"]["total"] if mark else None,
        "hello_cpu_s_workers": mark["cpu_s"]["workers"] if mark else None,
        "round_s": round(statistics.mean(rounds[r] for r in later if r in rounds), 2),
        "server_cpu_s_per_round": round(statistics.mean(fed[r]["fed/server_cpu_s"] for r in later), 2),
        "server_rss_mb_last": round(fed[last]["fed/server_rss_mb"], 1),
        "bytes_relayed_per_round": round(statistics.mean(fed[r]["fed/bytes_relayed"] for r in later)),
        "frames_relayed_per_round": round(statistics.mean(fed[r]["fed/frames_relayed"] for r in later), 1),
        "workers_rss_mb": peak["workers"]["rss_mb"], "workers_uss_mb": peak["workers"]["uss_mb"],
        "ray_actors_rss_mb": peak["ray_actors"]["rss_mb"], "ray_actors_uss_mb": peak["ray_actors"]["uss_mb"],
        "serverapp_rss_mb": peak["serverapp"]["rss_mb"], "serverapp_uss_mb": peak["serverapp"]["uss_mb"],
        "other_rss_mb": round(peak["ray_system"]["rss_mb"] + peak["other"]["rss_mb"], 1),
        "total_rss_mb": s["peak_total"]["rss_mb"], "total_uss_mb": s["peak_total"]["uss_mb"],
        "cpu_s_total": round(sum(s["cpu_s"].values()), 1), "wall_s": s["wall_s"], "rc": s["rc"],
        "load1_min": min(loads) if loads else None, "load1_max": max(loads) if loads else None,
        "reward_mean": round(statistics.mean(r["reward/mean"] for r in train), 3),
        "eval_id_last": round(statistics.mean(evals), 3) if evals else None,
        "rounds": len(fed), "marks": s.get("marks", []),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="the CSV to write (and its .jsonl); default with --committed: DIR/flwr-run.csv")
    ap.add_argument("--committed", metavar="DIR", help="the runs packed in DIR (module docstring)")
    ap.add_argument("runs", nargs="*", help="NAME=LOG,MEM_SUMMARY,OUTPUT_DIR")
    a = ap.parse_args(argv)
    if bool(a.committed) == bool(a.runs):
        ap.error("give either --committed DIR or NAME=LOG,MEM_SUMMARY,OUTPUT_DIR runs")
    rows = []
    if a.committed:
        d = Path(a.committed)
        names = sorted((p.name.removesuffix(".summary.json") for p in d.glob("*.summary.json")),
                       key=lambda n: int("".join(filter(str.isdigit, n)) or 0))
        for name in names:
            rows.append(row(name, d / f"{name}.log.gz", d / f"{name}.summary.json",
                            config=d / f"{name}.config.json", metrics=d / f"{name}.metrics.jsonl.gz"))
    for spec in a.runs:
        name, _, paths = spec.partition("=")
        log, summary, out = (Path(p) for p in paths.split(","))
        rows.append(row(name, log, summary, out))
    out = Path(a.out or Path(a.committed) / "flwr-run.csv")
    with open(out, "w", newline="") as fh:
        w = csv.DictWriter(fh, [k for k in rows[0] if k != "marks"])
        w.writeheader()
        for r in rows:
            w.writerow({k: v for k, v in r.items() if k != "marks"})
    out.with_suffix(".jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for r in rows:
        print({k: v for k, v in r.items() if k != "marks"})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
