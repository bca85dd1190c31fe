"""Issue 20: a sender that claims low generation log-probs gets the largest truncated weight C on
every token while passing the k1 filter; ``trunc-mean-cap = 1`` bounds such a completion to the
weight of an on-policy one, and leaves honest senders' completions (almost) untouched, because an
honest sender's truncated weights have mean E_gen[min(pi_theta / pi_gen, C)] <= 1.

Real objective (``ftis_loss``) on log-probs of real sampled tokens (a categorical policy pair)."""

from __future__ import annotations

import torch

from ftis_fed.learn.objective import LossInputs, ObjectiveConfig, cap_row_mean, ftis_loss

T = 24


def _grad_per_row(logp_gen_shift: float, cap: float) -> torch.Tensor:
    """|d loss / d logp| summed per row for [an on-policy row, a row whose sender claims log-probs
    ``logp_gen_shift`` nats per token lower than the receiver's own], same positive advantage."""
    logp = torch.full((2, T), -1.0, requires_grad=True)
    gen = torch.full((2, T), -1.0)
    gen[1] += logp_gen_shift
    x = LossInputs(logp=logp, logp_gen=gen, mask=torch.ones(2, T, dtype=torch.bool),
                   advantages=torch.tensor([1.0, 1.0]), source=torch.tensor([0, 1]),
                   local=torch.tensor([True, False]), source_names=("me", "liar"))
    out = ftis_loss(x, ObjectiveConfig(mode="F-TIS", trunc_mean_cap=cap))
    (g,) = torch.autograd.grad(out.loss, logp)
    return g.abs().sum(-1)


def test_a_logprob_liar_gets_c_times_the_weight_unless_the_mean_cap_bounds_it():
    off = _grad_per_row(-5.0, cap=0.0)
    assert torch.allclose(off[1], 2.0 * off[0])                   # trunc-c = 2: twice an on-policy row
    on = _grad_per_row(-5.0, cap=1.0)
    assert torch.allclose(on[1], on[0]) and torch.allclose(on[0], off[0])


def test_honest_senders_are_rarely_capped():
    """Completions sampled from a generator that differs from the receiver (random logits, 1,000
    completions of 24 tokens): the cap scales their weights by 0.98 or more on average."""
    torch.manual_seed(0)
    V, B = 50, 1000
    gen_logits, rx_logits = torch.randn(T, V), torch.randn(T, V) * 0.7 + torch.randn(T, V) * 0.3
    lp_gen, lp_rx = torch.log_softmax(gen_logits, -1), torch.log_softmax(rx_logits, -1)
    tokens = torch.distributions.Categorical(logits=gen_logits).sample((B,))     # (B,T) from the generator
    idx = torch.arange(T)
    ratio = torch.exp(lp_rx[idx, tokens] - lp_gen[idx, tokens])                   # (B,T)
    w = ratio.clamp(max=2.0)
    mask = torch.ones(B, T, dtype=torch.bool)
    capped = cap_row_mean(w, mask, 1.0)
    assert float(w.mean()) <= 1.0
    assert float((capped.sum(-1) / w.sum(-1)).mean()) >= 0.98
    assert torch.all(capped.mean(-1) <= 1.0 + 1e-6)
    assert torch.equal(cap_row_mean(w, mask, 0.0), w)
