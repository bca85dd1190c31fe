"""From received batches to one optimizer step on the F-TIS objective; the optimizer lives here.

``samples_from_batches`` turns completion batches (the receiver's own and its peers') into
``TrainSample`` rows: advantages computed per group *before* any filtering (vertical: each sender's
G completions of a prompt; horizontal: every sender's completions of the same task id, a mixed
group), and samples from a different tokenizer re-tokenized from their text and marked for a
sequence-level ratio. In a local-only mode (``alone``) peers' batches are dropped *before* the
advantages are computed, so nothing of a peer reaches the update.

``Trainer`` owns the optimisation of one model backend (``policies.base.Policy``): the optimizer
(``make_optimizer``: AdamW, or bitsandbytes 8-bit / paged 8-bit AdamW) over the backend's trainable
parameters, ``step(samples, sampling)`` (one F-TIS step, then the backend is told
its weights changed), and the checkpoint (trainable weights + optimizer + step count).

``ftis_step`` runs the objective over micro-batches with the whole update's denominators (so the
micro-batch losses add up to the full-batch loss), accumulates gradients, clips, and steps.
"""

from __future__ import annotations

import copy
import math
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np
import torch

from ftis_fed.atomic import atomic_path
from ftis_fed.wire.batch import CompletionBatch
from ftis_fed.learn.objective import (LOGP_GEN_FLOOR, LossInputs, ObjectiveConfig, compute_advantages, count_denominators,
                        ftis_loss, kl_quantiles, merge_stats, finalize_stats, MODES)
from ftis_fed.policies.config import PolicyConfig

if TYPE_CHECKING:
    from ftis_fed.wire.batch import SamplingParams
    from ftis_fed.policies.base import Policy


@dataclass
class TrainSample:
    """One completion as the receiver trains on it (ids in the receiver's tokenizer).

    logp_gen: (T,) the generator's per-token log-probs (zeros when ``seq_level``).
    seq_logp_gen: the generator's summed log-prob of the completion.
    seq_level: the generator's tokenizer differs: only a sequence-level ratio is defined.
    group: the advantage group the sample was normalised in (``<batch>/<group>`` when vertical,
        the task id when horizontal).
    implausible: the generator's claimed per-token log-probs (in its own tokenizer) include a value
        that is not finite or below ``objective.LOGP_GEN_FLOOR`` (see docs/method.md).
    surprisal_limit: the objective drops it when a token is more surprising than this many nats under
        the receiver's policy of the step (``peer-surprisal-max``: set by ``receive/surprisal.py``, inf
        when its surprising tokens are needed for its reward); None: no check set one.
    weight: the product of the receiver checks' weights so far (``reweight``; 0 once ``drop``ped);
        ``advantage`` already carries it. dropped: the reason of the check that dropped it, or "".
    batch, group_index, index: where it came from (the ``CompletionBatch``, its group, the completion).
    """

    prompt_ids: list[int]
    completion_ids: list[int]
    logp_gen: np.ndarray
    seq_logp_gen: float
    advantage: float
    source: str
    local: bool
    seq_level: bool = False
    group: str = ""
    implausible: bool = False
    surprisal_limit: float | None = None
    weight: float = 1.0
    dropped: str = ""
    batch: CompletionBatch | None = field(default=None, repr=False, compare=False)
    group_index: int = -1
    index: int = -1

    def reweight(self, w: float) -> None:
        """Multiply the advantage by ``w`` (a receiver check's weight, applied in the checks' order)."""
        self.advantage = self.advantage * w
        self.weight = self.weight * w

    def drop(self, reason: str) -> None:
        """Leave the sample out of the update's gradient (advantage 0; it still counts in the
        denominators, as a zero-advantage row), naming the check that dropped it."""
        self.reweight(0.0)
        self.dropped = self.dropped or reason


#: retokenize(prompt_text, completion_text, ended) -> (prompt_ids, completion_ids) in the receiver's
#: tokenizer; ``ended``: the sender's completion ended with its EOS (append the receiver's EOS).
Retokenize = Callable[[str, str, bool], tuple[list[int], list[int]]]


