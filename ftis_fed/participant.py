"""A participant: one policy + its task partition + its keys + its counters, for one run.

It is what lives in the long-lived per-participant process (``clients/worker.py``); the Flower
ClientApp only forwards messages to it. Nothing here imports Flower.

    hello()                       -> who I am (model, tokenizer fingerprint, key fingerprint, loads)
    generate(round, texts)        -> my signed batch of the round (phase 1)
    learn(round, peer_frames)     -> verify + re-check peers' batches, train on mine + theirs (phase 2)
    exchange(round, frames, texts)-> pipelined round: generate, then learn from it and peers' older batches
    evaluate(round)               -> greedy pass@1 on held-out ID / OOD sets
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np

from .batch import CompletionBatch, make_group
from .config import FederationConfig, ParticipantSpec
from .evaluation import evaluate as evaluate_policy
from .inbox import Inbox, InboxConfig
from .policies import build_policy
from .rewards import Verifier
from .reverify import reverify
from .source_weights import SourceAdapter
from .signing import ReplayGuard, fingerprint, key_paths, load_key_directory, load_private_key, sign_batch
from .training import samples_from_batches
from .wire import WireOptions


class InjectedFault(RuntimeError):
    """Raised by a participant configured with ``fault=raise:<phase>:<round>`` (tests)."""


class Participant:
    def __init__(self, spec: ParticipantSpec, fed: FederationConfig, policy=None, run_key: str = ""):
        self.spec, self.fed = spec, fed
        self.name = spec.name
        self.policy = policy if policy is not None else build_policy(spec.policy, fed.objective)
        self.state_dir = Path(spec.state_dir)
        self.run_key = run_key
        self.model_loads = self._count_load()
        paths = key_paths(spec.name, spec.keys_dir)
        self.key = load_private_key(paths.private)
        self.keys = load_key_directory(Path(spec.keys_dir) / "public")
        if self.keys.get(spec.name) is None or fingerprint(self.keys[spec.name]) != fingerprint(self.key):
            raise ValueError(f"participant {spec.name!r}: its public key is missing from {spec.keys_dir}/public "
                             "or does not match its private key")
        self.guard = ReplayGuard()
        self.verifier = Verifier()
        self.seq = 0
        self.own: dict[int, CompletionBatch] = {}           # my batches by round, until trained on
        self.completed_round = 0
        self.adapt = SourceAdapter(fed.source_adapt, self.name)   # per-source weights (source-adapt)
        if fed.resume and (self.state_dir / "participant.json").exists():
            self._load()
        self.inbox = Inbox(self.keys, InboxConfig(run_id=fed.run_name, max_tokens=fed.max_batch_tokens,
                                                  tokenizer_fp=self.policy.tokenizer_fp), self.guard)

    def _count_load(self) -> int:
        """Record this model load in state_dir/model_loads.jsonl; return the loads of this run so far
        (every process that loaded this participant's model for ``run_key``)."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        path = self.state_dir / "model_loads.jsonl"
        with path.open("a") as f:
            f.write(json.dumps({"run": self.run_key, "pid": os.getpid(), "time": time.time()}) + "\n")
        return sum(1 for line in path.read_text().splitlines() if json.loads(line)["run"] == self.run_key)

    # ------------------------------------------------------------------ identity
    def hello(self) -> dict:
        return {"participant": self.name, "model_id": self.policy.model_id,
                "tokenizer_fp": self.policy.tokenizer_fp, "vocab_size": self.policy.vocab_size,
                "key_fp": fingerprint(self.key), "model_loads": self.model_loads, "pid": os.getpid(),
                "completed_round": self.completed_round, "peer_budget": self.spec.peer_budget,
                "local_budget": self.spec.local_budget}

    def _fault(self, phase: str, round: int) -> None:
        if not self.spec.fault:
            return
        kind, at_phase, at_round = self.spec.fault.split(":")
        if at_phase == phase and int(at_round) == round:
            if kind == "exit":
                os._exit(3)
            if kind == "hang":
                time.sleep(1e6)
            raise InjectedFault(f"{self.name}: injected fault at {phase} round {round}")

    # ------------------------------------------------------------------ phase 1
    def generate(self, round: int, texts: bool) -> tuple[bytes, dict[str, float]]:
        """Sample this round's prompts, reward them, sign the batch. Returns (frame, metrics)."""
        self._fault("generate", round)
        t0 = time.perf_counter()
        fed = self.fed
        prompts = fed.task.prompts_for_round(self.spec.partition_id, self.spec.num_partitions, round)
        seed = fed.seed * 1_000_003 + round * 1009 + self.spec.partition_id
        rolls = self.policy.generate(prompts, fed.group_size, fed.sampling, seed=seed)
        groups, rewards, lengths = [], [], []
        for r in rolls:
            rw = [self.verifier.reward(r.prompt.task_id, t, r.prompt.reference, r.prompt.text)
                  for t in r.completion_texts]
            rewards += rw
            lengths += [len(c) for c in r.completion_ids]
            groups.append(make_group(r.prompt_ids, r.completion_ids, r.logprobs, rw, r.prompt.task_id,
                                     r.prompt.reference, r.prompt.text, r.completion_texts))
        # Strictly increasing per sender, also across a restart without checkpoint (the round
        # moves on): receivers' replay guards reject any seq they have seen.
        self.seq = max(self.seq + 1, round << 16)
        batch = CompletionBatch(sender=self.name, run_id=fed.run_name, round=round, seq=self.seq,
                                model_id=self.policy.model_id, tokenizer_fp=self.policy.tokenizer_fp,
                                vocab_size=self.policy.vocab_size, sampling=fed.sampling, groups=tuple(groups))
        frame = sign_batch(batch, self.key, WireOptions(texts=texts), max_tokens=fed.max_batch_tokens)
        self.own[round] = batch
        rw = np.asarray(rewards)
        group_std = np.mean([np.std(g.rewards) for g in groups])
        return frame, {
            "reward/mean": float(rw.mean()), "reward/solved_frac": float((rw >= 1.0).mean()),
            "reward/groups_with_signal": float(np.mean([np.ptp(g.rewards) > 0 for g in groups])),
            "reward/group_std": float(group_std), "gen/completion_len": float(np.mean(lengths)),
            "gen/tokens": float(np.sum(lengths)), "gen/seconds": time.perf_counter() - t0,
            "wire/frame_bytes": float(len(frame)), "wire/bytes_per_token": len(frame) / max(1, int(np.sum(lengths))),
        }

    # ------------------------------------------------------------------ phase 2
    def learn(self, round: int, peer_frames: list[bytes], peer_round: int | None = None) -> dict[str, float]:
        """Verify peers' frames (signature with the sender's key, replay, validation), re-check their
        rewards, then one F-TIS update on my batch of ``round`` and the accepted peer batches."""
        self._fault("learn", round)
        t0 = time.perf_counter()
        own = self.own.pop(round, None)
        peer_round = round if peer_round is None else peer_round
        accepted, rejected = self.inbox.accept_many(peer_frames, expected_round=peer_round)
        metrics: dict[str, float] = {f"offpolicy/rejected/{k}": float(v) for k, v in rejected.items()}
        metrics["offpolicy/received"] = float(len(peer_frames))
        metrics["offpolicy/accepted"] = float(len(accepted))
        batches, weights = [], {}
        if own is not None:
            batches.append(self._local_budget(own))
        decode = lambda ids: self.policy.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        checked = disagreements = 0.0
        for acc in accepted:
            if acc.batch.sender == self.name:
                metrics["offpolicy/rejected/own_batch_relayed"] = metrics.get("offpolicy/rejected/own_batch_relayed", 0) + 1
                continue
            res = reverify(acc.batch, self.verifier, self.fed.reverify, decode=decode,
                           tokenizer_fp=self.policy.tokenizer_fp)
            checked += res.metrics.get("reward/checked", 0.0)
            disagreements += res.metrics.get("reward/disagreements", 0.0)
            if res.batch is None:
                metrics["offpolicy/rejected/reward_disagreement"] = metrics.get(
                    "offpolicy/rejected/reward_disagreement", 0) + 1
                continue
            bi = len(batches)
            batches.append(res.batch)
            if res.weights is not None:
                for gi, w in enumerate(res.weights):
                    weights[(bi, gi)] = w
        metrics["reward/peer_checked"] = checked
        metrics["reward/peer_disagreements"] = disagreements
        samples = samples_from_batches(batches, self.name, self.policy.tokenizer_fp, self.fed.objective,
                                       retokenize=self.policy.retokenize, sample_weights=weights)
        samples = self.adapt.apply(samples)                 # source-adapt: peers' negative advantages x w_s
        metrics["train/own_samples"] = float(sum(s.local for s in samples))
        metrics["train/peer_samples"] = float(sum(not s.local for s in samples))
        if samples:
            metrics.update(self.policy.update(samples, self.fed.sampling))
            self.adapt.observe(metrics)
            metrics.update(self.adapt.metrics())
        metrics["train/seconds"] = time.perf_counter() - t0
        metrics["worker/pid"] = float(os.getpid())
        metrics["worker/model_loads"] = float(self.model_loads)
        self.completed_round = round
        self.save()
        return metrics

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

    def exchange(self, round: int, peer_frames: list[bytes], texts: bool) -> tuple[bytes, dict[str, float]]:
        """Pipelined round: generate this round's batch, then train on it plus peers' batches of the
        previous round (one message per round instead of two)."""
        frame, gen_metrics = self.generate(round, texts)
        metrics = self.learn(round, peer_frames, peer_round=round - 1)
        metrics.update(gen_metrics)
        return frame, metrics

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, round: int) -> dict[str, float]:
        self._fault("evaluate", round)
        t0 = time.perf_counter()
        sets = self.fed.eval_sets()
        out = evaluate_policy(self.policy, sets, self.verifier, max_new_tokens=self.fed.eval_max_new_tokens)
        out["eval/seconds"] = time.perf_counter() - t0
        return out

    # ------------------------------------------------------------------ resume
    def save(self) -> None:
        """Checkpoint: trainable state + optimizer (policy), sequence number, replay guard."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        if hasattr(self.policy, "save"):
            self.policy.save(self.state_dir / "policy.pt")
        state = {"seq": self.seq, "completed_round": self.completed_round, "guard": self.guard.to_json(),
                 "adapt": self.adapt.to_json(), "model_id": self.policy.model_id}
        tmp = self.state_dir / "participant.json.tmp"
        tmp.write_text(json.dumps(state))
        tmp.replace(self.state_dir / "participant.json")

    def _load(self) -> None:
        state = json.loads((self.state_dir / "participant.json").read_text())
        if state.get("model_id") != self.policy.model_id:
            raise ValueError(f"resume: {self.state_dir} holds a checkpoint of {state.get('model_id')!r}, "
                             f"not {self.policy.model_id!r}")
        if (self.state_dir / "policy.pt").exists():
            self.policy.load(self.state_dir / "policy.pt")
        self.seq = int(state["seq"])
        self.completed_round = int(state["completed_round"])
        self.guard = ReplayGuard.from_json(state["guard"])
        self.adapt = SourceAdapter.from_json(self.fed.source_adapt, self.name, state.get("adapt"))
