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

import pytest
from flwr.cli.build import build_fab_from_files, get_filtered_fab_paths
from flwr.cli.utils import collect_files, filter_paths_for_publish

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("ftis_fed", "strategies", "clients")


@pytest.fixture(scope="module")
def app_files(tmp_path_factory) -> dict[str, Path]:
    """The candidate files of ``flwr run``'s bundle: the app as ``ftis-fed sim`` stages it."""
    from ftis_fed.commands.app_stage import stage_app

    return filter_paths_for_publish(collect_files(stage_app(ROOT, tmp_path_factory.mktemp("stage") / "app")))


def test_every_file_of_the_packages_goes_into_the_fab(app_files):
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    kept = set(get_filtered_fab_paths(app_files, config))
    dropped = sorted(p for p in app_files if p.split("/")[0] in PACKAGES and p not in kept)
    assert not dropped, (f"files Flower leaves out of the app bundle (so missing in every flwr run): {dropped}; "
                         "ship data as .py/.json instead (see ftis_fed/wire/dictionary.py)")


def test_the_wire_dictionary_loads_from_a_fab_copy(app_files, tmp_path):
    fab, _ = build_fab_from_files(app_files)
    zipfile.ZipFile(io.BytesIO(fab)).extractall(tmp_path)
    assert (tmp_path / "ftis_fed" / "wire" / "dictionary.py").exists()
    code = ("import ftis_fed, ftis_fed.wire.dictionary as w; assert ftis_fed.__file__.startswith(%r), ftis_fed.__file__; "
            "print(w.dictionary(w.DEFAULT).dict_id())" % str(tmp_path))
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "1"


def test_the_run_bundle_carries_the_code_and_not_the_committed_evidence(app_files):
    """What ``ftis-fed sim`` hands ``flwr run`` (the staged app) builds a FAB without docs/results
    and tests: those grow with every committed grid, and every SuperNode receives the FAB each run."""
    from flwr.common.constant import FAB_MAX_SIZE

    fab, _ = build_fab_from_files(app_files)
    names = zipfile.ZipFile(io.BytesIO(fab)).namelist()
    assert not [n for n in names if n.startswith(("docs/results/", "tests/"))]
    assert {"README.md", "docs/method.md", "clients/client_app.py", "sims/presets/paper.toml"} <= set(names)
    assert len(fab) < FAB_MAX_SIZE // 3, len(fab)
