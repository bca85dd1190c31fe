"""The grid's guard table: what ``source-adapt = guard`` did to each peer's samples, read from the
cells' ``guard/...`` metrics (``grid.tables.guard_table``), its summary section and its rows in
summary.csv; cells without the guard give no row, so their grids' summaries are unchanged."""

from __future__ import annotations

import pytest

from ftis_fed.grid.plan import Cell
from ftis_fed.grid.report import summary_markdown
from ftis_fed.grid.tables import guard_table
from tests.grid_cells import write_cell


def _cell(tmp_path, method: str, seed: int, rows: list[dict]) -> Cell:
    write_cell(tmp_path, c := Cell(method, "vertical", seed), rows)
    return c


def _row(rnd: int, who: str, peer: str, kept: float, weight: float, cos: float, own: float) -> dict:
    return {"round": rnd, "participant": who, "phase": "train", "guard/kept_peers": kept,
            f"guard/{peer}/weight": weight, f"guard/{peer}/cos": cos, "guard/own_cos": own}


def test_the_guard_table_averages_rounds_then_seeds_with_the_per_seed_range(tmp_path):
    c0 = _cell(tmp_path, "F-TIS+guard", 0, [_row(1, "spec", "base", 1.0, 0.0, -0.2, 0.1),
                                            _row(2, "spec", "base", 1.0, 1.0, 0.3, 0.1),
                                            _row(3, "spec", "base", 0.0, 0.5, 0.1, 0.2),
                                            _row(1, "base", "spec", 1.0, 1.0, 0.2, -0.1),
                                            {"round": 0, "participant": "spec", "phase": "eval"}])
    c1 = _cell(tmp_path, "F-TIS+guard", 1, [_row(1, "spec", "base", 1.0, 0.0, -0.1, 0.3)])
    plain = _cell(tmp_path, "F-TIS", 0, [{"round": 1, "participant": "spec", "phase": "train",
                                          "offpolicy/base/kl_p50": 3.0}])
    unfinished = _cell(tmp_path, "F-TIS+guard", 2, [_row(1, "spec", "base", 0.0, 0.0, 0.0, 0.0)])
    (tmp_path / "cells" / unfinished.name / "done.json").unlink()
    got = {(r["participant"], r["peer"]): r for r in guard_table([c0, c1, plain, unfinished], tmp_path)}
    assert set(got) == {("spec", "base"), ("base", "spec")}          # no row for the cell without the guard
    s = got[("spec", "base")]
    assert s["method"] == "F-TIS+guard" and s["seeds"] == 2            # the unfinished cell is not read
    assert s["kept"] == pytest.approx((2 / 3 + 1.0) / 2)
    assert (s["kept_min"], s["kept_max"]) == pytest.approx((2 / 3, 1.0))
    assert s["weight"] == pytest.approx((0.5 + 0.0) / 2)
    assert (s["weight_min"], s["weight_max"]) == (0.0, 0.5)
    assert s["weight_zero"] == pytest.approx((1 / 3 + 1.0) / 2)       # the share of rounds with weight 0
    assert s["cos"] == pytest.approx((0.2 / 3 - 0.1) / 2)
    assert s["own_cos"] == pytest.approx((0.4 / 3 + 0.3) / 2)
    assert got[("base", "spec")]["seeds"] == 1 and got[("base", "spec")]["kept"] == 1.0
    assert guard_table([plain], tmp_path) == []


def test_the_summary_has_a_guard_section_only_with_guard_rows():
    row = {"method": "F-TIS+guard", "participant": "spec", "peer": "base", "seeds": 5, "kept": 0.85,
           "kept_min": 0.82, "kept_max": 0.87, "weight": 0.39, "weight_min": 0.15, "weight_max": 0.54,
           "weight_zero": 0.56, "cos": -0.014, "own_cos": -0.008}
    with_guard = summary_markdown([], [], [], "t", guards=[row])
    assert "| F-TIS+guard | spec | base | 5 | 85 % [82, 87] | 0.39 [0.15, 0.54] | 56 % | -0.014 | -0.008 |" in with_guard
    assert "## The guard" not in summary_markdown([], [], [], "t")


