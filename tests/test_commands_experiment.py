"""The experiment grid: cells planned, run, resumed and summarised from their own metrics files."""

from __future__ import annotations

import gzip
import json
import math
import statistics
from pathlib import Path

import pytest

from ftis_fed.commands import cells
from ftis_fed.grid import plan as gplan, records, report, run as grun
from ftis_fed.grid.plan import Cell, plan
from ftis_fed.grid.report import write_summary
from ftis_fed.grid.run import run_grid


def _accuracy(cell: Cell, participant: str) -> tuple[float, float]:
    """A distinct, non-trivial accuracy per cell and participant (what a run would have measured)."""
    base = {"alone": 0.30, "noIS": 0.20, "F-TIS": 0.40}[cell.mode] + 0.01 * cell.seed
    off = 0.05 if participant == "b" else 0.0
    return round(base + off, 4), round(base / 2 + off, 4)


def fake_runner(calls: list, fail: set = frozenset()):
    """Writes what a finished ``ftis-fed sim`` writes: metrics.jsonl with train and eval rows."""

    def run(cell: Cell, cell_dir, log_path):
        calls.append(cell.name)
        log_path.write_text("fake run\n")
        if cell.name in fail:
            return 1
        run_dir = cell_dir / "run"
        run_dir.mkdir(parents=True)
        rows = []
        for p in ("a", "b"):
            if cell.eval_initial is not False:                  # what eval-initial=false makes the engine skip
                rows.append({"round": 0, "participant": p, "phase": "eval", "eval/id/accuracy": 0.1,
                             "eval/ood/accuracy": 0.1, "eval/id/n": 24.0})
            for rnd in (1, 2):
                rows.append({"round": rnd, "participant": p, "phase": "train", "reward/mean": 0.1 * rnd,
                             "train/samples": 36.0})
            idacc, oodacc = _accuracy(cell, p)
            rows.append({"round": 2, "participant": p, "phase": "eval", "eval/id/accuracy": idacc,
                         "eval/ood/accuracy": oodacc, "eval/id/n": 24.0})
        for rnd in (1, 2):
            rows.append({"round": rnd, "participant": "_federation", "phase": "train", "fed/replies": 2.0,
                         "fed/generate_failures": 0.0, "fed/train_failures": 0.0, "fed/rejected": 0.0,
                         "fed/complete": 1.0})
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return 0

    return run


def test_plan_is_seed_major_and_checks_names():
    cells = plan(["alone", "F-TIS"], 2, ["vertical", "horizontal"], horizontal_modes=["F-TIS"])
    assert [c.name for c in cells] == ["alone__vertical__s0", "F-TIS__vertical__s0", "F-TIS__horizontal__s0",
                                       "alone__vertical__s1", "F-TIS__vertical__s1", "F-TIS__horizontal__s1"]
    assert cells[2].method == "F-TIS/h"
    with pytest.raises(ValueError, match="--modes: 'FTIS'"):
        plan(["FTIS"], 1)
    with pytest.raises(ValueError, match="--seeds=0"):
        plan(["alone"], 0)


def test_horizontal_cells_of_a_preset_with_another_partition_are_valid_runs(tmp_path):
    """The paper preset partitions prompts by expertise; its horizontal cells take the shared prompts
    (what the horizontal mode needs), and the whole run config passes the check done before a run."""
    import tomllib
    from pathlib import Path

    from ftis_fed.config.validation import validate_run_config

    root = Path(__file__).resolve().parents[1]
    defaults = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    preset = tomllib.loads((root / "sims" / "presets" / "paper.toml").read_text())
    assert preset["task-scheme"] == "expertise"
    v, h = plan(["F-TIS"], 1, ["vertical", "horizontal"])
    assert "task-scheme" not in v.run_config(tmp_path) and h.run_config(tmp_path)["task-scheme"] == "shared"
    with pytest.raises(ValueError, match="task-scheme"):
        validate_run_config({**defaults, **preset, **h.run_config(tmp_path), "task-scheme": "expertise"},
                            check_models=False)
    fed = validate_run_config({**defaults, **preset, **h.run_config(tmp_path)}, check_models=False)
    assert fed.objective.advantage_groups == "horizontal" and fed.task.scheme == "shared"


