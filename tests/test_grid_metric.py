"""``ftis-fed grid --metric``: a grid summarised on sampled pass@1 (per prompt solved/k of the
``eval-samples`` completions) or, by default, on greedy pass@1 — recorded in grid.json, reproduced by
``--summary-only`` byte for byte, and a clear error for cells measured without samples. The greedy
summaries of the committed grids stay what they were, byte for byte."""

from __future__ import annotations

import csv
import gzip
import io
import json
import math
import shutil
import statistics
from pathlib import Path

import numpy as np
import pytest

from ftis_fed.commands import experiment
from ftis_fed.commands.cli import main
from ftis_fed.grid import metric as gmetric, plan as gplan, report, stats as gs
from ftis_fed.grid.claims import CLAIMS, rule_words, verdicts
from ftis_fed.grid.pack import SUMMARY_BY
from ftis_fed.grid.plan import Cell, plan
from ftis_fed.grid.run import run_grid
from ftis_fed.grid.tables import paired_prompt_table

ROOT = Path(__file__).resolve().parents[1]
K, N = 4, 24
OOD = ("add3", "mul15")                               # two OOD families of 4 prompts each
P_SOLVE = {"alone": 0.3, "noIS": 0.1, "F-TIS": 0.6}   # a sampled completion's chance to be right
OUTPUTS = ("summary.md", "summary.csv", "cells.csv", "final_accuracy.png", "curves.png")


def _sampled_runner(k: int | None = K):
    """What ``ftis-fed sim`` with ``eval-samples = k`` leaves: metrics rows with the greedy and the
    sampled keys (as ``learn.evaluation.sampled_eval`` computes them) and per-prompt records written by
    ``participant.write_eval_prompts``, for evaluations at rounds 0 (``eval-initial``), 1 and 2. The
    greedy replies solve the same prompts (every fifth) for every method; the sampled completions are
    binomial with the method's ``P_SOLVE`` (k = None: no samples, as ``eval-samples = 0``)."""
    from ftis_fed.participant import write_eval_prompts

    def run(cell: Cell, cell_dir, log_path):
        log_path.write_text("fake\n")
        run_dir = cell_dir / "run"
        rows = []
        for p in ("a", "b"):
            for rnd in (0, 1, 2):
                if rnd == 0 and cell.eval_initial is False:
                    continue
                # before training every cell holds the same models: one draw for round 0, whatever the cell
                rng = np.random.default_rng(gs.stable_seed(*(("start", p) if rnd == 0 else (cell.name, p, rnd))))
                q = 0.2 if rnd == 0 else P_SOLVE[cell.mode] * (0.5 + 0.25 * rnd) + (0.05 if p == "b" else 0)
                sets = {"id": [f"{'add30' if i % 2 == 0 else 'sub30'}/eval/0/{i // 2}" for i in range(N)],
                        **{f: [f"{f}/eval/0/{i}" for i in range(4)] for f in OOD}}
                per = {s: [(t, i % 5 == 0) for i, t in enumerate(ids)] for s, ids in sets.items()}
                counts = {s: [int(c) for c in rng.binomial(k, q, len(ids))] for s, ids in sets.items()} if k else None
                write_eval_prompts(run_dir / "participants" / p / "eval_prompts.jsonl.gz", p, rnd, per, None,
                                   counts, k or 0)
                row = {"round": rnd, "participant": p, "phase": "eval", "eval/id/n": float(N)}
                for s, flags in per.items():
                    prefix = "eval/id" if s == "id" else f"eval/ood/{s}"
                    row[f"{prefix}/accuracy"] = float(np.mean([ok for _, ok in flags]))
                    if counts:
                        row[f"{prefix}/sampled_accuracy"] = sum(counts[s]) / (k * len(flags))
                        row[f"{prefix}/pass_at_k"] = sum(c > 0 for c in counts[s]) / len(flags)
                row["eval/ood/accuracy"] = statistics.fmean(row[f"eval/ood/{f}/accuracy"] for f in OOD)
                if counts:
                    row["eval/ood/sampled_accuracy"] = statistics.fmean(row[f"eval/ood/{f}/sampled_accuracy"]
                                                                        for f in OOD)
                rows.append(row)
                if rnd:
                    rows.append({"round": rnd, "participant": p, "phase": "train", "train/samples": 8.0,
                                 "reward/mean": q})
        for rnd in (1, 2):
            rows.append({"round": rnd, "participant": "_federation", "phase": "train", "fed/replies": 2.0,
                         "fed/complete": 1.0})
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (run_dir / "config.json").write_text(json.dumps({"eval_samples": k or 0}))
        return 0

    return run


