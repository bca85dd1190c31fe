"""The per-sample KL quantiles of the peers' samples (issue #27: the filter's firing reported as what
it is): exact over an update, whatever its micro-batches, and consistent with the filter."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ftis_fed.learn.objective import ObjectiveConfig, kl_quantiles
from ftis_fed.learn.training import Trainer, TrainSample
from ftis_fed.policies import PolicyConfig, build_policy
from ftis_fed.wire.batch import SamplingParams
from tests.grid_cells import write_cell

G = 70.0                                 # nats: between the peer samples' median and largest KL here
SP = SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=16)


def test_quantiles_per_source_skip_the_rows_outside_the_loss():
    kl = torch.tensor([1.0, 2.0, 3.0, 4.0, 100.0, math.nan, 60.0, 0.5])
    source = torch.tensor([0, 0, 0, 0, 0, 1, 1, 1])
    got = kl_quantiles(kl, source, ("peer", "me"), g=50.0)
    assert got["offpolicy/peer/kl_p50"] == pytest.approx(3.0)
    assert got["offpolicy/peer/kl_p90"] == pytest.approx(float(np.quantile([1, 2, 3, 4, 100], 0.9)))
    assert got["offpolicy/peer/kl_ge_g_frac"] == pytest.approx(0.2)
    assert got["offpolicy/me/kl_ge_g_frac"] == pytest.approx(0.5)            # the NaN row is not counted
    assert got["offpolicy/me/kl_p50"] == pytest.approx(float(np.quantile([60.0, 0.5], 0.5)))
    assert kl_quantiles(torch.full((3,), math.nan), torch.zeros(3, dtype=torch.long), ("a",), 50.0) == {}


def test_an_updates_quantiles_are_the_same_in_one_micro_batch_or_many_and_agree_with_the_filter():
    """A peer whose claimed log-probs are far from the receiver's (here 16-90 nats summed; some
    samples above g = 70): the quantiles are the same with micro-batches of 3 as of 24 rows, ordered p50 <= p90 <= p99 <=
    the largest KL, and the share F-TIS dropped is part of the share with KL >= g (its negative
    advantages)."""
    g = torch.Generator().manual_seed(3)
    rng = np.random.default_rng(0)
    samples = []
    for i in range(24):
        p = torch.randint(3, 200, (5,), generator=g).tolist()
        c = torch.randint(3, 200, (int(rng.integers(2, 9)),), generator=g).tolist()
        peer = i % 2 == 1
        lp = (-rng.exponential(0.3 if peer else 5.0, len(c))).astype(np.float32)   # the peer claims confidence
        samples.append(TrainSample(p, c, lp, float(lp.sum()), float(rng.standard_normal()),
                                   "peer" if peer else "me", not peer))
    out = []
    for mb in (3, 24):
        pol = build_policy(PolicyConfig(model="tiny-llama", micro_batch=mb, lr=1e-3))
        out.append(Trainer(pol, ObjectiveConfig(mode="F-TIS", filter_g=G)).step(samples, SP))
    a, b = out
    keys = [k for k in a if "/kl_p" in k or k.endswith("kl_ge_g_frac")]
    assert {"offpolicy/peer/kl_p50", "offpolicy/peer/kl_p99", "offpolicy/peer/kl_ge_g_frac"} <= set(keys)
    for k in keys:
        assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-6), k
    q = [a[f"offpolicy/peer/kl_p{n}"] for n in (50, 90, 99)] + [a["offpolicy/peer/kl_max"]]
    assert q == sorted(q) and q[-1] == pytest.approx(max(q))
    share = a["offpolicy/peer/kl_ge_g_frac"]
    assert 0.0 < share < 1.0, (q, share)
    assert 0.0 < a["offpolicy/peer/filtered_frac"] <= share


def test_the_grid_filter_table_reads_the_quantiles_of_the_peers_samples(tmp_path):
    """Per method x receiver x peer: the rounds' quantiles averaged, the largest KL of any round, the
    shares; a cell made before the quantiles (no kl_p50) gives no row, so older summaries are unchanged."""
    from ftis_fed.grid.plan import Cell
    from ftis_fed.grid.tables import filter_table

    def cell(seed: int, rows: list[dict]) -> Cell:
        write_cell(tmp_path, c := Cell("F-TIS", "vertical", seed), rows)
        return c

    def row(rnd: int, who: str, peer: str, p50: float, mx: float, ge: float, dropped: float) -> dict:
        q = f"offpolicy/{peer}/"
        return {"round": rnd, "participant": who, "phase": "train", q + "kl_p50": p50, q + "kl_p90": 2 * p50,
                q + "kl_p99": 3 * p50, q + "kl_max": mx, q + "kl_ge_g_frac": ge, q + "filtered_frac": dropped,
                f"offpolicy/{who}/kl_p50": 0.0}
    c0 = cell(0, [row(1, "spec", "base", 40.0, 90.0, 0.4, 0.2), row(2, "spec", "base", 60.0, 120.0, 0.6, 0.3),
                  row(1, "base", "spec", 2.0, 5.0, 0.0, 0.0)])
    c1 = cell(1, [row(1, "spec", "base", 20.0, 70.0, 0.2, 0.1)])
    write_cell(tmp_path, old := Cell("TIS", "vertical", 0),
               [{"round": 1, "participant": "spec", "phase": "train", "offpolicy/base/kl_max": 3.0}])
    got = {(r["participant"], r["peer"]): r for r in filter_table([c0, c1, old], tmp_path)}
    assert set(got) == {("spec", "base"), ("base", "spec")}                  # not a receiver's own samples
    s = got[("spec", "base")]
    assert s["method"] == "F-TIS" and s["seeds"] == 2
    assert s["kl_p50"] == pytest.approx((50.0 + 20.0) / 2)                  # per cell over rounds, then seeds
    assert s["kl_p99"] == pytest.approx((150.0 + 60.0) / 2)
    assert s["kl_max"] == 120.0                                              # the largest of any round and seed
    assert s["kl_ge_g_frac"] == pytest.approx((0.5 + 0.2) / 2)
    assert s["filtered_frac"] == pytest.approx((0.25 + 0.1) / 2)


def test_the_filter_section_names_the_methods_that_ran_the_any_sign_variant(tmp_path):
    """The summary's filter section says which methods dropped rewarded samples too (``filter-sign =
    any``, read from each cell's config.json); a grid without such cells reads as before."""
    from ftis_fed.grid.plan import Cell
    from ftis_fed.grid.report import _any_sign_methods, _configs, _objectives, summary_markdown

    cells = [Cell("F-TIS", "vertical", 0), Cell("F-TIS", "vertical", 0, "any", (("filter-sign", "any"),)),
             Cell("TIS", "vertical", 0)]
    for c, objective in zip(cells, ({"filter_sign": "negative"}, {"filter_sign": "any"}, {})):
        write_cell(tmp_path, c, config={"objective": objective})
    assert _any_sign_methods(_objectives(_configs(cells, tmp_path))) == ["F-TIS+any"]
    assert _any_sign_methods(_objectives(_configs(cells[:1] + cells[2:], tmp_path))) == []
    row = {"method": "F-TIS+any", "participant": "spec", "peer": "base", "seeds": 1, "kl_p50": 1.0, "kl_p90": 2.0,
           "kl_p99": 3.0, "kl_max": 4.0, "kl_ge_g_frac": 0.5, "filtered_frac": 0.5}
    with_any = summary_markdown([], [], [], "t", filters=[row], filter_g=50.0, any_sign=["F-TIS+any"])
    without = summary_markdown([], [], [], "t", filters=[row], filter_g=50.0)
    assert "F-TIS+any: `filter-sign = any`, a variant, not the paper" in with_any
    assert "filter-sign" not in without and with_any.replace(
        " F-TIS+any: `filter-sign = any`, a variant, not the paper: it drops every sample with a nonzero advantage "
        "and KL ≥ g.", "") == without
