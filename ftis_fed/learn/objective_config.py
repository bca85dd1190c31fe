"""The objective's knobs (``ObjectiveConfig``), apart from the torch code in ``objective.py``, so that
reading a run config (``ftis_fed.config.federation``: the ClientApp, which Flower starts once per
message in deployment, and the ServerApp) does not import torch."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ftis_fed.knobs import knob
from ftis_fed.learn.modes import MODES

#: ``ratio-level`` values: per token; per completion, summed log-ratio; per completion, mean (GSPO).
RATIO_LEVELS = ("token", "sequence", "sequence-mean")


@dataclass(frozen=True)
class ObjectiveConfig:
    """Knobs of the objective; each field is a Flower run-config key (declared with ``knob``)."""

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
    peer_surprisal_max: float = knob("peer-surprisal-max", 0.0, """
        > 0: a peer's sample is dropped from the update (advantage 0, whatever its sign and whatever the
        sender claims) when any of its tokens has a surprisal -log pi_theta(token | prefix) above this
        many nats under the *receiver's own* current policy and sampling distribution
        (``surprising_rows``): the receiver cannot check a peer's claimed log-probs, but it computes its
        own likelihood of every token it trains on. It bounds poisoning with correct answers (a payload
        the receiver would never produce rides on a positive advantage, which the F filter always keeps;
        docs/security.md). The receiver's own samples are never dropped. 0 (default) = off, >= 0.""")
    peer_surprisal_keep_needed: bool = knob("peer-surprisal-keep-needed", True, """
        with ``peer-surprisal-max``: keep a peer's sample whose surprising tokens its reward needs
        (``learn/surprisal.py``: deleted, the receiver's own verifier scores the rest lower: a
        specialist's correct answer the receiver cannot yet give), drop the others (a payload on a
        correct answer earns nothing); false: drop every such sample.""")
    peer_phrase_ratio: float = knob("peer-phrase-ratio", 0.0, """
        > 0: the phrase check (``learn/phrases.py``): a peer's rewarded sample (reward above its group's
        mean) is dropped from the update when it carries a character n-gram that is in at least
        ``peer-phrase-min-share`` of that peer's rewarded completions so far and this many times more
        often than in the receiver's *own* completions, and that its reward does not need (deleted,
        the receiver's own verifier scores the text as high). It bounds a payload made of tokens the
        receiver already finds likely, which ``peer-surprisal-max`` cannot see (docs/security.md).
        0 (default) = off, else >= 1.""")
    peer_phrase_min_share: float = knob("peer-phrase-min-share", 0.05, """
        with ``peer-phrase-ratio``: the least share of a peer's rewarded completions a phrase must be in
        to be flagged, in (0, 1); also sets the counters' memory (lossy counting, error half of this).""")
    peer_phrase_min_count: int = knob("peer-phrase-min-count", 8, """
        with ``peer-phrase-ratio``: the least number of a peer's rewarded completions a phrase must be in
        to be flagged, >= 1 (no verdict from a handful of samples).""")
    clip_eps: float = knob("clip-eps", 0.2, "eps of the PPO clip, in [0, 1).")
    filter_g: float = knob("filter-g", 50.0, """
        g, the KL threshold above which negative-advantage samples are dropped; > 0, ``inf``
        disables (50.0 is meaningful for the default summed estimator).""")
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
        need(self.peer_surprisal_max >= 0 and not math.isnan(self.peer_surprisal_max), "peer_surprisal_max",
             "must be >= 0 (0 = off)")
        need(self.peer_phrase_ratio == 0 or self.peer_phrase_ratio >= 1, "peer_phrase_ratio",
             "must be 0 (off) or >= 1")
        need(0 < self.peer_phrase_min_share < 1, "peer_phrase_min_share", "must be in (0, 1)")
        need(self.peer_phrase_min_count >= 1, "peer_phrase_min_count", "must be >= 1")
        need(0 <= self.clip_eps < 1, "clip_eps", "must be in [0, 1)")
        need(self.filter_g > 0, "filter_g", "must be > 0 (inf disables the filter)")
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
