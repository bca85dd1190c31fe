"""metrics.csv is appended to while rows bring no new column and rewritten from metrics.jsonl when
they do; either way it is the CSV that rewriting it from the JSONL would give."""

from __future__ import annotations

from ftis_fed.metrics.writer import MetricsWriter

ROWS = [[{"round": 1, "participant": "a", "phase": "train", "x": 1.5}],
        [{"round": 2, "participant": "a", "phase": "train", "x": float("nan")}],
        [{"round": 3, "participant": "b", "phase": "eval", "y": 2}],             # a new column
        [{"round": 4, "participant": "a", "phase": "train", "x": 0.1}]]


def _rewritten(w: MetricsWriter) -> str:
    appended = w.csv.read_text()
    w._write_csv(w.rows())
    assert w.csv.read_text() == appended
    return appended


def test_the_csv_appended_equals_the_csv_rewritten(tmp_path):
    w = MetricsWriter(tmp_path, append=False)
    for rows in ROWS:
        w.write(rows)
    text = _rewritten(w)
    assert text.splitlines()[0] == "round,participant,phase,x,y" and len(text.splitlines()) == 5


def test_a_resumed_writer_appends_under_the_existing_header(tmp_path):
    w = MetricsWriter(tmp_path, append=False)
    for rows in ROWS[:3]:
        w.write(rows)
    again = MetricsWriter(tmp_path, append=True)                # resume: reads the CSV's header
    again.write(ROWS[3])
    assert len(_rewritten(again).splitlines()) == 5
