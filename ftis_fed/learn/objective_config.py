"""The objective's knobs (``ObjectiveConfig``), apart from the torch code in ``objective.py``, so that
reading a run config (``ftis_fed.config.keys``: the ClientApp, which Flower starts once per
message in deployment, and the ServerApp) does not import torch."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ftis_fed.knobs import knob
from ftis_fed.learn.modes import MODES

#: ``ratio-level`` values: per token; per completion, summed log-ratio; per completion, mean (GSPO).
RATIO_LEVELS = ("token", "sequence", "sequence-mean")
#: ``filter-sign`` values: the paper's filter (negative-advantage samples only); a variant dropping both signs.
FILTER_SIGNS = ("negative", "any")


@dataclass(frozen=True)
class ObjectiveConfig:
    """Knobs of the objective; each field is a Flower run-config key (declared with ``knob``). The
    receiver checks' knobs are their own (``ftis_fed/receive/``: ``peer-phrase-*``, ``peer-surprisal-*``,
    ``source-adapt*``)."""

    mode: str = knob("loss-mode", "F-TIS", "one of ``MODES``: alone, noIS, VIS, TIS, F-noIS, F-VIS, F-TIS (default).")
    ratio_level: str = knob("ratio-level", "token", """
        ``token`` (default, the paper), ``sequence`` (one ratio per completion: exp of the summed
        log-ratio; TRL's ``vllm_importance_sampling_mode = sequence_truncate``) or ``sequence-mean``
        (GSPO, TRL's ``importance_sampling_level = sequence``: exp of the mean per-token log-ratio,
        the mean over the receiver's tokens). The weight min(ratio, C) is truncated the same way at
        every level; the F filter's KL estimate does not depend on it. Cross-tokenizer samples use
        ``sequence`` at ``token`` level.""")
    trunc_c: float = knob("trunc-c", 2.0, "C, the truncation cap of the importance weight; > 0, ``inf`` disables.")
    trunc_mean_cap: float = knob("trunc-mean-cap", 0.0, """
        > 0: each completion's truncated weights are scaled so that their mean over its tokens is at
        most this (``cap_row_mean``; 1 = no completion weighs more than an on-policy one: an honest
        sender's mean weight is <= 1 in expectation, E_gen[min(pi_theta/pi_gen, C)] <= 1, while one
        claiming low log-probs gets C on every token; docs/security.md); 0 (default) = off, >= 0.""")
    clip_eps: float = knob("clip-eps", 0.2, "eps of the PPO clip, in [0, 1).")
    filter_g: float = knob("filter-g", 50.0, """
        g, the KL threshold above which negative-advantage samples are dropped; > 0, ``inf``
        disables (50.0 is meaningful for the default summed estimator).""")
    filter_sign: str = knob("filter-sign", "negative", """
        which samples the F filter may drop at KL_i >= g: ``negative`` (default, the paper: negative
        advantage only; a far sample with positive advantage is always kept) or ``any`` (a variant, not
        the paper: every sample with a nonzero advantage, so a peer's rewarded samples the receiver
        cannot express, KL_i >= g, do not dominate its update either; docs/method.md section 4).""")
    kl_estimator: str = knob("kl-estimator", "sum-k1", """
        ``sum-k1`` (default), ``sum-k3``, ``mean-k1``, ``mean-k3``: how the per-sample
        KL(pi_gen || pi_theta) is estimated from per-token log-ratios d = log pi_gen - log pi_theta
        (k1 = d, k3 = exp(-d) - 1 + d); the default (docs/method.md) is the sum of k1.""")
    length_norm: str = knob("length-norm", "sequence", """
        ``sequence`` (GRPO: each completion's token sum / its length, then mean over completions),
        ``constant`` (Dr. GRPO: token sum / (N * norm_constant)), ``token`` (DAPO: token sum / number
        of tokens).""")
    #: the Dr. GRPO constant (the generation budget), >= 1; set from ``max-new-tokens`` by the run config
    norm_constant: int = 128
    log_ratio_clamp: float = knob("log-ratio-clamp", 20.0, """
        |log-ratio| is clamped to this before exp, and each token's log-ratio entering the KL
        estimate is clamped to +-this; finite and > 0.""")
    advantage_groups: str = knob("advantage-groups", "vertical", """
        ``vertical`` (each sender's G completions of a prompt form a group, the paper's default) or
        ``horizontal`` (all senders' completions of the same task).""")
    scale_rewards: str = knob("scale-rewards", "group",
                              "``group`` (divide by the group std, GRPO) or ``none`` (Dr. GRPO).")

    def __post_init__(self) -> None:
        def need(ok: bool, field: str, limit: str) -> None:
            if not ok:
                raise ValueError(f"objective.{field}={getattr(self, field)!r}: {limit}")

        need(self.mode in MODES, "mode", f"must be one of {sorted(MODES)}")
        need(self.ratio_level in RATIO_LEVELS, "ratio_level", f"must be one of {', '.join(RATIO_LEVELS)}")
        need(self.trunc_c > 0, "trunc_c", "must be > 0 (inf disables truncation)")
        need(self.trunc_mean_cap >= 0, "trunc_mean_cap", "must be >= 0 (0 = off)")
        need(0 <= self.clip_eps < 1, "clip_eps", "must be in [0, 1)")
        need(self.filter_g > 0, "filter_g", "must be > 0 (inf disables the filter)")
        need(self.filter_sign in FILTER_SIGNS, "filter_sign", f"must be one of {', '.join(FILTER_SIGNS)}")
        need(self.kl_estimator in ("sum-k1", "sum-k3", "mean-k1", "mean-k3"), "kl_estimator",
             "must be one of sum-k1, sum-k3, mean-k1, mean-k3")
        need(self.length_norm in ("sequence", "constant", "token"), "length_norm",
             "must be 'sequence' (GRPO), 'constant' (Dr. GRPO) or 'token' (DAPO)")
        need(int(self.norm_constant) == self.norm_constant and self.norm_constant >= 1,
             "norm_constant", "must be an integer >= 1")
        need(math.isfinite(self.log_ratio_clamp) and self.log_ratio_clamp > 0, "log_ratio_clamp",
             "must be finite and > 0")
        need(self.advantage_groups in ("vertical", "horizontal"), "advantage_groups",
             "must be 'vertical' or 'horizontal'")
        need(self.scale_rewards in ("group", "none"), "scale_rewards", "must be 'group' or 'none'")