def test_a_guard_without_alignment_gives_weight_1_and_no_cosines(tmp_path):
    """``source-adapt-align = false``: the cells carry ``guard/<peer>/weight`` = 1 and no cosines; the
    row's cosines are NaN and the summary reads them as –."""
    rows = [{"round": r, "participant": "spec", "phase": "train", "guard/kept_peers": k, "guard/base/weight": 1.0}
            for r, k in ((1, 1.0), (2, 0.0))]
    c = _cell(tmp_path, "F-TIS+guardchoice", 0, rows)
    (row,) = guard_table([c], tmp_path)
    assert row["kept"] == 0.5 and row["weight"] == 1.0 and row["weight_zero"] == 0.0
    assert row["cos"] != row["cos"] and row["own_cos"] != row["own_cos"]          # NaN: not measured
    md = summary_markdown([], [], [], "t", guards=[row])
    assert "| F-TIS+guardchoice | spec | base | 1 | 50 % [50, 50] | 1.00 [1.00, 1.00] | 0 % | – | – |" in md


def test_the_guard_score_table_reads_each_group_s_differences_and_votes(tmp_path):
    """``guard_score_table``: per receiver the whole batch's difference (with − without) and, with
    ``source-adapt-val-group = family``, each group's; mean and sd over rounds, then the mean over
    seeds with the per-seed range; ``drop``: the share of rounds the group's window mean was below 0
    (all: the rounds that dropped the peers). Rounds without both scores and cells without the guard
    give nothing; the summary prints the figures ×10⁻³."""
    from ftis_fed.grid.tables import guard_score_table

    def fam(rnd, kept, w, wo, add, add_mean, sub, sub_mean):
        return {"round": rnd, "participant": "base", "phase": "train", "guard/kept_peers": kept,
                "guard/val_with": w, "guard/val_without": wo, "guard/val/add99/diff": add,
                "guard/val/add99/diff_mean": add_mean, "guard/val/sub99/diff": sub,
                "guard/val/sub99/diff_mean": sub_mean}

    c0 = _cell(tmp_path, "F-TIS+guardfam", 0, [fam(1, 0.0, -1.0, -1.002, 0.004, 0.004, -0.002, -0.002),
                                               fam(2, 1.0, -1.0, -1.004, 0.002, 0.003, 0.001, 0.0005),
                                               {"round": 3, "participant": "base", "phase": "train",
                                                "guard/kept_peers": 1.0, "guard/val_with": -1.0}])   # no own samples
    c1 = _cell(tmp_path, "F-TIS+guardfam", 1, [fam(1, 1.0, -1.0, -0.998, 0.0, 0.0, 0.003, 0.003)])
    one = _cell(tmp_path, "F-TIS+guardchoice", 0, [
        {"round": r, "participant": "spec", "phase": "train", "guard/kept_peers": float(w >= wo),
         "guard/val_with": w, "guard/val_without": wo} for r, (w, wo) in enumerate([(0.5, 0.25), (0.25, 0.5)], 1)])
    plain = _cell(tmp_path, "F-TIS", 0, [{"round": 1, "participant": "spec", "phase": "train"}])
    got = {(r["method"], r["participant"], r["group"]): r for r in guard_score_table([c0, c1, one, plain], tmp_path)}
    assert list(got) == [("F-TIS+guardchoice", "spec", "all"), ("F-TIS+guardfam", "base", "all"),
                         ("F-TIS+guardfam", "base", "add99"), ("F-TIS+guardfam", "base", "sub99")]
    a = got[("F-TIS+guardfam", "base", "all")]
    assert a["seeds"] == 2 and a["d"] == pytest.approx((0.003 - 0.002) / 2)           # seed 0: +0.002, +0.004
    assert (a["d_min"], a["d_max"]) == pytest.approx((-0.002, 0.003))
    assert a["d_sd"] == pytest.approx((0.001 + 0.0) / 2) and a["drop"] == pytest.approx((0.5 + 0.0) / 2)
    sub = got[("F-TIS+guardfam", "base", "sub99")]
    assert sub["d"] == pytest.approx((-0.0005 + 0.003) / 2) and sub["drop"] == pytest.approx((0.5 + 0.0) / 2)
    assert got[("F-TIS+guardfam", "base", "add99")]["drop"] == 0.0
    c = got[("F-TIS+guardchoice", "spec", "all")]
    assert c["d"] == 0.0 and c["d_sd"] == 0.25 and c["drop"] == 0.5
    md = summary_markdown([], [], [], "t", guard_scores=[sub])
    assert "| F-TIS+guardfam | base | sub99 | 2 | +1.25 [-0.50, +3.00] | 0.75 | 25 % |" in md
    assert "## The guard's scores" not in summary_markdown([], [], [], "t")


