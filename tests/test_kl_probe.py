"""sims.kl_probe: the per-sample KL between a sender's samples and a receiver, as the filter computes it."""

import pytest

from sims import kl_probe


@pytest.mark.slow
def test_a_model_is_at_kl_zero_from_itself_and_the_summary_reads_the_samples():
    rows = kl_probe.probe("tiny-llama", ["tiny-llama"], ["add30", "sub30"], n=4, seed=1, temperature=0.7,
                          max_new_tokens=6, g=50.0)
    (row,) = rows
    assert row["all"]["n"] == 4 and row["add30"]["n"] == 2 and row["sub30"]["n"] == 2
    assert row["all"]["max"] == pytest.approx(0.0, abs=1e-4) and row["all"]["ge_g"] == 0.0


def test_summary_quantiles_and_share_at_or_above_g():
    s = kl_probe.summarize([1.0, 2.0, 3.0, 60.0], g=50.0)
    assert s == {"n": 4, "p50": 2.5, "p90": pytest.approx(42.9), "p99": pytest.approx(58.29), "mean": 16.5,
                 "max": 60.0, "ge_g": 0.25}
