"""A participant: one policy + its task partition + its keys + its counters, for one run.

It is what lives in the long-lived per-participant process (``clients/worker.py``); the Flower
ClientApp only forwards messages to it. Nothing here imports Flower.

One entry point, one name per action end to end (engine -> transport -> here): ``handle`` reads
the request's fields as the action table (``ftis_fed.actions``) lists them and calls the method of
the same name with them, in that order; its return value becomes the reply's fields::

    handle(action, request) -> reply
      hello    {run, node, challenge}  -> {info: who I am + proof: my signature of the challenge}
      generate {round, texts}          -> {frames: [my signed batch of the round], metrics}   (phase 1:
                                          G completions per prompt, or my share ceil(G/N) of each
                                          shared prompt's group with horizontal advantage groups);
                                          texts: bool, or [False, True] = the batch twice: without
                                          and with its texts (one per kind of receiver), same seq
      learn    {round, frames}         -> {metrics}: verify + re-check peers' batches, train (phase 2)
      exchange {round, frames, texts}  -> {frames, metrics}: pipelined: generate, then learn from it
                                          and peers' batches of the previous round
      evaluate {round}                 -> {metrics}: greedy pass@1 on held-out ID / OOD sets
      finish   {}                      -> {info: {stopped}}
"""

from __future__ import annotations

import functools
import json
import os
import time
from pathlib import Path

import numpy as np

from ftis_fed import participant_state
from ftis_fed.actions import reply_fields, request_args, variants_of
from ftis_fed.atomic import atomic_write
from ftis_fed.wire.batch import CompletionBatch
from ftis_fed.config.federation import FederationConfig, ParticipantSpec
from ftis_fed.learn.evaluation import evaluate as evaluate_policy, greedy_replies, sampled_eval, solved_share
from ftis_fed.learn.guard import GuardedUpdate, validation_prompts
from ftis_fed.learn.shadow import ShadowGuard
from ftis_fed.trust.inbox import Inbox, InboxConfig
from ftis_fed.policies import build_policy
from ftis_fed.policies.share import CardInfo, make_shareable, push_export, update_card
from ftis_fed.receive.checks import Receiver, Update, after_step, build_checks, checks_state, restore_checks, run_checks
from ftis_fed.receive.frames import ReceiverContext, receive
from ftis_fed.trust.run_id import signed_run_id, split_run_id
from ftis_fed.trust.attacks import Attacker, payload_poisoner
from ftis_fed.learn.rollouts import scored_groups_with_scores
from ftis_fed.tasks.scores import per_function_metrics
from ftis_fed.metrics.completions import append_log, completion_records
from ftis_fed.trust.signing import (ReplayGuard, fingerprint, key_paths, load_private_key, shared_key_directory,
                                   run_name_of, sign_batch, sign_challenge)
from ftis_fed.learn.training import Trainer, samples_from_batches
from ftis_fed.wire.codec import send_options


#: In the state dir: the run id of the last hello (``Participant._saved_run_id``).
RUN_ID_FILE = "run_id"


def checkpoint_due(round: int, num_rounds: int, every: int) -> bool:
    """Write the resume state after ``round``'s update? Every ``every``-th round (``checkpoint-every``)
    and after the last round; ``every`` = 0: after the last round only."""
    return round >= num_rounds or (every > 0 and round % every == 0)


#: Per-prompt results of every evaluation, in the participant's state folder (gzip members, one
#: JSON line per evaluation and set): what ``ftis-fed grid`` pairs prompt by prompt.
EVAL_PROMPTS = "eval_prompts.jsonl.gz"
#: The same for ``source-adapt = shadow``'s final evaluation of the model its last check did not choose
#: (``ShadowGuard.unchosen``), so that each cell holds both ends of that choice, scored on the held-out sets.
UNCHOSEN_EVAL_PROMPTS = "unchosen_eval_prompts.jsonl.gz"


#: The training prompts of every round, in the participant's state folder (gzip members, one JSON line
#: per round: ``{"round", "participant", "ids": [task ids]}``): which prompts a seed trained on.
TRAIN_PROMPTS = "train_prompts.jsonl.gz"