def test_shadow_cells_are_named_in_the_guard_sections_as_rows_over_their_checks(tmp_path):
    """``source-adapt = shadow`` (``learn/shadow.py``) reports its figures at its checks only; the
    summary's guard sections say so for the methods whose cells' config ran it, and nothing changes
    for a grid without them."""
    from ftis_fed.grid.report import _configs, _shadow_losses

    shadow = Cell("F-TIS", "vertical", 0, "shadow")
    write_cell(tmp_path, shadow, [{"round": 25, "participant": "base", "phase": "train"}],
               config={"checks": {"source-adapt": {"mode": "shadow"}}})
    guard = Cell("F-TIS", "vertical", 0, "guard")
    write_cell(tmp_path, guard, config={"checks": {"source-adapt": {"mode": "guard"}}})
    plain = _cell(tmp_path, "F-TIS", 0, [])
    assert sorted(_shadow_losses(_configs([shadow, guard, plain], tmp_path))) == ["F-TIS+shadow"]
    assert sorted(_shadow_losses(_configs([guard, plain], tmp_path))) == []
    row = {"method": "F-TIS+shadow", "participant": "base", "group": "all", "seeds": 1, "d": -0.012,
           "d_min": -0.012, "d_max": -0.012, "d_sd": 0.01, "drop": 0.25}
    md = summary_markdown([], [], [], "t", guard_scores=[row], shadow={"F-TIS+shadow": "run"})
    assert "For F-TIS+shadow (`source-adapt = shadow`, `learn/shadow.py`) the rows are over its checks: d is" in md
    assert "source-adapt = shadow" not in summary_markdown([], [], [], "t", guard_scores=[row])


