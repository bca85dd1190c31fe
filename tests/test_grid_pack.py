"""``ftis-fed grid --seed-from`` and ``--pack``: seeds run in a folder of their own join a grid as if
one run had made them all (the summary byte for byte that of the whole grid), and cells of another
experiment — other run-config items, another configuration, other weights, another evaluation before
training — are refused with nothing copied. A grid run again into its folder with more methods
describes every cell it holds."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from ftis_fed.commands.cli import main
from ftis_fed.commands.experiment import grid_meta
from ftis_fed.grid.pack import PackError, pack
from ftis_fed.grid import plan as gplan
from ftis_fed.grid.plan import plan
from ftis_fed.grid.records import MixedWeights
from ftis_fed.grid.run import run_grid
from tests.grid_cells import rewrite_metrics
from tests.test_grid_metric import OUTPUTS, _sampled_runner

MODES = ["alone", "noIS", "F-TIS"]
META = {"preset": "fixture", "modes": MODES, "run_config": ["eval-seed=0"], "metric": "sampled"}


def _grid(out: Path, seeds: int, seed_from: int = 0) -> Path:
    """The fixture's cells, each recorded as taking 0.0 s: ``done.json``'s wall time (0.1 s resolution)
    reaches cells.csv and the summary, and under load a fake cell took 0.1 s in one grid and 0.0 s in
    another, which is the machine, not the pack."""
    assert run_grid(plan(MODES, seeds, seed_from=seed_from), out, _sampled_runner(), echo=lambda s: None,
                    shared_initial=True) == []
    for done in out.glob("cells/*/done.json"):
        done.write_text(json.dumps({**json.loads(done.read_text()), "seconds": 0.0}))
    (out / "grid.json").write_text(json.dumps(META, indent=1))
    return out


@pytest.fixture(scope="module")
def grids(tmp_path_factory) -> dict[str, Path]:
    """The whole grid (seeds 0-2, one run) and its two parts: seeds 0-1, and seed 2 run alone with
    ``seed_from = 2`` (its first cell evaluates before training again)."""
    root = tmp_path_factory.mktemp("pack")
    whole = _grid(root / "whole", 3)
    assert main(["grid", "--summary-only", "--out", str(whole)]) == 0
    return {"whole": whole, "first": _grid(root / "first", 2), "rest": _grid(root / "rest", 1, seed_from=2)}


def _files(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def _copies(grids, tmp_path) -> tuple[Path, Path]:
    a, b = tmp_path / "a", tmp_path / "b"
    shutil.copytree(grids["first"], a)
    shutil.copytree(grids["rest"], b)
    return a, b


def test_seed_from_plans_the_later_seeds_only():
    assert [c.name for c in plan(["alone", "F-TIS"], 2, seed_from=5)] == [
        "alone__vertical__s5", "F-TIS__vertical__s5", "alone__vertical__s6", "F-TIS__vertical__s6"]
    with pytest.raises(ValueError, match="--seed-from=-1"):
        plan(["alone"], 1, seed_from=-1)


def test_packed_seeds_summarise_byte_for_byte_as_the_whole_grid(grids, tmp_path, capsys):
    a, b = _copies(grids, tmp_path)
    assert main(["grid", "--pack", str(b), "--out", str(a)]) == 0
    assert "[pack] F-TIS__vertical__s2: packed into" in capsys.readouterr().out
    for name in OUTPUTS:
        assert (a / name).read_bytes() == (grids["whole"] / name).read_bytes(), name
    meta = json.loads((a / "grid.json").read_text())
    assert meta["seeds"] == 3 and meta["cells"] == [c.name for c in plan(MODES, 3)] and meta["modes"] == MODES
    cfg = json.loads((a / "cells" / "noIS__vertical__s2" / "run" / "config.json").read_text())
    assert Path(cfg["output_dir"]) == (a / "cells" / "noIS__vertical__s2" / "run").resolve()   # its new home
    assert not list(a.glob("cells/*.packing"))
    # packing again adds nothing and keeps every file as it is
    before = _files(a)
    assert pack(b, a, echo=lambda s: None) == []
    assert _files(a) == before


def test_a_new_folder_becomes_a_copy_of_the_grid_checked_cell_by_cell(grids, tmp_path):
    new = tmp_path / "docs" / "results" / "g"
    assert pack(grids["whole"], new, echo=lambda s: None, cwd=tmp_path) == [c.name for c in plan(MODES, 3)]
    assert main(["grid", "--summary-only", "--out", str(new)]) == 0
    for name in OUTPUTS:
        assert (new / name).read_bytes() == (grids["whole"] / name).read_bytes(), name
    cfg = json.loads((new / "cells" / "F-TIS__vertical__s1" / "run" / "config.json").read_text())
    assert cfg["output_dir"] == "docs/results/g/cells/F-TIS__vertical__s1/run"       # relative to the repository
    assert json.loads((new / "grid.json").read_text())["preset"] == "fixture"
    # a source whose cells disagree among themselves is refused there too
    b = tmp_path / "b"
    shutil.copytree(grids["whole"], b)
    (b / "cells" / "alone__vertical__s2" / "run" / "config.json").write_text(json.dumps({"eval_samples": 8}))
    with pytest.raises(PackError, match="alone__vertical__s2: its run configuration differs from alone__vertical__s0's "
                                        r"in the source \(the destination is new\): eval_samples = 8"):
        pack(b, tmp_path / "other", echo=lambda s: None)
    assert not (tmp_path / "other").exists()


def test_a_cell_the_destination_has_is_kept_as_it_is(grids, tmp_path):
    a, b = _copies(grids, tmp_path)
    shutil.copytree(b / "cells" / "alone__vertical__s2", a / "cells" / "alone__vertical__s2")
    (a / "cells" / "alone__vertical__s2" / "done.json").write_text('{"mine": 1}')
    got = []
    assert pack(b, a, echo=got.append) == ["noIS__vertical__s2", "F-TIS__vertical__s2"]
    assert (a / "cells" / "alone__vertical__s2" / "done.json").read_text() == '{"mine": 1}'
    assert any("alone__vertical__s2: already in a, kept as it is" in s for s in got)


def test_the_destination_s_variant_definitions_stay_when_cells_of_other_methods_are_packed(grids, tmp_path):
    """A grid's ``grid.json`` lists the built-in variants with their defaults; packing cells that run none
    of them keeps the destination's own definitions (a committed grid's ``shadow`` with its validation
    items was once replaced by the built-in default that way) and adds none it does not use."""
    a, b = _copies(grids, tmp_path)
    mine = {"shadow": {"source-adapt": "shadow", "source-adapt-val-size": 256}}
    built_in = {"shadow": {"source-adapt": "shadow"}, "guard": {"source-adapt": "guard"}}
    for folder, variants in ((a, mine), (b, built_in)):
        meta = json.loads((folder / "grid.json").read_text())
        (folder / "grid.json").write_text(json.dumps({**meta, "variants": variants}))
    assert pack(b, a, echo=lambda s: None)
    assert json.loads((a / "grid.json").read_text())["variants"] == mine
    # a variant the packed cells ran and the destination lacks comes after the destination's, which keep
    # their order (packing `research-w`'s guard seed 6 had moved its `guard` definition to the top)
    from ftis_fed.grid.pack import merged_meta
    merged = merged_meta({"variants": {"2G": {"x": 1}, "guard": {"y": 2}}}, [], {"guard": {"y": 3}, "new": {"z": 4}})
    assert list(merged["variants"].items()) == [("2G", {"x": 1}), ("guard", {"y": 2}), ("new", {"z": 4})]


def test_cells_of_another_code_version_compare_on_what_both_record(grids, tmp_path):
    """A setting only one side records (the older code did not have it) must hold today's default;
    one today's code no longer has is named, not compared."""
    from ftis_fed.config.federation import FederationConfig

    a, b = _copies(grids, tmp_path)
    default_share = FederationConfig().attack_payload_share
    for value, packs in ((default_share, True), (default_share / 2, False)):
        for cell in (b / "cells").iterdir():
            cfg = json.loads((cell / "run" / "config.json").read_text())
            (cell / "run" / "config.json").write_text(json.dumps({**cfg, "attack_payload_share": value,
                                                                   "retired_setting": 1}))
        got = []
        if packs:
            assert pack(b, a, echo=got.append) == [f"{m}__vertical__s2" for m in MODES]
            assert any("recorded by one code version only, not compared: retired_setting" in s for s in got)
        else:
            a2 = tmp_path / "a2"
            shutil.copytree(grids["first"], a2)
            with pytest.raises(PackError, match=rf"attack_payload_share = {value} \(here absent\)"):
                pack(b, a2, echo=got.append)


