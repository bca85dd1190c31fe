"""docs/scale.md's flwr-run table recomputes from the records committed in docs/results/scale."""

from pathlib import Path

from sims import scale_table

ROOT = Path(__file__).resolve().parents[1]
RECORDS = ROOT / "docs" / "results" / "scale"


def test_the_flwr_run_scale_table_recomputes_from_its_committed_records(tmp_path, capsys):
    out = tmp_path / "flwr-run.csv"
    assert scale_table.main(["--committed", str(RECORDS), "--out", str(out)]) == 0
    assert out.read_text() == (RECORDS / "flwr-run.csv").read_text()
    rows = out.read_text().splitlines()
    assert [r.split(",")[1] for r in rows[1:]] == ["4", "16", "64", "256"]      # participants
    assert (tmp_path / "flwr-run.jsonl").read_text() == (RECORDS / "flwr-run.jsonl").read_text()