@pytest.fixture(scope="module")
def sampled_grid(tmp_path_factory) -> Path:
    """A finished 3-method × 3-seed grid with sampled records (k = 4), compacted as a real one."""
    out = tmp_path_factory.mktemp("sampled-grid")
    assert run_grid(plan(["alone", "noIS", "F-TIS"], 3), out, _sampled_runner(), echo=lambda s: None,
                    shared_initial=True) == []
    (out / "grid.json").write_text(json.dumps({"preset": "fixture", "modes": ["alone", "noIS", "F-TIS"]}, indent=1))
    return out


def _records(out: Path, cell: str, rnd: int = 2) -> dict[tuple[str, str], dict]:
    """(participant, set) -> the per-prompt record of round ``rnd``, read straight from the cell's file."""
    text = gzip.decompress((out / "cells" / cell / "run" / "eval_prompts.jsonl.gz").read_bytes()).decode()
    recs = [json.loads(x) for x in text.splitlines() if x.strip()]
    return {(r["participant"], r["set"]): r for r in recs if r["round"] == rnd}


def _solved_over_k(rec: dict, every: int = 1, start: int = 0) -> np.ndarray:
    return np.array(rec["sampled"][start::every], dtype=float) / rec["k"]


def test_the_sampled_summary_is_solved_over_k_of_the_records(sampled_grid, tmp_path):
    work = tmp_path / "g"
    shutil.copytree(sampled_grid, work)
    got = report.write_summary(gplan.discover_cells(work), work, "t", gmetric.SAMPLED)
    assert got["metric"] == "sampled" and got["ks"] == [K]
    summary = {(r["method"], r["participant"]): r for r in got["summary"]}
    for mode in P_SOLVE:
        for p in "ab":
            recs = [_records(work, f"{mode}__vertical__s{s}") for s in range(3)]
            ids = [_solved_over_k(r[(p, "id")]).mean() for r in recs]
            oods = [np.concatenate([_solved_over_k(r[(p, f)]) for f in OOD]).mean() for r in recs]
            row = summary[(mode, p)]
            assert row["eval/id/sampled_accuracy:mean"] == pytest.approx(statistics.fmean(ids), abs=1e-12)
            assert row["eval/id/sampled_accuracy:sd"] == pytest.approx(statistics.stdev(ids), abs=1e-12)
            assert row["eval/ood/sampled_accuracy:mean"] == pytest.approx(statistics.fmean(oods), abs=1e-12)
            assert "eval/id/accuracy:mean" not in row                        # greedy is not shown
    # the paired per-prompt table: d = solved/k of F-TIS − solved/k of alone, aligned by prompt
    paired = {(r["a"], r["b"], r["participant"], r["set"]): r for r in got["prompt_paired"]}
    d = np.stack([_solved_over_k(_records(work, f"F-TIS__vertical__s{s}")[("a", "id")])
                  - _solved_over_k(_records(work, f"alone__vertical__s{s}")[("a", "id")]) for s in range(3)])
    r = paired[("F-TIS", "alone", "a", "id")]
    assert set(np.unique(d * K)) <= set(range(-K, K + 1)) and len(np.unique(d)) > 3      # float-valued d
    assert r["diff"] == pytest.approx(d.mean(), abs=1e-12) and r["lo"] < r["diff"] < r["hi"]
    assert (r["t_lo"], r["t_hi"]) == pytest.approx(gs.t_interval(d.mean(axis=1))[1:])
    assert r["discord"] == pytest.approx((d ** 2).mean()) and r["discord"] < (d != 0).mean()
    assert r["se_prompt"] == pytest.approx(math.sqrt((d ** 2).mean() / d.size))
    fam = paired[("F-TIS", "alone", "a", "id:sub30")]
    assert fam["diff"] == pytest.approx(d[:, 1::2].mean(), abs=1e-12) and fam["prompts"] == N // 2
    families = {(x["method"], x["participant"], x["set"]): x for x in got["families"]}
    assert families[("noIS", "b", "id:add30")]["mean"] == pytest.approx(statistics.fmean(
        _solved_over_k(_records(work, f"noIS__vertical__s{s}")[("b", "id")], 2, 0).mean() for s in range(3)))
    # the verdicts read the sampled intervals: the greedy replies are the same for every method (d = 0)
    v = {x["claim"]: x for x in got["verdicts"]}
    assert v["2a"]["verdict"] == gs.HELD                                 # F-TIS − noIS ≈ +0.5 sampled
    greedy = paired_prompt_table(gplan.discover_cells(work), work)
    alike = {x["claim"]: x for x in verdicts(greedy, ["a", "b"], None, None)}["2a"]     # d = 0 on every prompt
    assert alike["verdict"] == gs.INCONCLUSIVE and "alike on every prompt of every seed (untested)" in alike["interval"]
    # the evaluation before training (one cell's, shared) is the sampled one, and so is the stronger partner
    r0 = next(r for c in sorted(gplan.discover_cells(work), key=lambda c: c.name) if (r := _records(work, c.name, 0)))
    init = {p: _solved_over_k(r0[(p, "id")]).mean() for p in "ab"}
    assert got["initial"]["a"]["eval/id/sampled_accuracy"] == pytest.approx(init["a"], abs=1e-12)
    stronger = max(init, key=init.get) if init["a"] != init["b"] else "none: the participants tie before training"
    assert v["5"]["statement"].startswith(f"the stronger partner ({stronger})")


