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
   = task``: every family of the task, those it is not trained on included), half from the OOD families
   (``source-adapt-val-ood``: another share, 0 for none), all from the *train* split under a seed of
   their own, so disjoint by content from every held-out evaluation set) with its validation replies
   (``validation_reply``: the reference answers, or with ``source-adapt-val-score = loglik`` the worked
   solutions where the family has them): g_V = gradient of the mean log-likelihood of those replies
   (teacher-forced; the direction that makes right answers likelier).
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
   50–66 % of rounds though they help), while its mean over rounds is the peers' effect.
   With ``source-adapt-val-group = family`` (``loglik`` only) each group of V (each in-distribution
   family, and the OOD families together) has its own score, difference and window, and the peers
   are kept only while every group's mean is >= 0. Why: on ``research-w-spec`` the base's mean
   difference over the whole batch was ~0 while its accuracy fell, as a loss on one family that a
   gain on another hides would make it. Measured (docs/RESULTS.md §4): it ended where alone did on
   both learning-tier pairs, protecting that base but giving up ``research-w``'s gain; on
   ``research-w-spec`` addition vetoed the peer while subtraction, the family the base loses, scored
   the peer's update better.

Cost per update (measured in ``train/seconds``, and ``guard/seconds``): one validation backward and
1 + (peers) probe backwards (neither with ``align = false``), two optimizer steps instead of one, two
greedy passes over V (``loglik``: two teacher-forced forward passes instead), and a copy of the
trainable state and optimizer state.
Nothing here reads the off-policy diagnostics, so the weights do not depend on ``score-zero-advantage``.

