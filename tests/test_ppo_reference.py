"""``updates-per-round`` > 1 reads the PPO clip's reference off the round's first step: the same metrics
and weights, bit for bit, as the plain computation (a no-grad ``old_logprobs`` pass over the samples in
their order, then the steps), which is what the committed research-w cells ran. The rows whose first-step
micro-batch is laid out like their ``old_logprobs`` chunk take the reference from that forward, the others
are scored beforehand with their chunk's layout (``Policy.score_layout``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ftis_fed.learn.objective import ObjectiveConfig
from ftis_fed.learn.training import Trainer, TrainSample
from ftis_fed.policies import PolicyConfig, build_policy
from ftis_fed.policies.logprobs import token_layout, token_logprobs
from ftis_fed.wire.batch import SamplingParams

#: (sender, prompt length, completion lengths): two senders' groups of other prompt and completion
#: lengths, so that the first step's micro-batches (groups longest first: A, C | B, D) are laid out unlike
#: the ``old_logprobs`` chunks (the samples in order: A, B | C, D) for every group but A
GROUPS = (("me", 7, (6, 1, 2, 3)), ("me", 5, (2, 3, 1, 2)), ("peer", 6, (5, 4, 1, 2)), ("peer", 4, (1, 2, 2, 1)))


def samples(vocab: int, seed: int = 0) -> list[TrainSample]:
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    out = []
    for sender, p_len, c_lens in GROUPS:
        prompt = torch.randint(0, vocab, (p_len,), generator=g).tolist()
        for n in c_lens:
            out.append(TrainSample(prompt, torch.randint(0, vocab, (n,), generator=g).tolist(),
                                   -rng.exponential(0.5, n).astype(np.float32), 0.0,
                                   float(rng.standard_normal()), sender, sender == "me"))
    return out


def trained(cfg: PolicyConfig, rows: list[TrainSample], sampling: SamplingParams, plain: bool):
    """(metrics of the round's update, weights after it, no-grad rows scored) on a fresh policy."""
    pol = build_policy(cfg)
    scored = []
    score = pol.score_padded
    pol.score_padded = lambda p, c, s, g, *a, _f=score, **k: (scored.append(0 if g else len(p)), _f(p, c, s, g, *a, **k))[1]
    trainer = Trainer(pol, ObjectiveConfig(mode="F-TIS"))
    torch.manual_seed(0)
    if plain:                                            # what Trainer.step computed before
        old = trainer.old_logprobs(rows, sampling)
        m = trainer.one_step(rows, sampling, None)
        last = trainer.one_step(rows, sampling, old)
        m.update({k: last[k] for k in ("train/loss", "train/grad_norm", "train/lr")})
    else:
        m = trainer.step(rows, sampling)
    return m, pol.trainable_state(), sum(scored)


@pytest.mark.parametrize("adapter, dropout, top_p", [("full", 0.0, 1.0), ("lora", 0.0, 1.0),
                                                     pytest.param("full", 0.0, 0.9, marks=pytest.mark.slow),
                                                     pytest.param("lora", 0.1, 1.0, marks=pytest.mark.slow)])
def test_the_reference_off_the_first_step_gives_the_same_update_bit_for_bit(adapter, dropout, top_p):
    """Full fine-tuning and LoRA; the fused LM head (top-p 1: the reference is the head's no-grad values
    beside it) and the autograd head (top-p 0.9); LoRA dropout (the reference then comes from a no-grad
    pass in evaluation mode, as before)."""
    cfg = PolicyConfig(model="tiny-llama", adapter=adapter, lora_r=4, lora_dropout=dropout, micro_batch=8, lr=3e-3,
                       updates_per_round=2)
    sampling = SamplingParams(temperature=0.7, top_p=top_p, max_new_tokens=16)
    rows = samples(1000)
    m0, w0, scored0 = trained(cfg, rows, sampling, plain=True)
    m1, w1, scored1 = trained(cfg, rows, sampling, plain=False)
    assert {k: v for k, v in m1.items() if k not in ("train/updates", "train/advantage_groups")} == m0
    assert w1.keys() == w0.keys() and all(torch.equal(w1[k], w0[k]) for k in w0)
    assert not all(torch.equal(w0[k], v) for k, v in build_policy(cfg).trainable_state().items())   # it trained
    assert scored0 == len(rows)
    # before the step, only the rows laid out otherwise there (all but group A's 4) are scored without a
    # graph; with dropout every chunk, as before
    assert scored1 == (len(rows) - 4 if dropout == 0 else len(rows))


def test_a_row_gets_the_same_log_probs_in_any_call_of_its_layout():
    """A row's values depend on the other rows of a shared-prefix call only through the layout (P, T): a
    call on a subset, padded to the whole call's layout, gives them bit for bit; order does not matter."""
    pol = build_policy(PolicyConfig(model="tiny-llama"))
    rows = samples(1000)
    P, C = [r.prompt_ids for r in rows], [r.completion_ids for r in rows]
    sampling = SamplingParams(temperature=0.7, max_new_tokens=16)
    layout = token_layout(pol.model, P, C, share_prefix=True)
    assert layout == ("shared", 7, 6)
    with torch.no_grad():
        whole = token_logprobs(pol.model, P, C, sampling, pol.tokenizer.pad_token_id, grad=False, share_prefix=True)
        some = [9, 2, 14, 3]                                  # one row of each group: no prompt repeats
        part = token_logprobs(pol.model, [P[i] for i in some], [C[i] for i in some], sampling,
                              pol.tokenizer.pad_token_id, grad=False, layout=layout)
    assert part.shape == (4, 6) and torch.equal(part, whole[some])
    assert token_layout(pol.model, P[:1], C[:1], share_prefix=True) is None   # nothing shared: not described
    assert token_layout(pol.model, P, C, share_prefix=False) is None