def sender_eos_id(batch: CompletionBatch) -> int | None:
    """The sender's EOS id inferred from its batch, or None: the fallback for a batch that does not
    carry ``eos_id`` (wire v1, older v2 frames); a batch that carries it is read as it says.

    Generation stops before ``sampling.max_new_tokens`` only at EOS (both backends pass the
    tokenizer's single EOS id and no stop strings), so every completion shorter than the budget ends
    with the sender's EOS: that id, when all of them agree. None when no completion stopped early
    or they disagree.
    """
    budget = batch.sampling.max_new_tokens
    last = {int(c[-1]) for g in batch.groups for c in g.completion_ids if 0 < len(c) < budget}
    return last.pop() if len(last) == 1 else None


def completion_ended(completion_ids: np.ndarray, budget: int, eos: int | None) -> bool:
    """Did the sender's completion end with EOS (rather than being cut at the budget)?

    With the sender's EOS id known (the batch's ``eos_id``, else ``sender_eos_id``): its last token
    is that id (this also covers a completion whose EOS is exactly its ``budget``-th token, which
    inference cannot tell from a cut when no completion stopped early). Otherwise: it is shorter
    than the budget.
    """
    if len(completion_ids) == 0:
        return False
    if eos is not None:
        return int(completion_ids[-1]) == eos
    return len(completion_ids) < budget


def generator_claims_plausible(logprobs: np.ndarray) -> bool:
    """Every claimed per-token log-prob is finite and >= LOGP_GEN_FLOOR (docs/method.md)."""
    lp = np.asarray(logprobs, dtype=np.float64)
    return bool(np.all(np.isfinite(lp)) and np.all(lp >= LOGP_GEN_FLOOR))


def samples_from_batches(batches: Sequence[CompletionBatch], receiver: str, tokenizer_fp: str,
                         cfg: ObjectiveConfig, retokenize: Retokenize | None = None) -> list[TrainSample]:
    """Rows for ``ftis_step`` from all batches of one update.

    receiver: this participant's id (its own batches are ``local``). In a local-only mode
        (``alone``) the other senders' batches are skipped before anything is computed from them.
    retokenize(prompt_text, completion_text, ended) -> (prompt_ids, completion_ids) in the
        receiver's tokenizer; needed for batches whose ``tokenizer_fp`` differs (they must carry
        texts). ``ended`` says whether the sender's completion ended with EOS (``completion_ended``).
    Every sample starts with weight 1; the receiver's checks (``ftis_fed/receive/``) then reweight or
    drop samples on the sample itself, after normalisation.

    Advantage groups: ``vertical``, each (batch, group); ``horizontal``, every completion of the
    same task id, across senders (the mixed group of the paper's horizontal mode: participants take
    the round's shared prompts, each its share of G, and receivers refuse peers' groups of other
    tasks; ``advantage_group_metrics`` counts mixed and unshared groups).
    """
    rows: list[dict] = []
    local_only = MODES[cfg.mode].local_only
    for bi, b in enumerate(batches):
        if local_only and b.sender != receiver:
            continue
        cross = b.tokenizer_fp != tokenizer_fp
        if cross and retokenize is None:
            raise ValueError(f"batch from {b.sender!r} has tokenizer {b.tokenizer_fp}, receiver has "
                             f"{tokenizer_fp}: a retokenize function is needed")
        eos = (b.eos_id if b.eos_id is not None else sender_eos_id(b)) if cross else None
        for gi, g in enumerate(b.groups):
            rewards = g.rewards
            if cross and (not g.completion_texts or not g.prompt_text):
                raise ValueError(f"batch from {b.sender!r}: cross-tokenizer use needs prompt_text and "
                                 "completion_texts in the batch")
            for i in range(g.size):
                if cross:
                    ended = completion_ended(g.completion_ids[i], b.sampling.max_new_tokens, eos)
                    p_ids, c_ids = retokenize(g.prompt_text, g.completion_texts[i], ended)
                    lp = np.zeros(len(c_ids), dtype=np.float32)
                else:
                    p_ids, c_ids, lp = g.prompt_ids.tolist(), g.completion_ids[i].tolist(), g.logprobs[i]
                group_key = f"{bi}/{gi}" if cfg.advantage_groups == "vertical" else g.task_id
                rows.append(dict(prompt_ids=p_ids, completion_ids=c_ids, logp_gen=lp,
                                 seq_logp_gen=float(np.sum(g.logprobs[i], dtype=np.float64)),
                                 reward=float(rewards[i]), group=group_key, batch=b, gi=gi, i=i,
                                 source=b.sender, local=b.sender == receiver, seq_level=cross,
                                 implausible=not generator_claims_plausible(g.logprobs[i])))
    if not rows:
        return []
    keys = {k: j for j, k in enumerate(dict.fromkeys(r["group"] for r in rows))}
    adv = compute_advantages(torch.tensor([r["reward"] for r in rows], dtype=torch.float64),
                             torch.tensor([keys[r["group"]] for r in rows]), cfg.scale_rewards)
    return [TrainSample(r["prompt_ids"], r["completion_ids"], r["logp_gen"], r["seq_logp_gen"],
                        float(a), r["source"], r["local"], r["seq_level"], str(r["group"]),
                        r["implausible"], batch=r["batch"], group_index=r["gi"], index=r["i"])
            for r, a in zip(rows, adv.tolist())]


