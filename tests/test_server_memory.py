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


def test_fraction_evaluate_asks_a_sample_and_each_participant_equally_often(tmp_path):
    """``fraction-evaluate`` (Flower's fraction_evaluate): an evaluation round asks ceil(f N) of the N
    admitted participants (at least ``min-evaluate-participants``), the ones furthest below their fair
    share of evaluations (the evaluation's own lags): 16 participants at 0.25, rounds 0-3, each
    evaluated exactly once."""
    import json
    from collections import Counter

    from ftis_fed.bench.swarm import light_federation
    from ftis_fed.config.federation import FederationConfig
    from ftis_fed.engine.core import Engine
    from ftis_fed.engine.inprocess import InProcessTransport

    parts, keys = light_federation(tmp_path, 16)
    fed = FederationConfig(num_rounds=3, min_participants=2, run_name="swarm", output_dir=str(tmp_path),
                           eval_every=1, eval_initial=True, progress_every_s=0, fraction_evaluate=0.25,
                           min_evaluate_participants=3, plot_every=0)
    assert Engine(fed, keys, tmp_path, InProcessTransport(parts), plots=False, log=lambda *a, **k: None).run() == 3
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if r.get("phase") == "eval"]
    per_round = Counter(r["round"] for r in evals)
    assert per_round == {0: 4, 1: 4, 2: 4, 3: 4}
    assert Counter(r["participant"] for r in evals) == {n: 1 for n in parts}
    trained = [r for r in rows if r.get("phase") == "train" and r["participant"] != "_federation"]
    assert len(trained) == 3 * 16                                          # training still asks everyone
    with pytest.raises(ValueError, match=r"fraction-evaluate=0.0: must be in \(0, 1\]"):
        FederationConfig(fraction_evaluate=0.0)