def test_grid_resumes_and_reruns_only_unfinished_cells(tmp_path):
    cells = plan(["alone", "noIS", "F-TIS"], 2)
    calls: list = []
    failed = run_grid(cells, tmp_path, fake_runner(calls, fail={"noIS__vertical__s1"}), echo=lambda s: None)
    assert [c.name for c in failed] == ["noIS__vertical__s1"]
    assert len(calls) == 6
    # an interrupted cell: folder there, no done.json
    (tmp_path / "cells" / "F-TIS__vertical__s1" / "done.json").unlink()
    calls.clear()
    msgs: list = []
    failed = run_grid(cells, tmp_path, fake_runner(calls), echo=msgs.append)
    assert failed == []
    assert calls == ["noIS__vertical__s1", "F-TIS__vertical__s1"]          # the finished ones skipped
    assert any("4 of 6 cells already done" in m for m in msgs)
    assert list(tmp_path.glob("cells/F-TIS__vertical__s1.interrupted-*"))  # old attempt kept aside
    calls.clear()
    run_grid(cells, tmp_path, fake_runner(calls), echo=lambda s: None)
    assert calls == []


def test_summary_is_computed_from_the_metrics_files(tmp_path):
    cells = plan(["alone", "noIS", "F-TIS"], 3)
    run_grid(cells, tmp_path, fake_runner([]), echo=lambda s: None)
    out = write_summary(cells, tmp_path, "test grid")
    summary = {(r["method"], r["participant"]): r for r in out["summary"]}
    for mode in ("alone", "noIS", "F-TIS"):
        for p in ("a", "b"):
            ids = [_accuracy(Cell(mode, "vertical", s), p)[0] for s in range(3)]
            row = summary[(mode, p)]
            assert row["seeds"] == 3
            assert row["eval/id/accuracy:mean"] == pytest.approx(statistics.fmean(ids))
            assert row["eval/id/accuracy:sd"] == pytest.approx(statistics.stdev(ids))
    paired = {(r["method"], r["participant"]): r for r in out["paired"]}
    assert set(paired) == {("alone", "a"), ("alone", "b"), ("noIS", "a"), ("noIS", "b")}
    assert paired[("noIS", "a")]["eval/id/accuracy:diff_mean"] == pytest.approx(0.20)
    assert paired[("noIS", "a")]["eval/id/accuracy:ref_wins"] == 3
    # changing one cell's file changes the summary: nothing is typed in
    f = tmp_path / "cells" / "alone__vertical__s0" / "run" / "metrics.jsonl.gz"      # compacted cell
    rows = [json.loads(x) for x in gzip.decompress(f.read_bytes()).decode().splitlines()]
    for r in rows:
        if r["phase"] == "eval" and r["round"] == 2 and r["participant"] == "a":
            r["eval/id/accuracy"] = 0.9
    f.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in rows).encode()))
    out2 = write_summary(cells, tmp_path, "test grid")
    row = {(r["method"], r["participant"]): r for r in out2["summary"]}[("alone", "a")]
    assert row["eval/id/accuracy:mean"] == pytest.approx(statistics.fmean([0.9, 0.31, 0.32]))
    # training diagnostics: reward/mean is 0.1 * round in every fake cell -> mean over rounds 1, 2 = 0.15
    diag = {(r["method"], r["participant"]): r for r in out2["diagnostics"]}
    assert diag[("noIS", "b")]["reward/mean:mean"] == pytest.approx(0.15)
    assert math.isnan(diag[("noIS", "b")]["offpolicy/kl_mean:mean"])          # not in the files: not invented
    md = (tmp_path / "summary.md").read_text()
    assert "Training diagnostics" in md
    assert "| F-TIS |" in md
    assert (tmp_path / "summary.csv").exists() and (tmp_path / "cells.csv").exists()
    assert (tmp_path / "final_accuracy.png").stat().st_size > 1000
    assert (tmp_path / "curves.png").stat().st_size > 1000


def test_min_eval_size():
    n = gplan.min_eval_size(0.05)
    assert n == 800
    se = math.sqrt(2 * 0.25 / n)
    assert 0.05 / se == pytest.approx(2.0, rel=0.01)