def advantage_group_metrics(samples: Sequence[TrainSample], cfg: ObjectiveConfig) -> dict[str, float]:
    """How the advantage groups of one update were made up.

    ``train/advantage_groups``: groups; in horizontal mode also ``train/horizontal_mixed_groups``
    (groups with completions from more than one sender: the partition of prompts is shared) and
    ``train/horizontal_unshared_groups`` (one sender only: horizontal then equals vertical for that
    prompt, a sign that the schedule gave participants disjoint prompts).
    """
    senders: dict[str, set[str]] = {}
    for s in samples:
        senders.setdefault(s.group, set()).add(s.source)
    out = {"train/advantage_groups": float(len(senders))}
    if cfg.advantage_groups == "horizontal":
        mixed = sum(len(v) > 1 for v in senders.values())
        out["train/horizontal_mixed_groups"] = float(mixed)
        out["train/horizontal_unshared_groups"] = float(len(senders) - mixed)
    return out


def _pad(arrays: Sequence[np.ndarray], T: int) -> torch.Tensor:
    out = torch.zeros((len(arrays), T), dtype=torch.float32)                      # (b,T)
    for i, a in enumerate(arrays):
        out[i, : len(a)] = torch.as_tensor(np.asarray(a, dtype=np.float32))
    return out


def row_order(prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]],
              group_prompts: bool, zero: Sequence[bool] | None = None) -> list[int]:
    """The order rows are cut into micro-batches: longest first (least padding); with ``group_prompts``,
    the rows of one prompt stay contiguous (groups longest first, then longest completion first).
    zero: per row, its advantage is 0; such rows (without grouping) or prompts all of whose rows are
    such (with grouping) go last, so they fill whole micro-batches that need no backward."""
    n = len(prompt_ids)
    z = list(zero) if zero is not None else [False] * n
    if not group_prompts:
        return sorted(range(n), key=lambda i: (z[i], -len(prompt_ids[i]) - len(completion_ids[i])))
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, p in enumerate(prompt_ids):
        groups.setdefault(tuple(p), []).append(i)
    longest = {k: max(len(prompt_ids[i]) + len(completion_ids[i]) for i in rows) for k, rows in groups.items()}
    all_zero = {k: all(z[i] for i in rows) for k, rows in groups.items()}
    order: list[int] = []
    for k in sorted(groups, key=lambda k: (all_zero[k], -longest[k])):
        order += sorted(groups[k], key=lambda i: -len(completion_ids[i]))
    return order


def step_rows(samples: Sequence[TrainSample], cfg: ObjectiveConfig, group_prompts: bool) -> tuple[list[int], list[int]]:
    """(keep, order): the samples an update trains on (all; in a local-only mode, ``alone``, the own ones)
    as indices into ``samples``, and the order ``ftis_step`` cuts them into micro-batches, as indices into
    ``keep`` (``row_order``)."""
    keep = [i for i, s in enumerate(samples) if s.local or not MODES[cfg.mode].local_only]
    kept = [samples[i] for i in keep]
    return keep, row_order([s.prompt_ids for s in kept], [s.completion_ids for s in kept], group_prompts,
                           zero=[s.advantage == 0.0 for s in kept])


