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