def write_train_prompts(path: Path, participant: str, round: int, task_ids: list[str]) -> None:
    """Append this round's training prompts (one gzip member: the file is a concatenation of them)."""
    import gzip

    path.parent.mkdir(parents=True, exist_ok=True)
    line = json.dumps({"round": round, "participant": participant, "ids": task_ids}) + "\n"
    with open(path, "ab") as f:
        f.write(gzip.compress(line.encode(), mtime=0))


#: Seed of the sampled evaluation (``eval-samples``), plus the round: the same draws in every cell.
EVAL_SAMPLE_SEED = 7_000_003
#: seed offset of ``source-adapt = shadow``'s sampled validation (+ the round; the model and its shadow alike)
SHADOW_VAL_SEED = 8_000_009


def write_eval_prompts(path: Path, participant: str, round: int, per_prompt: dict[str, list[tuple[str, bool]]],
                       payload_hits: dict[str, list[bool]] | None = None,
                       sampled: dict[str, list[int]] | None = None, k: int = 0) -> None:
    """Append one line per set: ``{"round", "participant", "set", "ids": [task ids], "solved": "0110..."}``
    (a gzip member per evaluation; concatenated members read as one stream); with ``payload_hits``
    (``attack-payload`` set) also ``"payload": "0010..."``, the replies that carry it; with ``sampled``
    (``eval-samples`` = k > 0) also ``"k"`` and ``"sampled": [solved completions of each prompt]``."""
    import gzip

    def line(name: str, rows: list[tuple[str, bool]]) -> str:
        rec = {"round": round, "participant": participant, "set": name, "ids": [t for t, _ in rows],
               "solved": "".join("1" if ok else "0" for _, ok in rows)}
        if payload_hits is not None and name in payload_hits:
            rec["payload"] = "".join("1" if hit else "0" for hit in payload_hits[name])
        if sampled is not None and name in sampled:
            rec["k"], rec["sampled"] = k, sampled[name]
        return json.dumps(rec)

    lines = [line(name, rows) for name, rows in per_prompt.items()]
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "ab") as f:
        f.write(gzip.compress(("\n".join(lines) + "\n").encode(), mtime=0))


