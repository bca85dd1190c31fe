"""sims.compare_cells: how docs/RESULTS.md counts "value for value", on committed cells."""

from pathlib import Path

from sims.compare_cells import compare, keyed_rows, machine_figure, main

SPEC = Path(__file__).resolve().parents[1] / "docs" / "results" / "research-w-spec" / "cells"


def test_the_last_round_margin_changes_only_the_final_rows_of_a_tie(capsys):
    """RESULTS §4 ("Ties end on the shadow"): F-TIS+shadowxz equals F-TIS+shadowx value for value
    except the spec's final rows at its ties (seed 2 is one), and everywhere at the other seeds."""
    tie = [SPEC / f"F-TIS+shadow{v}__vertical__s2" for v in ("x", "xz")]
    assert main([str(p) for p in tie] + ["--show", "100"]) == 1
    out = capsys.readouterr().out
    listed = [line for line in out.splitlines() if line.startswith("  ")]
    assert listed and all(line.startswith("  spec round 100 ") for line in listed)
    assert "eval/id/sampled_accuracy" in out
    assert main([str(SPEC / f"F-TIS+shadow{v}__vertical__s0") for v in ("x", "xz")]) == 0
    assert "14,372 figures compared, 14,372 equal" in capsys.readouterr().out


def test_rows_are_matched_by_participant_round_and_phase_and_machine_figures_are_left_out():
    a = [{"participant": "p", "round": 1, "phase": "train", "train/loss": 0.5, "train/seconds": 3.0,
          "worker/pid": 11, "wire/frame_bytes": 100},
         {"participant": "p", "round": 0, "phase": "eval", "eval/id/accuracy": 0.25}]
    b = [{"participant": "p", "round": 1, "phase": "train", "train/loss": 0.5, "train/seconds": 9.0,
          "worker/pid": 12, "wire/frame_bytes": 101, "train/grad_norm": 1.0}]
    c = compare(keyed_rows(a), keyed_rows(b))
    assert (c["rows"], c["only_a"], c["only_b"], c["compared"], c["equal"]) == (1, 1, 0, 1, 1)
    b[0]["train/loss"] = 0.5000001
    assert compare(keyed_rows(a), keyed_rows(b))["diffs"] == [(("p", 1, "train", 0), "train/loss", 0.5, 0.5000001)]
    assert compare(keyed_rows(a, rounds=0), keyed_rows(b, rounds=0))["rows"] == 0
    assert machine_figure("gen/seconds") and machine_figure("model_weights") and not machine_figure("reward/mean")


def test_a_folder_that_is_not_a_finished_cell_is_refused(tmp_path, capsys):
    assert main([str(tmp_path), str(SPEC / "F-TIS+shadowx__vertical__s0")]) == 2
    assert "not a finished cell" in capsys.readouterr().err
