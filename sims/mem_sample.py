"""Run a command (an ``ftis-fed sim`` launch) and sample the memory of everything it starts, by kind.

    python -m sims.mem_sample --out mem.jsonl --every 3 -- python -m ftis_fed.commands.cli sim --preset lora256

Every ``--every`` seconds: the processes of the launch (the command's descendants, and every process
whose environment carries the launch's ``FTIS_FED_LAUNCH`` token, which Ray's and Flower's daemons
keep after they leave the process tree), each classified by its command line, their RSS and USS
(private memory: ``psutil``'s ``memory_full_info``, from ``/proc/<pid>/smaps_rollup``) summed per
kind, their CPU seconds so far, the load average, and the lines of the command's log (``--log``)
that match ``--mark`` since the last sample (the admission, each round: so the CPU and time of the
hello and of each round can be read off); one JSON line per sample in ``--out``. At the end one JSON line on
stdout: the peak of each kind (the largest sum over the samples) and of the total (the largest
total of one sample, not the sum of the kinds' peaks), with the process counts at that sample and
the command's wall time and exit status, the CPU seconds per kind, and the marks. docs/scale.md's flwr-run tables are measured with it.

Kinds: ``workers`` (``clients.worker``: the participants' models), ``ray_actors`` (``ray::`` processes:
the ClientApp actors), ``serverapp`` (``flwr-simulation`` / ``flwr-serverapp``: the engine, and in a
simulation Ray's driver), ``ray_system`` (raylet, GCS, Ray's dashboard and log daemons), ``other``
(the SuperLink, SuperExec, the ``flwr`` CLI, the launcher).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import psutil

KINDS = ("workers", "ray_actors", "serverapp", "ray_system", "other")
TOKEN_ENV = "FTIS_FED_LAUNCH"


def kind_of(cmdline: list[str]) -> str:
    """The kind of a process, from its command line (see the module docstring)."""
    line = " ".join(cmdline)
    if "clients.worker" in line:
        return "workers"
    if line.startswith("ray::"):
        return "ray_actors"
    if "flwr-simulation" in line or "flwr-serverapp" in line:
        return "serverapp"
    if "ray" in line and any(p in line for p in ("raylet", "gcs_server", "dashboard", "log_monitor", "monitor.py",
                                                 "runtime_env", "ray/_private", "default_worker")):
        return "ray_system"
    return "other"


def _token(proc: psutil.Process) -> str | None:
    try:
        return proc.environ().get(TOKEN_ENV)
    except (psutil.Error, OSError):
        return None


def launch_processes(root: psutil.Process, token: str | None) -> tuple[list[psutil.Process], str | None]:
    """(the root's descendants and every process with ``token`` in its environment, the token: learnt
    from the first descendant that carries one)."""
    found: dict[int, psutil.Process] = {}
    try:
        for p in root.children(recursive=True):
            found[p.pid] = p
    except psutil.Error:
        pass
    if token is None:
        for p in list(found.values()):
            token = _token(p)
            if token:
                break
    if token:
        for p in psutil.process_iter():
            if p.pid not in found and p.pid != os.getpid() and _token(p) == token:
                found[p.pid] = p
    return list(found.values()), token


def sample(procs: list[psutil.Process], cpu_seen: dict[tuple, tuple[str, float]]) -> dict:
    """Per kind: RSS and USS in MB, the process count, and the CPU seconds (user + system) of every
    process of that kind seen so far (``cpu_seen``: (pid, start time) -> (kind, its last CPU
    seconds), updated here, so a process that ended still counts what it used up to its last
    sample)."""
    out = {k: {"rss_mb": 0.0, "uss_mb": 0.0, "procs": 0, "cpu_s": 0.0} for k in KINDS}
    for p in procs:
        try:
            kind = kind_of(p.cmdline())
            mem = p.memory_full_info()
            cpu = p.cpu_times()
            cpu_seen[(p.pid, p.create_time())] = (kind, cpu.user + cpu.system)
        except (psutil.Error, OSError):
            continue
        row = out[kind]
        row["rss_mb"] += mem.rss / 2**20
        row["uss_mb"] += mem.uss / 2**20
        row["procs"] += 1
    for kind, cpu_s in cpu_seen.values():
        out[kind]["cpu_s"] += cpu_s
    out["total"] = {key: sum(out[k][key] for k in KINDS) for key in ("rss_mb", "uss_mb", "procs", "cpu_s")}
    return out


def new_marks(log: Path | None, offset: int, pattern: re.Pattern) -> tuple[list[str], int]:
    """(the lines of ``log`` after byte ``offset`` that match ``pattern``, the new offset: the end of
    its last whole line)."""
    if log is None or not log.exists():
        return [], offset
    with open(log, "rb") as fh:
        fh.seek(offset)
        data = fh.read()
    end = data.rfind(b"\n") + 1
    lines = data[:end].decode(errors="replace").splitlines()
    return [ln for ln in lines if pattern.search(ln)], offset + end


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSONL file: one line per sample")
    ap.add_argument("--every", type=float, default=3.0, help="seconds between samples (default 3)")
    ap.add_argument("--log", default=None, help="the command's stdout and stderr go here (default: inherited)")
    ap.add_argument("--mark", default=r"admission:|round \d+/\d+:|Results:",
                    help="log lines (of --log) to note with the sample's time and CPU (default: the admission, "
                         "each round's line, the end)")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- the command to run")
    a = ap.parse_args(argv)
    cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not cmd:
        ap.error("no command given (after --)")
    log = open(a.log, "ab") if a.log else None
    t0 = time.monotonic()
    child = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT if log else None)
    root = psutil.Process(child.pid)
    token, peak, peak_total = None, {k: {"rss_mb": 0.0, "uss_mb": 0.0} for k in KINDS}, None
    cpu_seen: dict = {}
    marks, offset, pattern = [], 0, re.compile(a.mark)
    with open(a.out, "w") as out:
        while child.poll() is None:
            procs, token = launch_processes(root, token)
            row = sample(procs, cpu_seen)
            row["t"], row["load1"] = round(time.monotonic() - t0, 1), os.getloadavg()[0]
            lines, offset = new_marks(Path(a.log) if a.log else None, offset, pattern)
            for line in lines:
                marks.append({"t": row["t"], "line": line.strip()[:200], "load1": row["load1"],
                              "cpu_s": {k: round(row[k]["cpu_s"], 1) for k in (*KINDS, "total")}})
            row["marks"] = lines
            out.write(json.dumps(row) + "\n")
            out.flush()
            for k in KINDS:
                for key in ("rss_mb", "uss_mb"):
                    peak[k][key] = max(peak[k][key], row[k][key])
            if peak_total is None or row["total"]["rss_mb"] > peak_total["total"]["rss_mb"]:
                peak_total = row
            try:
                child.wait(timeout=a.every)
            except subprocess.TimeoutExpired:
                pass
    summary = {"command": cmd, "rc": child.returncode, "wall_s": round(time.monotonic() - t0, 1),
               "peak_by_kind": {k: {key: round(v, 1) for key, v in peak[k].items()} for k in KINDS},
               "peak_total": None if peak_total is None else {
                   "t": peak_total["t"], "rss_mb": round(peak_total["total"]["rss_mb"], 1),
                   "uss_mb": round(peak_total["total"]["uss_mb"], 1),
                   "procs": {k: peak_total[k]["procs"] for k in KINDS}},
               "cpu_s": {k: round(sum(c for kind, c in cpu_seen.values() if kind == k), 1) for k in KINDS},
               "marks": marks}
    print(json.dumps(summary), flush=True)
    Path(a.out).with_suffix(".summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return child.returncode or 0


if __name__ == "__main__":
    sys.exit(main())
