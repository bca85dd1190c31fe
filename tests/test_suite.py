"""sims/suite.py: the learning tier's suite read from the committed grids — the commands that make
each grid's finished cells, and what the cells cost."""

from __future__ import annotations

import json
from pathlib import Path

from sims import suite
from tests.grid_cells import rewrite_metrics


def _grid(tmp: Path, cells: dict[str, float], meta: dict) -> Path:
    for name, seconds in cells.items():
        (tmp / "cells" / name).mkdir(parents=True)
        (tmp / "cells" / name / "done.json").write_text(json.dumps({"seconds": seconds, "load1_start": 2.0}))
    (tmp / "cells" / "TIS__vertical__s9").mkdir()                   # unfinished: no done.json, not a cell
    (tmp / "grid.json").write_text(json.dumps(meta))
    return tmp


def test_one_command_per_set_of_methods_sharing_their_seeds(tmp_path):
    meta = {"preset": "research-w", "transport": "inprocess", "run_config": ["eval-seed=0", "num-rounds=10"],
            "metric": "sampled", "variants": {"guard": {"source-adapt": "guard"}, "2G": {"prompts-per-round": 64}}}
    cells = {f"{m}__vertical__s{s}": 60.0 for m in ("alone", "alone+2G") for s in range(3)}
    cells |= {"F-TIS+guard__vertical__s0": 600.0, "F-TIS+guard__vertical__s1": 600.0,
              "F-TIS+guard__vertical__s3": 600.0}
    grid = _grid(tmp_path, cells, meta)
    common = ["ftis-fed", "grid", "--preset", "research-w", "--transport", "inprocess", "--eval-seed", "0",
              "--run-config", "num-rounds=10", "--metric", "sampled", "--out", str(grid)]
    assert suite.commands(grid) == [
        [*common, "--modes", "alone,alone+2G", "--groups", "vertical", "--variant", "2G:prompts-per-round=64",
         "--seeds", "3"],
        [*common, "--modes", "F-TIS+guard", "--groups", "vertical", "--seeds", "2"],      # built-in: no --variant
        [*common, "--modes", "F-TIS+guard", "--groups", "vertical", "--seeds", "1", "--seed-from", "3"]]
    assert suite.cost(grid) == {"cells": 9, "seconds": 2160.0, "load": 2.0}
    from ftis_fed.grid.plan import Cell

    assert suite.cell_command(grid, Cell("F-TIS", "vertical", 3, "guard"), tmp_path / "o") == [
        *common[:-1], str(tmp_path / "o"), "--modes", "F-TIS+guard", "--groups", "vertical", "--seeds", "1",
        "--seed-from", "3"]


def test_a_built_in_variant_the_grid_redefines_gets_its_own_variant_argument(tmp_path):
    """``shadow`` is built in with ``source-adapt = shadow`` alone; a grid whose shadow cells validated on
    256 prompts must say so, or its command makes other cells (the suite once dropped it)."""
    shadow = {"source-adapt": "shadow", "source-adapt-val-size": 256}
    meta = {"preset": "research-w", "run_config": ["eval-seed=0"], "metric": "sampled",
            "variants": {"shadow": shadow, "guard": {"source-adapt": "guard"}}}
    grid = _grid(tmp_path, {"F-TIS+shadow__vertical__s0": 60.0, "F-TIS+guard__vertical__s0": 60.0}, meta)
    (cmd,) = suite.commands(grid)
    assert cmd[cmd.index("--modes") + 1] == "F-TIS+guard,F-TIS+shadow"
    assert [cmd[i + 1] for i, x in enumerate(cmd) if x == "--variant"] == [
        "shadow:source-adapt=shadow,source-adapt-val-size=256"]


def test_the_committed_suite_has_a_command_for_every_finished_cell(capsys):
    assert suite.main([]) == 0
    out = capsys.readouterr().out
    for name in suite.SUITE:
        grid = suite.RESULTS / name
        planned = 0
        for cmd in suite.commands(grid):
            n = int(cmd[cmd.index("--seeds") + 1])
            planned += n * len(cmd[cmd.index("--modes") + 1].split(","))
        assert planned == suite.cost(grid)["cells"] > 0, name
        assert f"| `{name}` |" in out
    assert "cell-hours: at least" in out and "docs/results/research-w " in out


