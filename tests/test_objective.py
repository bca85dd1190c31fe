"""The F-TIS objective family against hand-computed values and a slow reference GRPO."""

from __future__ import annotations

import dataclasses

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from ftis_fed.learn.objective import (LOGP_GEN_FLOOR, MODES, LossInputs, ObjectiveConfig, aggregate,
                                compute_advantages, count_denominators, filter_mask, finalize_stats, ftis_loss,
                                kl_estimate, log_ratios, merge_stats, sanitize_generator_logprobs)

LN = math.log


def two_samples(local=(True, False)):
    """Sample A: pi_theta=.5, pi_gen=.1 (ratio 5), A=+1.  Sample B: .2 vs .8 (ratio .25), A=-1."""
    logp = torch.tensor([[LN(0.5)], [LN(0.2)]], requires_grad=True)
    x = LossInputs(logp=logp, logp_gen=torch.tensor([[LN(0.1)], [LN(0.8)]]),
                   mask=torch.ones(2, 1, dtype=torch.bool), advantages=torch.tensor([1.0, -1.0]),
                   source=torch.tensor([0, 1]), local=torch.tensor(local), source_names=("a", "b"))
    return logp, x


# mode -> (loss, dL/dlogp_A, dL/dlogp_B) with g = 1.0 (B's KL = log(.8/.2) = 1.386 >= 1 -> filtered)
HAND = {
    "noIS": (0.0, -0.5, 0.5),          # w=1: (-1 + 1)/2
    "TIS": (-0.875, -1.0, 0.125),      # w_A=min(5,2)=2, w_B=.25: (-2 + .25)/2
    "VIS": (-0.2, 0.0, 0.0),           # R_A=5 clipped to 1.2, R_B=.25 clipped to .8: (-1.2 + .8)/2
    "F-noIS": (-0.5, -0.5, 0.0),       # B filtered: (-1 + 0)/2
    "F-TIS": (-1.0, -1.0, 0.0),        # (-2 + 0)/2
    "F-VIS": (-0.6, 0.0, 0.0),         # (-1.2 + 0)/2
    "alone": (-1.0, -1.0, 0.0),        # only A (local): -1/1
}


@pytest.mark.parametrize("mode", sorted(HAND))
def test_hand_computed_values_per_mode(mode):
    logp, x = two_samples()
    out = ftis_loss(x, ObjectiveConfig(mode=mode, filter_g=1.0))
    out.loss.backward()
    loss, ga, gb = HAND[mode]
    assert out.loss.item() == pytest.approx(loss, abs=1e-6)
    assert logp.grad[0, 0].item() == pytest.approx(ga, abs=1e-6)
    assert logp.grad[1, 0].item() == pytest.approx(gb, abs=1e-6)


def test_vis_inside_clip_has_ratio_gradient():
    logp = torch.tensor([[LN(0.55)]], requires_grad=True)                  # ratio 1.1 vs gen .5
    x = LossInputs(logp=logp, logp_gen=torch.tensor([[LN(0.5)]]), mask=torch.ones(1, 1, dtype=torch.bool),
                   advantages=torch.tensor([1.0]), source=torch.tensor([0]), local=torch.tensor([False]),
                   source_names=("p",))
    out = ftis_loss(x, ObjectiveConfig(mode="VIS"))
    out.loss.backward()
    assert out.loss.item() == pytest.approx(-1.1, abs=1e-6)
    assert logp.grad.item() == pytest.approx(-1.1, abs=1e-6)                 # d(-R A)/dlogp = -R A


def test_diagnostics_hand_values():
    _, x = two_samples()
    m = ftis_loss(x, ObjectiveConfig(mode="F-TIS", filter_g=1.0)).metrics
    assert m["offpolicy/a/ratio_mean"] == pytest.approx(5.0, rel=1e-5)      # raw, before truncation
    assert m["offpolicy/a/truncated_frac"] == 1.0                          # 5 > C=2
    assert m["offpolicy/b/truncated_frac"] == 0.0
    assert m["offpolicy/a/filtered_frac"] == 0.0                           # positive advantage: kept
    assert m["offpolicy/b/filtered_frac"] == 1.0
    assert m["offpolicy/b/kl_mean"] == pytest.approx(LN(4.0), rel=1e-5)     # sum-k1 = log(.8/.2)
    assert m["offpolicy/a/kl_mean"] == pytest.approx(LN(0.2), rel=1e-5)


def test_kl_estimators_hand_values():
    lr = torch.tensor([[LN(5.0), LN(0.25)]])                                # log(pi_theta/pi_gen)
    mask = torch.ones(1, 2, dtype=torch.bool)
    seq = torch.tensor([False])
    k1 = -(LN(5.0) + LN(0.25))
    k3 = (5 - 1 - LN(5.0)) + (0.25 - 1 - LN(0.25))
    assert kl_estimate(lr, mask, seq, "sum-k1", 20.0).item() == pytest.approx(k1, rel=1e-6)
    assert kl_estimate(lr, mask, seq, "mean-k1", 20.0).item() == pytest.approx(k1 / 2, rel=1e-6)
    assert kl_estimate(lr, mask, seq, "sum-k3", 20.0).item() == pytest.approx(k3, rel=1e-6)
    assert kl_estimate(lr, mask, seq, "mean-k3", 20.0).item() == pytest.approx(k3 / 2, rel=1e-6)


