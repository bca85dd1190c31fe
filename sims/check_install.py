"""Does ftis-fed with the vLLM extra resolve on a CUDA Linux machine? Ask pip (``--dry-run``).

    python sims/check_install.py [--pins recommended|pyproject] [--python-version 3.12] [--glibc 2.35]
                                 [--native] [--report FILE]

Nothing is installed and no multi-GB wheel is downloaded: pip resolves with ``--dry-run
--ignore-installed`` and reads each candidate's metadata with HTTP range requests
(``--use-feature=fast-deps``; the index used here serves no PEP 658 metadata files, and without
range requests pip downloads every candidate wheel whole: torch and vLLM are 0.3-0.6 GB each). By
default pip resolves *for* a CUDA Linux target (``--platform manylinux_2_<glibc>_x86_64`` and every
older manylinux tag, ``--python-version``, ``--only-binary=:all:``), so it runs on any machine;
``--native`` resolves for the interpreter running it (use it on the CUDA machine itself).

Pin sets (the project's own dependencies are read from ``pyproject.toml``; a pin replaces the
requirement of the same name):

- ``recommended``: what docs/gpu.md records: flwr[simulation] 1.42.0 (the Message API and the
  SuperLink CLI the launcher uses), vllm 0.22.1 (the newest vLLM without ``fastapi<0.137``: flwr
  1.33+ needs fastapi 0.138.x), torch 2.11.0 (vLLM 0.22.1's pin);
- ``pyproject``: the extra exactly as ``pyproject.toml`` declares it today.

Prints one JSON line: ``resolved`` (bool), the versions pip chose for the packages that matter, the
command, and pip's last error lines when it failed. Exit status 0 when it resolved.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: name -> requirement; replaces the project's requirement of that name.
PIN_SETS = {
    "recommended": {
        "flwr": "flwr[simulation]==1.42.0",
        "vllm": "vllm==0.22.1",
        "torch": "torch==2.11.0",
    },
    "pyproject": {},
}

#: Packages whose chosen versions are reported.
WATCH = ("flwr", "vllm", "torch", "transformers", "fastapi", "starlette", "uvicorn", "ray", "peft",
         "bitsandbytes", "accelerate", "protobuf", "grpcio", "pydantic", "numpy", "triton")


def _name(req: str) -> str:
    return re.split(r"[\[<>=!~;\s]", req.strip(), maxsplit=1)[0].lower().replace("_", "-")


def requirements(pins: dict[str, str], extras: tuple[str, ...] = ("vllm", "quant")) -> list[str]:
    """The project's dependencies + ``extras`` from pyproject.toml, with ``pins`` applied."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    for e in extras:
        reqs += project.get("optional-dependencies", {}).get(e, [])
    out: dict[str, str] = {}
    for r in reqs:
        out.setdefault(_name(r), r)
    for name, r in pins.items():
        out[name] = r
    out.setdefault("tomli-w", "tomli-w>=1.0")          # used by launch.py (pyproject may not declare it yet)
    return sorted(out.values())


def platform_args(glibc: str) -> list[str]:
    """``--platform`` for a manylinux x86_64 target with this glibc, and every older tag."""
    major, minor = (int(x) for x in glibc.split("."))
    tags = [f"manylinux_{major}_{m}_x86_64" for m in range(minor, 4, -1)]
    tags += ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64", "linux_x86_64"]
    return [a for t in tags for a in ("--platform", t)]


def pip_command(reqs: list[str], report: Path, python_version: str | None, glibc: str, native: bool) -> list[str]:
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--use-feature=fast-deps",
           "--report", str(report)]
    if not native:
        cmd += ["--only-binary=:all:", "--python-version", python_version or "3.12", *platform_args(glibc)]
    return cmd + reqs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pins", choices=sorted(PIN_SETS), default="recommended")
    ap.add_argument("--python-version", default="3.12", help="target interpreter (default 3.12)")
    ap.add_argument("--glibc", default="2.35", help="target glibc (default 2.35: Ubuntu 22.04)")
    ap.add_argument("--native", action="store_true", help="resolve for this interpreter and platform")
    ap.add_argument("--report", default="", help="keep pip's JSON report here")
    a = ap.parse_args(argv)
    reqs = requirements(PIN_SETS[a.pins])
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(a.report) if a.report else Path(tmp) / "report.json"
        cmd = pip_command(reqs, report, a.python_version, a.glibc, a.native)
        r = subprocess.run(cmd, capture_output=True, text=True)
        out: dict = {"pins": a.pins, "target": "native" if a.native else
                     f"manylinux_{a.glibc.replace('.', '_')}_x86_64 / Python {a.python_version}",
                     "resolved": r.returncode == 0, "requirements": reqs}
        if r.returncode == 0:
            rep = json.loads(report.read_text())
            got = {i["metadata"]["name"].lower().replace("_", "-"): i["metadata"]["version"] for i in rep["install"]}
            out["versions"] = {k: got.get(k) for k in WATCH}
            out["packages"] = len(got)
        else:
            out["error"] = [line for line in (r.stderr or r.stdout).splitlines() if line.strip()][-6:]
    print(json.dumps(out))
    return 0 if out["resolved"] else 1


if __name__ == "__main__":
    sys.exit(main())