def test_today_s_presets_resolve_to_every_committed_grid_s_cells(capsys, monkeypatch):
    """Each grid's command names a preset: it makes the committed cells only while the preset (with the
    grid's items and the suite's pins) resolves to what the cells recorded. worked-1 ran research-w as it
    was before the calibration moved it (16 prompts a round on the expertise split, 128 held-out prompts):
    without its pinned items it drifts, by exactly those settings. The refusals run on two of the grids
    (the whole suite's drift is checked once, by the first ``--check``)."""
    assert suite.main(["--check"]) == 0, capsys.readouterr().err
    n = len(suite.SUITE)
    assert f"{n} of {n} grids" in capsys.readouterr().err
    found = suite.drift(suite.RESULTS / "calibration/worked-1")
    assert len(found) == 2 and all("alone+lr" in f for f in found)
    for setting in ("task.prompts_per_round = 16 (here 32)", "task.scheme = 'expertise' (here 'iid')",
                    "eval_size = 128 (here 256)"):
        assert setting in found[0]
    monkeypatch.setattr(suite, "SUITE", ["calibration/worked-1", "calibration/alone-5"])
    monkeypatch.setattr(suite, "PINNED", {})
    assert suite.main(["--check"]) == 1
    assert suite.main(["--run", "--out", "unused"]) == 1                 # refused before any cell runs
    err = capsys.readouterr().err
    assert "calibration/worked-1: alone+lr1__vertical__s0" in err and "1 of 2 grids" in err


def test_the_core_is_the_main_pair_s_alone_and_f_tis_cells_only(tmp_path, capsys):
    """``--core`` keeps each core grid's named methods: their commands, cost and drift check, nothing
    of the grid's other methods (a grid of alone, TIS and F-TIS here: TIS is left out)."""
    meta = {"preset": "research-w", "run_config": ["eval-seed=0"], "metric": "sampled"}
    cells = {f"{m}__vertical__s{s}": 60.0 * (1 + (m == "F-TIS")) for m in ("alone", "TIS", "F-TIS") for s in (0, 1)}
    grid = _grid(tmp_path, cells, meta)
    (cmd,) = suite.commands(grid, labels=("alone", "F-TIS"))
    assert cmd[cmd.index("--modes") + 1] == "alone,F-TIS" and cmd[cmd.index("--seeds") + 1] == "2"
    assert suite.cost(grid, ("alone", "F-TIS"))["seconds"] == 360.0
    assert suite.cost(grid)["seconds"] == 480.0
    assert suite.main(["--core"]) == 0
    out = capsys.readouterr().out
    assert "`research-w`" in out and "`research-w-spec`" not in out and "--modes alone,F-TIS " in out
    assert "20 cells" in out                                           # research-w: alone and F-TIS, 10 seeds
    assert suite.main(["--core", "--check"]) == 0


def test_run_records_its_time_and_compares_each_cell_it_holds_with_the_committed_one(tmp_path, monkeypatch, capsys):
    """``--run`` (its grid commands faked: they put a copy of two committed cells in place, one with a
    figure changed) writes ``suite.json`` with its command, commit, wall and CPU seconds, and per grid the
    cells equal to the committed ones and those that differ, by how many figures."""
    import shutil
    import subprocess

    committed = suite.RESULTS / "research-w" / "cells"
    real_run = subprocess.run

    def raise_last_accuracy(rows):
        next(r for r in reversed(rows) if "eval/id/accuracy" in r)["eval/id/accuracy"] += 0.5
        return rows

    def fake_run(cmd, **kw):
        if cmd[0] == "git":
            return real_run(cmd, **kw)
        cells = Path(cmd[cmd.index("--out") + 1]) / "cells"
        for name in ("alone__vertical__s0", "alone__vertical__s1"):
            shutil.copytree(committed / name, cells / name)
        rewrite_metrics(cells / "alone__vertical__s1", raise_last_accuracy)
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(suite.subprocess, "run", fake_run)
    monkeypatch.setattr(suite, "CORE", {"research-w": ("alone",)})
    assert suite.main(["--core", "--run", "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "suite.json").read_text())
    assert record["command"] == ["python", "-m", "sims.suite", "--core", "--run", "--out", str(tmp_path)]
    assert len(record["commit"]) == 40 and record["wall_seconds"] >= 0 and record["cpu_seconds"] >= 0
    found = record["grids"]["research-w"]
    assert found["done_before"] == 0 and found["cells"] == 2 and found["equal"] == 1 and found["figures"] > 8000
    assert found["cell_seconds"] == {n: json.loads((committed / n / "done.json").read_text())["seconds"]
                                     for n in ("alone__vertical__s0", "alone__vertical__s1")}
    assert list(found["differ"]) == ["alone__vertical__s1"]
    assert found["differ"]["alone__vertical__s1"].startswith("1 of ")
    assert "1 of 2 cells equal the committed ones" in capsys.readouterr().err