def test_length_normalisations_hand_values():
    per_tok = torch.tensor([[1.0, 2.0], [3.0, 99.0]])
    mask = torch.tensor([[True, True], [True, False]])
    rows = torch.tensor([True, True])
    assert aggregate(per_tok, mask, rows, "sequence", 4).item() == pytest.approx((1.5 + 3) / 2)   # GRPO
    assert aggregate(per_tok, mask, rows, "token", 4).item() == pytest.approx(6 / 3)              # DAPO
    assert aggregate(per_tok, mask, rows, "constant", 4).item() == pytest.approx(6 / (2 * 4))     # Dr. GRPO


def test_sequence_level_ratio_uses_product_of_token_ratios():
    # token ratios 2 and .5 -> sequence ratio 1: TIS weight 1 on every token (token-level: 2 and .5)
    logp = torch.tensor([[LN(0.5), LN(0.5)]], requires_grad=True)
    x = LossInputs(logp=logp, logp_gen=torch.tensor([[LN(0.25), LN(1.0)]]), mask=torch.ones(1, 2, dtype=torch.bool),
                   advantages=torch.tensor([1.0]), source=torch.tensor([0]), local=torch.tensor([False]),
                   source_names=("p",))
    out = ftis_loss(x, ObjectiveConfig(mode="TIS", ratio_level="sequence"))
    out.loss.backward()
    assert out.loss.item() == pytest.approx(-1.0, abs=1e-6)
    assert logp.grad[0].tolist() == pytest.approx([-0.5, -0.5], abs=1e-6)
    logp.grad = None
    out = ftis_loss(x, ObjectiveConfig(mode="TIS"))
    out.loss.backward()
    assert out.loss.item() == pytest.approx(-(2 + 0.5) / 2, abs=1e-6)


def test_cross_tokenizer_rows_use_given_sequence_logprob():
    logp = torch.tensor([[LN(0.5), LN(0.5)]], requires_grad=True)
    x = LossInputs(logp=logp, logp_gen=torch.zeros(1, 2), mask=torch.ones(1, 2, dtype=torch.bool),
                   advantages=torch.tensor([1.0]), source=torch.tensor([0]), local=torch.tensor([False]),
                   source_names=("p",), seq_level=torch.tensor([True]),
                   seq_logp_gen=torch.tensor([LN(0.125)]))                    # ratio .25 / .125 = 2
    out = ftis_loss(x, ObjectiveConfig(mode="TIS", trunc_c=10.0))
    assert out.loss.item() == pytest.approx(-2.0, abs=1e-5)


def test_advantages_hand_values():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 5.0, 5.0, 3.0])
    g = torch.tensor([0, 0, 0, 0, 1, 1, 2])
    adv = compute_advantages(r, g)
    std = math.sqrt(4 * 0.25 / 3)
    assert adv[:4].tolist() == pytest.approx([0.5 / (std + 1e-4), -0.5 / (std + 1e-4)] * 1 + [-0.5 / (std + 1e-4),
                                              0.5 / (std + 1e-4)], rel=1e-6)
    assert adv[4:].tolist() == [0.0, 0.0, 0.0]                               # all-equal and singleton
    assert compute_advantages(r, g, scale="none")[:4].tolist() == pytest.approx([0.5, -0.5, -0.5, 0.5])


# ------------------------------------------------------------------ F-TIS == GRPO when nothing is off-policy

def reference_grpo(logp: torch.Tensor, lengths: list[int], adv: torch.Tensor, eps: float = 0.2) -> torch.Tensor:
    """Slow, obvious GRPO (per-sequence normalisation, one epoch, no KL)."""
    total = 0.0
    for i, n in enumerate(lengths):
        s = 0.0
        for t in range(n):
            ratio = torch.exp(logp[i, t] - logp[i, t].detach())
            s = s + torch.minimum(ratio * adv[i], ratio.clamp(1 - eps, 1 + eps) * adv[i])
        total = total - s / max(n, 1)
    return total / len(lengths)


def test_ftis_equals_grpo_in_loss_and_gradients_when_on_policy():
    torch.manual_seed(0)
    B, T, V, H = 6, 7, 11, 5
    W = torch.randn(V, H, requires_grad=True)                               # a real (tiny) model
    h = torch.randn(B, T, H)
    tokens = torch.randint(0, V, (B, T))
    lengths = [7, 3, 0, 5, 7, 1]
    mask = torch.arange(T)[None] < torch.tensor(lengths)[:, None]
    adv = torch.randn(B)

    def logp_of():
        return torch.log_softmax(h @ W.T, -1).gather(-1, tokens[..., None]).squeeze(-1)

    ref = reference_grpo(logp_of(), lengths, adv)
    (g_ref,) = torch.autograd.grad(ref, W)
    lp = logp_of()
    x = LossInputs(logp=lp, logp_gen=lp.detach(), mask=mask, advantages=adv, source=torch.tensor([0, 0, 1, 1, 2, 2]),
                   local=torch.tensor([1, 1, 0, 0, 0, 0]).bool(), source_names=("me", "p1", "p2"))
    out = ftis_loss(x, ObjectiveConfig(mode="F-TIS", trunc_c=math.inf, filter_g=math.inf))
    (g,) = torch.autograd.grad(out.loss, W)
    assert out.loss.item() == pytest.approx(ref.item(), abs=1e-6)
    assert torch.allclose(g, g_ref, atol=1e-6)
    assert g.abs().sum() > 0


# ------------------------------------------------------------------ the filter

def test_filter_drops_exactly_negative_advantage_samples_over_threshold():
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, 0.0, 0.0, -0.5])
    kl = torch.tensor([100.0, 1.0, 100.0, 1.0, 100.0, 1.0, 50.0])
    assert filter_mask(adv, kl, 50.0).tolist() == [False, False, True, False, False, False, True]