ScoreFn = Callable[[Sequence[Sequence[int]], Sequence[Sequence[int]], bool], torch.Tensor]


def ftis_step(score: ScoreFn, params: Sequence[torch.nn.Parameter], optimizer: torch.optim.Optimizer,
              samples: Sequence[TrainSample], cfg: ObjectiveConfig, micro_batch: int,
              max_grad_norm: float, logp_old: Sequence[torch.Tensor] | None = None,
              group_prompts: bool = False, score_zero_advantage: bool = True,
              reference_out: list | None = None) -> dict[str, float]:
    """One optimizer step of the F-TIS objective over ``samples``.

    score(prompt_ids, completion_ids, grad) -> (b,T) padded log-probs under the current weights.
    logp_old: per-sample (T_i,) log-probs before this update (multi-epoch PPO); None = first epoch.
    reference_out: a list of len(samples) whose None entries get each scored row's (T_i,) log-probs under
        this step's weights as a no-grad ``score`` gives them (the next steps' ``logp_old``); ``score`` then
        returns (log-probs, reference) pairs (``Policy.score_padded_and_reference``). Unscored rows stay None
        (the next steps leave them unscored too: advantages, and so the micro-batches, do not change).
    group_prompts: micro-batches keep the rows of one prompt together (see ``row_order``), so a
        shared-prefix ``score`` computes each prompt once.
    A micro-batch whose rows all have advantage 0 is scored with ``grad=False`` and gets no backward
    (its gradient is exactly zero); ``train/no_backward_rows`` counts those rows. With
    ``score_zero_advantage`` False it is not scored at all (``train/unscored_rows``): the loss,
    gradient and step are the same, only the off-policy diagnostics then cover the other rows.
    Returns finalised metrics: loss, grad norm, per-source off-policy diagnostics.
    """
    keep, order = step_rows(samples, cfg, group_prompts)      # keep: each row's index in the caller's list
    samples = [samples[i] for i in keep]
    logp_old = [logp_old[i] for i in keep] if logp_old is not None else None
    optimizer.zero_grad(set_to_none=True)
    if not samples:
        return {"train/samples": 0.0}
    names = tuple(dict.fromkeys(s.source for s in samples))
    lengths = torch.tensor([len(s.completion_ids) for s in samples])
    all_mask = torch.arange(int(lengths.max()))[None, :] < lengths[:, None]
    denominators = count_denominators(all_mask, torch.ones(len(samples), dtype=torch.bool))
    limits = any(s.surprisal_limit is not None for s in samples)   # peer-surprisal-max on in this update
    stats: dict[str, float] = {}
    row_kl, row_source = [], []                 # every scored row's KL and source: the update's quantiles
    loss_total = 0.0
    skipped_rows = unscored_rows = 0
    for start in range(0, len(order), micro_batch):
        idx = order[start:start + micro_batch]
        mb = [samples[i] for i in idx]
        # rows with advantage 0 (a group whose rewards are all equal) add exactly nothing to the loss or its
        # gradient (every loss term is multiplied by the advantage): a micro-batch of only such rows is
        # scored without a graph (its log-probs still feed the diagnostics), or not at all, and no backward
        # runs for it
        grad = any(s.advantage != 0.0 for s in mb)
        skipped_rows += 0 if grad else len(mb)
        if not grad and not score_zero_advantage:
            unscored_rows += len(mb)
            continue
        logp = score([s.prompt_ids for s in mb], [s.completion_ids for s in mb], grad)  # (b,T)
        if reference_out is not None:
            logp, ref = logp
            for r, i in enumerate(idx):
                if reference_out[keep[i]] is None:
                    reference_out[keep[i]] = ref[r, :len(samples[i].completion_ids)].clone()
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
            implausible=torch.tensor([s.implausible for s in mb]),
            surprisal_limit=torch.tensor([math.inf if s.surprisal_limit is None else s.surprisal_limit
                                          for s in mb], dtype=torch.float64) if limits else None,
        )
        out = ftis_loss(x, cfg, denominators)
        if out.loss.requires_grad:
            out.loss.backward()
        loss_total += float(out.loss.detach())
        out.stats.pop("loss/value", None)
        stats = merge_stats(stats, out.stats)
        row_kl.append(out.row_kl)
        row_source.append(x.source)
    if skipped_rows == len(order):        # no backward ran: the zero gradient every backward would have given
        for p in params:                    # (AdamW still steps: momentum, weight decay)
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
    grad_norm = torch.nn.utils.clip_grad_norm_([p for p in params if p.grad is not None], max_grad_norm)
    finite = bool(torch.isfinite(grad_norm))
    if finite:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    metrics = finalize_stats(stats)
    if row_kl:
        metrics.update(kl_quantiles(torch.cat(row_kl), torch.cat(row_source), names, cfg.filter_g))
    metrics.update({"train/loss": loss_total, "train/grad_norm": float(grad_norm),
                    "train/skipped_nonfinite": float(not finite), "train/samples": float(len(samples)),
                    "train/no_backward_rows": float(skipped_rows), "train/unscored_rows": float(unscored_rows),
                    "train/tokens": float(denominators[1])})
    return metrics


