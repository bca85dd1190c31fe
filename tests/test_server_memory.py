"""The server's memory stays flat over rounds: 50 rounds of the real engine (admission with proof of
possession, sampling, relay, server-side verification, replay guard, metrics rows, CSV, plots,
server_state.json) with light participants that sign and verify real frames (``bench/swarm.py``).
Growth is measured (least-squares slope of the process RSS over rounds 10-50), not wall time."""

from __future__ import annotations

import numpy as np
import pytest

from ftis_fed.bench.swarm import measure
from ftis_fed.engine.core import plot_due


def test_plots_every_n_rounds_and_after_the_last():
    assert [r for r in range(1, 24) if plot_due(r, 23, 10)] == [10, 20, 23]
    assert [r for r in range(1, 6) if plot_due(r, 5, 0)] == [5]
    assert all(plot_due(r, 5, 1) for r in range(1, 6))


@pytest.mark.slow
def test_server_rss_flat_over_50_rounds(tmp_path):
    r = measure(16, 50, 3, 1.0, tmp_path, plots=True, plot_every=10)   # redrawn in a child process
    rows = r["per_round"]
    assert len(rows) == 50 and all(x["frames_relayed"] == 16 * 3 for x in rows)
    late = [x for x in rows if x["round"] >= 10]
    growth = float(np.polyfit([x["round"] for x in late], [x["rss_mb"] for x in late], 1)[0])
    assert growth < 0.1, growth                            # MB per round: < 4 MB over the 40 rounds
    assert sorted(p.name for p in tmp_path.glob("*.png"))   # drawn (rounds 10 ... 40 in the background, 50 here)