def test_the_any_sign_variant_drops_both_signs_over_threshold_never_zero_advantage():
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, 0.0, 0.0, -0.5, 0.5])
    kl = torch.tensor([100.0, 1.0, 100.0, 1.0, 100.0, 1.0, 50.0, math.inf])
    assert filter_mask(adv, kl, 50.0, "any").tolist() == [True, False, True, False, False, False, True, True]


def test_the_any_sign_variant_zeroes_a_far_rewarded_sample_in_the_loss():
    """A peer's sample with positive advantage and KL_i >> g: the paper's filter keeps it (its
    gradient is TIS's), the ``any`` variant drops it (zero gradient, counted as filtered); every
    other row is untouched."""
    lp = torch.log(torch.full((3, 4), 0.5))
    lp_theta = lp.clone()
    lp_theta[1] -= 30.0                                                      # row 1: KL_i = 4 * 30 = 120 nats
    adv = torch.tensor([1.0, 1.0, -1.0])
    grads, filtered = {}, {}
    for sign in ("negative", "any"):
        x = LossInputs(logp=lp_theta.clone().requires_grad_(True), logp_gen=lp, mask=torch.ones(3, 4, dtype=torch.bool),
                       advantages=adv, source=torch.zeros(3, dtype=torch.long), local=torch.zeros(3, dtype=torch.bool),
                       source_names=("p",))
        out = ftis_loss(x, ObjectiveConfig(mode="F-TIS", filter_sign=sign))
        out.loss.backward()
        grads[sign], filtered[sign] = x.logp.grad, out.metrics["offpolicy/p/filtered_frac"]
    assert (grads["negative"][1] != 0).all() and (grads["any"][1] == 0).all()
    assert torch.equal(grads["negative"][[0, 2]], grads["any"][[0, 2]])
    assert (filtered["negative"], filtered["any"]) == (0.0, pytest.approx(1 / 3))


def test_filter_sign_is_checked():
    with pytest.raises(ValueError, match="filter_sign.*negative, any"):
        ObjectiveConfig(filter_sign="positive")


def test_filter_leaves_kept_samples_untouched():
    torch.manual_seed(1)
    B, T = 8, 4
    lp = torch.log_softmax(torch.randn(B, T, 3), -1)[..., 0].clone().requires_grad_(True)
    gen = lp.detach().clone()
    gen[[1, 2, 5]] -= 30.0                                                   # rows 1,2,5 far off-policy (KL < 0)
    gen[[3, 6]] = -1e3                                                       # huge ratio, KL very negative
    gen[[0, 4]] = 0.0                                                        # KL = sum(lp) < 0 ... not > g
    lp2 = lp.detach().clone()
    lp2[[1, 2]] -= 80.0                                                      # pi_theta << pi_gen: KL large
    lp2 = lp2.requires_grad_(True)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0, -1.0, 1.0, 1.0, -1.0])
    base = dict(logp_gen=lp.detach(), mask=torch.ones(B, T, dtype=torch.bool), advantages=adv,
                source=torch.zeros(B, dtype=torch.long), local=torch.zeros(B, dtype=torch.bool), source_names=("p",))
    x = LossInputs(logp=lp2, **base)
    out_f = ftis_loss(x, ObjectiveConfig(mode="F-TIS"))
    out_f.loss.backward()
    g_f = lp2.grad.clone()
    lp2.grad = None
    out_t = ftis_loss(x, ObjectiveConfig(mode="TIS"))
    out_t.loss.backward()
    g_t = lp2.grad.clone()
    # row 1: negative advantage, KL = 4*80 = 320 >= 50 -> dropped; row 2: positive -> kept
    assert g_f[1].abs().sum() == 0 and g_t[1].abs().sum() > 0
    keep = [0, 2, 3, 4, 5, 6, 7]
    assert torch.allclose(g_f[keep], g_t[keep])
    assert out_f.metrics["offpolicy/p/filtered_frac"] == pytest.approx(1 / 8)


# ------------------------------------------------------------------ extreme inputs

@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("est", ["sum-k1", "sum-k3", "mean-k1", "mean-k3"])
@pytest.mark.parametrize("norm", ["sequence", "token", "constant"])
def test_extreme_inputs_give_finite_loss_and_gradients(mode, est, norm):
    B, T = 6, 5
    logp = torch.tensor([[-1e4] * T, [-1e-3] * T, [-2.0] * T, [-0.5] * T, [-1.0] * T, [-1.0] * T], requires_grad=True)
    gen = torch.tensor([[0.0] * T, [-1e4] * T, [float("-inf")] * T, [-0.5] * T, [-1.0] * T, [-3.0] * T])
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[4] = False                                                          # an empty completion
    mask[5, 2:] = False
    for adv in (torch.tensor([1.0, -1.0, -2.0, 0.5, -1.0, 3.0]), torch.zeros(B)):  # incl. all-equal rewards
        logp.grad = None
        x = LossInputs(logp=logp, logp_gen=gen, mask=mask, advantages=adv, source=torch.tensor([0, 0, 1, 1, 2, 2]),
                       local=torch.tensor([1, 0, 0, 1, 0, 1]).bool(), source_names=("a", "b", "c"))
        out = ftis_loss(x, ObjectiveConfig(mode=mode, kl_estimator=est, length_norm=norm, ratio_level="token"))
        out.loss.backward()
        assert torch.isfinite(out.loss)
        assert torch.isfinite(logp.grad).all()
        assert all(math.isfinite(v) for v in out.metrics.values())