Caveat, stated where the results are: V includes OOD-family *train* problems, so this option's
selection has seen problems of the OOD families' kind (never the evaluation problems themselves);
with ``source-adapt-val-ood = 0`` it has not.
"""

from __future__ import annotations

import collections
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
                       families: str = "trained", ood_share: float = 0.5) -> list[Prompt]:
    """The receiver's validation batch: floor(n * ``ood_share``) prompts from the OOD families
    (round-robin) after n minus that many in-distribution prompts, round-robin over ``families``
    (``trained``: the families of its mixture with weight > 0; ``task``: every family of the task, as
    its held-out ID evaluation has them), all from the train split under seed ``task.seed +
    VAL_SEED_OFFSET + partition_id``. The in-distribution prompts do not depend on ``ood_share``
    beyond their count: a batch with fewer OOD prompts extends the same sequence."""
    if families == "task":
        own = list(task.families)
    else:
        mix = task.mixture(partition_id, num_partitions)
        own = [f for f, w in mix.items() if w > 0] or list(task.families)
    seed = task.seed + VAL_SEED_OFFSET + partition_id
    k_own = n - math.floor(n * ood_share + 1e-9)           # 1e-9: 0.29 * 100 is 28.999...; whole prompts
    out = [task_at(own[i % len(own)], "train", seed, i) for i in range(k_own)]
    out += [task_at(OOD_FAMILIES[i % len(OOD_FAMILIES)], "train", seed, i) for i in range(n - k_own)]
    return out


def val_group(prompt: Prompt) -> str:
    """The group of a validation prompt under ``source-adapt-val-group = family``: its family (the
    first part of its task id), or "ood" for any OOD family (so few prompts each that they share one)."""
    family = prompt.task_id.split("/")[0]
    return "ood" if family in OOD_FAMILIES else family


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
    window: ``source-adapt-window`` (the differences it holds, per group, are its state: ``to_json``
    / ``load_json`` carry them across a resume); group: ``source-adapt-val-group``.
    """

    def __init__(self, trainer, val: Sequence[Prompt], val_reward: Callable[[], float], score: str = "reward",
                 align: bool = True, window: int = 1, group: str = "all"):
        self.trainer, self.val, self.val_reward, self.score, self.align = trainer, list(val), val_reward, score, align
        self.window, self.group = window, group
        if group == "family" and score != "loglik":
            raise ValueError("source-adapt-val-group=family needs source-adapt-val-score=loglik")
        #: the group of each validation prompt: "all", or (``family``) its family, "ood" for an OOD one
        self.val_groups = [val_group(p) if group == "family" else "all" for p in self.val]
        self.diffs: dict[str, collections.deque[float]] = {}
        pol = trainer.policy
        # (prompt_ids, reply_ids + EOS) per validation prompt; none where nothing reads them (the
        # ``reward`` score without the alignment gradient)
        self.val_rows = ([pol.retokenize(p.text, validation_reply(p, score), True) for p in self.val]
                         if score == "loglik" or align else [])

    def to_json(self) -> dict:
        return {"diffs": {g: list(d) for g, d in self.diffs.items()}}

    def load_json(self, state: Mapping | None) -> None:
        """Restore ``to_json``'s differences per group (the last ``window`` of each; none when ``state``
        is None; a list, as checkpoints before groups have it, is the group "all")."""
        saved = (state or {}).get("diffs", {})
        saved = {"all": saved} if isinstance(saved, list) else saved
        self.diffs = {str(g): collections.deque((float(d) for d in ds), maxlen=self.window) for g, ds in saved.items()}

    def diff_mean(self, group: str | None = None) -> float:
        """The mean of ``group``'s window of differences (NaN while it holds none); without a group,
        the smallest of the groups' means: the one that decides."""
        if group is None:
            means = [self.diff_mean(g) for g in self.diffs]
            return min(means) if means else math.nan
        d = self.diffs.get(group)
        return sum(d) / len(d) if d else math.nan

    def keeps_peers(self, r_with: float | Mapping[str, float], r_without: float | Mapping[str, float]) -> bool:
        """Fold in this round's difference per group (a number: the group "all") and decide: every
        group's mean over its window is >= 0 (window 1, one group: ``r_with >= r_without``); a
        non-finite difference in any group is kept in none and drops the peers."""
        r_with, r_without = ({"all": r} if not isinstance(r, Mapping) else r for r in (r_with, r_without))
        d = {g: r_with[g] - r_without[g] for g in r_with}
        if not all(math.isfinite(x) for x in d.values()):
            return False
        for g, x in d.items():
            self.diffs.setdefault(g, collections.deque(maxlen=self.window)).append(x)
        return all(self.diff_mean(g) >= 0 for g in d)

    def _val_loglik(self, sampling, grad: bool, rows: bool = False) -> torch.Tensor:
        """The mean per-token log-likelihood of the validation replies: a scalar, with its graph when
        ``grad``, in whatever mode the policy is in; ``rows``: instead (sum, tokens) per reply, (V, 2)."""
        pol = self.trainer.policy
        with torch.set_grad_enabled(grad):
            logp = pol.score_padded([r[0] for r in self.val_rows], [r[1] for r in self.val_rows], sampling, grad)
            T = logp.shape[1]                                                                    # logp: (V,T)
            mask = torch.arange(T)[None, :] < torch.tensor([len(r[1]) for r in self.val_rows])[:, None]
            if rows:
                return torch.stack([(logp * mask).sum(1), mask.sum(1).to(logp.dtype)], 1)
            return (logp * mask).sum() / mask.sum()

    def validation_score(self, sampling) -> float:
        """The current weights' score on the whole validation batch (``score``: greedy pass@1, or the
        mean per-token log-likelihood of the validation replies in evaluation mode, as between updates)."""
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

    def _scores(self, sampling) -> tuple[float, dict[str, float]]:
        """This round's score on the whole batch (``guard/val_with`` / ``guard/val_without``: comparable
        whatever the groups) and per deciding group ("all", or with ``family`` each group's tokens' mean
        log-likelihood); one teacher-forced pass either way."""
        if self.group == "all":
            score = self.validation_score(sampling)
            return score, {"all": score}
        sums: dict[str, list[float]] = {}
        per_row = self._val_loglik(sampling, False, rows=True).tolist()
        for g, (s, n) in zip(self.val_groups, per_row):
            acc = sums.setdefault(g, [0.0, 0.0])
            acc[0], acc[1] = acc[0] + s, acc[1] + n
        whole = sum(s for s, _ in per_row) / sum(n for _, n in per_row)
        return whole, {g: s / n for g, (s, n) in sums.items()}

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
        start = self.trainer.snapshot()
        m_with = self.trainer.step(weighted, sampling)
        whole_with, r_with = self._scores(sampling)
        if not own:                                     # nothing to compare with: keep the update with peers
            out.update({"guard/kept_peers": 1.0, "guard/val_with": whole_with})
            return {**m_with, **out, "guard/seconds": time.perf_counter() - t0}
        with_peers = self.trainer.snapshot()
        self.trainer.restore(start, "guard")
        m_without = self.trainer.step(own, sampling)
        whole_without, r_without = self._scores(sampling)
        out.update({"guard/val_with": whole_with, "guard/val_without": whole_without})
        keep = self.keeps_peers(r_with, r_without)
        if self.group == "family":
            out.update({f"guard/val/{g}/diff": r_with[g] - r_without[g] for g in r_with})
            if self.window > 1:
                out.update({f"guard/val/{g}/diff_mean": self.diff_mean(g) for g in r_with})
        if self.window > 1:
            out["guard/diff_mean"] = self.diff_mean()
        if keep:
            self.trainer.restore(with_peers, "guard")
        out["guard/kept_peers"] = float(keep)
        return {**(m_with if keep else m_without), **out, "guard/seconds": time.perf_counter() - t0}