def test_a_setting_whose_knob_names_what_the_older_code_did_compares_with_that():
    """``source-adapt-shadow-loss`` came with the default ``alone``, but the shadow cells recorded before it
    ran ``run`` (its knob's ``before``): a cell that does not record it may have run either (the cells that
    ran no shadow record neither), and a setting whose knob names nothing compares with today's default.
    A shadow variant that names ``run`` (the committed grids' ``grid.json``) is what keeps a cell of
    ``alone`` out of those cells' method: ``--pack`` compares the variant's items."""
    from ftis_fed.grid.pack import _differences

    old = {"checks": {"source-adapt": {"mode": "shadow", "z": 2.0}}}
    def new(loss):
        return {"checks": {"source-adapt": {"mode": "shadow", "z": 2.0, "shadow_loss": loss}}}

    assert _differences(old, new("run")) == ([], []) == _differences(new("alone"), old)
    assert _differences(new("twin"), old) == (["checks.source-adapt.shadow_loss = 'twin' (here absent)"], [])
    assert _differences({"eval_samples": 0}, {}) == ([], [])                 # today's default: no knob's `before`
    assert _differences({"eval_samples": 8}, {})[0] == ["eval_samples = 8 (here absent)"]


def test_a_grid_from_before_metric_existed_reads_as_greedy(grids, tmp_path):
    """A grid.json written before ``--metric`` records none: its cells were summarised on greedy
    pass@1 (``recorded_metric``), so greedy cells join it and sampled ones do not."""
    a, b = _copies(grids, tmp_path)
    (a / "grid.json").write_text(json.dumps({k: v for k, v in META.items() if k != "metric"}))
    with pytest.raises(PackError, match="metric: 'sampled' in .* but 'greedy' in"):
        pack(b, a, echo=lambda s: None)
    (b / "grid.json").write_text(json.dumps({**META, "metric": "greedy"}))
    assert pack(b, a, echo=lambda s: None) == [f"{m}__vertical__s2" for m in MODES]