#: parameter dtypes torch's fused AdamW kernel takes on CPU and CUDA
FUSED_ADAMW_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def fused_adamw_ok(params: Sequence[torch.nn.Parameter]) -> bool:
    """Whether torch's fused AdamW kernel applies: every parameter a CPU or CUDA tensor of a float dtype
    it takes (one kernel over all tensors instead of a Python loop of ~10 ops per tensor)."""
    return bool(params) and all(p.device.type in ("cpu", "cuda") and p.dtype in FUSED_ADAMW_DTYPES
                                for p in params)


def make_optimizer(params: Sequence[torch.nn.Parameter], cfg: PolicyConfig) -> torch.optim.Optimizer:
    """The ``optimizer`` key's optimizer over ``params`` with the config's learning rate and weight
    decay: ``adamw`` = torch AdamW (its fused kernel where ``fused_adamw_ok``: the same update, measured
    ~6x faster on SmolLM2-135M on a CPU; TRL's default ``adamw_torch_fused`` too); ``adamw-8bit`` / ``paged-adamw-8bit`` = bitsandbytes AdamW8bit /
    PagedAdamW8bit (moments in blockwise 8-bit; tensors under 4096 elements keep 32-bit state, as
    bitsandbytes decides). A clear error names the key when bitsandbytes is missing."""
    if cfg.optimizer == "adamw":
        params = list(params)
        return torch.optim.AdamW(params, lr=cfg.effective_lr, weight_decay=cfg.weight_decay,
                                 fused=True if fused_adamw_ok(params) else None)
    try:
        import bitsandbytes as bnb
    except ImportError as e:
        raise ImportError(f"optimizer={cfg.optimizer!r} needs bitsandbytes: pip install 'ftis-fed[quant]' "
                          f"(or set optimizer='adamw'): {e}") from e
    cls = {"adamw-8bit": bnb.optim.AdamW8bit, "paged-adamw-8bit": bnb.optim.PagedAdamW8bit}.get(cfg.optimizer)
    if cls is None:
        raise ValueError(f"optimizer={cfg.optimizer!r}: must be 'adamw', 'adamw-8bit' or 'paged-adamw-8bit'")
    return cls(params, lr=cfg.effective_lr, weight_decay=cfg.weight_decay)