def test_summary_only_takes_the_metric_from_grid_json_and_reproduces_byte_for_byte(sampled_grid, tmp_path, capsys):
    work = tmp_path / "g"
    shutil.copytree(sampled_grid, work)
    assert main(["grid", "--summary-only", "--metric", "sampled", "--out", str(work)]) == 0
    assert json.loads((work / "grid.json").read_text())["metric"] == "sampled"
    first = {name: (work / name).read_bytes() for name in OUTPUTS}
    md, csv_head = first["summary.md"].decode(), first["summary.csv"].decode().splitlines()[0]
    assert md.splitlines()[2].endswith("final held-out sampled pass@1; *before training*: the shared evaluation "
                                       "before round 1 (the same models in every cell).")
    assert md.splitlines()[4].startswith("Metric (`--metric sampled`, recorded in grid.json): pass@1 at the "
                                         "sampling temperature estimated from k = 4 sampled completions")
    assert "## eval/id/sampled_accuracy (mean ± sd over seeds)" in md and "eval/id/accuracy" not in md
    assert {"eval/id/sampled_accuracy:mean", "metric"} <= set(csv_head.split(","))
    rows = list(csv.DictReader(io.StringIO(first["summary.csv"].decode())))
    assert len(rows) > 20 and {r["metric"] for r in rows} == {"sampled"}
    for name in OUTPUTS:
        (work / name).unlink()
    assert main(["grid", "--summary-only", "--out", str(work)]) == 0             # no --metric: grid.json's
    for name in OUTPUTS:
        assert (work / name).read_bytes() == first[name], name
    # back to greedy: recorded too (a grid.json without the field is greedy: the committed grids' test)
    assert main(["grid", "--summary-only", "--metric", "greedy", "--out", str(work)]) == 0
    assert json.loads((work / "grid.json").read_text())["metric"] == "greedy"
    md, head = (work / "summary.md").read_text(), (work / "summary.csv").read_text().splitlines()[0]
    assert "final held-out greedy pass@1" in md and "Metric (" not in md and "held-out sampled pass@1" not in md
    assert "eval/id/sampled_accuracy" not in md        # the tables read greedy (the start table shows both)
    assert "eval/id/accuracy:mean" in head.split(",") and "metric" not in head.split(",")


