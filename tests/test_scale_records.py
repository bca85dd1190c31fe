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


def test_mem_sample_sees_what_the_command_starts_and_its_marked_log_lines(tmp_path, capsys):
    """The command starts a process that holds 60 MB for a second and prints a round line: the peak of
    its kind covers the 60 MB (the command's descendants are sampled, not the command itself: the
    launcher), the mark carries the line, the summary (stdout and .summary.json) the exit status."""
    import json
    import sys

    from sims import mem_sample

    child = ("import time; x = bytearray(60 * 2**20); x[::4096] = b'1' * len(x[::4096]); "
             "print('round 1/1: 2 replies, 0 dropped, 0 rejected, 10 bytes relayed, 0.1 s', flush=True); "
             "time.sleep(1.5)")
    launcher = f"import subprocess, sys; sys.exit(subprocess.call([sys.executable, '-c', {child!r}]))"
    out = tmp_path / "m.jsonl"
    assert mem_sample.main(["--out", str(out), "--every", "0.2", "--log", str(tmp_path / "m.log"), "--",
                            sys.executable, "-c", launcher]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary == json.loads((tmp_path / "m.summary.json").read_text())
    assert summary["rc"] == 0 and summary["peak_by_kind"]["other"]["rss_mb"] >= 60
    assert [m["line"] for m in summary["marks"]] == ["round 1/1: 2 replies, 0 dropped, 0 rejected, 10 bytes relayed, 0.1 s"]
    assert len(out.read_text().splitlines()) >= 3