def test_all_empty_completions_are_finite():
    logp = torch.zeros(3, 0, requires_grad=True)
    x = LossInputs(logp=logp, logp_gen=torch.zeros(3, 0), mask=torch.zeros(3, 0, dtype=torch.bool),
                   advantages=torch.tensor([1.0, -1.0, 0.0]), source=torch.zeros(3, dtype=torch.long),
                   local=torch.ones(3, dtype=torch.bool), source_names=("a",))
    for mode in MODES:
        out = ftis_loss(x, ObjectiveConfig(mode=mode))
        assert out.loss.item() == 0.0


def test_bad_config_names_field_and_limit():
    with pytest.raises(ValueError, match=r"objective.mode='FTIS'.*one of"):
        ObjectiveConfig(mode="FTIS")
    with pytest.raises(ValueError, match=r"objective.clip_eps=1.5.*\[0, 1\)"):
        ObjectiveConfig(clip_eps=1.5)
    with pytest.raises(ValueError, match="objective.kl_estimator"):
        ObjectiveConfig(kl_estimator="max-k2")


# ------------------------------------------------------------------ properties over random batches

@st.composite
def batches(draw):
    B = draw(st.integers(1, 6))
    T = draw(st.integers(0, 6))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, 4, generator=g) * draw(st.sampled_from([0.1, 1.0, 30.0]))
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None] < lengths[:, None]
    scale = draw(st.sampled_from([0.0, 1.0, 50.0, 1e4]))
    gen = -(torch.rand(B, T, generator=g) * scale)
    adv = torch.randn(B, generator=g) * draw(st.sampled_from([0.0, 1.0, 100.0]))
    src = torch.randint(0, 3, (B,), generator=g)
    seq = torch.rand(B, generator=g) < 0.3
    return logits, mask, gen, adv, src, seq


def _inputs(logits, mask, gen, adv, src, seq, rows=slice(None)):
    logp = torch.log_softmax(logits[rows], -1)[..., 0] if logits.shape[1] else torch.zeros(logits[rows].shape[0], 0)
    return LossInputs(logp=logp, logp_gen=gen[rows], mask=mask[rows], advantages=adv[rows], source=src[rows],
                      local=(src[rows] == 0), source_names=("me", "p1", "p2"), seq_level=seq[rows])


@settings(max_examples=60, deadline=None)
@given(batches(), st.sampled_from(sorted(MODES)), st.sampled_from(["sequence", "token", "constant"]))
def test_random_batches_finite_and_microbatches_add_up(b, mode, norm):
    logits, mask, gen, adv, src, seq = b
    logits = logits.clone().requires_grad_(True)
    cfg = ObjectiveConfig(mode=mode, length_norm=norm, norm_constant=8)
    full = ftis_loss(_inputs(logits, mask, gen, adv, src, seq), cfg)
    assert torch.isfinite(full.loss)
    (g_full,) = torch.autograd.grad(full.loss, logits, allow_unused=True) if full.loss.requires_grad else (None,)
    rows_all = (src == 0) if MODES[mode].local_only else torch.ones_like(src, dtype=torch.bool)
    den = count_denominators(mask, rows_all)
    B = logits.shape[0]
    parts, stats = [], {}
    for s in range(0, B, 2):
        out = ftis_loss(_inputs(logits, mask, gen, adv, src, seq, slice(s, s + 2)), cfg, den)
        parts.append(out.loss)
        out.stats.pop("loss/value")
        stats = merge_stats(stats, out.stats)
    total = sum(parts)
    assert total.item() == pytest.approx(full.loss.item(), rel=1e-4, abs=1e-5)
    if g_full is not None and total.requires_grad:
        (g_parts,) = torch.autograd.grad(total, logits)
        assert torch.isfinite(g_parts).all()
        assert torch.allclose(g_parts, g_full, rtol=1e-4, atol=1e-5)
    m_full = dict(full.metrics)
    m_full.pop("loss/value")
    m_parts = finalize_stats(stats)
    assert m_parts.keys() == m_full.keys()
    for k in m_full:
        assert m_parts[k] == pytest.approx(m_full[k], rel=1e-4, abs=1e-5), k


@settings(max_examples=60, deadline=None)
@given(batches(), st.floats(0.5, 10.0))
def test_truncated_weight_never_exceeds_c(b, c):
    logits, mask, gen, adv, src, seq = b
    logp = torch.log_softmax(logits, -1)[..., 0] if logits.shape[1] else torch.zeros(logits.shape[0], 0)
    logp = logp.detach().requires_grad_(True)
    adv_pos = adv.abs() + 1.0
    x = LossInputs(logp=logp, logp_gen=gen, mask=mask, advantages=adv_pos, source=src, local=src == 0,
                   source_names=("me", "p1", "p2"))
    out = ftis_loss(x, ObjectiveConfig(mode="TIS", trunc_c=c, length_norm="token"))
    if not out.loss.requires_grad:
        return
    out.loss.backward()
    # d/dlogp of -(w * R * A)/N with R=1 in value: -w*A/N, so |grad| * N / A is the weight w <= C
    n_tok = max(int(mask.sum()), 1)
    w = (-logp.grad * n_tok / adv_pos[:, None])[mask]
    assert (w <= c + 1e-4).all() and (w >= 0).all()


