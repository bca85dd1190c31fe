"""Beyond the paper (``source-adapt = "shadow"``): beside the model that learns from its peers, keep a
shadow copy that trains alone, and fall back to it when my own validation says, with confidence, that
the peers have made me worse than I would be without them.

Why (docs/RESULTS.md §4). The per-update guard (``learn/guard.py``) decides each round from one
update's score on a small validation batch. On the learning tier one update's effect is far below
that score's noise: whether scored by greedy pass@1, by the worked replies' log-likelihood, per
family or over a window of 20 rounds, it either kept peers that cost a partner 9 points
(``research-w-spec``'s base) or dropped peers worth 5–8 points (``research-w``). The harm and the help
build up over many updates, so they can only be seen along the trajectory: by comparing what the
model *is*, in sampled accuracy, with what it would be had it trained alone.

The rule. Each receiver holds two trainable states of its one model: the **main** (the model: it
generates the round's samples, is evaluated and exported) and the **shadow** (the same model trained
on its own samples only: the alone trajectory, started from the same weights).

1. Every round the main takes the run's update on own + peers' samples, as without this option.
2. The shadow's weights are loaded, it draws this round's own samples itself (the same prompts, seed
   and reward as the main's ``generate``, ``own_samples``) and takes ``loss-mode = alone``'s update on
   them (``source-adapt-shadow-loss = alone``); then the main's weights are loaded back. So the shadow
   is, bit for bit, the run this receiver makes with ``loss-mode = alone`` and the same knobs. (With
   ``run`` it takes the run's loss instead: F-TIS weighs even its own samples by min(pi_theta / pi_gen,
   C), and the sampler's log-probs differ from the training forward's in the last digits, so that
   shadow drifts from the alone run, and on the learning tier two such runs end ~2 points apart.) The
   receiver checks (``receive/``) concern peers' samples and are not run on the shadow's.
3. Every ``source-adapt-period`` rounds (in a population that trains the receiver in some rounds
   only: at its first update that many rounds after the last check), and at the run's last round,
   both are scored on the receiver's validation batch V (``learn/guard.validation_prompts``;
   disjoint by content from every held-out evaluation set): k = ``source-adapt-val-samples`` sampled
   completions per prompt at the run's temperature, the same seeds for both (paired draws), solved
   by the evaluation's rule. With d_i = (solved_main,i − solved_shadow,i) / k per prompt, its mean d̄
   and standard error se: the main is **reset to the shadow** (weights, optimizer state, step count)
   when d̄ + z · se < 0 (``source-adapt-z``): when even the upper end of the interval says the peers
   made it worse. Otherwise the main stays. After a reset the main learns from its peers again,
   from the shadow's point; the shadow is never changed by the main.
4. At the run's last round the check is a choice of the final model: the main stays when d̄ >= 0
   (``source-adapt-z-last`` = 0, the default). Before it, keeping the main has a value beyond its
   score (the peers may help in the rounds to come), hence the margin; at the end only which model is
   better counts, and d̄ is the best estimate of that. With z_last > 0 the main stays only when
   d̄ − z_last · se > 0, so a tie ends on the shadow. Measured (docs/RESULTS.md §4, z_last = 1, five
   pairs, 45 seeds): claim 1s held on every pair, each tie ending on the alone run; at the ties it
   decided the model held out better as often as its shadow or more (the spec pair 2 of 4, the mixed
   pair's spec 4 of 5), and on the OOD-aware pair two ties ended the base on alone where its model
   held out 5.4 and 3.1 points above it. The margin buys the guarantee, not accuracy, hence it is a
   setting and 0 the default.

So the main never ends below training alone by its own validation, yet keeps what its peers are
worth where they help: a spurious reset before the end needs the interval's upper end below 0, at
z = 2 about 2 % of the checks where the two are equal.

Cost per round: a second update (the shadow's, on G · prompts own samples) and a second generation
of the round's own samples, two copies of the trainable state + optimizer state (memory: one more
of each), and at each check 2 · |V| · k sampled completions. ``guard/seconds`` measures all of it.
Metrics: ``guard/<peer>/weight`` (1: every peer's samples as sent), at the checks ``guard/val_with`` /
``guard/val_without`` (the main's and the shadow's sampled pass@1 on V), ``guard/diff_mean`` (d̄),
``guard/diff_se`` (se), ``guard/kept_peers`` (0 where the main was reset) and ``guard/resets`` (so far).
At the final evaluation the participant also scores, on the held-out sets and as it scores the model,
the one the last check did not choose (``unchosen``: the shadow where the model stayed, the model with
its peers where it was reset; ``participant.Participant._unchosen_heldout``: ``unchosen/eval/...``
metrics, per-prompt records in ``unchosen_eval_prompts.jsonl.gz``), so both ends of that choice are on
record and whether it chose the one that holds out better can be counted.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from pathlib import Path
from typing import Callable, Sequence

from ftis_fed.learn.training import TrainSample, read_snapshot, save_snapshot, snapshot_from, snapshot_items


def paired_difference(main: Sequence[int], alone: Sequence[int], k: int) -> tuple[float, float]:
    """(d̄, se) of the per-prompt differences d_i = (main_i − alone_i) / k: solved completions of k
    per prompt, the same prompts in the same order; se = the sample standard deviation / sqrt(n)
    (0 for one prompt). A length mismatch or an empty batch is a ValueError."""
    if len(main) != len(alone) or not main:
        raise ValueError(f"paired_difference: {len(main)} and {len(alone)} prompts (must be equal, > 0)")
    d = [(m - a) / k for m, a in zip(main, alone)]
    se = statistics.stdev(d) / math.sqrt(len(d)) if len(d) > 1 else 0.0
    return statistics.fmean(d), se


def resets(d_mean: float, se: float, z: float) -> bool:
    """The main is reset to the shadow when d̄ + z · se < 0; a non-finite d̄ or se resets too (no
    evidence that the peers are harmless)."""
    return not (math.isfinite(d_mean) and math.isfinite(se)) or d_mean + z * se < 0


class ShadowGuard:
    """The ``shadow`` update of one receiver (see the module docstring).

    trainer: the participant's ``Trainer`` (its policy holds the main's weights between calls);
    own_samples(round): this round's own samples drawn by the weights loaded at the call;
    val_counts(round): per validation prompt, how many of k sampled completions the loaded weights
    solve (the same seeds whichever weights are loaded); k, period, z, z_last: ``source-adapt-val-samples``,
    ``source-adapt-period``, ``source-adapt-z``, ``source-adapt-z-last``; last_round: the run's
    ``num-rounds`` (always checked).
    """

    def __init__(self, trainer, own_samples: Callable[[int], list[TrainSample]],
                 val_counts: Callable[[int], Sequence[int]], k: int, period: int, z: float, last_round: int,
                 z_last: float = 0.0, shadow_loss: str = "alone"):
        self.trainer, self.own_samples, self.val_counts = trainer, own_samples, val_counts
        self.shadow_loss = shadow_loss
        self.k, self.period, self.z, self.z_last, self.last_round = k, period, z, z_last, last_round
        #: (trainable state, optimizer state, optimizer steps) of the alone trajectory; None until the
        #: first update, when it starts as the main's weights before that update
        self.shadow: tuple | None = None
        self.resets = 0
        self.checked = 0                                         # the round of the last check
        #: after the last round's check, the state it did not choose: the shadow where the model stayed,
        #: the model with its peers where it was reset (the participant's final evaluation scores it too)
        self.unchosen: tuple | None = None

    def shadow_objective(self):
        """The objective of the shadow's updates (``source-adapt-shadow-loss``): the trainer's with
        ``loss-mode = alone`` (``alone``), or the trainer's own (``run``)."""
        objective = self.trainer.objective
        return dataclasses.replace(objective, mode="alone") if self.shadow_loss == "alone" else objective

    def due(self, round: int) -> bool:
        """A check at ``round``: ``period`` rounds after the last check (every ``period``-th round when
        the participant trains every round; in a population that trains it in some rounds only, its
        first round at least ``period`` after), and at the run's last round."""
        return round - self.checked >= self.period or round >= self.last_round

    def decide(self, round: int, with_peers: Sequence[int], alone: Sequence[int]) -> tuple[float, float, bool]:
        """(d̄, se, reset) of a check at ``round``: reset when d̄ + z · se < 0 before the last round; at it
        when d̄ < 0 (z_last = 0), or unless d̄ − z_last · se > 0 (z_last > 0: a tie ends on the shadow)."""
        d, se = paired_difference(with_peers, alone, self.k)
        if round < self.last_round:
            return d, se, resets(d, se, self.z)
        return d, se, resets(d, se, 0.0) if self.z_last == 0 else not d - self.z_last * se > 0

    def step(self, samples: Sequence[TrainSample], sampling, round: int) -> dict[str, float]:
        """The main's update on ``samples`` (own + peers), the shadow's on its own draws, and at a
        check the comparison; returns the main's update metrics plus ``guard/...``."""
        if self.shadow is None:
            self.shadow = self.trainer.snapshot()
        metrics = self.trainer.step(samples, sampling)
        t0 = time.perf_counter()
        source_kl = dict(self.trainer.source_kl)             # the main's, for the checks' ``after_step``
        main = self.trainer.snapshot()
        self.trainer.restore(self.shadow, "shadow")
        own = self.own_samples(round)
        if own:
            self.trainer.step(own, sampling, self.shadow_objective())
        self.shadow = self.trainer.snapshot()
        out = {f"guard/{s}/weight": 1.0 for s in dict.fromkeys(s.source for s in samples if not s.local)}
        if self.due(round):
            self.checked = round
            alone = list(self.val_counts(round))                 # the shadow's weights are loaded
            self.trainer.restore(main, "shadow")
            with_peers = list(self.val_counts(round))
            d, se, reset = self.decide(round, with_peers, alone)
            if round >= self.last_round:
                self.unchosen = main if reset else self.shadow
            if reset:
                self.trainer.restore(self.shadow, "shadow")
                self.resets += 1
            n = self.k * len(alone)
            out.update({"guard/val_with": sum(with_peers) / n, "guard/val_without": sum(alone) / n,
                        "guard/diff_mean": d, "guard/diff_se": se, "guard/kept_peers": float(not reset),
                        "guard/resets": float(self.resets)})
        else:
            self.trainer.restore(main, "shadow")
        self.trainer.source_kl = source_kl
        out["guard/seconds"] = time.perf_counter() - t0
        return {**metrics, **out}

    # ------------------------------------------------------------------ resume
    def save(self, path: str | Path) -> None:
        """The shadow's state (``Trainer.save``'s layout), the reset count, the last check's round and,
        after the last round's check, the end it did not choose (``"shadow"`` where that is the shadow,
        else the model's state before the reset), written atomically; nothing before the first update.
        So a run resumed between its last update and its final evaluation still scores both ends."""
        if self.shadow is None:
            return
        extra = {}
        if self.unchosen is not None:
            extra["unchosen"] = "shadow" if self.unchosen is self.shadow else snapshot_items(self.unchosen)
        save_snapshot(path, self.shadow, resets=self.resets, checked=self.checked, **extra)

    def load(self, path: str | Path) -> None:
        """Restore what ``save`` wrote (nothing when there is no file: a checkpoint made before the
        first update, whose shadow then starts from the restored main)."""
        if not Path(path).exists():
            return
        self.shadow, state = read_snapshot(path)
        self.resets, self.checked = int(state["resets"]), int(state["checked"])
        got = state.get("unchosen")
        self.unchosen = self.shadow if got == "shadow" else None if got is None else snapshot_from(got)
