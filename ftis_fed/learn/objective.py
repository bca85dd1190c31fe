"""The F-TIS objective family as pure tensor functions (read next to docs/method.md).

    L = -(1/N) sum_i norm_i sum_t  w_it * min( R_it * A'_i , clip(R_it, 1-eps, 1+eps) * A'_i )

    w_it  = min( pi_theta / pi_gen , C ), detached          truncated importance weight ("TIS")
    R_it  = pi_theta / stopgrad(pi_old)                      PPO ratio (== 1 in value on the first epoch)
    A'_i  = A_i if A_i > 0 or KL_i < g else 0                the filter ("F")
            (and 0 for a peer's sample with a token of the receiver's own surprisal -log pi_theta >
            ``peer-surprisal-max``, when set: ``surprising_rows``, the poisoning defence)
    KL_i  = estimate of KL(pi_gen || pi_theta) from the sampled tokens' log-ratios (default sum of k1)

Each named mode is an importance-weight rule plus a filter switch (``MODES``, ``learn/modes.py``):

    alone   own samples only, w = 1 (on-policy GRPO)   noIS / F-noIS   w = 1
    VIS / F-VIS   R = pi_theta / pi_gen inside the clip  TIS / F-TIS     w = min(ratio, C)

The three pieces are kept apart, as in docs/method.md: ``importance_weights`` (w and R), ``filter_advantages``
(A'), and ``aggregate`` (length normalisation: per-sequence as in GRPO, a constant as in Dr. GRPO,
token-mean as in DAPO). ``ftis_loss`` composes them and returns per-source diagnostics measured
*before* truncation and filtering. All log-ratios are clamped before ``exp``; masked positions are
selected with ``torch.where`` (never multiplied), so no -inf/NaN reaches the loss or its gradient.

Sender-reported log-probs are sanitised and bounded (docs/method.md, "Sanitisation and clamps"):
per-token generator log-probs below ``LOGP_GEN_FLOOR`` = log(1e-30) (or non-finite) cannot come from
an honest sampler; such a sample is *implausible*: its log-probs are floored for the importance
weight, and the F filter treats it as maximally off-policy (KL = +inf). The KL estimate itself uses
log-ratios clamped symmetrically to +-log_ratio_clamp per token.

Shapes: B samples (completions), T padded completion length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ftis_fed.learn.modes import MODES
from ftis_fed.learn.objective_config import ObjectiveConfig   # noqa: F401 - its knobs; imported from here too

Tensor = torch.Tensor


# ----------------------------------------------------------------------------- advantages

def compute_advantages(rewards: Tensor, group_index: Tensor, scale: str = "group", eps: float = 1e-4) -> Tensor:
    """Group-relative advantages A_i = (r_i - mean_g(r)) / (std_g(r) + eps).

    rewards: (B,) float; group_index: (B,) long, samples with equal index form one group.
    scale: ``group`` divides by the unbiased group std (GRPO / TRL), ``none`` only centres
    (Dr. GRPO). Singleton groups and all-equal groups get advantage 0. A NaN reward (no reward for
    that sample, TRL's None) is left out of its group's mean and std and gets advantage 0, as in TRL.
    """
    scored = ~torch.isnan(rewards)                                                 # (B,)
    r = torch.where(scored, rewards, torch.zeros_like(rewards)).to(torch.float64)  # (B,)
    _, inv = torch.unique(group_index, return_inverse=True)                        # (B,)
    k = int(inv.max()) + 1 if inv.numel() else 0
    count = torch.zeros(k, dtype=r.dtype).index_add_(0, inv, scored.to(r.dtype))   # (K,) scored samples
    mean = torch.zeros(k, dtype=r.dtype).index_add_(0, inv, r) / count.clamp(min=1)  # (K,)
    centred = torch.where(scored, r - mean[inv], torch.zeros_like(r))              # (B,)
    if scale == "none":
        adv = centred
    else:
        sq = torch.zeros(k, dtype=r.dtype).index_add_(0, inv, centred**2)          # (K,)
        std = torch.sqrt(sq / (count - 1).clamp(min=1))                            # (K,) unbiased
        adv = centred / (std[inv] + eps)
    adv = torch.where((count[inv] > 1) & scored, adv, torch.zeros_like(adv))
    return adv.to(rewards.dtype)


# ----------------------------------------------------------------------------- log-ratios & KL

#: Lowest per-token generator log-prob a sender can honestly claim for a token it sampled: log(1e-30).
#: An honest sampler draws a token of probability < 1e-30 with probability < V * 1e-30 per step
#: (V = vocabulary size, ~5e4 here): never in practice. Lower (or non-finite) claims mark the sample
#: implausible (see ``implausible_rows``).
LOGP_GEN_FLOOR = math.log(1e-30)


def masked_sum(x: Tensor, mask: Tensor) -> Tensor:
    """(B,T) -> (B,) sum over valid positions, selecting with where (no 0 * inf)."""
    return torch.where(mask, x, torch.zeros_like(x)).sum(-1)


def log_ratios(logp: Tensor, logp_gen: Tensor, mask: Tensor, seq_level: Tensor,
               seq_logp_gen: Tensor | None) -> Tensor:
    """log(pi_theta / pi_gen), (B,T), *unclamped*; on sequence-level rows the summed log-ratio
    sum_t logp - seq_logp_gen (default sum_t logp_gen) is the value of every position of the row.

    Inputs are finite (clamped by the caller), so the result is finite. Gradient flows through
    ``logp`` (VIS needs it); callers clamp before any exp and detach for weights. On a
    sequence-level row the gradient at position t is d log pi_theta(a_t) (the summed log-ratio's
    value, each token's own gradient), so the length normalisation scales a sequence-level row's
    gradient by 1/|a_i| exactly as it does a token-level row's; broadcasting the sum itself would
    give every token the whole row's gradient, |a_i| times too much.
    """
    tok = torch.where(mask, logp - logp_gen, torch.zeros_like(logp))               # (B,T)
    gen_seq = masked_sum(logp_gen, mask) if seq_logp_gen is None else seq_logp_gen  # (B,)
    seq = (masked_sum(logp, mask) - gen_seq.to(logp.dtype)).detach()               # (B,)
    seq_tok = seq[:, None] + torch.where(mask, logp - logp.detach(), torch.zeros_like(logp))  # (B,T)
    return torch.where(seq_level[:, None], seq_tok, tok)                           # (B,T)


def sequence_mean_log_ratios(raw: Tensor, logp: Tensor, mask: Tensor, rows: Tensor) -> Tensor:
    """GSPO's log-ratio on ``rows`` (``ratio-level = sequence-mean``): the row's summed log-ratio
    (``log_ratios`` on a sequence-level row) divided by its valid tokens |a_i|, as every position's
    value, each position keeping its own token's gradient (as ``log_ratios``: with GRPO's 1/|a_i|
    normalisation the row's gradient is s_i * (1/|a_i|) sum_t grad log pi_theta(a_t), GSPO's).
    Other rows unchanged. (B,T) -> (B,T)."""
    if not raw.shape[1]:
        return raw
    n = mask.sum(-1).clamp(min=1).to(raw.dtype)                                    # (B,)
    mean = raw.detach()[:, 0] / n                                                  # (B,) the summed value / |a_i|
    val = mean[:, None] + torch.where(mask, logp - logp.detach(), torch.zeros_like(logp))   # (B,T)
    return torch.where(rows[:, None], val, raw)


def kl_estimate(log_ratio: Tensor, mask: Tensor, seq_level: Tensor, estimator: str, clamp: float) -> Tensor:
    """(B,) sample estimate of KL(pi_gen || pi_theta) from log-ratios lr = log(pi_theta/pi_gen).

    Each token's lr is clamped to [-clamp, clamp] first (symmetrically: a sender's claimed
    log-probs can move one token's term by at most ``clamp`` either way). Per token d = -lr;
    k1 = d, k3 = exp(-d) - 1 + d. ``sum-*`` sums over the completion, ``mean-*`` averages. On
    sequence-level rows only the summed d is known: its per-token average d/n is clamped, k1 is
    exact (within the clamp), k3 uses the average.
    """
    reduce, k = estimator.split("-")
    n = mask.sum(-1).clamp(min=1).to(log_ratio.dtype)                              # (B,)
    lr_tok = log_ratio.clamp(-clamp, clamp)                                        # (B,T)
    lr_seq_mean = (log_ratio[:, 0] / n).clamp(-clamp, clamp) if log_ratio.shape[1] else torch.zeros_like(n)  # (B,)
    if k == "k1":
        per_tok, seq_val = -lr_tok, -lr_seq_mean
    else:
        per_tok = torch.expm1(lr_tok) - lr_tok
        seq_val = torch.expm1(lr_seq_mean) - lr_seq_mean
    kl = torch.where(seq_level, seq_val * n, masked_sum(per_tok, mask))             # (B,) summed
    return kl if reduce == "sum" else kl / n


# ----------------------------------------------------------------------------- importance weights

WeightFn = Callable[[Tensor, Tensor, Tensor, float], tuple[Tensor, Tensor]]
IMPORTANCE_WEIGHTS: dict[str, WeightFn] = {}


def register_weight(name: str):
    def deco(fn: WeightFn) -> WeightFn:
        IMPORTANCE_WEIGHTS[name] = fn
        return fn
    return deco


@register_weight("none")
def _no_is(logp: Tensor, logp_old: Tensor, log_ratio_gen: Tensor, c: float) -> tuple[Tensor, Tensor]:
    """w = 1; R = pi_theta / pi_old: the samples are treated as on-policy."""
    return torch.ones_like(logp), logp - logp_old


@register_weight("tis")
def _truncated_is(logp: Tensor, logp_old: Tensor, log_ratio_gen: Tensor, c: float) -> tuple[Tensor, Tensor]:
    """w = min(pi_theta / pi_gen, C), detached; R = pi_theta / pi_old."""
    w = torch.exp(log_ratio_gen.detach()).clamp(max=c)
    return w, logp - logp_old


@register_weight("vis")
def _vanilla_is(logp: Tensor, logp_old: Tensor, log_ratio_gen: Tensor, c: float) -> tuple[Tensor, Tensor]:
    """w = 1; R = pi_theta / pi_gen (with gradient) inside the PPO clip."""
    return torch.ones_like(logp), log_ratio_gen


def cap_row_mean(w: Tensor, mask: Tensor, cap: float) -> Tensor:
    """(B,T) weights scaled per row so that each row's mean weight over its valid tokens is at most
    ``cap`` (rows at or below it unchanged; ``cap`` <= 0: no change). Depends on each row only."""
    if cap <= 0:
        return w
    n = mask.sum(-1).clamp(min=1).to(w.dtype)                                      # (B,)
    mean = torch.where(mask, w, torch.zeros_like(w)).sum(-1) / n                   # (B,)
    scale = torch.where(mean > cap, cap / mean.clamp(min=1e-30), torch.ones_like(mean))  # (B,)
    return w * scale[:, None]


def importance_weights(mode: str, logp: Tensor, logp_old: Tensor, log_ratio_gen: Tensor,
                       c: float) -> tuple[Tensor, Tensor]:
    """(w, log R), both (B,T): the detached weight and the log of the PPO ratio for ``mode``."""
    return IMPORTANCE_WEIGHTS[MODES[mode].weight](logp, logp_old, log_ratio_gen, c)


# ----------------------------------------------------------------------------- filter

def filter_mask(advantages: Tensor, kl: Tensor, g: float, sign: str = "negative") -> Tensor:
    """(B,) True where the F filter drops the sample: KL_i >= g and a negative advantage (``sign =
    "negative"``, the paper) or any nonzero one (``"any"``, a variant).

    With the paper's filter positive-advantage samples are always kept, however off-policy;
    zero-advantage samples carry no gradient either way and are never counted as filtered.
    """
    signed = advantages < 0 if sign == "negative" else advantages != 0
    return signed & ~(kl < g)


def max_surprisal(logp: Tensor, mask: Tensor) -> Tensor:
    """(B,) the largest surprisal -log pi_theta of a valid token of each row (0 for an empty row).
    ``logp`` is the receiver's own log-prob of each sampled token (clamped finite by the caller)."""
    return torch.where(mask, -logp.detach(), torch.zeros_like(logp)).amax(-1) if logp.shape[1] else \
        torch.zeros(logp.shape[0], dtype=logp.dtype)


def surprising_rows(top: Tensor, local: Tensor, limit: Tensor | float) -> Tensor:
    """(B,) True for a peer's row (not ``local``) with a token of surprisal above its ``limit`` nats
    under the receiver's own policy (``peer-surprisal-max``, per row as ``receive/surprisal.py`` set it,
    or one number; ``top``: each row's ``max_surprisal``); none where the limit is <= 0 (off) or inf
    (exempt). Depends on each row only, and on nothing the sender claims."""
    limit = torch.as_tensor(limit, dtype=top.dtype, device=top.device)
    return ~local.bool() & (limit > 0) & (top > limit)


def filter_advantages(advantages: Tensor, dropped: Tensor) -> Tensor:
    """A'_i = 0 where dropped, else A_i. Dropped samples still count in the normaliser."""
    return torch.where(dropped, torch.zeros_like(advantages), advantages)


# ----------------------------------------------------------------------------- surrogate & norm

def clipped_surrogate(log_r: Tensor, w: Tensor, adv: Tensor, eps: float, clamp: float) -> Tensor:
    """Per-token loss -w * min(R A, clip(R, 1-eps, 1+eps) A), (B,T); adv is (B,)."""
    ratio = torch.exp(log_r.clamp(-clamp, clamp))                                  # (B,T)
    a = adv[:, None]                                                               # (B,1)
    return -w * torch.minimum(ratio * a, ratio.clamp(1 - eps, 1 + eps) * a)


def aggregate(per_token: Tensor, mask: Tensor, rows: Tensor, how: str, norm_constant: int,
              denominators: tuple[float, float] | None = None) -> Tensor:
    """Reduce (B,T) per-token losses over valid tokens of the ``rows`` (B,) that take part.

    denominators: (rows, tokens) of the *whole* update when this is one micro-batch of it, so that
    the micro-batch losses sum exactly to the full-batch loss; default: this batch's own counts.
    """
    m = mask & rows[:, None]                                                       # (B,T)
    tok_sum = masked_sum(per_token, m)                                             # (B,)
    n_rows, n_tok = denominators or (float(rows.sum()), float(m.sum()))
    n_rows, n_tok = max(n_rows, 1.0), max(n_tok, 1.0)
    if how == "sequence":
        return (tok_sum / m.sum(-1).clamp(min=1)).sum() / n_rows
    if how == "constant":
        return tok_sum.sum() / (n_rows * norm_constant)
    return tok_sum.sum() / n_tok                                                   # token


# ----------------------------------------------------------------------------- the loss

@dataclass
class LossInputs:
    """One update's samples, padded to (B,T).

    logp: current policy log-probs of the sampled tokens (requires grad).
    logp_gen: the generator's recorded log-probs (zeros on cross-tokenizer rows).
    mask: valid completion tokens. advantages: (B,) computed before filtering.
    source: (B,) long index into ``source_names``; local: (B,) the receiver's own samples.
    logp_old: log-probs before this update (multi-epoch PPO); default logp.detach().
    seq_level: (B,) rows that must use a sequence-level ratio (cross-tokenizer); default none.
    seq_logp_gen: (B,) the generator's summed log-prob per completion (needed on cross-tokenizer
        rows, where logp_gen has no per-token meaning); default the masked sum of logp_gen.
    implausible: (B,) rows whose sender claimed an implausible log-prob somewhere the loss cannot
        see it (a cross-tokenizer row's per-token claims in the sender's tokenizer); default none.
        ``ftis_loss`` adds the rows it can check itself (see ``sanitize_generator_logprobs``).
    surprisal_limit: (B,) float, per row the surprisal in nats above which a token drops a peer's row
        (``peer-surprisal-max``, set per sample by ``receive/surprisal.py``; inf: exempt, its
        surprising tokens are needed for its reward); default none: the check is off.
    """

    logp: Tensor
    logp_gen: Tensor
    mask: Tensor
    advantages: Tensor
    source: Tensor
    local: Tensor
    source_names: tuple[str, ...]
    logp_old: Tensor | None = None
    seq_level: Tensor | None = None
    seq_logp_gen: Tensor | None = None
    implausible: Tensor | None = None
    surprisal_limit: Tensor | None = None


@dataclass
class LossOutput:
    """loss: scalar with grad. stats: mergeable sums (see ``merge_stats``); metrics: finalised view."""

    loss: Tensor
    stats: dict[str, float]
    #: (B,) each row's KL estimate (the filter's, before the implausible rows' inf), NaN where the row
    #: is not in the loss: what ``kl_quantiles`` reads over a whole update's micro-batches
    row_kl: Tensor | None = None

    @property
    def metrics(self) -> dict[str, float]:
        return finalize_stats(self.stats)


def ftis_loss(x: LossInputs, cfg: ObjectiveConfig,
              denominators: tuple[float, float] | None = None) -> LossOutput:
    """The whole objective for ``cfg.mode``; see the module docstring for the formula.

    Every weight, KL estimate and filter decision depends on its own row only, so a batch may be
    split into micro-batches: pass the whole batch's ``denominators`` (``count_denominators``) and
    the micro-batch losses add up to the full-batch loss exactly.
    """
    mode = MODES[cfg.mode]
    mask = x.mask.bool()
    logp = torch.where(mask, x.logp, torch.zeros_like(x.logp)).clamp(min=-1e4)     # (B,T)
    logp_old = logp.detach() if x.logp_old is None else \
        torch.where(mask, x.logp_old, logp.detach()).clamp(min=-1e4)
    seq_level = participating_seq_level(x, cfg)                                     # (B,)
    rows = participating_rows(x, cfg)                                              # (B,)
    logp_gen, seq_logp_gen, implausible = sanitize_generator_logprobs(x, mask, seq_level, logp.dtype)

    raw = log_ratios(logp, logp_gen, mask, seq_level, seq_logp_gen)               # (B,T)
    weighted = sequence_mean_log_ratios(raw, logp, mask, seq_level) if cfg.ratio_level == "sequence-mean" else raw
    log_ratio_gen = weighted.clamp(-cfg.log_ratio_clamp, cfg.log_ratio_clamp)      # clamp before exp
    w, log_r = importance_weights(cfg.mode, logp, logp_old, log_ratio_gen, cfg.trunc_c)
    w = cap_row_mean(w, mask, cfg.trunc_mean_cap)                                  # a log-prob liar's bound
    kl = kl_estimate(raw.detach(), mask, seq_level, cfg.kl_estimator, cfg.log_ratio_clamp)  # (B,)
    adv = x.advantages.to(logp.dtype)
    kl_filter = torch.where(implausible, torch.full_like(kl, math.inf), kl)        # (B,)
    dropped = filter_mask(adv, kl_filter, cfg.filter_g, cfg.filter_sign) & rows if mode.filtered \
        else torch.zeros_like(rows)
    top = max_surprisal(logp, mask)                                                # (B,) the receiver's own surprisal
    surprising = None if x.surprisal_limit is None else \
        surprising_rows(top, x.local, x.surprisal_limit) & rows                    # (B,) the receiver's own check
    adv_f = filter_advantages(adv, dropped if surprising is None else dropped | surprising)

    per_token = clipped_surrogate(log_r, w, adv_f, cfg.clip_eps, cfg.log_ratio_clamp)  # (B,T)
    loss = aggregate(per_token, mask, rows, cfg.length_norm, cfg.norm_constant, denominators)
    with torch.no_grad():
        stats = source_stats(raw.detach(), mask, rows, kl, dropped, x, cfg, implausible, surprising, top)
        stats["loss/value"] = float(loss.detach())
        row_kl = torch.where(rows, kl, torch.full_like(kl, math.nan))
    return LossOutput(loss, stats, row_kl)


def sanitize_generator_logprobs(x: LossInputs, mask: Tensor, seq_level: Tensor,
                                dtype: torch.dtype) -> tuple[Tensor, Tensor | None, Tensor]:
    """The sender's claims made safe to compute with: (logp_gen (B,T), seq_logp_gen (B,) or None,
    implausible (B,) bool).

    Per token: NaN and -inf become ``LOGP_GEN_FLOOR``, +inf becomes 0, then values are clamped to
    [LOGP_GEN_FLOOR, 0]; a row with any valid token that was not a finite value >= the floor is
    implausible. Per completion (``seq_logp_gen``, used on sequence-level rows): NaN and -inf become
    n * LOGP_GEN_FLOOR (n: the row's valid tokens), +inf becomes 0, then clamped to
    [n * LOGP_GEN_FLOOR, 0]; a sequence-level row whose value was not finite or below that bound is
    implausible. ``x.implausible`` adds the rows flagged by whoever built the inputs.
    """
    gen = x.logp_gen.to(dtype)
    bad_tok = mask & ~(torch.isfinite(gen) & (gen >= LOGP_GEN_FLOOR))               # (B,T)
    gen = torch.nan_to_num(gen, nan=LOGP_GEN_FLOOR, posinf=0.0, neginf=LOGP_GEN_FLOOR)
    logp_gen = torch.where(mask, gen, torch.zeros_like(gen)).clamp(LOGP_GEN_FLOOR, 0.0)  # (B,T)
    implausible = bad_tok.any(-1) if bad_tok.shape[1] else torch.zeros_like(seq_level)  # (B,)
    seq_logp_gen = None
    if x.seq_logp_gen is not None:
        floor = LOGP_GEN_FLOOR * mask.sum(-1).clamp(min=1).to(dtype)               # (B,)
        raw = x.seq_logp_gen.to(dtype)
        bad_seq = seq_level & ~(torch.isfinite(raw) & (raw >= floor))              # (B,)
        raw = torch.where(torch.isnan(raw) | (raw == -math.inf), floor, raw)
        seq_logp_gen = torch.maximum(raw.clamp(max=0.0), floor)                    # (B,)
        implausible = implausible | bad_seq
    if x.implausible is not None:
        implausible = implausible | x.implausible.bool()
    return logp_gen, seq_logp_gen, implausible


def participating_seq_level(x: LossInputs, cfg: ObjectiveConfig) -> Tensor:
    """(B,) rows using a sequence-level ratio: all of them at ratio_level=sequence, else the
    cross-tokenizer rows marked in ``x.seq_level``."""
    if cfg.ratio_level in ("sequence", "sequence-mean"):
        return torch.ones_like(x.local, dtype=torch.bool)
    return x.seq_level.bool() if x.seq_level is not None else torch.zeros_like(x.local, dtype=torch.bool)


def participating_rows(x: LossInputs, cfg: ObjectiveConfig) -> Tensor:
    """(B,) rows that enter the loss: the receiver's own only for ``alone``, else all."""
    return x.local.bool() if MODES[cfg.mode].local_only else torch.ones_like(x.local, dtype=torch.bool)


def count_denominators(mask: Tensor, rows: Tensor) -> tuple[float, float]:
    """(rows, tokens) of a whole update, for micro-batched ``ftis_loss`` calls."""
    return float(rows.sum()), float((mask.bool() & rows[:, None]).sum())


def source_stats(log_ratio: Tensor, mask: Tensor, rows: Tensor, kl: Tensor, dropped: Tensor,
                 x: LossInputs, cfg: ObjectiveConfig, implausible: Tensor | None = None,
                 surprising: Tensor | None = None, top: Tensor | None = None) -> dict[str, float]:
    """Mergeable per-source sums: raw ratio statistics before truncation (the ratio saturates at
    exp(log_ratio_clamp); log-ratio statistics are unclamped), truncated tokens, filtered samples,
    samples with implausible generator log-probs, KL (the clamped estimate, finite); with ``top``
    (each row's ``max_surprisal`` under the receiver's own policy) the largest token surprisal
    (``surprisal_max``) and, when ``peer-surprisal-max`` is on (``surprising`` given), the samples it
    dropped (``surprising``)."""
    out: dict[str, float] = {}
    ratio = torch.exp(log_ratio.clamp(-cfg.log_ratio_clamp, cfg.log_ratio_clamp))  # (B,T)
    for s, name in enumerate(x.source_names):
        sel = (x.source == s) & rows                                               # (B,)
        if not bool(sel.any()):
            continue
        tok = mask & sel[:, None]                                                  # (B,T)
        r, lr = ratio[tok], log_ratio[tok]
        p = f"offpolicy/{name}/"
        out[p + "samples"] = float(sel.sum())
        out[p + "tokens"] = float(r.numel())
        out[p + "filtered"] = float(dropped[sel].sum())
        out[p + "implausible"] = float(implausible[sel].sum()) if implausible is not None else 0.0
        out[p + "kl_sum"] = float(kl[sel].sum())
        out[p + "kl_max"] = float(kl[sel].max())
        if top is not None:
            out[p + "surprisal_max"] = float(top[sel].max())
        if surprising is not None:
            out[p + "surprising"] = float(surprising[sel].sum())
        if r.numel():
            out[p + "ratio_sum"] = float(r.sum())
            out[p + "ratio_max"] = float(r.max())
            out[p + "ratio_min"] = float(r.min())
            out[p + "log_ratio_sum"] = float(lr.sum())
            out[p + "truncated"] = float((r > cfg.trunc_c).sum())
    return out


#: the per-sample KL quantiles ``kl_quantiles`` reports (``offpolicy/<source>/kl_p50`` ...)
KL_QUANTILES = (0.5, 0.9, 0.99)


def kl_quantiles(row_kl: Tensor, source: Tensor, names: Sequence[str], g: float) -> dict[str, float]:
    """Per source, over the rows in the loss (``row_kl`` not NaN): the per-sample KL estimate's
    quantiles (``kl_p50``, ``kl_p90``, ``kl_p99``: the KL of the median / 90th / 99th percentile
    sample, in the estimator's unit — summed nats for ``sum-*``) and ``kl_ge_g_frac``, the share of
    samples at or above the filter's threshold g whatever their advantage (the filter drops those
    among them with a negative advantage, with ``filter-sign = any`` any nonzero one:
    ``filtered_frac``, in the F- modes only). Exact over an update: pass every micro-batch's rows
    at once."""
    out: dict[str, float] = {}
    for s, name in enumerate(names):
        v = row_kl[(source == s) & ~torch.isnan(row_kl)].double()
        if not v.numel():
            continue
        p = f"offpolicy/{name}/"
        for q in KL_QUANTILES:
            out[f"{p}kl_p{round(q * 100)}"] = float(torch.quantile(v, q))
        out[p + "kl_ge_g_frac"] = float((v >= g).double().mean())
    return out


def merge_stats(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    """Combine two ``source_stats`` results (keys ending _max take the max, _min the min, else sum)."""
    out = dict(a)
    for k, v in b.items():
        if k not in out:
            out[k] = v
        elif k.endswith("_max"):
            out[k] = max(out[k], v)
        elif k.endswith("_min"):
            out[k] = min(out[k], v)
        else:
            out[k] = out[k] + v
    return out


def finalize_stats(stats: dict[str, float]) -> dict[str, float]:
    """Sums -> means/fractions: ratio_mean, log_ratio_mean, truncated_frac, filtered_frac,
    implausible_frac, kl_mean, surprising_frac (with ``peer-surprisal-max``)."""
    out = {k: v for k, v in stats.items()
           if not k.endswith(("_sum", "/filtered", "/truncated", "/implausible", "/surprising"))}
    for prefix in {k.rsplit("/", 1)[0] for k in stats if k.startswith("offpolicy/")}:
        g = lambda key: stats.get(f"{prefix}/{key}", 0.0)  # noqa: E731
        n_tok, n_s = max(g("tokens"), 1.0), max(g("samples"), 1.0)
        if f"{prefix}/ratio_sum" in stats:
            out[f"{prefix}/ratio_mean"] = g("ratio_sum") / n_tok
            out[f"{prefix}/log_ratio_mean"] = g("log_ratio_sum") / n_tok
            out[f"{prefix}/truncated_frac"] = g("truncated") / n_tok
        out[f"{prefix}/filtered_frac"] = g("filtered") / n_s
        out[f"{prefix}/implausible_frac"] = g("implausible") / n_s
        if f"{prefix}/surprising" in stats:
            out[f"{prefix}/surprising_frac"] = g("surprising") / n_s
        out[f"{prefix}/kl_mean"] = g("kl_sum") / n_s
    return out