def test_an_interrupted_pack_leaves_no_finished_half_cell_and_a_second_one_completes(grids, tmp_path, monkeypatch):
    a, b = _copies(grids, tmp_path)
    real_copy = shutil.copy

    def copy(src, dst):                       # the machine stops as the second cell gets its done.json
        if Path(src).name == "done.json" and "noIS__vertical__s2" in str(dst):
            raise KeyboardInterrupt
        return real_copy(src, dst)

    monkeypatch.setattr(shutil, "copy", copy)
    with pytest.raises(KeyboardInterrupt):
        pack(b, a, echo=lambda s: None)
    monkeypatch.setattr(shutil, "copy", real_copy)
    assert (a / "cells" / "alone__vertical__s2" / "done.json").exists()
    half = a / "cells" / "noIS__vertical__s2"
    assert half.is_dir() and not (half / "done.json").exists()
    assert "noIS__vertical__s2" not in [c.name for c in gplan.discover_cells(a)]        # not counted as finished
    got = []
    assert pack(b, a, echo=got.append) == ["noIS__vertical__s2", "F-TIS__vertical__s2"]
    assert any("noIS__vertical__s2: an unfinished folder there moved to noIS__vertical__s2.interrupted-" in s
               for s in got)
    assert main(["grid", "--summary-only", "--out", str(a)]) == 0
    for name in OUTPUTS:
        assert (a / name).read_bytes() == (grids["whole"] / name).read_bytes(), name


def _rewrite_metrics(cell: Path, change) -> None:
    rewrite_metrics(cell, lambda rows: [change(r) for r in rows])


def _other_start(r: dict) -> dict:
    return {**r, "eval/id/accuracy": 0.99} if r["round"] == 0 and r["phase"] == "eval" else r


def _other_weights(r: dict) -> dict:
    return {**r, "model_weights": "w-other"} if r["phase"] == "train" and r["participant"] != "_federation" else r