def test_a_variant_cell_carries_its_extra_run_config_and_is_compared_with_its_reference(tmp_path):
    cells = plan(["F-TIS", "F-TIS+adapt"], 2)
    assert [c.name for c in cells] == ["F-TIS__vertical__s0", "F-TIS+adapt__vertical__s0",
                                       "F-TIS__vertical__s1", "F-TIS+adapt__vertical__s1"]
    rc = cells[1].run_config(tmp_path / "run")
    assert rc["source-adapt"] == "kl" and rc["loss-mode"] == "F-TIS" and rc["seed"] == 0
    assert "source-adapt" not in cells[0].run_config(tmp_path / "run")
    with pytest.raises(ValueError, match="no variant 'nope'"):
        plan(["F-TIS+nope"], 1)
    name, items = gplan.parse_variant("soft:source-adapt=kl,source-adapt-tau=2.5")
    assert name == "soft" and items == {"source-adapt": "kl", "source-adapt-tau": 2.5}
    with pytest.raises(ValueError, match="NAME:key=value"):
        gplan.parse_variant("soft")
    custom = plan(["TIS+soft"], 1, variants={"soft": items})
    assert custom[0].run_config(tmp_path)["source-adapt-tau"] == 2.5 and custom[0].method == "TIS+soft"
    # the variant's rows land under their own method, paired against F-TIS on the same seeds
    runs: list = []

    def runner(cell, cell_dir, log_path):
        runs.append(cell.run_config(cell_dir / "run"))
        base = fake_runner([])
        plain = Cell("F-TIS", cell.groups, cell.seed)
        status = base(plain, cell_dir, log_path)
        if cell.variant:                                        # the variant measured 0.05 higher OOD
            p = cell_dir / "run" / "metrics.jsonl"
            rows = [json.loads(x) for x in p.read_text().splitlines()]
            for r in rows:
                if r.get("phase") == "eval" and r["round"] == 2:
                    r["eval/ood/accuracy"] += 0.05
            p.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return status

    assert run_grid(cells, tmp_path, runner, echo=lambda s: None) == []
    assert [r.get("source-adapt") for r in runs] == [None, "kl", None, "kl"]
    out = write_summary(cells, tmp_path, "t")
    pair = [r for r in out["paired"] if r["method"] == "F-TIS+adapt" and r["participant"] == "a"][0]
    assert pair["reference"] == "F-TIS" and pair["seeds"] == 2
    assert pair["eval/ood/accuracy:diff_mean"] == pytest.approx(-0.05)
    assert pair["eval/id/accuracy:diff_mean"] == pytest.approx(0.0)
    assert "F-TIS+adapt" in (tmp_path / "summary.md").read_text()


def test_the_initial_evaluation_runs_in_one_cell_and_serves_the_whole_grid(tmp_path):
    cells = plan(["alone", "F-TIS"], 2)
    seen: list = []
    fail = {"alone__vertical__s0"}

    def runner(cell, cell_dir, log_path):
        seen.append((cell.name, cell.run_config(cell_dir / "run").get("eval-initial")))
        return fake_runner([], fail=fail)(cell, cell_dir, log_path)

    # the first cell fails: the next one run carries the initial evaluation instead
    assert [c.name for c in run_grid(cells, tmp_path, runner, echo=lambda s: None, shared_initial=True)] == \
        ["alone__vertical__s0"]
    assert seen == [("alone__vertical__s0", True), ("F-TIS__vertical__s0", True),
                    ("alone__vertical__s1", False), ("F-TIS__vertical__s1", False)]
    seen.clear()
    fail.clear()
    assert run_grid(cells, tmp_path, runner, echo=lambda s: None, shared_initial=True) == []
    assert seen == [("alone__vertical__s0", False)]          # resumed: the finished carrier still serves
    init = records.initial_eval(tmp_path)
    assert set(init) == {"a", "b"} and init["a"]["eval/id/accuracy"] == 0.1
    out = write_summary(cells, tmp_path, "t")
    # round 0 is never a cell's result; every method's curve starts from the shared evaluation
    assert all(r["round"] == 2 for r in out["results"])
    curves = report._curves(cells, tmp_path)
    for meth in ("alone", "F-TIS"):
        assert curves[(meth, "a", "eval/id/accuracy")][0][:2] == (0, pytest.approx(0.1))
    md = (tmp_path / "summary.md").read_text()
    assert "| *before training* | 0.100 | 0.100 |" in md
    assert json.loads((tmp_path / "cells" / "F-TIS__vertical__s0" / "done.json").read_text())["eval_initial"] is True