@settings(max_examples=40, deadline=None)
@given(batches(), st.sampled_from(["negative", "any"]))
def test_filter_only_changes_filtered_rows(b, sign):
    logits, mask, gen, adv, src, seq = b
    if logits.shape[1] == 0:
        return
    cfg_f, cfg_t = ObjectiveConfig(mode="F-TIS", filter_g=5.0, filter_sign=sign), ObjectiveConfig(mode="TIS")
    grads = []
    for cfg in (cfg_f, cfg_t):
        lg = logits.clone().requires_grad_(True)
        out = ftis_loss(_inputs(lg, mask, gen, adv, src, seq), cfg)
        if out.loss.requires_grad:
            out.loss.backward()
        grads.append(torch.zeros_like(lg) if lg.grad is None else lg.grad)
    x = _inputs(logits, mask, gen, adv, src, seq)
    lp = torch.where(x.mask, x.logp, torch.zeros_like(x.logp)).clamp(min=-1e4)
    gen_s, seq_gen, implausible = sanitize_generator_logprobs(x, x.mask, seq, lp.dtype)
    raw = log_ratios(lp, gen_s, x.mask, seq, seq_gen)
    kl = kl_estimate(raw, x.mask, seq, "sum-k1", 20.0)
    kl = torch.where(implausible, torch.full_like(kl, math.inf), kl)          # implausible: maximally off-policy
    dropped = filter_mask(adv, kl, 5.0, sign)
    keep = ~dropped
    assert torch.allclose(grads[0][keep], grads[1][keep], atol=1e-6)
    assert (grads[0][dropped] == 0).all()


# ------------------------------------------------------------------ issue 13: sequence-level length scaling

@pytest.mark.parametrize("mode", ["VIS", "F-VIS", "TIS", "noIS"])
@pytest.mark.parametrize("norm", ["sequence", "token", "constant"])
def test_sequence_level_rows_get_the_token_level_length_scaling(mode, norm):
    """On-policy rows (pi_theta = pi_gen): every ratio is 1, so a sequence-level row must produce
    the same loss and gradient as a token-level row, per token d/dlogp_t = -A * (1/|a_i|) / N under
    GRPO's length norm. Before the fix, sequence-level VIS gave every token the whole row's
    gradient (|a_i| times too much)."""
    lp = torch.log(torch.tensor([[0.5, 0.4, 0.3], [0.6, 0.1, 0.2]]))
    mask = torch.tensor([[True, True, True], [True, False, False]])
    adv = torch.tensor([1.0, -0.5])
    grads, losses = [], []
    for level in ("token", "sequence"):
        logp = lp.clone().requires_grad_(True)
        x = LossInputs(logp=logp, logp_gen=lp.clone(), mask=mask, advantages=adv, source=torch.tensor([0, 0]),
                       local=torch.tensor([False, False]), source_names=("p",))
        out = ftis_loss(x, ObjectiveConfig(mode=mode, ratio_level=level, length_norm=norm, norm_constant=4))
        out.loss.backward()
        grads.append(logp.grad.clone())
        losses.append(out.loss.item())
    assert losses[1] == pytest.approx(losses[0], abs=1e-6)
    assert torch.allclose(grads[1], grads[0], atol=1e-6)
    if norm == "sequence":
        assert grads[0][0].tolist() == pytest.approx([-1 / 3 / 2] * 3, abs=1e-6)     # -A / |a| / N


def test_cross_tokenizer_vis_row_weighs_like_a_token_level_row():
    """A cross-tokenizer row (sequence-level, given summed generator log-prob) at ratio 1 has the
    gradient of the same row scored token by token."""
    lp = torch.log(torch.tensor([[0.5, 0.4, 0.3, 0.9]]))
    ref = lp.clone().requires_grad_(True)
    x = LossInputs(logp=ref, logp_gen=lp.clone(), mask=torch.ones(1, 4, dtype=torch.bool),
                   advantages=torch.tensor([2.0]), source=torch.tensor([0]), local=torch.tensor([False]),
                   source_names=("p",))
    ftis_loss(x, ObjectiveConfig(mode="VIS")).loss.backward()
    cross = lp.clone().requires_grad_(True)
    x = LossInputs(logp=cross, logp_gen=torch.zeros(1, 4), mask=torch.ones(1, 4, dtype=torch.bool),
                   advantages=torch.tensor([2.0]), source=torch.tensor([0]), local=torch.tensor([False]),
                   source_names=("p",), seq_level=torch.tensor([True]), seq_logp_gen=lp.sum(-1))
    ftis_loss(x, ObjectiveConfig(mode="VIS")).loss.backward()
    assert torch.allclose(cross.grad, ref.grad, atol=1e-6)
    assert cross.grad[0].tolist() == pytest.approx([-2.0 / 4] * 4, abs=1e-6)


# ------------------------------------------------------------------ issue 13: seq_logp_gen sanitised