class Trainer:
    """The optimisation of one model backend: ``make_optimizer`` (the ``optimizer`` key) over
    ``policy.trainable_parameters()``.

    policy: a ``policies.base.Policy`` (it scores with gradient and exposes its parameters; it
        owns no optimizer). objective: the F-TIS objective of every step.
    cfg: optimizer, learning rate, weight decay, micro-batch and gradient clipping
        (``PolicyConfig``); default ``policy.cfg``.
    """

    def __init__(self, policy: "Policy", objective: ObjectiveConfig, cfg: PolicyConfig | None = None):
        self.policy = policy
        self.objective = objective
        self.cfg = cfg if cfg is not None else policy.cfg
        self.params = list(policy.trainable_parameters())
        self.optimizer = make_optimizer(self.params, self.cfg)
        self.steps = 0
        self.source_kl: dict[str, float] = {}      # the last step's mean sample KL per peer source with samples

    def step(self, samples: Sequence[TrainSample], sampling: "SamplingParams",
             objective: ObjectiveConfig | None = None) -> dict[str, float]:
        """The round's update on ``samples``: ``updates-per-round`` F-TIS optimizer steps (one by
        default); ``sampling`` defines pi_theta's distribution; ``objective`` the loss of this update
        (default the trainer's: ``source-adapt = shadow`` steps its alone copy with ``loss-mode = alone``).
        Returns the first step's metrics of ``ftis_step`` (the off-policy diagnostics as the samples
        arrived) and ``advantage_group_metrics``, with the last step's loss and gradient norm when there
        are several; ``source_kl`` then holds each peer source's mean sample KL of the first step (what
        ``source-adapt`` adapts to)."""
        objective = self.objective if objective is None else objective
        n = int(self.cfg.updates_per_round)
        old, rest = self._references_outside_first_step(samples, sampling, objective) if n > 1 else (None, False)
        metrics = self.one_step(samples, sampling, None, reference_out=old if rest else None,   # fills the rest
                                objective=objective)
        for _ in range(n - 1):
            last = self.one_step(samples, sampling, old, objective=objective)
            metrics.update({k: last[k] for k in ("train/loss", "train/grad_norm", "train/lr") if k in last})
            metrics["train/skipped_nonfinite"] = metrics.get("train/skipped_nonfinite", 0.0) + \
                last.get("train/skipped_nonfinite", 0.0)
        metrics["train/updates"] = float(n)
        peers = dict.fromkeys(s.source for s in samples if not s.local)
        self.source_kl = {p: metrics[f"offpolicy/{p}/kl_mean"] for p in peers if f"offpolicy/{p}/kl_mean" in metrics}
        metrics.update(advantage_group_metrics(samples, objective))
        return metrics

    def old_logprobs(self, samples: Sequence[TrainSample], sampling: "SamplingParams") -> list[torch.Tensor]:
        """Each sample's (T_i,) log-probs under the current weights (no gradient): what ``step`` reads off
        its first step's forward as the PPO clip's reference for the round's further steps."""
        pol, mb = self.policy, max(1, self.cfg.micro_batch)
        out: list[torch.Tensor] = []
        with torch.no_grad():
            for start in range(0, len(samples), mb):
                chunk = samples[start:start + mb]
                logp = pol.score_padded([s.prompt_ids for s in chunk], [s.completion_ids for s in chunk],
                                        sampling, False)
                out += [logp[i, :len(s.completion_ids)].detach().clone() for i, s in enumerate(chunk)]
        return out

    def _references_outside_first_step(self, samples: Sequence[TrainSample], sampling: "SamplingParams",
                                       objective: ObjectiveConfig) -> tuple[list[torch.Tensor | None], bool]:
        """The PPO clip's reference of the round's further steps is ``old_logprobs``: the round-start
        log-probs of micro-batches of ``samples`` in their order. The first step computes the same rows
        in its own micro-batches (``step_rows``), and reads a row's reference off that forward when its
        micro-batch is laid out as its ``old_logprobs`` chunk (``Policy.score_layout``: then the values are
        the same, bit for bit). This computes the others, before the first step (at the round-start
        weights): the chunk's rows the step scores in another layout, scored with the chunk's layout, or,
        for a chunk of unknown layout, the whole chunk as ``old_logprobs`` scores it (dropout: the same
        draws). Returns (per sample its reference or None, whether the first step must read some: the
        rows it scores that are still None; rows the steps never score stay None)."""
        pol, mb = self.policy, self.cfg.micro_batch                # micro_batch >= 1 (PolicyConfig)
        keep, order = step_rows(samples, objective, self.cfg.share_prefix)
        layout_in_step: dict[int, object] = {}                      # the rows the steps score: their layout
        for start in range(0, len(order), mb):
            idx = [keep[j] for j in order[start:start + mb]]
            if self.cfg.score_zero_advantage or any(samples[i].advantage != 0.0 for i in idx):   # scored
                lay = pol.score_layout([samples[i].prompt_ids for i in idx], [samples[i].completion_ids for i in idx])
                layout_in_step.update((i, lay) for i in idx)
        out: list[torch.Tensor | None] = [None] * len(samples)
        for start in range(0, len(samples), mb):
            chunk = list(range(start, min(start + mb, len(samples))))
            lay = pol.score_layout([samples[i].prompt_ids for i in chunk], [samples[i].completion_ids for i in chunk])
            need = [i for i in chunk if i in layout_in_step and (lay is None or layout_in_step[i] != lay)]
            if need or lay is None:
                rows = chunk if lay is None else need
                with torch.no_grad():
                    logp = pol.score_padded([samples[i].prompt_ids for i in rows],
                                            [samples[i].completion_ids for i in rows], sampling, False,
                                            **({} if lay is None else {"layout": lay}))
                for r, i in enumerate(rows):
                    if i in layout_in_step:
                        out[i] = logp[r, :len(samples[i].completion_ids)].detach().clone()
        return out, any(out[i] is None for i in layout_in_step)

    def one_step(self, samples: Sequence[TrainSample], sampling: "SamplingParams",
                 logp_old: Sequence[torch.Tensor] | None, reference_out: list | None = None,
                 objective: ObjectiveConfig | None = None) -> dict[str, float]:
        """One F-TIS optimizer step (``ftis_step``) at the warm-up's rate for this step, of ``objective``
        (default the trainer's); with ``reference_out``, each scored sample's no-grad log-probs of the
        step's weights go there."""
        pol = self.policy
        lr = self.cfg.lr_at(self.steps + 1)                  # the warm-up follows the saved step count
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        pol.train_mode(True)
        try:
            score = pol.score_padded if reference_out is None else pol.score_padded_and_reference
            metrics = ftis_step(lambda p, c, g: score(p, c, sampling, g), self.params, self.optimizer,
                                samples, self.objective if objective is None else objective,
                                self.cfg.micro_batch, self.cfg.max_grad_norm,
                                logp_old=logp_old,
                                group_prompts=self.cfg.share_prefix,   # a prompt's rows in one micro-batch
                                score_zero_advantage=self.cfg.score_zero_advantage,
                                reference_out=reference_out)
        finally:
            pol.train_mode(False)
        self.steps += 1
        pol.weights_changed()
        metrics["train/lr"] = lr
        return metrics

    def snapshot(self) -> tuple:
        """(trainable state, optimizer state, optimizer steps), copied: a point ``restore`` returns to
        (the guards' candidate updates and shadow copy, ``learn/guard.py``, ``learn/shadow.py``)."""
        return self.policy.trainable_state(), copy.deepcopy(self.optimizer.state_dict()), self.steps

    def restore(self, snap: tuple, source: str = "snapshot") -> None:
        """Back to ``snapshot``'s point (``snap`` is not aliased: it can be restored again);
        ``source`` names it in a load error."""
        weights, opt, steps = snap
        self.policy.load_trainable_state(weights, source=source)
        self.optimizer.load_state_dict(copy.deepcopy(opt))
        self.steps = steps
        self.policy.weights_changed()

    def save(self, path: str | os.PathLike) -> None:
        """Trainable parameters + optimizer state + step count (resume), written atomically."""
        save_snapshot(path, (self.policy.trainable_state(), self.optimizer.state_dict(), self.steps),
                      model_id=self.policy.model_id)

    def load(self, path: str | os.PathLike) -> None:
        """Restore what ``save`` wrote (the backend's weights first, then the optimizer)."""
        self.restore(read_snapshot(path)[0], source=str(path))


def snapshot_items(snap: tuple) -> dict:
    """A ``Trainer.snapshot`` (trainable state, optimizer state, steps) as the checkpoint's items."""
    weights, opt, steps = snap
    return {"trainable": weights, "optimizer": opt, "steps": steps}


def snapshot_from(items: dict) -> tuple:
    """The snapshot that ``snapshot_items`` made ``items`` of."""
    return dict(items["trainable"]), items["optimizer"], int(items["steps"])


def save_snapshot(path: str | os.PathLike, snap: tuple, **extra) -> None:
    """A ``Trainer.snapshot`` and ``extra`` items, written atomically: the checkpoint layout of
    ``Trainer.save`` and of the shadow (``learn/shadow.py``)."""
    with atomic_path(path) as tmp:
        torch.save({**snapshot_items(snap), **extra}, tmp)


def read_snapshot(path: str | os.PathLike) -> tuple[tuple, dict]:
    """(snapshot, every item) of what ``save_snapshot`` wrote."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    return snapshot_from(state), state
