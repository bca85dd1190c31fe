"""The learning tier's statistics: the verdict interval (pigeonhole ∪ t over seeds), sample efficiency on
the training reward, and the before-training table (greedy, sampled pass@1, pass@k)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ftis_fed.grid import efficiency, report
from ftis_fed.grid import stats as gs
from ftis_fed.grid.claims import CLAIMS, verdicts, with_shadow_variants
from ftis_fed.grid.plan import Cell, discover_cells
from ftis_fed.participant import write_eval_prompts
from tests.grid_cells import write_cell


def test_the_verdict_reads_the_union_of_the_pigeonhole_and_t_intervals():
    row = {"diff": 0.05, "lo": 0.01, "hi": 0.09, "t_lo": -0.02, "t_hi": 0.08}
    assert gs.verdict_bounds(row) == (-0.02, 0.09)
    assert gs.verdict_bounds({**row, "t_lo": math.nan, "t_hi": math.nan}) == (0.01, 0.09)    # one seed
    assert gs.verdict_bounds({"lo": 0.2, "hi": 0.5}) == (0.2, 0.5)                             # an update ratio
    # three seeds that disagree: the pigeonhole interval clears 0, the t interval (t(2) = 4.303) does not
    rng = np.random.default_rng(0)
    d = np.stack([np.full(400, x) + rng.normal(0, 0.3, 400) for x in (0.19, 0.04, 0.24)])       # (S,N)
    r = gs.paired_interval(d, "disagree")
    assert r["lo"] > 0 > r["t_lo"]
    claim = next(c for c in CLAIMS if c.id == "2a")
    got = verdicts([{**r, "a": "F-TIS", "b": "noIS", "participant": "p", "set": "id", "a_acc": 0.5, "b_acc": 0.4}],
                   ["p"], "p", None, [claim])[0]
    assert got["verdict"] == gs.INCONCLUSIVE
    assert got["interval"] == f"p: {100 * r['diff']:+.1f} [{100 * r['t_lo']:+.1f}, {100 * max(r['hi'], r['t_hi']):+.1f}] (3 seeds)"


def test_methods_alike_on_every_prompt_leave_a_mechanism_claim_untested_and_an_outcome_claim_decided():
    """F-TIS and TIS alike on every prompt of every seed (the filter dropped nothing: the same updates):
    claim 3 is inconclusive, said so, not "not held"; a shadow alike with alone holds claim 1s (an
    outcome: it ended where alone did). One prompt apart at every seed, claim 3 is decided by its interval
    again."""
    same = gs.paired_interval(np.zeros((10, 200)), "alike")
    assert (same["lo"], same["hi"], same["t_lo"], same["t_hi"], same["discord"]) == (0, 0, 0, 0, 0)
    one_apart = np.zeros((10, 200))
    one_apart[:, 7] = -1.0                                  # TIS solves prompt 7 at every seed, F-TIS not
    apart = gs.paired_interval(one_apart, "apart")
    rows = [{**r, "a": a, "b": b, "participant": "p", "set": "id", "a_acc": 0.5, "b_acc": 0.5}
            for r, a, b in ((same, "F-TIS", "TIS"), (same, "F-TIS+shadow", "alone"))]
    got = {v["claim"]: v for v in verdicts(rows, ["p"], "p", None)}
    assert got["3"]["verdict"] == gs.INCONCLUSIVE
    assert got["3"]["interval"] == "p: alike on every prompt of every seed (untested) (10 seeds)"
    assert got["1s"]["verdict"] == gs.HELD and got["1s"]["interval"] == "p: +0.0 [+0.0, +0.0] (10 seeds)"
    decided = verdicts([{**rows[0], **apart}], ["p"], "p", None, [c for c in CLAIMS if c.id == "3"])[0]
    assert decided["verdict"] == gs.NOT_HELD and apart["discord"] > 0


def test_the_shadow_claim_is_a_row_only_where_the_shadow_ran_and_reads_claim_1s_rule():
    def row(a, p, diff, lo, hi):
        return {"a": a, "b": "alone", "participant": p, "set": "id", "a_acc": 0.4, "b_acc": 0.4, "diff": diff,
                "lo": lo, "hi": hi, "t_lo": lo, "t_hi": hi, "seeds": 5}
    f_tis = [row("F-TIS", p, 0.01, -0.005, 0.02) for p in ("base", "spec")]
    assert [r["claim"] for r in verdicts(f_tis, ["base", "spec"], "base", None)
            if r["claim"] in ("1", "1s")] == ["1"]                          # no F-TIS+shadow cell: no row
    held = {r["claim"]: r for r in verdicts(
        f_tis + [row("F-TIS+shadow", "base", 0.02, -0.005, 0.04), row("F-TIS+shadow", "spec", 0.0, -0.009, 0.01)],
        ["base", "spec"], "base", None)}
    assert held["1s"]["verdict"] == gs.HELD and held["1s"]["comparison"] == "F-TIS+shadow − alone, ID"
    assert held["1s"]["rule"] == held["1"]["rule"]
    short = verdicts([row("F-TIS+shadow", "base", 0.02, -0.005, 0.04), row("F-TIS+shadow", "spec", 0.0, -0.019, 0.01)],
                     ["base", "spec"], "base", None)
    assert next(r for r in short if r["claim"] == "1s")["verdict"] == gs.INCONCLUSIVE    # spec's bound −1.9 < −1
    lost = verdicts([row("F-TIS+shadow", "base", 0.02, -0.005, 0.04),
                     row("F-TIS+shadow", "spec", -0.03, -0.05, -0.015)], ["base", "spec"], "base", None)
    assert next(r for r in lost if r["claim"] == "1s")["verdict"] == gs.NOT_HELD
    # one seed: the interval has no seed component, so no verdict from it, whatever its bounds
    single = verdicts([{**row("F-TIS+shadow", p, 0.08, 0.05, 0.11), "seeds": 1} for p in ("base", "spec")],
                      ["base", "spec"], "base", None)
    one = next(r for r in single if r["claim"] == "1s")
    assert one["verdict"] == gs.INCONCLUSIVE and "(1 seed: no seed component, inconclusive)" in one["interval"]
    # another shadow variant (other knobs) gets claim 1s's rule on its own rows, right after 1s
    claims = with_shadow_variants(["F-TIS+shadow", "F-TIS+shadowid"])
    assert [c.id for c in claims][:4] == ["1", "1s", "1s:shadowid", "2a"] and with_shadow_variants([]) == CLAIMS
    both = {r["claim"]: r for r in verdicts(
        f_tis + [row("F-TIS+shadow", "base", 0.02, -0.005, 0.04), row("F-TIS+shadow", "spec", 0.0, -0.019, 0.01),
                 row("F-TIS+shadowid", "base", 0.02, -0.005, 0.04), row("F-TIS+shadowid", "spec", 0.0, -0.009, 0.01)],
        ["base", "spec"], "base", None, claims)}
    assert (both["1s"]["verdict"], both["1s:shadowid"]["verdict"]) == (gs.INCONCLUSIVE, gs.HELD)
    assert both["1s:shadowid"]["comparison"] == "F-TIS+shadowid − alone, ID"
    assert both["1s:shadowid"]["statement"].startswith("beyond the paper: F-TIS+shadowid (with its variant's knobs; ")
    assert both["1s:shadowid"]["rule"] == both["1s"]["rule"]
    alone_variant = verdicts(f_tis + [row("F-TIS+shadowid", p, 0.0, -0.009, 0.01) for p in ("base", "spec")],
                             ["base", "spec"], "base", None, with_shadow_variants(["F-TIS+shadowid"]))
    assert [r["claim"] for r in alone_variant if r["claim"].startswith("1")] == ["1", "1s:shadowid"]


def test_reward_curves_are_trailing_means_from_the_window_on():
    rows = [{"round": k, "participant": "a", "phase": "train", "reward/mean": float(k)} for k in range(1, 13)]
    rows += [{"round": 1, "participant": "_federation", "phase": "train", "reward/mean": 9.0},
             {"round": 1, "participant": "b", "phase": "train", "reward/mean": 0.5}]
    got = efficiency.reward_curves(rows, window=10)
    assert got == {"a": [(10, 5.5), (11, 6.5), (12, 7.5)]}                   # b: fewer rounds than the window


def _cell(out, mode: str, seed: int, rewards: dict[str, list[float]], k: int = 4) -> None:
    """A finished cell of ``rewards`` per participant and round, with one ID evaluation before round 1
    (8 prompts: greedy flags and sampled counts out of k) and after its last round."""
    cell = Cell(mode, "vertical", seed)
    run = out / "cells" / cell.name / "run"
    rows = []
    for p, rs in rewards.items():
        for rnd, v in enumerate(rs, 1):
            rows.append({"round": rnd, "participant": p, "phase": "train", "reward/mean": v, "train/samples": 8.0})
        for rnd in (0, len(rs)):
            rows.append({"round": rnd, "participant": p, "phase": "eval", "eval/id/accuracy": 0.5,
                         "eval/ood/accuracy": 0.0, "eval/id/sampled_accuracy": 0.25, "eval/ood/sampled_accuracy": 0.0,
                         "eval/id/n": 8.0})
            ids = [f"{'add99' if i % 2 == 0 else 'sub99'}/eval/0/{i // 2}" for i in range(8)]
            write_eval_prompts(run / "participants" / p / "eval_prompts.jsonl.gz", p, rnd,
                               {"id": [(t, i < 4) for i, t in enumerate(ids)]},
                               sampled={"id": [0, 0, 1, 2, 0, 4, 1, 0]}, k=k)
    write_cell(out, cell, rows, done={"seconds": 1.0})


def test_efficiency_on_the_training_reward_and_the_start_table(tmp_path):
    T = 40
    alone = [0.30 + 0.20 * r / T for r in range(1, T + 1)]                # +0.2 over 40 rounds
    fast = [0.30 + 0.40 * r / T for r in range(1, T + 1)]                 # twice as fast
    for s in range(3):
        _cell(tmp_path, "alone", s, {"a": alone, "b": alone})
        _cell(tmp_path, "F-TIS", s, {"a": fast, "b": alone})
    cells = discover_cells(tmp_path)
    assert {c.name for c in cells} >= {"alone__vertical__s0", "F-TIS__vertical__s2"}
    rows = {(r["a"], r["participant"], r["set"]): r for r in
            efficiency.efficiency_table(cells, tmp_path, {})}
    # alone's target: the mean of its last 10 rounds (rounds 31..40); F-TIS's trailing mean reaches it at
    # the first r with mean of (r-9..r) >= it: 0.3 + 0.4 (r - 4.5) / 40 >= 0.3 + 0.2 * 35.5 / 40 -> r >= 22.25
    a = rows[("F-TIS", "a", "updates:reward")]
    assert a["seeds"] == 3 and a["reached"] == 3 and a["diff"] == pytest.approx(23 / 40) and a["ratios"] == "0.57 " * 2 + "0.57"
    b = rows[("F-TIS", "b", "updates:reward")]
    assert b["diff"] == pytest.approx(1.0)                                # the same curve: reached at the end
    assert ("F-TIS", "a", "updates") not in rows                          # held-out: no start given, no row
    claim7r = next(c for c in CLAIMS if c.id == "7r")
    v = verdicts(list(rows.values()), ["a", "b"], None, None, [claim7r])[0]
    assert v["verdict"] == gs.HELD and v["comparison"] == "F-TIS − alone, UPDATES:REWARD"
    # the start table: greedy 4/8, sampled pass@1 (0+0+1+2+0+4+1+0) / (8 k), pass@4 = 4 of 8 prompts
    got = report.write_summary(cells, tmp_path, "t")
    start = {(r["participant"], r["set"]): r for r in got["starts"]}
    assert start[("a", "id")]["greedy"] == 0.5 and start[("a", "id")]["sampled"] == pytest.approx(8 / 32)
    assert start[("a", "id")]["pass_at_k"] == 0.5 and start[("a", "id")]["k"] == 4
    assert start[("a", "id:add99")]["pass_at_k"] == start[("a", "id:sub99")]["pass_at_k"] == 0.5   # 0,1,0,1 / 0,2,4,0
    assert start[("a", "id:sub99")]["sampled"] == pytest.approx(6 / 16)
    md = (tmp_path / "summary.md").read_text()
    assert "| a | id | 8 | 0.500 | 0.250 | 0.500 |" in md and "| F-TIS | a | training reward | 3 | 3 |" in md