def test_a_cell_whose_only_evaluation_is_the_initial_one_has_no_result(tmp_path):
    rows = [{"round": 0, "participant": "a", "phase": "eval", "eval/id/accuracy": 0.5},
            {"round": 1, "participant": "a", "phase": "train", "reward/mean": 0.2}]
    assert records.final_eval(rows) == {}
    cells = plan(["alone"], 1)

    def crashed_after_round_0(cell, cell_dir, log_path):
        (cell_dir / "run").mkdir(parents=True)
        (cell_dir / "run" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return 0

    assert run_grid(cells, tmp_path, crashed_after_round_0, echo=lambda s: None) == cells
    assert not (tmp_path / "cells" / "alone__vertical__s0" / "done.json").exists()


def test_sim_runner_passes_the_cell_and_runs_this_tree(tmp_path, monkeypatch):
    calls = []

    def fake_run(cmd, **kw):
        calls.append((cmd, kw))

        class R:
            returncode = 0
        return R()

    monkeypatch.setattr(cells.subprocess, "run", fake_run)
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    run = cells.sim_runner(tmp_path, "grid-small", ["eval-size=8"], ["--keep-superlink", "--address", "h:1"])
    cell = Cell("F-TIS", "vertical", 2, eval_initial=False)
    (tmp_path / "c").mkdir()
    assert run(cell, tmp_path / "c", tmp_path / "c" / "run.log") == 0
    cmd, kw = calls[0]
    assert cmd[cmd.index("--preset") + 1] == "grid-small" and cmd[cmd.index("--address") + 1] == "h:1"
    items = [cmd[i + 1] for i, x in enumerate(cmd) if x == "--run-config"]
    assert items[0] == "eval-size=8" and 'loss-mode="F-TIS"' in items and "seed=2" in items
    assert "eval-initial=false" in items
    assert kw["cwd"] == tmp_path and kw["env"]["PYTHONPATH"].split(":") == [str(tmp_path), "/elsewhere"]


def test_a_run_whose_participants_were_dropped_is_not_a_finished_cell(tmp_path):
    cells = plan(["F-TIS"], 1)

    def dropped(cell, cell_dir, log_path):
        fake_runner([])(cell, cell_dir, log_path)
        f = cell_dir / "run" / "metrics.jsonl"
        rows = [json.loads(x) for x in f.read_text().splitlines()]
        rows = [r for r in rows if not (r["phase"] == "train" and r["participant"] == "b")]   # b never trained
        for r in rows:
            if r["participant"] == "_federation":
                r["fed/dropped/no_reply"] = 1.0
        f.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return 0                                                   # the run itself "completed"

    msgs: list = []
    assert run_grid(cells, tmp_path, dropped, echo=msgs.append) == cells
    assert not (tmp_path / "cells" / "F-TIS__vertical__s0" / "done.json").exists()
    assert any("fed/dropped/no_reply=1.0" in m and "b did not train in round(s) [1, 2]" in m for m in msgs)
    rows = records.read_rows(tmp_path / "cells" / "F-TIS__vertical__s0" / "run" / "metrics.jsonl")
    assert records.cell_defects(rows)
    # a clean run has none
    assert run_grid(cells, tmp_path, fake_runner([]), echo=lambda s: None) == []


def test_compact_cell_keeps_the_training_prompts_of_every_participant(tmp_path):
    """Each round's training prompts (participant.TRAIN_PROMPTS) survive compacting, participants in
    name order, one line per participant and round."""
    import gzip

    from ftis_fed.participant import TRAIN_PROMPTS, write_train_prompts

    run = tmp_path / "cell" / "run"
    for p in ("spec", "base"):
        for rnd in (1, 2):
            write_train_prompts(run / "participants" / p / TRAIN_PROMPTS, p, rnd, [f"add30/train/{rnd}/{p}"])
    (run / "metrics.jsonl").write_text("{}\n")
    grun.compact_cell(tmp_path / "cell")
    lines = [json.loads(x) for x in gzip.decompress((run / TRAIN_PROMPTS).read_bytes()).decode().splitlines()]
    assert [(r["participant"], r["round"], r["ids"]) for r in lines] == [
        ("base", 1, ["add30/train/1/base"]), ("base", 2, ["add30/train/2/base"]),
        ("spec", 1, ["add30/train/1/spec"]), ("spec", 2, ["add30/train/2/spec"])]
    assert not (run / "participants").exists()


def test_an_in_process_grid_runs_the_app_folders_own_code(tmp_path):
    """``--transport inprocess`` runs a cell in the grid's own process only where that is the code of
    ``--app``: an app folder with another ``ftis_fed`` (a worktree of another commit) gets a process
    per cell with that folder first on its path."""
    from ftis_fed.commands.experiment import runs_this_code

    root = Path(__file__).resolve().parents[1]
    assert runs_this_code(root) and runs_this_code(tmp_path)            # this tree; a folder without the package
    (tmp_path / "ftis_fed").mkdir()
    (tmp_path / "ftis_fed" / "__init__.py").write_text("")
    assert not runs_this_code(tmp_path)
