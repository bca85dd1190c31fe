"""From received batches to one optimizer step on the F-TIS objective.

``samples_from_batches`` turns completion batches (the receiver's own and its peers') into
``TrainSample`` rows: advantages computed per group *before* any filtering (vertical: each sender's
G completions of a prompt; horizontal: every sender's completions of the same task), and samples
from a different tokenizer re-tokenized from their text and marked for a sequence-level ratio.

``ftis_step`` runs the objective over micro-batches with the whole update's denominators (so the
micro-batch losses add up to the full-batch loss), accumulates gradients, clips, and steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from .batch import CompletionBatch
from .objective import (LossInputs, ObjectiveConfig, compute_advantages, count_denominators, ftis_loss,
                        merge_stats, finalize_stats, MODES)


@dataclass
class TrainSample:
    """One completion as the receiver trains on it (ids in the receiver's tokenizer).

    logp_gen: (T,) the generator's per-token log-probs (zeros when ``seq_level``).
    seq_logp_gen: the generator's summed log-prob of the completion.
    seq_level: the generator's tokenizer differs: only a sequence-level ratio is defined.
    """

    prompt_ids: list[int]
    completion_ids: list[int]
    logp_gen: np.ndarray
    seq_logp_gen: float
    advantage: float
    source: str
    local: bool
    seq_level: bool = False


Retokenize = Callable[[str, str], tuple[list[int], list[int]]]


def samples_from_batches(batches: Sequence[CompletionBatch], receiver: str, tokenizer_fp: str,
                         cfg: ObjectiveConfig, retokenize: Retokenize | None = None,
                         sample_weights: dict[tuple[int, int], np.ndarray] | None = None) -> list[TrainSample]:
    """Rows for ``ftis_step`` from all batches of one update.

    receiver: this participant's id (its own batches are ``local``).
    retokenize(prompt_text, completion_text) -> (prompt_ids, completion_ids) in the receiver's
        tokenizer; needed for batches whose ``tokenizer_fp`` differs (they must carry texts).
    sample_weights[(batch_index, group_index)]: per-completion multipliers of the advantage
        (down-weighting after reward disagreement), applied after normalisation.
    """
    rows: list[dict] = []
    for bi, b in enumerate(batches):
        cross = b.tokenizer_fp != tokenizer_fp
        if cross and retokenize is None:
            raise ValueError(f"batch from {b.sender!r} has tokenizer {b.tokenizer_fp}, receiver has "
                             f"{tokenizer_fp}: a retokenize function is needed")
        for gi, g in enumerate(b.groups):
            rewards = g.rewards
            weights = (sample_weights or {}).get((bi, gi), np.ones(g.size))
            if cross and (not g.completion_texts or not g.prompt_text):
                raise ValueError(f"batch from {b.sender!r}: cross-tokenizer use needs prompt_text and "
                                 "completion_texts in the batch")
            for i in range(g.size):
                if cross:
                    p_ids, c_ids = retokenize(g.prompt_text, g.completion_texts[i])
                    lp = np.zeros(len(c_ids), dtype=np.float32)
                else:
                    p_ids, c_ids, lp = g.prompt_ids.tolist(), g.completion_ids[i].tolist(), g.logprobs[i]
                group_key = f"{bi}/{gi}" if cfg.advantage_groups == "vertical" else g.task_id
                rows.append(dict(prompt_ids=p_ids, completion_ids=c_ids, logp_gen=lp,
                                 seq_logp_gen=float(np.sum(g.logprobs[i], dtype=np.float64)),
                                 reward=float(rewards[i]), weight=float(weights[i]), group=group_key,
                                 source=b.sender, local=b.sender == receiver, seq_level=cross))
    if not rows:
        return []
    keys = {k: j for j, k in enumerate(dict.fromkeys(r["group"] for r in rows))}
    adv = compute_advantages(torch.tensor([r["reward"] for r in rows], dtype=torch.float64),
                             torch.tensor([keys[r["group"]] for r in rows]), cfg.scale_rewards)
    return [TrainSample(r["prompt_ids"], r["completion_ids"], r["logp_gen"], r["seq_logp_gen"],
                        float(a) * r["weight"], r["source"], r["local"], r["seq_level"])
            for r, a in zip(rows, adv.tolist())]


def _pad(arrays: Sequence[np.ndarray], T: int) -> torch.Tensor:
    out = torch.zeros((len(arrays), T), dtype=torch.float32)                      # (b,T)
    for i, a in enumerate(arrays):
        out[i, : len(a)] = torch.as_tensor(np.asarray(a, dtype=np.float32))
    return out


def row_order(prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]],
              group_prompts: bool) -> list[int]:
    """The order rows are cut into micro-batches: longest first (least padding); with ``group_prompts``,
    the rows of one prompt stay contiguous (groups longest first, then longest completion first)."""
    n = len(prompt_ids)
    if not group_prompts:
        return sorted(range(n), key=lambda i: -len(prompt_ids[i]) - len(completion_ids[i]))
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, p in enumerate(prompt_ids):
        groups.setdefault(tuple(p), []).append(i)
    longest = {k: max(len(prompt_ids[i]) + len(completion_ids[i]) for i in rows) for k, rows in groups.items()}
    order: list[int] = []
    for k in sorted(groups, key=lambda k: -longest[k]):
        order += sorted(groups[k], key=lambda i: -len(completion_ids[i]))
    return order


ScoreFn = Callable[[Sequence[Sequence[int]], Sequence[Sequence[int]], bool], torch.Tensor]


def ftis_step(score: ScoreFn, params: Sequence[torch.nn.Parameter], optimizer: torch.optim.Optimizer,
              samples: Sequence[TrainSample], cfg: ObjectiveConfig, micro_batch: int,
              max_grad_norm: float, logp_old: Sequence[torch.Tensor] | None = None,
              group_prompts: bool = False) -> dict[str, float]:
    """One optimizer step of the F-TIS objective over ``samples``.

    score(prompt_ids, completion_ids, grad) -> (b,T) padded log-probs under the current weights.
    logp_old: per-sample (T_i,) log-probs before this update (multi-epoch PPO); None = first epoch.
    group_prompts: micro-batches keep the rows of one prompt together (see ``row_order``), so a
        shared-prefix ``score`` computes each prompt once.
    Returns finalised metrics: loss, grad norm, per-source off-policy diagnostics.
    """
    if MODES[cfg.mode].local_only:
        keep = [i for i, s in enumerate(samples) if s.local]
        samples = [samples[i] for i in keep]
        logp_old = [logp_old[i] for i in keep] if logp_old is not None else None
    optimizer.zero_grad(set_to_none=True)
    if not samples:
        return {"train/samples": 0.0}
    names = tuple(dict.fromkeys(s.source for s in samples))
    lengths = torch.tensor([len(s.completion_ids) for s in samples])
    all_mask = torch.arange(int(lengths.max()))[None, :] < lengths[:, None]
    denominators = count_denominators(all_mask, torch.ones(len(samples), dtype=torch.bool))
    order = row_order([s.prompt_ids for s in samples], [s.completion_ids for s in samples], group_prompts)
    stats: dict[str, float] = {}
    loss_total = 0.0
    for start in range(0, len(order), micro_batch):
        idx = order[start:start + micro_batch]
        mb = [samples[i] for i in idx]
        logp = score([s.prompt_ids for s in mb], [s.completion_ids for s in mb], True)  # (b,T)
        T = logp.shape[1]
        mask = torch.arange(T)[None, :] < torch.tensor([len(s.completion_ids) for s in mb])[:, None]
        x = LossInputs(
            logp=logp, logp_gen=_pad([s.logp_gen for s in mb], T), mask=mask,
            advantages=torch.tensor([s.advantage for s in mb], dtype=torch.float32),
            source=torch.tensor([names.index(s.source) for s in mb]),
            local=torch.tensor([s.local for s in mb]), source_names=names,
            logp_old=_pad([logp_old[i] for i in idx], T) if logp_old is not None else None,
            seq_level=torch.tensor([s.seq_level for s in mb]),
            seq_logp_gen=torch.tensor([s.seq_logp_gen for s in mb], dtype=torch.float32),
        )
        out = ftis_loss(x, cfg, denominators)
        if out.loss.requires_grad:
            out.loss.backward()
        loss_total += float(out.loss.detach())
        out.stats.pop("loss/value", None)
        stats = merge_stats(stats, out.stats)
    grad_norm = torch.nn.utils.clip_grad_norm_([p for p in params if p.grad is not None], max_grad_norm)
    finite = bool(torch.isfinite(grad_norm))
    if finite:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    metrics = finalize_stats(stats)
    metrics.update({"train/loss": loss_total, "train/grad_norm": float(grad_norm),
                    "train/skipped_nonfinite": float(not finite), "train/samples": float(len(samples)),
                    "train/tokens": float(denominators[1])})
    return metrics
