"""Beyond the paper (``source-adapt = "guard"``): weigh each peer by whether its samples help *me*,
measured on a validation batch I hold myself, and keep an update with peers only when it does not
make me worse on that batch than the update without them.

Why (docs/RESULTS.md, issue #18). The paper's F-TIS matched training alone in-distribution but the
stronger partner sometimes *lost* out-of-distribution accuracy. The earlier option (``kl``) weighted
a peer by its measured sample KL: a length-driven quantity that lags a round, only shrinks negative
advantages (a net pull toward imitating the partner) and says nothing about whether the peer's
samples move the receiver in a useful direction. This rule asks that question directly.

Per update, with own samples O and each peer source s's samples P_s (F-TIS advantages, filter and
truncation as configured):

1. **Validation gradient.** The receiver's validation batch V (``validation_prompts``:
   ``source-adapt-val-size`` prompts, half from its own training families (``source-adapt-val-families
   = task``: every family of the task, those it is not trained on included), half from the OOD
   families, all from the *train* split under a seed of their own, so disjoint by content from every
   held-out evaluation set) with its validation replies (``validation_reply``: the reference answers,
   or with ``source-adapt-val-score = loglik`` the worked solutions where the family has them): g_V =
   gradient of the mean log-likelihood of those replies (teacher-forced; the direction that makes
   right answers likelier).
2. **Alignment weights.** g_O, g_s = the F-TIS loss gradients of O and of each P_s alone (one
   backward each, no step; ``ftis_step`` with a probe optimizer). c_O = cos(g_O, g_V),
   c_s = cos(g_s, g_V); the weight of source s is w_s = clip(c_s / c_O, 0, 1) when c_O > 0 (a peer
   counts as much as my own data when its samples point as well toward my validation objective,
   less when they point less well, not at all when they point away), else 1[c_s > 0]. Every sample
   of P_s (positive and negative advantage alike) has its advantage multiplied by w_s.
   With ``source-adapt-align = false`` steps 1–2 are skipped and every w_s = 1: on the learning
   tier (docs/RESULTS.md §4) c_O was <= 0 in 54–59 % of the rounds (|c_O| median ~0.05), so the
   weights were 0 in about half the rounds and 1 in a third, a coin flip rather than a measurement.
3. **Guard.** From the same starting state (trainable weights + optimizer state) two candidate
   updates are made: with peers (O + weighted P) and without (O only); each is scored on V by greedy
   pass@1 (``source-adapt-val-score = reward``) or by the mean per-token log-likelihood of the
   validation replies (``loglik``: continuous, so the two candidates rarely tie; pass@1 on 16
   prompts tied in 83 % of ``research-w-spec``'s rounds). The update with peers is kept when its
   score is no worse (>=); otherwise the update without them. Ties keep the peers. With
   ``source-adapt-window = W`` > 1 the rule reads the mean of the last W rounds' differences
   d = score with − score without (this round's included; a non-finite d keeps neither it nor the
   peers): kept when that mean is >= 0. Per round d is mostly noise (on ``research-w`` with the
   ``loglik`` score its standard deviation was 3–17 times its mean, so the peers were kept in only
   50–60 % of rounds though they help), while its mean over rounds is the peers' effect.

Cost per update (measured in ``train/seconds``, and ``guard/seconds``): one validation backward and
1 + (peers) probe backwards (neither with ``align = false``), two optimizer steps instead of one, two
greedy passes over V (``loglik``: two teacher-forced forward passes instead), and a copy of the
trainable state and optimizer state.
Nothing here reads the off-policy diagnostics, so the weights do not depend on ``score-zero-advantage``.

Caveat, stated where the results are: V includes OOD-family *train* problems, so this option's
selection has seen problems of the OOD families' kind (never the evaluation problems themselves).
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import math
import time
from typing import Callable, Mapping, Sequence

import torch

from ftis_fed.learn.training import TrainSample, ftis_step
from ftis_fed.tasks.families import OOD_FAMILIES
from ftis_fed.tasks.prompt import Prompt
from ftis_fed.tasks.suite import TaskSpec, task_at, worked_solution

#: offset of the validation batch's task seed (its own instances of the train split)
VAL_SEED_OFFSET = 7_777_777


def validation_prompts(task: TaskSpec, partition_id: int, num_partitions: int, n: int,
                       families: str = "trained") -> list[Prompt]:
    """The receiver's validation batch: ceil(n/2) in-distribution prompts, round-robin over
    ``families`` (``trained``: the families of its mixture with weight > 0; ``task``: every family of
    the task, as its held-out ID evaluation has them), and the rest from the OOD families, from the
    train split under seed ``task.seed + VAL_SEED_OFFSET + partition_id``."""
    if families == "task":
        own = list(task.families)
    else:
        mix = task.mixture(partition_id, num_partitions)
        own = [f for f, w in mix.items() if w > 0] or list(task.families)
    seed = task.seed + VAL_SEED_OFFSET + partition_id
    k_own = -(-n // 2)
    out = [task_at(own[i % len(own)], "train", seed, i) for i in range(k_own)]
    out += [task_at(OOD_FAMILIES[i % len(OOD_FAMILIES)], "train", seed, i) for i in range(n - k_own)]
    return out


def validation_reply(prompt: Prompt, score: str = "reward") -> str:
    """The reply whose log-likelihood the guard's validation gradient raises (and, with ``loglik``,
    scores): ``prompt.reference`` for ``reward``; for ``loglik`` the family's worked solution, the
    reply a worked model was warmed up to give (``tasks.suite.worked_solution``), else the reference."""
    return (worked_solution(prompt.task_id) or prompt.reference) if score == "loglik" else prompt.reference


class _GradProbe:
    """An "optimizer" for ``ftis_step`` that records the flattened gradient instead of stepping."""

    def __init__(self, params: Sequence[torch.nn.Parameter]):
        self.params = list(params)
        self.flat: torch.Tensor | None = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    def step(self) -> None:
        self.flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().flatten().float()
                               for p in self.params])


def _cos(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    """cos(a, b); 0 when either has no direction (a zero or non-finite gradient: no signal)."""
    if a is None or b is None:
        return 0.0
    na, nb = float(a.norm()), float(b.norm())
    ok = na > 0 and nb > 0 and math.isfinite(na) and math.isfinite(nb)
    return float(a @ b) / (na * nb) if ok else 0.0


def alignment_weight(c_source: float, c_own: float) -> float:
    """w_s = clip(c_s / c_O, 0, 1) when c_O > 0, else 1 if c_s > 0 else 0 (non-finite c_s: 0)."""
    if not math.isfinite(c_source):
        return 0.0
    if math.isfinite(c_own) and c_own > 0:
        return min(1.0, max(0.0, c_source / c_own))
    return 1.0 if c_source > 0 else 0.0


class GuardedUpdate:
    """The ``guard`` update of one receiver (see the module docstring).

    trainer: the participant's ``Trainer``; val: its validation prompts; val_reward(): greedy pass@1
    of the current weights on ``val`` (read only with ``score = "reward"``); score: ``source-adapt-val-
    score``; align: ``source-adapt-align`` (false: every peer at weight 1, no gradient probes);
    window: ``source-adapt-window`` (the differences it holds are its state: ``to_json`` /
    ``load_json`` carry them across a resume).
    """

    def __init__(self, trainer, val: Sequence[Prompt], val_reward: Callable[[], float], score: str = "reward",
                 align: bool = True, window: int = 1):
        self.trainer, self.val, self.val_reward, self.score, self.align = trainer, list(val), val_reward, score, align
        self.window = window
        self.diffs: collections.deque[float] = collections.deque(maxlen=window)
        pol = trainer.policy
        # (prompt_ids, reply_ids + EOS) per validation prompt
        self.val_rows = [pol.retokenize(p.text, validation_reply(p, score), True) for p in self.val]

    def to_json(self) -> dict:
        return {"diffs": list(self.diffs)}

    def load_json(self, state: Mapping | None) -> None:
        """Restore ``to_json``'s differences (the last ``window`` of them; none when ``state`` is None)."""
        self.diffs = collections.deque((float(d) for d in (state or {}).get("diffs", [])), maxlen=self.window)

    def diff_mean(self) -> float:
        """The mean of the window's differences (NaN while it holds none)."""
        return sum(self.diffs) / len(self.diffs) if self.diffs else math.nan

    def keeps_peers(self, r_with: float, r_without: float) -> bool:
        """Fold in this round's difference and decide: the mean over the window is >= 0 (window 1:
        ``r_with >= r_without``); a non-finite difference is not kept and drops the peers."""
        d = r_with - r_without
        if not math.isfinite(d):
            return False
        self.diffs.append(d)
        return self.diff_mean() >= 0

    def _val_loglik(self, sampling, grad: bool) -> torch.Tensor:
        """The mean per-token log-likelihood of the validation replies: a scalar, with its graph when
        ``grad``, in whatever mode the policy is in."""
        pol = self.trainer.policy
        with torch.set_grad_enabled(grad):
            logp = pol.score_padded([r[0] for r in self.val_rows], [r[1] for r in self.val_rows], sampling, grad)
            T = logp.shape[1]                                                                    # logp: (V,T)
            mask = torch.arange(T)[None, :] < torch.tensor([len(r[1]) for r in self.val_rows])[:, None]
            return (logp * mask).sum() / mask.sum()

    def validation_score(self, sampling) -> float:
        """The current weights' score on the validation batch (``score``: greedy pass@1, or the mean
        per-token log-likelihood of the validation replies in evaluation mode, as between updates)."""
        return float(self._val_loglik(sampling, False)) if self.score == "loglik" else float(self.val_reward())

    def _val_gradient(self, sampling) -> torch.Tensor:
        pol, params = self.trainer.policy, self.trainer.params
        for p in params:
            p.grad = None
        pol.train_mode(True)
        try:
            (-self._val_loglik(sampling, True)).backward()
        finally:
            pol.train_mode(False)
        g = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().flatten().float() for p in params])
        for p in params:
            p.grad = None
        return g

    def _probe(self, samples: Sequence[TrainSample], sampling) -> torch.Tensor | None:
        t, pol = self.trainer, self.trainer.policy
        probe = _GradProbe(t.params)
        pol.train_mode(True)
        try:
            ftis_step(lambda p, c, g: pol.score_padded(p, c, sampling, g), t.params, probe, samples, t.objective,
                      t.cfg.micro_batch, t.cfg.max_grad_norm, group_prompts=t.cfg.share_prefix,
                      score_zero_advantage=False)
        finally:
            pol.train_mode(False)
        return probe.flat

    def _state(self) -> tuple:
        t = self.trainer
        return t.policy.trainable_state(), copy.deepcopy(t.optimizer.state_dict()), t.steps

    def _restore(self, state: tuple) -> None:
        t = self.trainer
        weights, opt, steps = state
        t.policy.load_trainable_state(weights, source="guard")
        t.optimizer.load_state_dict(copy.deepcopy(opt))
        t.steps = steps
        t.policy.weights_changed()

    def step(self, samples: Sequence[TrainSample], sampling) -> dict[str, float]:
        """One guarded update on ``samples`` (own + peers); returns the kept update's metrics plus
        ``guard/...``: per-source ``guard/<s>/weight`` (and with ``align``, ``guard/<s>/cos`` and
        ``guard/own_cos``), ``guard/kept_peers`` (1 / 0), ``guard/val_with`` / ``guard/val_without``,
        with ``window`` > 1 ``guard/diff_mean`` (the mean that decided), ``guard/seconds``."""
        t0 = time.perf_counter()
        own = [s for s in samples if s.local]
        sources = list(dict.fromkeys(s.source for s in samples if not s.local))
        if not sources:
            return self.trainer.step(samples, sampling)
        out: dict[str, float] = {}
        weights = dict.fromkeys(sources, 1.0)
        if self.align:
            g_val = self._val_gradient(sampling)
            c_own = _cos(self._probe(own, sampling), g_val) if own else 0.0
            out["guard/own_cos"] = c_own
            for src in sources:
                c = _cos(self._probe([s for s in samples if s.source == src], sampling), g_val)
                weights[src] = alignment_weight(c, c_own)
                out[f"guard/{src}/cos"] = c
        out.update({f"guard/{src}/weight": w for src, w in weights.items()})
        weighted = own + [dataclasses.replace(s, advantage=s.advantage * weights[s.source])
                          for s in samples if not s.local]
        start = self._state()
        m_with = self.trainer.step(weighted, sampling)
        r_with = self.validation_score(sampling)
        if not own:                                     # nothing to compare with: keep the update with peers
            out.update({"guard/kept_peers": 1.0, "guard/val_with": r_with})
            return {**m_with, **out, "guard/seconds": time.perf_counter() - t0}
        with_peers = self._state()
        self._restore(start)
        m_without = self.trainer.step(own, sampling)
        r_without = self.validation_score(sampling)
        keep = self.keeps_peers(r_with, r_without)
        if self.window > 1:
            out["guard/diff_mean"] = self.diff_mean()
        if keep:
            self._restore(with_peers)
        out.update({"guard/kept_peers": float(keep), "guard/val_with": r_with, "guard/val_without": r_without})
        return {**(m_with if keep else m_without), **out, "guard/seconds": time.perf_counter() - t0}