def test_a_cell_without_samples_is_a_clear_error_naming_it(tmp_path, capsys):
    out = tmp_path / "g"
    cells = plan(["alone", "F-TIS"], 1)
    run_grid(cells[:1], out, _sampled_runner(), echo=lambda s: None)
    run_grid(cells[1:], out, _sampled_runner(None), echo=lambda s: None)             # eval-samples = 0
    (out / "grid.json").write_text(json.dumps({"preset": "fixture"}, indent=1))
    before = (out / "grid.json").read_bytes()
    assert main(["grid", "--summary-only", "--metric", "sampled", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "F-TIS__vertical__s0 (eval-samples = 0)" in err and "alone__vertical__s0" not in err
    assert "--run-config eval-samples=K" in err
    assert (out / "grid.json").read_bytes() == before and not (out / "summary.md").exists()
    # the committed research fixture (greedy only, no config.json): the same error
    work = tmp_path / "fixture"
    shutil.copytree(ROOT / "tests" / "fixtures" / "research-grid", work)
    assert main(["grid", "--summary-only", "--metric", "sampled", "--out", str(work)]) == 2
    assert "F-TIS__vertical__s0 (eval-samples not recorded)" in capsys.readouterr().err
    # a record whose counts do not fit k: named with its cell
    rec = gzip.decompress((out / "cells" / "alone__vertical__s0" / "run" / "eval_prompts.jsonl.gz").read_bytes())
    bad = [json.loads(x) for x in rec.decode().splitlines()]
    bad[-1]["sampled"][0] = K + 1
    (out / "cells" / "alone__vertical__s0" / "run" / "eval_prompts.jsonl.gz").write_bytes(
        gzip.compress("".join(json.dumps(r) + "\n" for r in bad).encode()))
    with pytest.raises(gmetric.MissingMetric, match=r"cell alone__vertical__s0: participant b, round 2, .*\[0, k=4\]"):
        report.write_summary([c for c in gplan.discover_cells(out) if c.mode == "alone"], out, "t", gmetric.SAMPLED)


def test_a_sampled_grid_records_its_metric_and_checks_eval_samples_before_running(tmp_path, monkeypatch, capsys):
    ran = []

    def runner(app, preset, extra):
        assert "eval-samples=4" in extra
        fake = _sampled_runner()
        return lambda cell, cell_dir, log: ran.append(cell.name) or fake(cell, cell_dir, log)

    monkeypatch.setattr(experiment, "inprocess_runner", runner)
    out = tmp_path / "g"
    args = ["grid", "--preset", "research", "--transport", "inprocess", "--modes", "alone,F-TIS", "--seeds", "1",
            "--out", str(out), "--app", str(ROOT), "--metric", "sampled"]
    assert main(args) == 2                                     # the research preset samples nothing
    err = capsys.readouterr().err
    assert "eval-samples is 0 for cell(s) alone__vertical__s0, F-TIS__vertical__s0" in err and not ran
    assert not out.exists()
    assert main(["grid", "--preset", "research", "--variant", "s:eval-samples=4", "--modes", "alone,F-TIS+s",
                 "--seeds", "1", "--out", str(out), "--app", str(ROOT), "--metric", "sampled"]) == 2
    assert "cell(s) alone__vertical__s0 (" in capsys.readouterr().err      # the variant's cell has samples
    assert main([*args, "--run-config", "eval-samples=4"]) == 0
    assert ran == ["alone__vertical__s0", "F-TIS__vertical__s0"]
    meta = json.loads((out / "grid.json").read_text())
    assert meta["metric"] == "sampled" and "final held-out sampled pass@1" in (out / "summary.md").read_text()
    # resumed without --metric: the recorded metric stays
    assert main([*args[:-2], "--run-config", "eval-samples=4"]) == 0
    assert json.loads((out / "grid.json").read_text())["metric"] == "sampled"


def test_the_rule_column_is_the_rule_the_verdicts_apply():
    words = {c.id: rule_words(c) for c in CLAIMS}
    assert words["1"] == "held: every lower bound ≥ −1; not held: some upper bound < −1"
    assert words["2a"] == words["4"] == "held: some lower bound > 0; not held: every upper bound ≤ 0"
    assert words["5"] == "held: upper bound < 0; not held: lower bound ≥ 0"
    assert words["h"] == "as claim 1"
    assert words["7"] == words["7r"] == \
        "held: some t upper bound of the update ratio ≤ 0.6; not held: every lower bound > 0.6"
    # the boundaries, as the words say (equality sides)
    at_most, at_least = gs.RULES["at_most"], gs.RULES["at_least"]
    assert at_most.decide(0.2, 0.6, 0.6) == gs.HELD and at_most.decide(0.6, 0.9, 0.6) == gs.INCONCLUSIVE
    assert at_most.decide(0.61, 0.9, 0.6) == gs.NOT_HELD and at_most.decide(math.nan, 0.9, 0.6) == gs.MISSING
    assert at_least.decide(-0.01, 0.2, -0.01) == gs.HELD and at_least.decide(-0.3, -0.01, -0.01) == gs.INCONCLUSIVE
    assert gs.RULES["less"].decide(-0.2, 0.0, 0.0) == gs.INCONCLUSIVE
    assert gs.RULES["greater"].decide(-0.2, 0.0, 0.0) == gs.NOT_HELD


def _committed_grids() -> list[Path]:
    """The ``ftis-fed grid`` folders under docs/results: a grid.json that names no other summary writer
    (``summary_by``: ``sims.poisoning``'s folders) and a summary.md."""
    return sorted(p.parent for p in (ROOT / "docs" / "results").rglob("grid.json")
                  if SUMMARY_BY not in json.loads(p.read_text()) and (p.parent / "summary.md").exists())


def test_the_committed_grids_are_found():
    names = {p.relative_to(ROOT / "docs" / "results").as_posix() for p in _committed_grids()}
    assert {"research", "research-ood", "smollm2-check", "calibration/worked-1"} <= names


def _small(grid: Path) -> bool:
    return len(list((grid / "cells").glob("*/done.json"))) <= 4


@pytest.mark.parametrize("grid", [pytest.param(g, marks=() if _small(g) else pytest.mark.slow)
                                  for g in _committed_grids()],
                         ids=lambda p: p.relative_to(ROOT / "docs" / "results").as_posix())
def test_the_greedy_summary_of_a_committed_grid_is_unchanged(grid, tmp_path):
    """Default behaviour unchanged: the grid's cells and grid.json (no ``metric``: greedy) copied to tmp,
    ``--summary-only`` writes its committed summary and figures byte for byte (grids of more than 4
    cells: the slow tier, ~5-10 CPU-s each)."""
    work = tmp_path / "g"
    shutil.copytree(grid / "cells", work / "cells")
    shutil.copy(grid / "grid.json", work / "grid.json")
    assert main(["grid", "--summary-only", "--out", str(work)]) == 0
    for name in OUTPUTS:
        if (grid / name).exists():
            assert (work / name).read_bytes() == (grid / name).read_bytes(), name


def test_a_committed_sampled_grid_summarised_on_its_samples(tmp_path):
    """calibration/worked-1 (real cells run with eval-samples = 8): its sampled summary's means, read
    from the metrics rows that ``sampled_eval`` wrote, are the records' solved/k averaged over prompts."""
    grid = ROOT / "docs" / "results" / "calibration" / "worked-1"
    if not grid.exists():
        pytest.skip("docs/results/calibration/worked-1 is not in this tree")
    work = tmp_path / "g"
    shutil.copytree(grid / "cells", work / "cells")
    shutil.copy(grid / "grid.json", work / "grid.json")
    assert main(["grid", "--summary-only", "--metric", "sampled", "--out", str(work)]) == 0
    rows = list(csv.DictReader(io.StringIO((work / "cells.csv").read_text())))
    assert rows and {r["metric"] for r in rows} == {"sampled"}
    for r in rows:
        final = _records(work, r["cell"], int(r["round"]))
        assert final[(r["participant"], "id")]["k"] == 8
        ids = _solved_over_k(final[(r["participant"], "id")])
        oods = [_solved_over_k(rec).mean() for (p, s), rec in sorted(final.items())
                if p == r["participant"] and s != "id"]
        assert float(r["eval/id/sampled_accuracy"]) == pytest.approx(ids.mean(), abs=1e-12)
        assert float(r["eval/ood/sampled_accuracy"]) == pytest.approx(statistics.fmean(oods), abs=1e-12)


@pytest.mark.parametrize("how", ["summary-only", "run", "pack into", "pack from"])
def test_a_folder_whose_summary_another_tool_writes_is_left_to_it(tmp_path, capsys, how):
    """A folder whose grid.json names the command that writes its summary (``summary_by``: the
    poisoning experiment's attack tables, as its committed folders and ``sims.poisoning`` write it):
    ``ftis-fed grid`` neither rewrites its summary, runs cells into it, packs into it nor packs from it;
    it says which command writes it, and the folder is as it was."""
    from sims.poisoning import SUMMARY_COMMAND

    folder = tmp_path / "poisoning"
    (folder / "cells" / "alone+control__vertical__s0").mkdir(parents=True)
    (folder / "cells" / "alone+control__vertical__s0" / "done.json").write_text('{"status": 0}')
    meta = json.dumps({"preset": "poisoning", "attacks": ["control"], SUMMARY_BY: SUMMARY_COMMAND})
    (folder / "grid.json").write_text(meta)
    other = tmp_path / "other"                     # a grid folder of ftis-fed grid's, or none ("pack from")
    if how == "pack into":
        (other / "cells" / "alone__vertical__s1").mkdir(parents=True)
        (other / "cells" / "alone__vertical__s1" / "done.json").write_text('{"status": 0}')
        (other / "grid.json").write_text(json.dumps({"preset": "poisoning"}))
    args = {"summary-only": ["--summary-only", "--out", str(folder)],
            "run": ["--preset", "poisoning", "--modes", "alone", "--seeds", "1", "--out", str(folder)],
            "pack into": ["--pack", str(other), "--out", str(folder)],
            "pack from": ["--pack", str(folder), "--out", str(other)]}[how]
    assert main(["grid", *args]) == 2
    assert f"summary is written by `{SUMMARY_COMMAND} --out {folder}`" in capsys.readouterr().err
    assert sorted(p.name for p in folder.iterdir()) == ["cells", "grid.json"]
    assert (folder / "grid.json").read_text() == meta
    assert other.exists() == (how == "pack into")


def test_the_committed_poisoning_folders_name_their_summary_writer():
    """The committed folders of the poisoning experiment say in grid.json what writes their summary, so
    that ``ftis-fed grid`` leaves them alone (the test above)."""
    from sims.poisoning import SUMMARY_COMMAND

    results = ROOT / "docs" / "results"
    metas = {p.parent.relative_to(results).as_posix(): json.loads(p.read_text()) for p in results.rglob("grid.json")}
    theirs = sorted(name for name, meta in metas.items() if "attacks" in meta)
    assert {"poisoning", "poisoning-plausible", "poisoning/calibration/1-end-HAIL"} <= set(theirs)
    assert all(metas[name].get(SUMMARY_BY) == SUMMARY_COMMAND for name in theirs)
    assert all(SUMMARY_BY not in meta for name, meta in metas.items() if name not in theirs)