@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf"), -3e38])
def test_bad_sequence_logprob_cannot_poison_the_batch(mode, bad):
    """A cross-tokenizer row whose summed generator log-prob is NaN/inf/absurd: the loss and every
    gradient stay finite, and the honest row's gradient is the same as with a sane value there."""
    lp = torch.log(torch.tensor([[0.5, 0.4], [0.3, 0.2]]))
    grads = []
    for seq_gen in (torch.tensor([bad, LN(0.1)]), torch.tensor([LN(0.2), LN(0.1)])):
        logp = lp.clone().requires_grad_(True)
        x = LossInputs(logp=logp, logp_gen=torch.zeros(2, 2), mask=torch.ones(2, 2, dtype=torch.bool),
                       advantages=torch.tensor([1.0, 1.0]), source=torch.tensor([0, 1]),
                       local=torch.tensor([True, True]), source_names=("a", "b"),
                       seq_level=torch.tensor([True, True]), seq_logp_gen=seq_gen)
        out = ftis_loss(x, ObjectiveConfig(mode=mode))
        assert torch.isfinite(out.loss)
        out.loss.backward()
        assert torch.isfinite(logp.grad).all()
        assert all(math.isfinite(v) for v in out.metrics.values())
        grads.append(logp.grad.clone())
    assert torch.allclose(grads[0][1], grads[1][1], atol=1e-6)
    if bad != float("inf"):
        m = ftis_loss(LossInputs(logp=lp, logp_gen=torch.zeros(2, 2), mask=torch.ones(2, 2, dtype=torch.bool),
                                 advantages=torch.tensor([1.0, 1.0]), source=torch.tensor([0, 1]),
                                 local=torch.tensor([True, True]), source_names=("a", "b"),
                                 seq_level=torch.tensor([True, True]),
                                 seq_logp_gen=torch.tensor([bad, LN(0.1)])), ObjectiveConfig(mode=mode)).metrics
        if mode != "alone":
            assert m["offpolicy/a/implausible_frac"] == 1.0 and m["offpolicy/b/implausible_frac"] == 0.0


# ------------------------------------------------------------------ issue 10: implausible generator log-probs

def _liar_inputs(claim: float, n: int = 8, seq: bool = False):
    """Row 0: an honest peer's sample; row 1: a peer's sample the receiver finds very unlikely
    (log pi_theta = -15 per token), negative advantage, generator log-probs claimed = ``claim``."""
    logp = torch.full((2, n), -15.0)
    logp[0] = -1.0
    logp = logp.requires_grad_(True)
    gen = torch.full((2, n), claim)
    gen[0] = -1.2
    kw = {}
    if seq:
        kw = dict(seq_level=torch.tensor([False, True]), seq_logp_gen=torch.tensor([-1.2 * n, claim * n]))
        gen[1] = 0.0
    return logp, LossInputs(logp=logp, logp_gen=gen, mask=torch.ones(2, n, dtype=torch.bool),
                            advantages=torch.tensor([1.0, -1.0]), source=torch.tensor([0, 1]),
                            local=torch.tensor([False, False]), source_names=("honest", "liar"), **kw)


@pytest.mark.parametrize("claim", [-3e38, -1e4, -1e3, LOGP_GEN_FLOOR - 0.01, float("-inf"), float("nan")])
@pytest.mark.parametrize("est", ["sum-k1", "mean-k1", "sum-k3", "mean-k3"])
@pytest.mark.parametrize("seq", [False, True], ids=["token", "cross-tokenizer"])
def test_implausible_sender_cannot_get_past_the_filter(claim, est, seq):
    """Claimed generator log-probs below log(1e-30) cannot come from an honest sampler: the sample is
    treated as maximally off-policy, so with a negative advantage the F filter drops it (before the
    rule, -3e38 drove the summed k1 estimate to about -8e4 and the sample was kept)."""
    g = 50.0 if est.startswith("sum") else 0.5
    logp, x = _liar_inputs(claim, seq=seq)
    out = ftis_loss(x, ObjectiveConfig(mode="F-TIS", kl_estimator=est, filter_g=g))
    out.loss.backward()
    assert logp.grad[1].abs().sum() == 0                                       # the liar's sample is dropped
    assert logp.grad[0].abs().sum() > 0                                        # the honest one is kept
    m = out.metrics
    assert m["offpolicy/liar/filtered_frac"] == 1.0 and m["offpolicy/liar/implausible_frac"] == 1.0
    assert m["offpolicy/honest/implausible_frac"] == 0.0
    assert all(math.isfinite(v) for v in m.values())


def test_implausible_claims_bound_the_importance_weight_by_c():
    """Positive-advantage samples are kept however off-policy; an implausible claim buys at most C."""
    logp, x = _liar_inputs(-3e38)
    x.advantages = torch.tensor([1.0, 1.0])
    out = ftis_loss(x, ObjectiveConfig(mode="F-TIS"))
    out.loss.backward()
    n = logp.shape[1]
    assert logp.grad[1].tolist() == pytest.approx([-2.0 / n / 2] * n, abs=1e-6)   # w = C = 2, A = 1, N = 2


def test_plausible_claims_keep_the_unclamped_estimate_and_the_floor_is_log_1e_minus_30():
    assert LOGP_GEN_FLOOR == pytest.approx(-69.0776, abs=1e-4)
    logp, x = _liar_inputs(-60.0)                                              # low but plausible
    gen, _, implausible = sanitize_generator_logprobs(x, x.mask, torch.zeros(2, dtype=torch.bool), torch.float32)
    assert not implausible.any() and gen[1, 0].item() == -60.0


def test_kl_estimate_clamps_each_token_symmetrically():
    lr = torch.tensor([[100.0, -100.0, 0.5]])                                  # log(pi_theta / pi_gen)
    mask = torch.ones(1, 3, dtype=torch.bool)
    seq = torch.tensor([False])
    assert kl_estimate(lr, mask, seq, "sum-k1", 20.0).item() == pytest.approx(-20 + 20 - 0.5)
    assert kl_estimate(lr[:, :1], mask[:, :1], seq, "sum-k1", 20.0).item() == pytest.approx(-20.0)
    k3 = math.expm1(-20.0) + 20.0
    assert kl_estimate(lr[:, 1:2], mask[:, :1], seq, "sum-k3", 20.0).item() == pytest.approx(k3)
    # a sequence-level row: the per-token average is clamped
    assert kl_estimate(torch.tensor([[-300.0, -300.0]]), torch.ones(1, 2, dtype=torch.bool), torch.tensor([True]),
                       "sum-k1", 20.0).item() == pytest.approx(40.0)


