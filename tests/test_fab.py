"""The Flower app bundle (FAB) that ``flwr run`` builds carries everything the code needs at run time.

Flower copies an app into a FAB with fixed built-in include patterns (.py, .toml, .md, .json(l),
.yaml: ``flwr.common.constant.FAB_INCLUDE_PATTERNS``), which ``[tool.flwr.app] fab-include`` can
narrow but never widen. Every participant and the server import the project from that copy, so a
data file of another kind inside a package (a binary zstd dictionary once) is silently missing in
every ``flwr run`` while the editable install in the tests still finds it.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

from flwr.cli.build import build_fab_from_files, get_filtered_fab_paths
from flwr.cli.utils import collect_files

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("ftis_fed", "strategies", "clients")


def _package_files() -> dict[str, Path]:
    files = {"pyproject.toml": ROOT / "pyproject.toml"}
    for pkg in PACKAGES:
        for rel, path in collect_files(ROOT / pkg).items():
            if "__pycache__" not in rel and not rel.endswith(".pyc"):
                files[f"{pkg}/{rel}"] = path
    return files


def test_every_file_of_the_packages_goes_into_the_fab():
    files = _package_files()
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    kept = set(get_filtered_fab_paths(files, config))
    dropped = sorted(p for p in files if p != "pyproject.toml" and p not in kept)
    assert not dropped, (f"files Flower leaves out of the app bundle (so missing in every flwr run): {dropped}; "
                         "ship data as .py/.json instead (see ftis_fed/wire/dictionary.py)")


def test_the_wire_dictionary_loads_from_a_fab_copy(tmp_path):
    fab, _ = build_fab_from_files(_package_files())
    zipfile.ZipFile(io.BytesIO(fab)).extractall(tmp_path)
    assert (tmp_path / "ftis_fed" / "wire" / "dictionary.py").exists()
    code = ("import ftis_fed, ftis_fed.wire.dictionary as w; assert ftis_fed.__file__.startswith(%r), ftis_fed.__file__; "
            "print(w.dictionary(w.DEFAULT).dict_id())" % str(tmp_path))
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "1"
