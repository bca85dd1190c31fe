"""docs/RESULTS.md's tables are the committed summaries' rows (sims/results_tables.py): every table
between ``<!-- table: NAME -->`` markers equals what the script generates from ``summary.csv``."""

from __future__ import annotations

from pathlib import Path

import pytest

from sims import results_tables as T

ROOT = Path(__file__).resolve().parents[1]


def test_every_marked_table_of_results_md_equals_the_committed_summaries():
    text = (ROOT / "docs" / "RESULTS.md").read_text()
    new, changed = T.regenerate(text)
    assert not changed, f"RESULTS.md tables differ from docs/results/*/summary.csv: {changed} " \
                        "(python -m sims.results_tables --write docs/RESULTS.md)"
    assert new == text
    assert {m.group(2) for m in T.BLOCK.finditer(text)} == set(T.TABLES)      # every table is in the document


def test_an_edited_number_is_found_and_an_unknown_table_refused():
    text = (ROOT / "docs" / "RESULTS.md").read_text()
    block = next(T.BLOCK.finditer(text))
    edited = text[:block.start(3)] + block.group(3).replace("0.", "9.", 1) + text[block.end(3):]
    new, changed = T.regenerate(edited)
    assert changed == [block.group(2)] and new == text
    with pytest.raises(ValueError, match="no such table"):
        T.regenerate("<!-- table: nope -->\nx\n<!-- end table -->")
    assert T.main(["--check", str(ROOT / "docs" / "RESULTS.md")]) == 0


def test_empty_marked_tables_are_filled_each_in_its_own_place():
    """A new table is added as two empty marker lines; neighbouring empty blocks stay apart."""
    empty = "<!-- table: efficiency -->\n<!-- end table -->\n\ntext\n<!-- table: filter -->\n<!-- end table -->\n"
    new, changed = T.regenerate(empty)
    assert changed == ["efficiency", "filter"]
    assert new == (f"<!-- table: efficiency -->\n{T.TABLES['efficiency']()}\n<!-- end table -->\n\ntext\n"
                   f"<!-- table: filter -->\n{T.TABLES['filter']()}\n<!-- end table -->\n")
    assert T.regenerate(new) == (new, [])


def test_sims_paired_reads_the_metric_the_grid_records():
    """sims/paired.py on a sampled grid gives the sampled comparison its summary holds (not greedy)."""
    from sims.paired import compare

    grid = ROOT / "docs" / "results" / "research-w-spec"
    got = {r["participant"]: r for r in compare(grid, "F-TIS", "TIS")}
    want = {r["participant"]: r for r in T.rows("research-w-spec")
            if r["kind"] == "paired_prompts" and r["a"] == "F-TIS" and r["b"] == "TIS" and r["set"] == "id"}
    assert set(got) == set(want) == {"base", "spec"}
    for p, r in got.items():
        assert r["metric"] == "sampled" and r["seeds"] == int(want[p]["seeds"])
        assert r["diff"] == round(100 * float(want[p]["diff"]), 1)
    assert {r["metric"] for r in compare(grid, "F-TIS", "TIS", metric="greedy")} == {"greedy"}


def test_the_seeds_table_counts_each_methods_finished_cells():
    """The seeds table (RESULTS' one count of seeds) matches the committed cells' folders."""
    from collections import Counter

    cells = Counter(d.name.split("__")[0] for d in (ROOT / "docs" / "results" / T.FOUR / "cells").iterdir()
                    if d.is_dir())
    row = next(line for line in T.seeds().splitlines() if line.startswith(f"| `{T.FOUR}` |"))
    got = dict(item.rsplit(" ", 1) for item in row.split(" | ")[1].rstrip(" |").split(", "))
    assert {m: int(n) for m, n in got.items()} == dict(cells)
    assert list(got)[0] == "alone"                                                   # baselines first


def test_the_verdict_table_holds_every_grids_claims_in_order(monkeypatch):
    """A claim only some grids decide (``1s:<variant>``, a shadow run with other knobs) gets its row
    after the claim that precedes it there, with "–" for the grids without it."""
    def v(claim):
        return {"kind": "verdict", "claim": claim, "statement": f"s{claim}", "comparison": "F-TIS − alone, ID",
                "verdict": "held", "interval": "p: +1.0"}
    have = {"g1": ["1", "1s", "2a"], "g2": ["1", "1s", "1s:shadowid", "2a", "7"]}
    monkeypatch.setattr(T, "rows", lambda g: [v(c) for c in have[g]])
    lines = T.verdicts(("g1", "g2")).splitlines()[2:]
    assert [ln.split(" ")[1] for ln in lines] == ["1", "1s", "1s:shadowid", "2a", "7"]
    assert lines[2].endswith("| – | **held**: p: +1.0 |")