# ------------------------------------------------------------------ samples_from_batches (training.py)

import numpy as np  # noqa: E402

from ftis_fed.wire.batch import BatchValidationError, CompletionBatch, SamplingParams, make_group  # noqa: E402
from ftis_fed.learn.training import (advantage_group_metrics, completion_ended, samples_from_batches,  # noqa: E402
                               sender_eos_id)


def _batch(sender, tasks, rewards, fp="tok-a", budget=8, completions=None, logprobs=None):
    """One batch of ``sender``: per task, len(rewards[k]) completions of 3 tokens."""
    groups = []
    for k, (task, rw) in enumerate(zip(tasks, rewards)):
        comps = completions[k] if completions else [[5, 6, 7]] * len(rw)
        lps = logprobs[k] if logprobs else [[-1.0] * len(c) for c in comps]
        groups.append(make_group([1, 2], comps, lps, rw, task, "ref", "question", ["text"] * len(rw)))
    return CompletionBatch(sender=sender, run_id="r", round=0, seq=1, model_id="m", tokenizer_fp=fp, vocab_size=100,
                           sampling=SamplingParams(max_new_tokens=budget), groups=tuple(groups)).validate()


def test_alone_never_sees_peers_also_with_horizontal_groups():
    """Issue 13: alone + horizontal computed advantages over every sender's completions of a task
    before dropping the peers' rows, so Alone's update depended on its peers."""
    own = _batch("me", ["t/0", "t/1"], [[1.0, 0.0, 0.0], [0.0, 1.0, 1.0]])
    peer = _batch("peer", ["t/0", "t/1"], [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    for groups in ("vertical", "horizontal"):
        cfg = ObjectiveConfig(mode="alone", advantage_groups=groups)
        alone = samples_from_batches([own], "me", "tok-a", cfg)
        mixed = samples_from_batches([own, peer], "me", "tok-a", cfg)
        assert all(s.local for s in mixed)
        assert [s.advantage for s in mixed] == [s.advantage for s in alone]
        assert [s.group for s in mixed] == [s.group for s in alone]


def test_horizontal_groups_mix_senders_of_the_same_task():
    """Each of two senders generated part (2) of each shared prompt's group (4): the advantages are
    those of the mixed group of 4, and the metrics count the groups as mixed."""
    a = _batch("a", ["t/0", "t/1"], [[1.0, 0.0], [1.0, 1.0]])
    b = _batch("b", ["t/0", "t/1"], [[1.0, 1.0], [0.0, 1.0]], fp="tok-a")
    cfg = ObjectiveConfig(mode="F-TIS", advantage_groups="horizontal")
    samples = samples_from_batches([a, b], "a", "tok-a", cfg)
    ref = compute_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 1.0]),
                             torch.tensor([0, 0, 1, 1, 0, 0, 1, 1]))
    assert [s.advantage for s in samples] == pytest.approx(ref.tolist())
    assert [s.group for s in samples] == ["t/0", "t/0", "t/1", "t/1"] * 2
    m = advantage_group_metrics(samples, cfg)
    assert m == {"train/advantage_groups": 2.0, "train/horizontal_mixed_groups": 2.0,
                 "train/horizontal_unshared_groups": 0.0}
    vertical = samples_from_batches([a, b], "a", "tok-a", ObjectiveConfig(advantage_groups="vertical"))
    assert [s.advantage for s in vertical] != [s.advantage for s in samples]


def test_horizontal_with_disjoint_prompts_is_reported_unshared():
    """Today's schedule gives participants disjoint prompts: horizontal then equals vertical, and
    the metrics say so."""
    a = _batch("a", ["t/0"], [[1.0, 0.0]])
    b = _batch("b", ["t/1"], [[0.0, 1.0]])
    cfg = ObjectiveConfig(advantage_groups="horizontal")
    samples = samples_from_batches([a, b], "a", "tok-a", cfg)
    m = advantage_group_metrics(samples, cfg)
    assert m["train/horizontal_mixed_groups"] == 0.0 and m["train/horizontal_unshared_groups"] == 2.0
    vertical = samples_from_batches([a, b], "a", "tok-a", ObjectiveConfig())
    assert [s.advantage for s in samples] == [s.advantage for s in vertical]
    assert "train/horizontal_mixed_groups" not in advantage_group_metrics(vertical, ObjectiveConfig())


def test_sender_eos_is_derived_from_its_own_batch():
    """Completions shorter than the budget stopped at EOS, so their common last id is the sender's
    EOS; a completion as long as the budget ended only if its last token is that id."""
    b = _batch("peer", ["t/0"], [[1.0, 0.0, 0.0, 1.0]], budget=4,
               completions=[[[5, 9], [5, 6, 7, 8], [5, 6, 7, 9], [9]]])
    assert sender_eos_id(b) == 9
    ended = [completion_ended(c, 4, 9) for c in b.groups[0].completion_ids]
    assert ended == [True, False, True, True]
    assert sender_eos_id(_batch("p", ["t/0"], [[1.0]], budget=3, completions=[[[5, 6, 7]]])) is None
    assert completion_ended(np.array([5, 6, 7]), 3, None) is False              # cut at the budget
    assert completion_ended(np.array([5, 6]), 3, None) is True                 # stopped early: EOS
    calls = []
    samples_from_batches([b], "me", "tok-other", ObjectiveConfig(),
                         retokenize=lambda p, c, e: calls.append(e) or ([1], [2, 3]))
    assert calls == [True, False, True, True]