@pytest.mark.parametrize("tamper, error, words", [
    (lambda a, b: (b / "grid.json").write_text(json.dumps({**META, "run_config": ["eval-seed=1"]})),
     PackError, "grid.json run_config: ['eval-seed=1'] in"),
    (lambda a, b: (b / "grid.json").write_text(json.dumps({**META, "preset": "other"})),
     PackError, "grid.json preset: 'other' in"),
    (lambda a, b: (b / "cells" / "noIS__vertical__s2" / "run" / "config.json").write_text(
        json.dumps({"eval_samples": 4, "num_rounds": 9})),
     PackError, "noIS__vertical__s2: its run configuration differs from noIS__vertical__s0's in the destination: "
                "num_rounds = 9 (here absent)"),
    (lambda a, b: _rewrite_metrics(b / "cells" / "alone__vertical__s2", _other_start),
     PackError, "the evaluation before round 1 differs: alone__vertical__s0 in"),
    (lambda a, b: _rewrite_metrics(b / "cells" / "F-TIS__vertical__s2", _other_weights),
     MixedWeights, "cells started from different model weights"),
])
def test_cells_of_another_experiment_are_refused_and_nothing_is_copied(grids, tmp_path, tamper, error, words):
    a, b = _copies(grids, tmp_path)
    for cell in (a / "cells").iterdir():                  # the destination's weights are fingerprinted too
        _rewrite_metrics(cell, lambda r: {**r, "model_weights": "w-1"} if r["phase"] == "train"
                         and r["participant"] != "_federation" else r)
    for cell in (b / "cells").iterdir():
        _rewrite_metrics(cell, lambda r: {**r, "model_weights": "w-1"} if r["phase"] == "train"
                         and r["participant"] != "_federation" else r)
    tamper(a, b)
    before = _files(a)
    with pytest.raises(error, match=None) as e:
        pack(b, a, echo=lambda s: None)
    assert words in str(e.value)
    assert _files(a) == before


def test_pack_on_the_command_line_names_what_is_wrong(grids, tmp_path, capsys):
    a, b = _copies(grids, tmp_path)
    assert main(["grid", "--pack", str(b)]) == 2
    assert "--pack needs --out" in capsys.readouterr().err
    (b / "grid.json").write_text(json.dumps({**META, "metric": "greedy"}))
    assert main(["grid", "--pack", str(b), "--out", str(a)]) == 2
    assert "grid.json metric: 'greedy' in" in capsys.readouterr().err
    assert not (a / "cells" / "alone__vertical__s2").exists()
    assert main(["grid", "--pack", str(a), "--out", str(a)]) == 2
    assert "the same folder as --out" in capsys.readouterr().err


def test_a_grid_run_again_with_more_methods_describes_every_cell(grids, tmp_path):
    a = tmp_path / "a"
    a.mkdir()
    shutil.copytree(grids["first"] / "cells" / "alone__vertical__s0", a / "cells" / "alone__vertical__s0")
    shutil.copytree(grids["first"] / "cells" / "alone__vertical__s1", a / "cells" / "alone__vertical__s1")
    fixed = {"preset": "fixture", "run_config": ["eval-seed=0"], "transport": "inprocess", "metric": "sampled"}
    (a / "grid.json").write_text(json.dumps({**fixed, "modes": ["alone"], "seeds": 2}))
    meta = grid_meta(a, fixed, plan(["F-TIS"], 3), {})
    assert meta["modes"] == ["alone", "F-TIS"] and meta["seeds"] == 3
    assert meta["cells"] == ["alone__vertical__s0", "F-TIS__vertical__s0", "alone__vertical__s1", "F-TIS__vertical__s1",
                             "F-TIS__vertical__s2"]
    with pytest.raises(ValueError, match="holds a grid with run_config \\['eval-seed=0'\\], not \\['eval-seed=3'\\]"):
        grid_meta(a, {**fixed, "run_config": ["eval-seed=3"]}, plan(["F-TIS"], 3), {})
    fresh = grid_meta(tmp_path / "new", fixed, plan(["alone", "F-TIS"], 2), {})
    assert list(fresh) == ["preset", "modes", "groups", "seeds", "run_config", "transport", "variants", "cells",
                           "metric"] and fresh["seeds"] == 2