def test_the_shadow_s_last_choice_held_out_reads_both_final_evaluations(tmp_path):
    """``unchosen_table``: per shadow cell × receiver, the last check's choice and the two ends' held-out ID
    accuracy (the model's final records and those of the end it did not choose), their per-prompt paired
    difference, whether the choice was the better end, and the alone cell's of the same seed; a shadow
    cell run before the unchosen end was scored gives no row, and the section is only there with rows."""
    import gzip
    import json

    from ftis_fed.grid.metric import SAMPLED
    from ftis_fed.grid.report import unchosen_lines
    from ftis_fed.grid.tables import unchosen_table
    from ftis_fed.participant import EVAL_PROMPTS, UNCHOSEN_EVAL_PROMPTS

    ids = ["add99/0", "add99/1", "sub99/0", "sub99/1"]

    def records(run, name, per_participant):
        lines = [json.dumps({"round": 4, "participant": p, "set": "id", "ids": ids, "solved": "0000", "k": 4,
                             "sampled": counts}) for p, counts in per_participant.items()]
        (run / name).write_bytes(gzip.compress(("\n".join(lines) + "\n").encode()))

    def check(rnd, who, kept, d, se):
        return {"round": rnd, "participant": who, "phase": "train", "guard/kept_peers": kept,
                "guard/diff_mean": d, "guard/diff_se": se}

    shadow = Cell("F-TIS", "vertical", 0, "shadow")
    run = write_cell(tmp_path, shadow, [check(2, "base", 0.0, -0.5, 0.1), check(4, "base", 1.0, 0.02, 0.01),
                                        check(4, "spec", 0.0, -0.03, 0.01)])
    records(run, EVAL_PROMPTS, {"base": [4, 4, 2, 0], "spec": [1, 1, 1, 1]})        # the chosen ends
    records(run, UNCHOSEN_EVAL_PROMPTS, {"base": [2, 4, 2, 0], "spec": [1, 1, 1, 1]})
    alone = write_cell(tmp_path, Cell("alone", "vertical", 0), [])
    records(alone, EVAL_PROMPTS, {"base": [3, 3, 3, 3], "spec": [0, 0, 0, 0]})
    older = Cell("F-TIS", "vertical", 1, "shadow")                                # no unchosen records
    records(write_cell(tmp_path, older, [check(4, "base", 1.0, 0.0, 0.0)]), EVAL_PROMPTS, {"base": [0, 0, 0, 0]})
    cells = [Cell("alone", "vertical", 0), shadow, older]
    got = {r["participant"]: r for r in unchosen_table(cells, tmp_path, SAMPLED)}
    assert sorted(got) == ["base", "spec"]
    b, s = got["base"], got["spec"]
    assert (b["method"], b["seed"], b["kept"], b["val_d"], b["val_se"]) == ("F-TIS+shadow", 0, 1.0, 0.02, 0.01)
    assert b["with_peers"] == pytest.approx(10 / 16) and b["shadow"] == pytest.approx(8 / 16)   # kept: model = with
    assert b["heldout_d"] == pytest.approx(0.125) and b["heldout_se"] == pytest.approx(0.125)   # d = (.5, 0, 0, 0)
    assert b["right"] == 1.0 and b["alone"] == pytest.approx(0.75)
    assert s["kept"] == 0.0 and s["heldout_d"] == 0.0 and s["right"] != s["right"]             # a tie: NaN
    assert s["alone"] == 0.0
    lines = unchosen_lines(list(got.values()), SAMPLED, {"F-TIS+shadow": "run"})
    assert "F-TIS+shadow: it chose the better one in 1 of 1 (ties on the held-out set: 1); the shadow − the " \
           "alone cell of its seed (`source-adapt-shadow-loss = run`: its shadow trained with the run's loss on " \
           "draws of its own, not the alone run) +0.0 points on average, sd 35.4, over 2." in lines[2]   # 50−75, 25−0
    assert "| F-TIS+shadow | base | 0 | +20 ± 10 | with peers | 62.5 | 50.0 | +12.5 ± 12.5 | yes | 75.0 |" in lines
    assert "| F-TIS+shadow | spec | 0 | -30 ± 10 | shadow | 25.0 | 25.0 | +0.0 ± 0.0 | tie | 0.0 |" in lines
    two = unchosen_lines([*got.values(), {**b, "method": "F-TIS+shadowx", "right": 0.0}], SAMPLED,
                         {"F-TIS+shadow": "run", "F-TIS+shadowx": "alone"})[2]
    assert "F-TIS+shadow: it chose the better one in 1 of 1 (ties on the held-out set: 1)" in two   # per method
    assert "F-TIS+shadowx: it chose the better one in 0 of 1 (ties on the held-out set: 0); the shadow − the " \
           "alone cell of its seed (its shadow is that run, `source-adapt-shadow-loss = alone`) -25.0 " \
           "points on average, over 1." in two
    # which loss a method's shadow trained with: its cells' config.json (recorded before the key: `run`)
    from ftis_fed.grid.report import _shadow_losses
    configs = {shadow: {"checks": {"source-adapt": {"mode": "shadow"}}},
               Cell("F-TIS", "vertical", 0, "shadowx"): {"checks": {"source-adapt": {"mode": "shadow",
                                                                                      "shadow_loss": "alone"}}},
               Cell("alone", "vertical", 0): {"checks": {"source-adapt": {"mode": "off"}}}}
    assert _shadow_losses(configs) == {"F-TIS+shadow": "run", "F-TIS+shadowx": "alone"}
    assert unchosen_table([older], tmp_path, SAMPLED) == []
    assert "## The shadow's last choice" not in summary_markdown([], [], [], "t")
    assert "## The shadow's last choice, held out" in summary_markdown([], [], [], "t", unchosen=list(got.values()))
