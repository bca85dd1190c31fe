"""``ftis-fed bench loss``: F-TIS vs plain GRPO, loss + backward on the same batch and model.

Both contenders run the same teacher-forced forward (chunked log-probs) and backward through the
same model; only the objective differs. The plain GRPO baseline is the textbook per-sequence
clipped surrogate (no importance weights, no filter, no diagnostics). Also reported: the ratio for
the objective alone on fixed log-probs, where F-TIS's extra work is not hidden by the model. The
command line is ``bench/cli.py``.
"""

from __future__ import annotations

import statistics

import torch

from ftis_fed.bench.common import interleaved_times, median_ratio
from ftis_fed.learn.objective import LossInputs, ObjectiveConfig, ftis_loss
from ftis_fed.policies import PolicyConfig
from ftis_fed.policies.hf import HFPolicy
from ftis_fed.wire.batch import SamplingParams


def plain_grpo_loss(logp: torch.Tensor, mask: torch.Tensor, adv: torch.Tensor, eps: float = 0.2) -> torch.Tensor:
    """GRPO: -mean_i (1/|a_i|) sum_t min(R A, clip(R) A), R = pi / stopgrad(pi)."""
    ratio = torch.exp(logp - logp.detach())                                     # (B,T)
    a = adv[:, None]
    per_tok = -torch.minimum(ratio * a, ratio.clamp(1 - eps, 1 + eps) * a)
    per_tok = torch.where(mask, per_tok, torch.zeros_like(per_tok))
    return (per_tok.sum(-1) / mask.sum(-1).clamp(min=1)).mean()


def run(model: str = "smollm2", rows: int = 16, prompt_len: int = 40, completion_len: int = 64,
        repeats: int = 5, seed: int = 0) -> dict:
    torch.manual_seed(seed)
    pol = HFPolicy(PolicyConfig(model=model, micro_batch=rows, dtype="fp32"))
    V = pol.vocab_size
    prompts = torch.randint(0, V, (rows, prompt_len)).tolist()
    lengths = torch.randint(completion_len // 2, completion_len + 1, (rows,))
    lengths[0] = completion_len
    comps = [torch.randint(0, V, (int(n),)).tolist() for n in lengths]
    sampling = SamplingParams(temperature=0.7, max_new_tokens=completion_len)
    mask = torch.arange(completion_len)[None] < lengths[:, None]                 # (B,T)
    with torch.no_grad():
        base = pol.score_padded(prompts, comps, sampling, grad=False)
    logp_gen = (base - 0.3 * torch.rand_like(base)).clamp(max=0)                 # a peer's log-probs
    adv = torch.randn(rows)
    src = torch.arange(rows) % 3
    cfg = ObjectiveConfig(mode="F-TIS", norm_constant=completion_len)

    def inputs(logp):
        return LossInputs(logp=logp, logp_gen=logp_gen, mask=mask, advantages=adv, source=src, local=src == 0,
                          source_names=("me", "p1", "p2"))

    def step(objective):
        def fn():
            pol.model.zero_grad(set_to_none=True)
            logp = pol.score_padded(prompts, comps, sampling, grad=True)
            loss = plain_grpo_loss(logp, mask, adv) if objective == "grpo" else ftis_loss(inputs(logp), cfg).loss
            loss.backward()
        return fn

    t_model = interleaved_times({"ftis": step("ftis"), "grpo": step("grpo")}, repeats)
    leaf = base.clone().requires_grad_(True)

    def loss_only(objective):
        def fn():
            for _ in range(20):
                leaf.grad = None
                loss = plain_grpo_loss(leaf, mask, adv) if objective == "grpo" else ftis_loss(inputs(leaf), cfg).loss
                loss.backward()
        return fn

    t_loss = interleaved_times({"ftis": loss_only("ftis"), "grpo": loss_only("grpo")}, repeats)
    return {
        "bench": "loss", "model": model, "rows": rows, "prompt_len": prompt_len, "completion_len": completion_len,
        "repeats": repeats, "threads": torch.get_num_threads(),
        "ftis_over_grpo_loss_backward": round(median_ratio(t_model, "ftis", "grpo"), 4),
        "target": 1.05,
        "ftis_over_grpo_objective_only": round(median_ratio(t_loss, "ftis", "grpo"), 4),
        "grpo_step_spread": round(statistics.pstdev(t_model["grpo"]) / statistics.mean(t_model["grpo"]), 4),
    }