def test_a_carried_eos_id_decides_what_inference_cannot():
    """Issue 18: no completion stopped early and one completion's EOS is exactly its budget-th token.
    Inferred, every completion looks cut (no EOS id to read); carried by the batch (``eos_id``),
    the one ending with EOS is read as ended, the others as cut."""
    b = _batch("peer", ["t/0"], [[1.0, 0.0]], budget=3, completions=[[[5, 6, 9], [5, 6, 7]]])
    assert sender_eos_id(b) is None
    calls = []
    retok = lambda p, c, e: calls.append(e) or ([1], [2, 3])                  # noqa: E731
    samples_from_batches([b], "me", "tok-other", ObjectiveConfig(), retokenize=retok)
    assert calls == [False, False]                                            # inference: both "cut"
    calls.clear()
    samples_from_batches([dataclasses.replace(b, eos_id=9).validate()], "me", "tok-other", ObjectiveConfig(),
                         retokenize=retok)
    assert calls == [True, False]
    with pytest.raises(BatchValidationError, match="eos_id=100"):
        dataclasses.replace(b, eos_id=100).validate()


def test_implausible_claims_are_flagged_per_completion():
    b = _batch("peer", ["t/0"], [[1.0, 0.0, 0.0]],
               logprobs=[[[-1.0, -2.0, -69.0], [-1.0, -3e38, -1.0], [-1.0, -70.0, -1.0]]])
    for fp in ("tok-a", "tok-other"):                                        # same and cross tokenizer
        samples = samples_from_batches([b], "me", fp, ObjectiveConfig(), retokenize=lambda p, c, e: ([1], [2, 3]))
        assert [s.implausible for s in samples] == [False, True, True]


# ------------------------------------------------------------------ issue 29: GSPO's sequence-mean ratio

def _one_row(logp_vals, gen_vals, adv=1.0):
    logp = torch.tensor([logp_vals], requires_grad=True)
    return logp, LossInputs(logp=logp, logp_gen=torch.tensor([gen_vals]),
                            mask=torch.ones(1, len(logp_vals), dtype=torch.bool), advantages=torch.tensor([adv]),
                            source=torch.tensor([0]), local=torch.tensor([False]), source_names=("p",))


def test_sequence_mean_is_gspo_s_mean_log_ratio_and_sequence_the_sum():
    """The issue's figures: -0.1 nat/token over 40 tokens weighs exp(-4) = 0.018 summed, exp(-0.1) =
    0.905 as GSPO's mean; TIS's weight is min(ratio, C) at either level (loss = -w with A = 1)."""
    _, x = _one_row([math.log(0.5)] * 40, [math.log(0.5) + 0.1] * 40)
    got = {level: -ftis_loss(x, ObjectiveConfig(mode="TIS", ratio_level=level)).loss.item()
           for level in ("sequence", "sequence-mean")}
    assert got["sequence"] == pytest.approx(math.exp(-4.0), rel=1e-5)
    assert got["sequence-mean"] == pytest.approx(math.exp(-0.1), rel=1e-5)
    # truncation: token ratios 3, 3 -> summed 9 and mean 3, both cut at C = 2; at C = 5 only the sum is
    _, x = _one_row([math.log(0.6)] * 2, [math.log(0.2)] * 2)
    for c, want in ((2.0, {"sequence": 2.0, "sequence-mean": 2.0}), (5.0, {"sequence": 5.0, "sequence-mean": 3.0})):
        for level, w in want.items():
            assert -ftis_loss(x, ObjectiveConfig(mode="TIS", ratio_level=level, trunc_c=c)).loss.item() \
                == pytest.approx(w, rel=1e-5)


def test_sequence_mean_gradient_is_trl_s_gspo_gradient():
    """VIS at ``sequence-mean`` with GRPO's length norm has TRL's GSPO gradient (TRL 1.16
    ``importance_sampling_level = "sequence"``: log_iw = masked mean of log pi_theta - log pi_old,
    broadcast over the row's tokens, loss_type grpo), rows of different lengths."""
    torch.manual_seed(0)
    lp = torch.log(torch.rand(3, 5) * 0.5 + 0.3)
    gen = lp + 0.05 * torch.randn(3, 5)                      # near on-policy: no clipping on either side
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]], dtype=torch.bool)
    adv = torch.tensor([1.0, -0.5, 0.3])
    ours = lp.clone().requires_grad_(True)
    x = LossInputs(logp=ours, logp_gen=gen, mask=mask, advantages=adv, source=torch.zeros(3, dtype=torch.long),
                   local=torch.zeros(3, dtype=torch.bool), source_names=("p",))
    ftis_loss(x, ObjectiveConfig(mode="VIS", ratio_level="sequence-mean", length_norm="sequence")).loss.backward()
    trl = lp.clone().requires_grad_(True)                    # TRL's computation, written out
    m = mask.float()
    log_iw = (((trl - gen) * m).sum(-1) / m.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef = torch.exp(log_iw)
    per_token = -torch.min(coef * adv[:, None], torch.clamp(coef, 0.8, 1.2) * adv[:, None])
    (((per_token * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean()).backward()
    assert torch.allclose(ours.grad, trl.grad, atol=1e-6)


def test_ratio_level_values_are_checked():
    assert ObjectiveConfig(ratio_level="sequence-mean").ratio_level == "sequence-mean"
    with pytest.raises(ValueError, match=r"ratio_level='gspo': must be one of token, sequence, sequence-mean"):
        ObjectiveConfig(ratio_level="gspo")