class Participant:
    def __init__(self, spec: ParticipantSpec, fed: FederationConfig, policy=None, run_key: str = ""):
        self.spec, self.fed = spec, fed
        self.name = spec.name
        t0 = time.perf_counter()
        self.policy = policy if policy is not None else build_policy(spec.policy)
        self.load_seconds = time.perf_counter() - t0        # reported in hello (the engine logs it)
        self.trainer = Trainer(self.policy, fed.objective)
        self.share = fed.completions_per_prompt(spec.num_partitions)   # G, or ceil(G/N) horizontal
        self.state_dir = Path(spec.state_dir)
        self.run_key = run_key
        self.model_loads = self._count_load()
        paths = key_paths(spec.name, spec.keys_dir)
        self.key = load_private_key(paths.private)
        self.keys = shared_key_directory(Path(spec.keys_dir) / "public")   # one parse per worker process
        if self.keys.get(spec.name) is None or fingerprint(self.keys[spec.name]) != fingerprint(self.key):
            raise ValueError(f"participant {spec.name!r}: its public key is missing from {spec.keys_dir}/public "
                             "or does not match its private key")
        self.guard = ReplayGuard()
        self.verifier = fed.task.verifier()                 # the task's reward rules (your own functions too)
        self.eval_verifier = fed.task.verifier(steps=False)  # held-out accuracy: the answer alone
        self.task_digest = fed.task.digest()                # announced in hello; batches are signed for it
        self.run_base = signed_run_id(fed.run_name, self.task_digest)   # run name (+ task digest), no nonce
        self.run_id = self._saved_run_id()                  # the run id hello named (run_base@nonce)
        self.served_before = participant_state.served_runs(self.state_dir)   # runs served before this process
        self.seq = 0
        self.own: dict[int, CompletionBatch] = {}           # my batches by round, until trained on
        self.completed_round = 0
        self.peer_models: dict[str, str] = {}               # peer -> model id of its accepted batches (card)
        self.heldout: dict[int, dict[str, float]] = {}      # round -> held-out accuracies (card)
        adapt = fed.checks["source-adapt"].mode
        self.guarded = self._guarded() if adapt == "guard" else None
        self.shadowed = self._shadowed() if adapt == "shadow" else None
        self.receiver = Receiver(self.name, fed, self.policy, self.verifier)   # what the receiver checks use
        self.checks = build_checks(self.receiver)            # receive/: the checks on in this run, in order
        self.attacker = (Attacker(spec.byzantine, self.key, lambda: payload_poisoner(fed, self.policy, self.verifier,
                                                                                    self.name))
                         if spec.byzantine else None)            # security experiments: trust/attacks.py
        if fed.resume and (self.state_dir / "participant.json").exists():
            self._load()
        self._rejoin()
        self.inbox = Inbox(self.keys, self._inbox_config(), self.guard)

    def _saved_run_id(self) -> str:
        """The run id the last hello to this participant named (``<state-dir>/run_id``), so that a worker
        restarted mid-run, which gets no hello, signs for the same run; ``run-name`` before any hello."""
        try:
            saved = (self.state_dir / RUN_ID_FILE).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError):
            return self.run_base
        return saved if run_name_of(saved) == self.run_base else self.run_base

    def _inbox_config(self) -> InboxConfig:
        return InboxConfig(run_id=self.run_id, max_tokens=self.fed.max_batch_tokens,
                           tokenizer_fp=self.policy.tokenizer_fp)

    def _guarded(self) -> GuardedUpdate:
        """``source-adapt = guard``: the update weighted by validation-gradient alignment and kept
        only if no worse on this participant's own validation batch (``learn/guard.py``)."""
        knobs = self.fed.checks["source-adapt"]
        val = validation_prompts(self.fed.task, self.spec.partition_id, self.spec.num_partitions,
                                 knobs.val_size, knobs.val_families, knobs.val_ood)
        return GuardedUpdate(self.trainer, val, lambda: solved_share(
            val, greedy_replies(self.policy, val, self.fed.eval_max_new_tokens), self.verifier), knobs.val_score,
            knobs.align, knobs.window, knobs.val_group)

    def _shadowed(self) -> ShadowGuard:
        """``source-adapt = shadow``: a shadow copy trained alone, which the model is reset to when its
        sampled accuracy on this participant's validation batch is confidently below it
        (``learn/shadow.py``)."""
        knobs = self.fed.checks["source-adapt"]
        val = validation_prompts(self.fed.task, self.spec.partition_id, self.spec.num_partitions,
                                 knobs.val_size, knobs.val_families, knobs.val_ood)

        def val_counts(round: int) -> list[int]:
            counts: dict[str, list[int]] = {}
            sampled_eval(self.policy, {"val": val}, knobs.val_samples, self.fed.sampling, seed=SHADOW_VAL_SEED + round,
                         verifier=self.eval_verifier, per_prompt=counts)
            return counts["val"]

        return ShadowGuard(self.trainer, self._own_samples, val_counts, knobs.val_samples, knobs.period, knobs.z,
                           self.fed.num_rounds, knobs.z_last, knobs.shadow_loss)

    def _count_load(self) -> int:
        """Record this model load in state_dir/model_loads.jsonl; return the loads of this run so far
        (every process that loaded this participant's model for ``run_key``)."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        path = self.state_dir / "model_loads.jsonl"
        with path.open("a") as f:
            f.write(json.dumps({"run": self.run_key, "pid": os.getpid(), "time": time.time()}) + "\n")
        return sum(1 for line in path.read_text().splitlines() if json.loads(line)["run"] == self.run_key)

    # ------------------------------------------------------------------ the entry point
    def handle(self, action: str, request: dict) -> dict:
        """The one entry point (see the module docstring); raises on an unknown action or a
        request without its fields (the caller turns that into an error reply)."""
        args = request_args(action, request)                # ValueError: not an action, or a field missing
        return reply_fields(action, getattr(self, action)(*args))

    # ------------------------------------------------------------------ identity
    def hello(self, run: str, node: str, challenge: bytes) -> dict:
        """Who I am, with ``proof``: my Ed25519 signature of the server's challenge for this run
        and node (proof of key possession). Refuses to sign a challenge of another run; ``run`` (the
        server's run id, ``run_name@nonce``) is what this participant's frames are signed for and the
        only run whose frames it accepts from then on. A run of the same name on another task (another
        digest in ``run``) gets a reply, so that the server refuses this participant by name
        (``task_mismatch``), but is not adopted. A run id this participant served in an earlier Flower
        run is refused unless it resumes (``participant_state.replayed_run``)."""
        if split_run_id(run_name_of(run))[0] != self.fed.run_name:
            raise ValueError(f"hello for run {run[:300]!r}: this participant belongs to run {self.run_base!r}")
        replay = participant_state.replayed_run(run, self.served_before, self.run_key, self.fed.resume)
        if replay:
            raise ValueError(replay)
        if run_name_of(run) == self.run_base and run != self.run_id:
            self.run_id = run
            self.inbox.config = self._inbox_config()
            atomic_write(self.state_dir / RUN_ID_FILE, run)
        if run_name_of(run) == self.run_base:
            participant_state.record_served(self.state_dir, run, self.run_key)
        return {"participant": self.name, "model_id": self.policy.model_id,
                "tokenizer_fp": self.policy.tokenizer_fp, "vocab_size": self.policy.vocab_size,
                "weights_fp": getattr(self.policy, "weights_fp", ""),
                "key_fp": fingerprint(self.key), "model_loads": self.model_loads, "pid": os.getpid(),
                "completed_round": self.completed_round, "peer_budget": self.spec.peer_budget,
                "local_budget": self.spec.local_budget, "load_seconds": round(self.load_seconds, 2),
                "num_partitions": self.spec.num_partitions, "task_digest": self.task_digest,
                "proof": sign_challenge(self.key, run, node, self.name, challenge)}

    # ------------------------------------------------------------------ phase 1
    def generate(self, round: int, texts: bool | tuple[bool, ...]) -> tuple[list[bytes], dict[str, float]]:
        """Sample this round's prompts, reward them, sign the batch: one frame per entry of ``texts``
        (a bool = one frame; ``(False, True)`` = without and with the completion texts, same seq).
        Returns (frames, metrics); an attacker (``byzantine``) sends what its ``attacks.Attacker`` makes of it."""
        variants = variants_of(texts)                           # the engine's reading of the same field
        if not 1 <= len(variants) <= 2:
            raise ValueError(f"texts={texts!r}: a bool or a list of one or two bools")
        t0 = time.perf_counter()
        fed = self.fed
        prompts = fed.task.prompts_for_round(self.spec.partition_id, self.spec.num_partitions, round)
        write_train_prompts(self.state_dir / TRAIN_PROMPTS, self.name, round, [p.task_id for p in prompts])
        rolls, groups, scores = self._rollouts(prompts, round)
        if fed.log_completions:                                 # TRL's log_completions: local files only
            k = fed.log_completions
            append_log(self.state_dir, completion_records(round, self.name, [(r.prompt.task_id, r.prompt.text)
                                                                             for r in rolls[:k]],
                                                          [r.completion_texts for r in rolls[:k]], scores[:k]))
        rewards = [float(x) for g in groups for x in g.rewards]
        lengths = [len(c) for g in groups for c in g.completion_ids]
        # Strictly increasing per sender, also across a restart without checkpoint (the round
        # moves on): receivers' replay guards reject any seq they have seen.
        self.seq = max(self.seq + 1, round << 16)
        participant_state.save(self.state_dir, self.run_key, self.seq, self.completed_round, self.guard)
        batch = self._batch(round, groups)
        signed = [sign_batch(batch, self.key, send_options(t), max_tokens=fed.max_batch_tokens) for t in variants]
        self.own[round] = batch
        attack: dict[str, float] = {}
        frames = signed
        if self.attacker is not None:                           # what an attacker sends instead
            frames = []
            for t in variants:
                frames += (sent := self.attacker.frames(batch, round, send_options(t), attack))
                self.seq = batch.seq + len(sent) - 1
        n_tok = max(1, int(np.sum(lengths)))
        suffix = {False: "", True: "_texts"}
        rw = np.asarray(rewards)
        scored = [r[~np.isnan(r)] for r in (np.asarray(g.rewards) for g in groups)]   # NaN: no reward (TRL's None)
        group_std = np.mean([np.std(r) if r.size else 0.0 for r in scored])
        return frames, {
            "reward/mean": float(np.mean(np.concatenate(scored))) if np.isfinite(rw).any() else 0.0,
            "reward/solved_frac": float(np.mean([ok for s in scores for ok in s.solved])),
            "reward/unscored": float(np.isnan(rw).sum()), **per_function_metrics(scores),
            "reward/groups_with_signal": float(np.mean([r.size > 1 and np.ptp(r) > 0 for r in scored])),
            "reward/group_std": float(group_std), "gen/completion_len": float(np.mean(lengths)),
            "gen/tokens": float(np.sum(lengths)), "gen/seconds": time.perf_counter() - t0,
            **{f"wire/frame_bytes{suffix[t]}": float(len(f)) for t, f in zip(variants, signed)},
            **{f"wire/bytes_per_token{suffix[t]}": len(f) / n_tok for t, f in zip(variants, signed)},
            **attack,
        }

    def _rollouts(self, prompts, round: int) -> tuple[list, list, list]:
        """(rollouts, groups, scores) of ``prompts``: G completions each (this participant's share)
        from the weights loaded now, under the round's seed, rewarded by the task's verifier."""
        seed = self.fed.seed * 1_000_003 + round * 1009 + self.spec.partition_id
        rolls = self.policy.generate(prompts, self.share, self.fed.sampling, seed=seed)
        return (rolls, *scored_groups_with_scores(rolls, self.verifier))

    def _batch(self, round: int, groups) -> CompletionBatch:
        """My batch of ``round`` holding ``groups`` (unsigned; ``generate`` signs it)."""
        return CompletionBatch(sender=self.name, run_id=self.run_id, round=round, seq=self.seq,
                               model_id=self.policy.model_id, tokenizer_fp=self.policy.tokenizer_fp,
                               vocab_size=self.policy.vocab_size, sampling=self.fed.sampling, groups=tuple(groups),
                               eos_id=getattr(self.policy.tokenizer, "eos_token_id", None))

    def _own_samples(self, round: int) -> list:
        """This round's own samples drawn again by the weights loaded now (``source-adapt = shadow``: the
        shadow's), as ``generate`` and ``learn`` make them: the same prompts, seed, rewards and local
        budget, without the receiver checks (they concern peers' samples)."""
        prompts = self.fed.task.prompts_for_round(self.spec.partition_id, self.spec.num_partitions, round)
        _, groups, _ = self._rollouts(prompts, round)
        return samples_from_batches([self._local_budget(self._batch(round, groups))], self.name,
                                    self.policy.tokenizer_fp, self.fed.objective, retokenize=self.policy.retokenize)

    # ------------------------------------------------------------------ phase 2
    def learn(self, round: int, peer_frames: list[bytes], peer_round: int | None = None) -> dict[str, float]:
        """Receive peers' frames of ``peer_round`` (default ``round``), run the receiver's checks on the
        update's samples, then one F-TIS update on my batch of ``round`` and what the checks left."""
        if round <= self.completed_round:                   # trained on it before a restart: never twice
            self.own.pop(round, None)
            return {"train/already_trained": 1.0, "train/seconds": 0.0, "worker/pid": float(os.getpid())}
        t0 = time.perf_counter()
        own = self.own.pop(round, None)
        peer_round = round if peer_round is None else peer_round
        # 1. receive: signature, bounds, task truth, rewards re-scored (receive/frames.py)
        recv = receive(peer_frames, peer_round, self.inbox, self._receiver_context(peer_round))
        self.peer_models.update({b.sender: b.model_id for b in recv.batches})
        batches = ([self._local_budget(own)] if own is not None else []) + recv.batches
        # 2. samples (advantages per group), then every receiver check on them (receive/checks.py)
        samples = samples_from_batches(batches, self.name, self.policy.tokenizer_fp, self.fed.objective,
                                       retokenize=self.policy.retokenize)
        metrics: dict[str, float] = dict(recv.metrics)
        metrics.update(run_checks(self.checks, samples, Update(self.receiver, recv, batches)))
        metrics["train/own_samples"] = float(sum(s.local for s in samples))
        metrics["train/peer_samples"] = float(sum(not s.local for s in samples))
        # 3. train: one F-TIS step (source-adapt = guard: the guarded step, learn/guard.py; shadow: the
        #    step beside an alone copy, learn/shadow.py)
        if samples:
            step = (functools.partial(self.shadowed.step, round=round) if self.shadowed is not None
                    else self.guarded.step if self.guarded is not None else self.trainer.step)
            metrics.update(step(samples, self.fed.sampling))
            metrics.update(after_step(self.checks, self.trainer))
        metrics["train/seconds"] = time.perf_counter() - t0
        metrics["train/steps"] = float(self.trainer.steps)   # optimizer steps so far, restored with the checkpoint
        metrics["worker/pid"] = float(os.getpid())
        metrics["worker/model_loads"] = float(self.model_loads)
        self._round_done(round, metrics)
        return metrics

    def _round_done(self, round: int, metrics: dict[str, float]) -> None:
        """After ``round``'s update: the rejoin counters, the checkpoint when due, the final export."""
        self.completed_round = round
        participant_state.save(self.state_dir, self.run_key, self.seq, self.completed_round, self.guard)
        if checkpoint_due(round, self.fed.num_rounds, self.fed.checkpoint_every):
            self.save()
        if round >= self.fed.num_rounds and self.fed.export_final and self.trainer.steps == 0:
            metrics["export/skipped_untrained"] = 1.0        # never an untrained model as this run's result
        elif round >= self.fed.num_rounds and self.fed.export_final:
            t1 = time.perf_counter()
            make_shareable(self.policy.export(self.state_dir / "export"), self.spec.policy, self._card())
            metrics["export/seconds"] = time.perf_counter() - t1
            if self.fed.eval_every <= 0:                    # no final evaluation to wait for: upload now
                metrics.update(self._push())

    def _receiver_context(self, peer_round: int) -> ReceiverContext:
        """How this participant checks peers' batches of ``peer_round``. Horizontal groups: a peer's
        group must be one of the round's shared prompts (this participant's own prompts of that
        round, recomputed here) and hold at most the share ceil(G/N) of the mixed group."""
        if self.fed.objective.advantage_groups != "horizontal":
            return ReceiverContext.from_run(self.fed, self.policy, self.verifier, self.name)
        shared = [p.task_id for p in self.fed.task.prompts_for_round(self.spec.partition_id, self.spec.num_partitions,
                                                                     peer_round)]
        return ReceiverContext.from_run(self.fed, self.policy, self.verifier, self.name, shared_tasks=shared,
                                        max_group_size=self.share)

    def _local_budget(self, batch: CompletionBatch) -> CompletionBatch:
        """Keep whole groups of my own batch up to ``local_budget`` completions (0 = all)."""
        budget = self.spec.local_budget
        if budget <= 0 or batch.num_completions <= budget:
            return batch
        keep, n = [], 0
        for g in batch.groups:
            if n + g.size > budget:
                break
            keep.append(g)
            n += g.size
        return CompletionBatch(batch.sender, batch.run_id, batch.round, batch.seq, batch.model_id, batch.tokenizer_fp,
                               batch.vocab_size, batch.sampling, tuple(keep) or batch.groups[:1])

    def exchange(self, round: int, peer_frames: list[bytes],
                 texts: bool | tuple[bool, ...]) -> tuple[list[bytes], dict[str, float]]:
        """Pipelined round: generate this round's batch, then train on it plus peers' batches of the
        previous round (one message per round instead of two)."""
        frames, gen_metrics = self.generate(round, texts)
        metrics = self.learn(round, peer_frames, peer_round=round - 1)
        metrics.update(gen_metrics)
        return frames, metrics

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, round: int) -> dict[str, float]:
        t0 = time.perf_counter()
        out = self._heldout(round, self.state_dir / EVAL_PROMPTS)
        out["eval/seconds"] = time.perf_counter() - t0
        self.heldout[round] = {k: v for k, v in out.items() if k.endswith("/accuracy")}
        if round >= self.fed.num_rounds and self.shadowed is not None and self.shadowed.unchosen is not None:
            out.update(self._unchosen_heldout(round))
        if round >= self.fed.num_rounds and self.fed.export_final:
            update_card(self.state_dir / "export", self.heldout)        # the card gets the final figures
            out.update(self._push())                                    # then, opt-in, to the hub
        return out

    def _heldout(self, round: int, records: Path) -> dict[str, float]:
        """The held-out evaluation of the weights loaded now (greedy, and sampled with ``eval-samples``),
        its per-prompt results appended to ``records``."""
        sets = self.fed.eval_sets()
        per_prompt: dict[str, list[tuple[str, bool]]] = {}
        hits: dict[str, list[bool]] | None = {} if self.fed.attack_payload else None
        out = evaluate_policy(self.policy, sets, self.eval_verifier, max_new_tokens=self.fed.eval_max_new_tokens,
                              per_prompt=per_prompt, payload=self.fed.attack_payload, payload_hits=hits,
                              payload_at=self.fed.attack_payload_at)
        sampled: dict[str, list[int]] | None = None
        if self.fed.eval_samples:
            sampled = {}
            out.update(sampled_eval(self.policy, sets, self.fed.eval_samples, self.fed.sampling,
                                    seed=EVAL_SAMPLE_SEED + round, verifier=self.eval_verifier, per_prompt=sampled))
        write_eval_prompts(records, self.name, round, per_prompt, hits, sampled, self.fed.eval_samples)
        return out

    def _unchosen_heldout(self, round: int) -> dict[str, float]:
        """``source-adapt = shadow``, at the final evaluation: the model its last check did not choose (the
        shadow, or the model with its peers where it was reset) scored as the model was (the same sets and
        sampling seeds), as ``unchosen/eval/...`` metrics and ``UNCHOSEN_EVAL_PROMPTS`` records; the model's
        state is loaded back after, so nothing else changes."""
        t0 = time.perf_counter()
        main = self.trainer.snapshot()
        self.trainer.restore(self.shadowed.unchosen, "unchosen")
        try:
            got = self._heldout(round, self.state_dir / UNCHOSEN_EVAL_PROMPTS)
        finally:
            self.trainer.restore(main, "model")
        out = {f"unchosen/{k}": v for k, v in got.items()}
        out["unchosen/eval/seconds"] = time.perf_counter() - t0
        return out

    def _card(self) -> CardInfo:
        """What the exported model's card says about this run (``policies.share``)."""
        fed, obj = self.fed, self.fed.objective
        method = {"loss-mode": obj.mode, "ratio-level": obj.ratio_level, "trunc-c": obj.trunc_c,
                  "filter-g": obj.filter_g, "filter-sign": obj.filter_sign, "kl-estimator": obj.kl_estimator,
                  "clip-eps": obj.clip_eps,
                  "length-norm": obj.length_norm, "advantage-groups": obj.advantage_groups,
                  "group-size": fed.group_size, "max-new-tokens": fed.max_new_tokens,
                  "temperature": fed.temperature, "learning rate": self.spec.policy.effective_lr}
        return CardInfo(self.name, self.run_id, self.completed_round, method, self._card_task(), dict(self.peer_models),
                        dict(self.heldout), fed.export_license, self._card_datasets())

    def _card_task(self) -> dict[str, str]:
        """The card's task: source, data set, reward functions with weights and the solved rule, digest."""
        t = self.fed.task
        out = {"task-source": t.source}
        if t.source == "user":
            funcs = t.user.reward_funcs
            out["data set"] = t.data if not Path(t.data).expanduser().exists() else Path(t.data).name
            out["reward functions (weight)"] = ", ".join(f"{n} ({f.weight:g})" for n, f in zip(funcs.names, funcs.funcs))
            out["solved"] = f"{t.user.solved_name} >= {t.solved_threshold:g}"
        elif t.source != "procedural":
            out["data set"] = Path(t.benchmark_path).name or t.benchmark_path
        else:
            out["data set"] = f"procedural arithmetic: {', '.join(t.families) or 'all ID families'}"
        out["task digest"] = self.task_digest or "(procedural: the run config)"
        return out

    def _card_datasets(self) -> tuple[str, ...]:
        """Hub ids of the data sets trained on (the card header's ``datasets``): a user task's hub id."""
        t = self.fed.task
        return (t.data,) if t.source == "user" and not Path(t.data).expanduser().exists() else ()

    def _push(self) -> dict[str, float]:
        """``push-to-hub``: upload the export (``policies.share.push_export``); an upload error is
        this participant's error reply, naming the repo."""
        if not self.fed.push_to_hub or not (self.state_dir / "export").exists():
            return {}
        url = push_export(self.state_dir / "export", self.fed.push_to_hub, self.name)
        print(f"[ftis-fed] {self.name}: pushed its export to {url}", flush=True)
        return {"export/pushed": 1.0}

    def finish(self) -> dict:
        """End of run: acknowledge (the worker process exits after answering)."""
        return {"stopped": True}

    # ------------------------------------------------------------------ resume
    def save(self) -> None:
        """Checkpoint: trainable state + optimizer (policy), sequence number, replay guard."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.trainer.save(self.state_dir / "policy.pt")
        state = {"seq": self.seq, "completed_round": self.completed_round, "guard": self.guard.to_json(),
                 "checks": checks_state(self.checks), "model_id": self.policy.model_id, "run_id": self.run_id,
                 "peer_models": self.peer_models, "heldout": {str(k): v for k, v in self.heldout.items()},
                 "run_key": self.run_key}
        if self.guarded is not None:
            state["guarded"] = self.guarded.to_json()
        if self.shadowed is not None:
            self.shadowed.save(self.state_dir / "shadow.pt")
        atomic_write(self.state_dir / "participant.json", json.dumps(state))

    def _rejoin(self) -> None:
        """A restart within this run (``participant_state``): continue from the counters and, when it
        is of this run, the last checkpoint; never reuse a sequence number or train a round twice."""
        got = participant_state.load(self.state_dir, self.run_key)
        if got is None:
            return
        ckpt = self.state_dir / "participant.json"
        if not self.fed.resume and ckpt.exists() and json.loads(ckpt.read_text()).get("run_key") == self.run_key:
            self._load()
        self.seq = max(self.seq, got.seq)
        self.completed_round = max(self.completed_round, got.trained_round)
        self.guard = got.guard

    def _load(self) -> None:
        state = json.loads((self.state_dir / "participant.json").read_text())
        if state.get("model_id") != self.policy.model_id:
            raise ValueError(f"resume: {self.state_dir} holds a checkpoint of {state.get('model_id')!r}, "
                             f"not {self.policy.model_id!r}")
        if (self.state_dir / "policy.pt").exists():
            self.trainer.load(self.state_dir / "policy.pt")
        self.seq = int(state["seq"])
        self.completed_round = int(state["completed_round"])
        self.guard = ReplayGuard.from_json(state["guard"])
        self.run_id = str(state.get("run_id") or self.run_base)
        restore_checks(self.checks, state.get("checks") or {"source-adapt": state.get("adapt"),   # or before the room:
                                                           "phrase": state.get("phrases")})     # its two states
        self.peer_models = dict(state.get("peer_models", {}))
        self.heldout = {int(k): v for k, v in state.get("heldout", {}).items()}
        if self.guarded is not None:
            self.guarded.load_json(state.get("guarded"))
        if self.shadowed is not None:
            self.shadowed.load(self.state_dir / "shadow.pt")

