"""Beyond the paper: per-source weights adapted from how off-policy each peer's samples have been.

Why. F-TIS matched training alone in-distribution, but the *stronger* partner sometimes lost
out-of-distribution accuracy (−3.5 to −6.2 points, FTIS.md). The filter drops a negative-advantage
sample only when its own KL exceeds a fixed g = 50 nats; samples below g from a partner whose
distribution is far from the receiver's are still pushed down in full. Pushing down tokens the
receiver would rarely produce moves probability mass onto other unlikely tokens — the mechanism the
filter exists for — and a fixed g cannot tell a peer that is usually close (a LoRA sibling) from one
that is usually far (a smaller or differently trained model).

The rule (``source-adapt = "kl"``). Each receiver keeps, per peer source s, an exponential moving
average m_s of that source's mean sample KL (the filter's estimator, KL_i between the generator and
the receiver's current policy, as the receiver measured it in its last updates:
``Trainer.source_kl``, reported as ``offpolicy/<s>/kl_mean``):

    m_s <- (1 - decay) * m_s + decay * max(0, kl_mean_s)        (first observation: m_s = kl_mean_s)
    w_s  = exp(-m_s / tau)                                        (1 before any observation)

and in the next update multiplies the advantage of every **negative-advantage** sample of peer s by
w_s. Positive-advantage samples are never touched (as in the paper's filter: showing the receiver a
good answer is safe however off-policy it is), nor are the receiver's own samples. It is a soft,
per-source version of the filter: a peer that is on average 1 nat away keeps 90 % of its negative
signal, one 10 nats away 37 %, one near g almost none. ``off`` (default) leaves every sample as the
paper has it. It acts on advantages *after* group normalisation (so group statistics are the
paper's), and uses only what the receiver measured itself: a peer cannot raise its own weight.

Pure: ``SourceAdapter`` holds the state; ``observe(kl_means)`` folds in one update's measurements,
``weights()`` gives w_s, and ``to_json`` / ``from_json`` carry it across a resume; the receiver check
``receive/source_adapt.py`` applies w_s to the samples.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping

from ftis_fed.knobs import knob

SOURCE_ADAPT_MODES = ("off", "kl", "guard", "shadow")
#: ``source-adapt-val-families``: which in-distribution families the guard's validation batch draws from
VAL_FAMILIES = ("trained", "task")
#: ``source-adapt-val-score``: how the guard scores a candidate update on its validation batch
VAL_SCORES = ("reward", "loglik")
#: ``source-adapt-val-group``: one score over the whole validation batch, or one per family
VAL_GROUPS = ("all", "family")
#: ``source-adapt-shadow-loss``: the loss the shadow copy trains with on its own samples
SHADOW_LOSSES = ("alone", "run")


@dataclass(frozen=True)
class SourceAdaptConfig:
    """Per-source adaptation, beyond the paper.

    The knobs of the receiver check ``source-adapt`` (``receive/source_adapt.py``; ``guard`` also
    replaces the step, ``learn/guard.py``); each field is a run-config key (``knob``)."""

    mode: str = knob("source-adapt", "off", """
        ``off`` (the paper: every source treated alike), ``kl`` (negative-advantage samples of peer
        s weighted by exp(-m_s / tau), m_s the running mean of s's measured sample KL) or ``guard``
        (``learn/guard.py``: each peer's samples weighted by how well their gradient aligns with the
        gradient of the receiver's own validation batch, and the update with peers kept only if the
        receiver's validation reward is no worse than that of the update without them) or ``shadow``
        (``learn/shadow.py``: beside the model a shadow copy trains on its own samples alone; every
        ``source-adapt-period`` rounds and at the last, the model is reset to the shadow when its sampled
        accuracy on the validation batch is confidently below the shadow's).""")
    tau: float = knob("source-adapt-tau", 10.0,
                      "nats, > 0; the KL at which a source keeps 1/e of its negative signal.")
    decay: float = knob("source-adapt-decay", 0.5, """
        in (0, 1]; weight of the newest update's measurement in m_s (1 = only the last update counts).""")
    val_size: int = knob("source-adapt-val-size", 16, """
        ``guard`` and ``shadow``: prompts of the receiver's validation batch, >= 2: a share
        ``source-adapt-val-ood`` of them (rounded down) from the OOD families, the rest from its own
        training families, all from their *train* split under a seed of their own (disjoint by content
        from every held-out evaluation set).""")
    val_families: str = knob("source-adapt-val-families", "trained", """
        ``guard`` and ``shadow``: the in-distribution part of the validation batch: ``trained`` (the
        families the receiver trains on, weight > 0 in its mixture) or ``task`` (every family of
        ``task-families``: all that its held-out ID evaluation covers, including a family it is not
        trained on, such as a peer's expertise under ``task-scheme = expertise``).""")
    val_ood: float = knob("source-adapt-val-ood", 0.5, """
        ``guard`` and ``shadow``: the share of the validation batch drawn from the OOD families, in [0,
        1), rounded down to whole prompts (0.5: half). 0 validates on in-distribution prompts only: on
        the learning tier most OOD validation prompts are solved by neither candidate, so they add
        prompts to the batch but not to the comparison; and the selection then has seen no problem of
        the OOD families' kind.""")
    val_score: str = knob("source-adapt-val-score", "reward", """
        ``guard``: what decides between the two candidate updates, and the target of the validation
        gradient: ``reward`` (greedy pass@1 on the validation batch; the gradient of the reference
        answers' log-likelihood) or ``loglik`` (the mean per-token log-likelihood of each validation
        prompt's worked solution, where its family has one, else of its reference answer: a
        continuous score, no greedy decoding, and the same replies as the gradient's target).""")
    align: bool = knob("source-adapt-align", True, """
        ``guard``: weigh each peer by how its samples' gradient aligns with the validation gradient
        (true), or keep every peer at weight 1 and let only the choice between the two candidate
        updates decide (false: no validation gradient and no probe backwards, so a cheaper update).""")
    window: int = knob("source-adapt-window", 1, """
        ``guard``: rounds, >= 1; the update with peers is kept when the mean of (its validation score −
        that of the update without them) over the last ``window`` rounds, this one included, is >= 0
        (1: this round's comparison alone). A longer window keeps a peer whose samples help a little on
        average though single rounds disagree; it drops one only where the harm shows in that mean.""")
    val_group: str = knob("source-adapt-val-group", "all", """
        ``guard``: what the window's mean is taken over: ``all`` (one score over the whole validation
        batch) or ``family`` (one score per in-distribution family of the batch and one for its OOD
        families together; the peers are kept only while *no* group's mean difference is below 0, so a
        loss on one family is not hidden by a gain on another). ``family`` needs ``source-adapt-val-score
        = loglik``: a pass@1 over a family's few validation prompts ties in most rounds.""")
    period: int = knob("source-adapt-period", 25, """
        ``shadow``: rounds, >= 1; the model and its shadow are compared ``period`` rounds after their
        last check (every ``period``-th round where the receiver trains every round) and at the run's
        last round.""")
    val_samples: int = knob("source-adapt-val-samples", 4, """
        ``shadow``: sampled completions per validation prompt, in [1, 64], at the run's temperature
        (the same seeds for the model and its shadow); each prompt's solved share is one paired
        difference.""")
    z: float = knob("source-adapt-z", 2.0, """
        ``shadow``: >= 0, finite; at a check before the run's last round the model is reset to its
        shadow when the mean paired difference (model − shadow) plus ``z`` standard errors is below 0
        (0: whenever the mean is below 0). At the last round ``source-adapt-z-last`` decides.""")
    z_last: float = knob("source-adapt-z-last", 0.0, """
        ``shadow``: >= 0, finite; the last round's choice of the final model. 0: the mean paired
        difference (model − shadow) alone decides, the model is kept when it is >= 0 (the one that
        validates better; a tie keeps the model). > 0: the model is kept only when that mean minus
        ``z_last`` standard errors is > 0, else the run ends on the shadow, the copy trained alone: a
        tie or a small lead does not keep a model its peers did not clearly improve. 1 is the setting
        that never ends below alone at a tie (docs/RESULTS.md §4: claim 1s held on every pair run with
        it); it buys that guarantee, not accuracy (a tied model held out better as often as its
        shadow or more), and costs a kept model its lead where a tie hid one.""")
    shadow_loss: str = knob("source-adapt-shadow-loss", "alone", before="run", help="""
        ``shadow``: the loss of the shadow's update on its own samples: ``alone`` (``loss-mode = alone``:
        the shadow is the run this receiver would have made alone, the same weights bit for bit) or
        ``run`` (the run's ``loss-mode``, e.g. F-TIS's truncated weight pi_theta / pi_gen on its own
        samples: the sampler's log-probs differ from the training forward's in the last digits, so the
        shadow drifts from the alone run, measured 1e-4 (full) / 1e-3 (LoRA) in the weights after 4
        updates of ``research-w``; the first shadow cells of docs/RESULTS.md ran it).""")

    def __post_init__(self) -> None:
        if self.mode not in SOURCE_ADAPT_MODES:
            raise ValueError(f"source-adapt={self.mode!r}: must be one of {', '.join(SOURCE_ADAPT_MODES)}")
        if not (self.tau > 0 and math.isfinite(self.tau)):
            raise ValueError(f"source-adapt-tau={self.tau}: must be a finite number > 0")
        if not 0 < self.decay <= 1:
            raise ValueError(f"source-adapt-decay={self.decay}: must lie in (0, 1]")
        if isinstance(self.val_size, bool) or int(self.val_size) != self.val_size or self.val_size < 2:
            raise ValueError(f"source-adapt-val-size={self.val_size!r}: must be an integer >= 2")
        if self.val_families not in VAL_FAMILIES:
            raise ValueError(f"source-adapt-val-families={self.val_families!r}: must be one of {', '.join(VAL_FAMILIES)}")
        if isinstance(self.val_ood, bool) or not (isinstance(self.val_ood, (int, float)) and 0 <= self.val_ood < 1):
            raise ValueError(f"source-adapt-val-ood={self.val_ood!r}: must be a number in [0, 1)")
        if self.val_score not in VAL_SCORES:
            raise ValueError(f"source-adapt-val-score={self.val_score!r}: must be one of {', '.join(VAL_SCORES)}")
        if self.val_group not in VAL_GROUPS:
            raise ValueError(f"source-adapt-val-group={self.val_group!r}: must be one of {', '.join(VAL_GROUPS)}")
        if self.val_group == "family" and self.val_score != "loglik":
            raise ValueError(f"source-adapt-val-group=family: needs source-adapt-val-score=loglik, not "
                             f"{self.val_score!r} (a pass@1 over one family's few validation prompts mostly ties)")
        if isinstance(self.window, bool) or int(self.window) != self.window or self.window < 1:
            raise ValueError(f"source-adapt-window={self.window!r}: must be an integer >= 1")
        if isinstance(self.period, bool) or int(self.period) != self.period or self.period < 1:
            raise ValueError(f"source-adapt-period={self.period!r}: must be an integer >= 1")
        if isinstance(self.val_samples, bool) or int(self.val_samples) != self.val_samples \
                or not 1 <= self.val_samples <= 64:
            raise ValueError(f"source-adapt-val-samples={self.val_samples!r}: must be an integer in [1, 64]")
        if isinstance(self.z, bool) or not (math.isfinite(self.z) and self.z >= 0):
            raise ValueError(f"source-adapt-z={self.z!r}: must be a finite number >= 0")
        if isinstance(self.z_last, bool) or not (math.isfinite(self.z_last) and self.z_last >= 0):
            raise ValueError(f"source-adapt-z-last={self.z_last!r}: must be a finite number >= 0")
        if self.shadow_loss not in SHADOW_LOSSES:
            raise ValueError(f"source-adapt-shadow-loss={self.shadow_loss!r}: must be one of "
                             f"{', '.join(SHADOW_LOSSES)}")
        if not isinstance(self.align, bool):
            raise ValueError(f"source-adapt-align={self.align!r}: must be true or false")


def source_weight(mean_kl: float, tau: float) -> float:
    """w = exp(-max(0, mean_kl) / tau): 1 on-policy, decreasing with the source's off-policy-ness."""
    return math.exp(-max(0.0, mean_kl) / tau)


@dataclass
class SourceAdapter:
    """One receiver's running per-source statistics and the weights they give."""

    cfg: SourceAdaptConfig
    receiver: str
    kl: dict[str, float] = field(default_factory=dict)        # source -> running mean sample KL
    updates: dict[str, int] = field(default_factory=dict)     # source -> updates observed

    def observe(self, kl_means: Mapping[str, float]) -> None:
        """Fold in one update's mean sample KL per peer source (the receiver's own measurement,
        ``Trainer.source_kl``: only sources that had samples); the receiver itself and non-finite
        values are ignored."""
        for source, value in kl_means.items():
            v = float(value)
            if source == self.receiver or not math.isfinite(v):
                continue
            v = max(0.0, v)
            old = self.kl.get(source)
            self.kl[source] = v if old is None else (1 - self.cfg.decay) * old + self.cfg.decay * v
            self.updates[source] = self.updates.get(source, 0) + 1

    def weight(self, source: str) -> float:
        """w_s for the next update: 1 when not ``kl``, for the receiver itself, or before any observation."""
        if self.cfg.mode != "kl" or source == self.receiver or source not in self.kl:
            return 1.0
        return source_weight(self.kl[source], self.cfg.tau)

    def weights(self) -> dict[str, float]:
        return {s: self.weight(s) for s in sorted(self.kl)}

    def metrics(self) -> dict[str, float]:
        """``adapt/<source>/weight`` and ``adapt/<source>/kl_ema`` for the round's metrics row."""
        out = {}
        for s in sorted(self.kl):
            out[f"adapt/{s}/weight"] = self.weight(s)
            out[f"adapt/{s}/kl_ema"] = self.kl[s]
        return out

    def to_json(self) -> dict:
        return {"kl": dict(self.kl), "updates": dict(self.updates)}

    @classmethod
    def from_json(cls, cfg: SourceAdaptConfig, receiver: str, state: Mapping | None) -> "SourceAdapter":
        state = state or {}
        return cls(cfg, receiver, {str(k): float(v) for k, v in state.get("kl", {}).items()},
                   {str(k): int(v) for k, v in state.get("updates", {}).items()})
