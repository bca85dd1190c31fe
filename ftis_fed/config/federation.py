"""Every knob of a run, built from the Flower run config (and a SuperNode's node config) in one place.

Why ~740 lines: it holds the run's dataclass key declarations (each key declared once, where other
engineers add theirs) and their whole-run checks; the docs generator (``reference.py``), the model
check (``models_check.py``) and GPU shares (``gpu_shares.py``) are their own modules.

Each run-config key is declared once, as a dataclass field made with ``ftis_fed.knobs.knob`` (key,
default, help): ``FederationConfig`` below, ``ObjectiveConfig``, ``TaskSpec``, ``ReverifyConfig``,
``PolicyConfig`` and ``ParticipantSpec``. The key tables here, the error names, the reference in
``docs/configuration.md`` (``python -m ftis_fed.config.reference``) and the check of ``pyproject.toml``'s
``[tool.flwr.app.config]`` (``tests/test_config.py``: same keys, same defaults) derive from those
declarations. This module declares and checks; the docs generator is ``config/reference.py``, the
check that models resolve offline (HF cache probing) ``config/models_check.py``, a participant's GPU
memory share ``config/gpu_shares.py``. Constructing a config does no I/O; ``validate_run_config`` checks a whole run config,
the data it reads included (``FederationConfig.check_data``), before anything starts. Participants:

- simulation: participant ``i`` (Flower partition id ``i``) reads ``p<i>-<key>`` (e.g. ``p2-quant``)
  and falls back to the run-wide ``<key>``;
- deployment: a SuperNode's ``--node-config`` gives ``participant``, ``model``, ``adapter``, ...,
  ``keys-dir`` and ``state-dir`` for its own participant (unprefixed), falling back to the run config.

At most ``MAX_PARTICIPANTS`` simulated participants in that numbered form (``p0`` ... ``p7``: each is
declared in ``pyproject.toml``, since Flower rejects run-config keys the app does not declare); a
``population`` (``ftis_fed.config.population``: one table of participants or groups, a file in the
app bundle) has no cap and is read the same way in simulation and by a deployment node.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Collection, Mapping

from ftis_fed.wire.batch import SamplingParams
from ftis_fed.config import population
from ftis_fed.config.churn import Churn, parse_churn
from ftis_fed.config.models_check import check_model
from ftis_fed.knobs import Knob, knob, knobs
from ftis_fed.config.trl_names import trl_hint
from ftis_fed.learn.modes import MODES
from ftis_fed.learn.objective_config import ObjectiveConfig
from ftis_fed.metrics.sinks import parse_report_to
from ftis_fed.policies.config import PolicyConfig
from ftis_fed.trust.attacks import parse_kinds
from ftis_fed.trust.reverify import ReverifyConfig
from ftis_fed.trust.signing import check_participant
from ftis_fed.learn.source_weights import SourceAdaptConfig
from ftis_fed.tasks.benchmarks import eval_pool
from ftis_fed.tasks.reward_funcs import absolute_spec, parse_specs
from ftis_fed.tasks.suite import TaskSpec, eval_sets
from ftis_fed.tasks.symbolic import require_math_verify


@dataclass(frozen=True)
class FederationConfig:
    """The schedule and the shared settings of a run: every field a run-config key (``knob``), plus
    the objective's, the task suite's and the re-verification's keys in their own dataclasses."""

    num_rounds: int = knob("num-rounds", 3, "rounds to run, >= 1.")
    scheme: str = knob("scheme", "sync", """
        ``sync`` (the paper: phase 1 every participant generates and returns a signed batch; phase 2
        each receives its peers' batches of the same round and updates) or ``pipelined`` (one
        exchange per round: each participant generates, then trains on its new batch and its peers'
        batches of the previous round, which arrive with the same message).""")
    min_participants: int = knob("min-participants", 2, """
        participants that must be connected before round 1 and reply in a round for it to count as
        complete, >= 1 (in simulation at most the participants declared).""")
    wait_for_participants_s: float = knob("wait-for-participants-s", 300.0, """
        how long to wait for them to connect and answer hello (their first message, which loads
        their model), > 0.""")
    round_timeout_s: float = knob("round-timeout-s", 900.0, """
        per phase; a participant that has not replied by then is treated as dropped for that round
        (the round finishes with the replies it has), > 0.""")
    group_size: int = knob("group-size", 4, "G, completions per prompt, >= 2.")
    temperature: float = knob("temperature", 0.7, """
        sampling temperature every participant generates (and scores) with, finite and > 0.""")
    top_p: float = knob("top-p", 1.0, "nucleus sampling threshold, in (0, 1]; 1 disables it.")
    top_k: int = knob("top-k", 0, "top-k sampling, >= 0; 0 disables it.")
    max_new_tokens: int = knob("max-new-tokens", 24, """
        the generation budget per completion, >= 1 (also Dr. GRPO's length-normalisation
        constant).""")
    local_budget: int = knob("local-budget", 0, "own completions a participant trains on per round (0 = all).")
    peer_budget: int = knob("peer-budget", 0, """
        peers' completions the server relays to a participant per round, whole signed batches only
        (0 = all).""")
    wire_texts: str = knob("wire-texts", "auto", """
        ``auto`` (send completion texts only when tokenizers differ in the run), ``always`` or
        ``never``.""")
    max_batch_tokens: int = knob("max-batch-tokens", 1 << 20, "larger batches are rejected (``too_large``), >= 1.")
    eval_every: int = knob("eval-every", 3, """
        greedy pass@1 on held-out ID/OOD sets before round 1, every k rounds and after the last
        (0 = never).""")
    eval_initial: bool = knob("eval-initial", True, """
        evaluate before round 1 too (when eval-every > 0); false skips it, e.g. in ``ftis-fed grid``,
        where every cell starts from the same models and one cell's round-0 evaluation serves all.""")
    eval_size: int = knob("eval-size", 24, """
        prompts in the held-out ID set (the eval split of task-families), >= 1; checked at start
        against the distinct problems the families have.""")
    eval_ood_size: int = knob("eval-ood-size", 8, "prompts per OOD family set (five families), >= 0; 0 = eval-size.")
    eval_max_new_tokens: int = knob("eval-max-new-tokens", 16, "generation budget of the greedy evaluation, >= 1.")
    eval_samples: int = knob("eval-samples", 0, """
        k completions per held-out prompt sampled with the run's sampling parameters (temperature,
        top-p/k), besides the greedy one: ``eval/.../sampled_accuracy`` (pass@1 at the training
        temperature, the mean over the k) and ``eval/.../pass_at_k``; 0 = off, at most 64. RL at
        temperature 1 sharpens the sampling distribution first, which greedy pass@1 may not show.""")
    eval_seed: int = knob("eval-seed", -1, """
        seeds the procedural held-out sets, >= -1; -1 = ``task-seed``. ``ftis-fed grid`` fixes it while
        ``task-seed`` varies with the seed, so every seed trains on other prompts and every cell is
        evaluated on the same held-out prompts (paired per-prompt comparisons).""")
    attack_payload: str = knob("attack-payload", "", """
        security experiments only (``sims/poisoning.py``, docs/security.md): the phrase a participant
        with ``byzantine = "payload"`` inserts before the EOS of its solved completions, and what
        every participant's evaluation counts: ``eval/<set>/payload`` = share of its greedy replies
        that contain it (``eval/payload``: all held-out replies). '' (default) = no payload, no
        count. At most 64 characters; no digits with ``attack-payload-at = "end"`` (the answer, the last
        number, must stay the same); with ``start`` digits are allowed (``"0"`` before ``17`` is
        ``017``): the attacker keeps only completions its verifier still scores as solved.""")
    attack_payload_at: str = knob("attack-payload-at", "end", """
        the ``payload`` attack: where the phrase goes in a solved completion: ``end`` (after the
        answer, before EOS) or ``start`` (before the answer: the first tokens of the reply, where a
        receiver's distribution is spread over the possible answers instead of concentrated on EOS).""")
    attack_payload_share: float = knob("attack-payload-share", 0.5, """
        the ``payload`` attack: share of the attacker's groups poisoned, in (0, 1] (0.25: every
        fourth group of the run, 0.5: every other).""")
    run_name: str = knob("run-name", "ftis-fed", """
        the run's name, non-empty, at most 200 characters; frames and hello proofs are bound to the run
        id ``<run-name>@<random nonce>`` the server draws at start (kept across a resume), so no frame
        of another run, or of an earlier run of the same name, is accepted.""")
    output_dir: str = knob("output-dir", "outputs/default", """
        results folder (metrics, plots, server state, participants' checkpoints in simulation);
        relative paths are resolved against the SuperLink's working directory (``ftis-fed sim``
        makes them absolute against the directory it is run from).""")
    resume: bool = knob("resume", False, "continue from output-dir's saved state instead of starting fresh.")
    checkpoint_every: int = knob("checkpoint-every", 1, """
        participants write their resume state (trainable weights, optimizer, counters; atomically)
        after every k-th round's update and after the last round, >= 0; 0 = after the last round
        only. 1 (default) makes every round resumable; for large full fine-tunes (a 1.5B model's
        state is ~18 GB in fp32) a larger k trades rounds redone after a stop for disk traffic. A
        resume continues from the last written state: rounds after it are redone.""")
    export_final: bool = knob("export-final", True, """
        after the last round's update every participant exports its trained model with
        ``save_pretrained`` into ``<state-dir>/export/``, shareable (docs/models.md, Exports): a peft
        adapter folder naming its base by hub id when the base came from a hub (QLoRA: with its
        bitsandbytes config in the card), otherwise a whole model (a LoRA merged into its base),
        with its tokenizer, generation_config.json and a filled model card (README.md);
        transformers (+ peft) and vLLM load it.""")
    export_license: str = knob("export-license", "", """
        the ``license`` of the exported model's card (a Hugging Face license id, e.g. ``apache-2.0``);
        '' = the base model's license where ftis-fed knows it (SmolLM2: apache-2.0), else none.""")
    push_to_hub: str = knob("push-to-hub", "", """
        opt-in: after the run each participant uploads its export with ``huggingface_hub``'s
        ``upload_folder`` to this hub repo id, ``{participant}`` replaced by its name (without it:
        ``<id>-<participant>``); needs a token (``HF_TOKEN`` / ``hf auth login``) where the workers
        run. Refused at start when the hub is offline (``HF_HUB_OFFLINE``); '' (default) = never.""")
    keys_dir: str = knob("keys-dir", "", """
        folder with ``public/<participant>.pub`` (and, on each node, its own
        ``private/<participant>.key``); '' = simulation: generate a fresh set in output-dir/keys.""")
    threads: int = knob("threads", 0, "torch threads per participant process, >= 0 (0 = cores / participants).")
    requires_gpu: bool = knob("requires-gpu", False, """
        the run needs CUDA GPUs (the GPU presets set it): a participant whose ``device`` is ``auto``
        on a machine where no CUDA device is visible stops the run before it starts (``ftis-fed sim``
        checks before Flower starts; a worker started by plain ``flwr run`` refuses with the same
        line) instead of running on the CPU; ``device = "cpu"`` (or ``p<i>-device``) runs that
        participant on the CPU all the same. false = ``auto`` falls back to the CPU. ``cuda`` /
        ``cuda:N`` always need the GPU they name.""")
    worker_idle_timeout_s: float = knob("worker-idle-timeout-s", 1800.0, """
        a participant process with no request for this long exits (the end-of-run message normally
        stops it first), > 0.""")
    seed: int = knob("seed", 0, "base seed of sampling (round and participant are mixed in), >= 0.")
    progress_every_s: float = knob("progress-every-s", 15.0, """
        while a phase runs, the server logs every this many seconds which participants replied and
        which it still waits for (one plain line, also fine in a log file), >= 0; 0 = off.""")
    plot_every: int = knob("plot-every", 10, """
        the PNG plots are redrawn every this many rounds, in a child process (not the server's
        round time or memory), and once more by the server after the last round, >= 0; 0 = after the
        last only (a run stopped early keeps the plots of its last redraw). Drawing reads the whole
        metrics.jsonl (~1-2 s of CPU at any N, docs/scale.md); the JSONL and CSV are written every
        round.""")
    report_to: str = knob("report-to", "none", """
        the server's metrics rows also to ``tensorboard`` (``<output-dir>/tensorboard``) and/or
        ``wandb`` (offline unless WANDB_MODE / WANDB_API_KEY say otherwise), comma-separated, as in
        TRL; ``none`` = only metrics.jsonl/.csv. Optional extras: ``pip install
        'ftis-fed[tensorboard]'`` / ``'ftis-fed[wandb]'``; a missing package stops the run at start.""")
    log_completions: int = knob("log-completions", 0, """
        TRL's ``log_completions``: each participant writes its first k prompts of every round with
        all their completions, rewards (per function too) and ``solved`` to
        ``<state-dir>/completions.jsonl`` and a table a person reads, ``<state-dir>/completions.md``
        (texts cut at 500 characters there), >= 0; 0 (default) = off.""")
    population: str = knob("population", "", """
        the participants as one table of participants or groups (``ftis_fed/config/population.py``):
        a .toml/.json/.yaml file relative to the app folder (carried in the app bundle) or absolute,
        or the same table as inline JSON; '' = the numbered ``p<i>-*`` keys (at most 8). At most
        16,384 participants; the ``p<i>-*`` keys must then stay unset.""")
    fraction_train: float = knob("fraction-train", 1.0, """
        participant sampling (Flower's fraction-train): the share of the admitted participants asked
        to generate and train each round, in (0, 1]: the ones furthest below their fair share, ties by
        the round's committed draw (docs/scale.md).""")
    min_train_participants: int = knob("min-train-participants", 2, """
        at least this many participants are sampled per round (every admitted one when fewer), >= 1.""")
    fraction_evaluate: float = knob("fraction-evaluate", 1.0, """
        evaluation sampling (Flower's fraction_evaluate): the share of the admitted participants asked
        to evaluate in an evaluation round, in (0, 1]; a window of the same kind of ring as
        fraction-train's (another order), moving every evaluation round, so each is evaluated equally
        often. 1.0 = every admitted participant.""")
    min_evaluate_participants: int = knob("min-evaluate-participants", 2, """
        at least this many participants evaluate in an evaluation round (every admitted one when
        fewer), >= 1 (Flower's min_evaluate_nodes).""")
    peers_per_round: int = knob("peers-per-round", 0, """
        peer sampling: each receiver gets the frames of k peers per round and each verified frame
        reaches k receivers (one more on the side with fewer members), drawn per round from the
        committed draw; relayed bytes O(N k); applied before peer-budget. 0 = every peer.""")
    join_timeout_s: float = knob("join-timeout-s", 120.0, """
        nodes that connect after the start (late joiners, restarted participants with a new node id)
        answer hello at the next round boundary within this many seconds (the round waits), > 0; a
        node that does not is refused and not asked again while it stays connected.""")
    retire_after_rounds: int = knob("retire-after-rounds", 0, """
        a participant that was asked and did not reply (or is no longer connected) this many rounds
        in a row is retired: no longer asked; it may come back with a new hello. >= 0; 0 = never.""")
    participants_per_worker: int = knob("participants-per-worker", 1, """
        simulation: this many participants (consecutive partition ids) share one worker process, so
        torch and the libraries are loaded once per process instead of once per participant (memory,
        docs/scale.md); 1 = a process each. Co-hosted participants are served one request at a time;
        an error in one is that participant's error reply only, but a crash or hang of one also drops
        its process-mates from that phase (each dropped and, after the restart, rejoining on its own).
        Co-hosted participants share the first one's device. >= 1; deployment nodes always run one.""")
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    task: TaskSpec = field(default_factory=TaskSpec)
    reverify: ReverifyConfig = field(default_factory=ReverifyConfig)
    source_adapt: SourceAdaptConfig = field(default_factory=SourceAdaptConfig)

    def __post_init__(self) -> None:
        def need(ok: bool, f: str, limit: str) -> None:
            if not ok:
                raise ValueError(f"{_key_of(f)}={getattr(self, f)!r}: {limit}")

        need(self.num_rounds >= 1, "num_rounds", "must be >= 1")
        need(isinstance(self.log_completions, int) and not isinstance(self.log_completions, bool)
             and self.log_completions >= 0, "log_completions", "must be an integer >= 0 (0 = off)")
        # ``scheme`` names a registered round schedule: checked by the engine (``engine.schedules.get_schedule``,
        # at ``Engine`` construction and by the launcher), so that config/ imports nothing of the engine
        need(isinstance(self.scheme, str) and bool(self.scheme), "scheme", "must be a schedule's name")
        need(self.min_participants >= 1, "min_participants", "must be >= 1")
        need(self.wait_for_participants_s > 0, "wait_for_participants_s", "must be > 0")
        need(self.round_timeout_s > 0, "round_timeout_s", "must be > 0")
        need(self.group_size >= 2, "group_size", "must be >= 2 (a group-relative advantage needs 2)")
        need(self.local_budget >= 0, "local_budget", "must be >= 0 (0 = all)")
        need(self.peer_budget >= 0, "peer_budget", "must be >= 0 (0 = all)")
        need(self.wire_texts in ("auto", "always", "never"), "wire_texts", "must be auto, always or never")
        need(self.max_batch_tokens >= 1, "max_batch_tokens", "must be >= 1")
        need(self.eval_every >= 0, "eval_every", "must be >= 0 (0 = never)")
        need(self.eval_size >= 1, "eval_size", "must be >= 1")
        need(self.eval_ood_size >= 0, "eval_ood_size", "must be >= 0 (0 = eval_size)")
        need(self.eval_max_new_tokens >= 1, "eval_max_new_tokens", "must be >= 1")
        need(0 <= self.eval_samples <= 64, "eval_samples", "must be in [0, 64] (0 = off)")
        need(self.eval_seed >= -1, "eval_seed", "must be >= -1 (-1 = task-seed)")
        need(len(self.attack_payload) <= 64, "attack_payload", "must be at most 64 characters")
        need(self.attack_payload_at == "start" or not any(c.isdigit() for c in self.attack_payload), "attack_payload",
             "must have no digits with attack-payload-at = 'end' (the answer, the last number, would change)")
        need(0.0 < self.attack_payload_share <= 1.0, "attack_payload_share", "must be in (0, 1]")
        need(self.attack_payload_at in ("end", "start"), "attack_payload_at", "must be 'end' or 'start'")
        need(bool(self.run_name), "run_name", "must be non-empty")
        need(len(self.run_name) <= 200, "run_name", "must be at most 200 characters (with its 33-character run nonce "
                                                    "it is the run id every frame carries, limit 256)")
        need(self.threads >= 0, "threads", "must be >= 0 (0 = auto)")
        need(self.worker_idle_timeout_s > 0, "worker_idle_timeout_s", "must be > 0")
        need(self.seed >= 0, "seed", "must be >= 0")
        need(self.progress_every_s >= 0, "progress_every_s", "must be >= 0 (0 = off)")
        need(self.plot_every >= 0, "plot_every", "must be >= 0 (0 = after the last round only)")
        parse_report_to(self.report_to)                  # ValueError naming report-to and the accepted values
        need(0.0 < self.fraction_train <= 1.0, "fraction_train", "must be in (0, 1]")
        need(self.min_train_participants >= 1, "min_train_participants", "must be >= 1")
        need(0.0 < self.fraction_evaluate <= 1.0, "fraction_evaluate", "must be in (0, 1]")
        need(self.min_evaluate_participants >= 1, "min_evaluate_participants", "must be >= 1")
        need(self.peers_per_round >= 0, "peers_per_round", "must be >= 0 (0 = every peer)")
        need(self.join_timeout_s > 0, "join_timeout_s", "must be > 0")
        need(self.participants_per_worker >= 1, "participants_per_worker", "must be >= 1")
        need(self.retire_after_rounds >= 0, "retire_after_rounds", "must be >= 0 (0 = never)")
        need(self.checkpoint_every >= 0, "checkpoint_every", "must be >= 0 (0 = after the last round only)")
        self.sampling  # validates temperature / top-p / top-k / max-new-tokens
        self._resolve_horizontal()

    def check_data(self) -> None:
        """What a run reads, checked once where it starts (``validate_run_config``, called by the
        launcher and the ServerApp) so that nothing fails mid-run: a benchmark's train file loads,
        math-verify is installed when MATH-500 answers are compared, the held-out sets exist.
        ValueError naming the key. (The constructor only checks values: it does no I/O.)"""
        if self.task.source != "procedural":                    # the train file must load now, not mid-run
            self.task.train_pool()
        if self.push_to_hub:                                    # an upload that cannot happen: say so now
            from ftis_fed.policies.share import check_push
            check_push(self.push_to_hub)
        if self.task.source == "math500" or self.task.math500_data:
            try:
                require_math_verify()
            except ImportError as e:
                raise ValueError(f"math500-data={self.task.math500_data!r}: {e}") from None
        if self.eval_every > 0:                                 # the held-out sets must exist: fail now, not mid-run
            try:
                self.eval_sets()
            except ValueError as e:
                trained = (f"task-families={','.join(self.task.families)}" if self.task.source == "procedural"
                           else f"task-source={self.task.source}")
                raise ValueError(f"eval-size={self.eval_size} / eval-ood-size={self.eval_ood_size} with "
                                 f"{trained}: {e}") from None

    def _resolve_horizontal(self) -> None:
        """``task-scheme = auto`` -> ``shared`` with horizontal groups, else ``iid``; horizontal groups
        with another explicit scheme, or with the pipelined schedule, are a config error."""
        horizontal = self.objective.advantage_groups == "horizontal"
        if self.task.scheme == "auto":
            object.__setattr__(self, "task", dataclasses.replace(self.task, scheme="shared" if horizontal else "iid"))
        if not horizontal:
            return
        if self.task.scheme != "shared":
            raise ValueError(f"task-scheme={self.task.scheme!r} with advantage-groups='horizontal': horizontal "
                             "groups mix every participant's completions of the same prompt, so participants must "
                             "get the same prompts: set task-scheme=shared (or auto, the default)")
        if self.scheme != "sync":
            raise ValueError(f"scheme={self.scheme!r} with advantage-groups='horizontal': horizontal groups need the "
                             "sync schedule (pipelined trains on peers' batches of the previous round next to its "
                             "own of this round, so no prompt's group would mix): set scheme=sync")

    def completions_per_prompt(self, num_participants: int) -> int:
        """Completions each participant generates per prompt: ``group-size`` G (vertical), or its share
        ceil(G / N) of the mixed group with N participants (horizontal; the mixed group then has
        N * ceil(G / N) >= G completions, G itself when N divides it). A local-only mode (``alone``)
        with horizontal groups generates the full G of every shared prompt: the baseline that trains
        alone on the same prompts with the same group size (not on its share of a group)."""
        if isinstance(num_participants, bool) or int(num_participants) != num_participants or num_participants < 1:
            raise ValueError(f"num_participants={num_participants!r}: must be an integer >= 1")
        if self.objective.advantage_groups != "horizontal" or MODES[self.objective.mode].local_only:
            return self.group_size
        return -(-self.group_size // int(num_participants))

    def eval_sets(self) -> dict:
        """The held-out sets every participant evaluates on. ``id``: the held-out part of what is
        trained on (the families' eval split, GSM8K test, or MATH-500's eval split; ``eval-size``
        items, an error if there are fewer). OOD: the procedural OOD families (``eval-ood-size``
        each) when training on procedural tasks or when no other benchmark file is given; a
        benchmark not trained on whose file is given (``gsm8k``: its test file; ``math500``: all of
        it), at most ``eval-ood-size`` (0: ``eval-size``) items."""
        t, n_ood = self.task, self.eval_ood_size or self.eval_size
        others = {b: path for b, path in (("gsm8k", t.gsm8k_data), ("math500", t.math500_data))
                  if path and b != t.source}
        if t.source == "procedural":
            sets = eval_sets(self.eval_size, seed=self.eval_seed_value, id_families=t.families,
                             n_ood=self.eval_ood_size or None)
        elif t.source == "user":
            return t.user.eval_sets(self.eval_size, n_ood)
        else:
            held = eval_pool(t.source, t.benchmark_path, int(t.math500_eval_percent), True)
            if len(held) < self.eval_size:
                raise ValueError(f"the {t.source} held-out set has {len(held)} items, fewer than {self.eval_size}")
            sets = {"id": list(held[:self.eval_size])}
            if not others:
                sets.update({k: v for k, v in eval_sets(1, self.eval_seed_value, id_families=t.families,
                                                        n_ood=self.eval_ood_size or None).items() if k != "id"})
        for b, path in others.items():
            sets[b] = list(eval_pool(b, path, int(t.math500_eval_percent), False)[:n_ood])
        return sets

    @property
    def eval_seed_value(self) -> int:
        """The seed of the procedural held-out sets: ``eval-seed``, or ``task-seed`` when it is -1."""
        return self.task.seed if self.eval_seed < 0 else self.eval_seed

    @property
    def sampling(self) -> SamplingParams:
        try:
            return SamplingParams(self.temperature, self.top_p, self.top_k, self.max_new_tokens)
        except ValueError as e:
            raise ValueError(str(e).replace("sampling.", "").replace("_", "-")) from None


@dataclass(frozen=True)
class ParticipantSpec:
    """One participant: who it is, what it runs (``policy``: its PolicyConfig), which task partition
    it generates from (``partition_id`` of ``num_partitions``), where its keys and state live."""

    name: str = knob("participant", help="""
        its id (names its key files), ``[A-Za-z0-9][A-Za-z0-9._-]*`` ('' = ``p<i>``).""",
        run=False, per_participant=True)
    policy: PolicyConfig
    partition_id: int
    num_partitions: int
    keys_dir: str = knob("keys-dir", help="""
        public keys of the run in ``public/``, its own key in ``private/`` (node config; simulation:
        the run-wide keys-dir).""", run=False)
    state_dir: str = knob("state-dir", help="""
        where its checkpoint (trainable weights, optimizer, counters) goes (node config; simulation:
        output-dir/participants/<participant>).""", run=False)
    local_budget: int = knob("local-budget", 0, "this participant's local-budget (default: the run-wide value).",
                             run=False, per_participant=True)
    peer_budget: int = knob("peer-budget", 0, "this participant's peer-budget (default: the run-wide value).",
                            run=False, per_participant=True)
    byzantine: str = knob("byzantine", "", """
        a validly signing ATTACKER, for security experiments only: '' (honest) or attacks from
        ``ftis_fed.trust.attacks`` (``forge``, ``inflate``, ``logprobs``, ``lowlogprobs``, ``payload``
        (with ``attack-payload``), ``flood``, comma-separated, or ``all`` = forge, inflate, logprobs,
        flood); see docs/security.md.""", run=False, per_participant=True)
    churn: str = knob("churn", "", """
        SIMULATION ONLY: this participant's simulated churn schedule, e.g. ``"join=3 absent=5
        away=7-8 leave=12"``: its node connects at round 3 (a late joiner), skips round 5 (connected,
        answers nothing usable), is not connected in rounds 7-8 and rejoins at round 9, leaves for
        good at round 12 ('' = always there; ``ftis_fed.config.churn``, docs/scale.md).""",
        run=False, per_participant=True)

    def __post_init__(self) -> None:
        if self.local_budget < 0 or self.peer_budget < 0:
            raise ValueError(f"local-budget={self.local_budget}, peer-budget={self.peer_budget}: must be >= 0")
        if self.byzantine:
            parse_kinds(self.byzantine)
        parse_churn(self.churn)

    @property
    def schedule(self) -> Churn:
        """Its parsed ``churn`` schedule."""
        return parse_churn(self.churn)


# ----------------------------------------------------------------------------- key tables (derived)

#: participants a simulation can declare: p0 ... p{MAX_PARTICIPANTS - 1}, each declared in pyproject.toml
MAX_PARTICIPANTS = 8

#: run-config key -> (section, field). section '' = FederationConfig itself.
KEYS: dict[str, tuple[str, str]] = {k.key: (k.section, k.field) for k in knobs(FederationConfig)}
#: participant key -> PolicyConfig field.
POLICY_KEYS: dict[str, str] = {k.key: k.field for k in knobs(PolicyConfig)}
#: every key a participant resolves (from p<i>-<key>, its node config or the run-wide value).
PARTICIPANT_KEYS: tuple[str, ...] = (*(k.key for k in knobs(ParticipantSpec)), *POLICY_KEYS)
#: keys declared per simulated participant as p<i>-<key>.
PER_PARTICIPANT_KEYS: tuple[str, ...] = tuple(k.key for k in (*knobs(ParticipantSpec), *knobs(PolicyConfig))
                                              if k.per_participant)


def run_knobs() -> dict[str, Knob]:
    """Every run-wide key (declared unprefixed in ``[tool.flwr.app.config]``) -> its declaration."""
    out: dict[str, Knob] = {}
    for k in (*knobs(FederationConfig), *knobs(PolicyConfig), *knobs(ParticipantSpec)):
        if k.run:
            if k.key in out:
                raise RuntimeError(f"run-config key {k.key!r} is declared twice: {out[k.key].cls.__name__}."
                                   f"{out[k.key].field} and {k.cls.__name__}.{k.field}")
            out[k.key] = k
    return out


RUN_KNOBS = run_knobs()


def inherit_value(key: str) -> Any:
    """The ``p<i>-<key>`` value that means "the run-wide value": '' for strings, -1 for numbers."""
    like = RUN_KNOBS[key].default if key in RUN_KNOBS else ""
    if isinstance(like, bool) or not isinstance(like, (int, float)):
        return ""
    return -1.0 if isinstance(like, float) else -1


def toml_default(k: Knob) -> Any:
    """A declaration's default as written in ``[tool.flwr.app.config]`` (lists: comma-separated, ''
    = the declared default)."""
    return "" if isinstance(k.default, tuple) else k.default


def declared_keys() -> set[str]:
    """Every key ``[tool.flwr.app.config]`` must declare (and may: Flower rejects any other)."""
    return set(RUN_KNOBS) | {f"p{i}-{k}" for i in range(MAX_PARTICIPANTS) for k in PER_PARTICIPANT_KEYS}


def pyproject_disagreements(app_config: Mapping[str, Any]) -> list[str]:
    """Every way ``[tool.flwr.app.config]`` (``app_config``) differs from the declarations: a key
    missing, a key not declared, a default or a TOML type that differs, a participant slot beyond the
    default federation that does not mean "the run-wide value". Empty when they agree."""
    out = []
    for key, k in RUN_KNOBS.items():
        want = toml_default(k)
        if key not in app_config:
            out.append(f"{key}: declared by {k.cls.__name__}.{k.field} (default {want!r}) but missing")
        elif type(app_config[key]) is not type(want) or app_config[key] != want:
            out.append(f"{key}: {app_config[key]!r} in pyproject.toml, {want!r} declared by {k.cls.__name__}.{k.field}")
    n = len(participant_names(app_config))
    for i in range(MAX_PARTICIPANTS):
        for key in PER_PARTICIPANT_KEYS:
            pk, want = f"p{i}-{key}", inherit_value(key)
            if pk not in app_config:
                out.append(f"{pk}: missing (p0 ... p{MAX_PARTICIPANTS - 1} are each declared)")
            elif type(app_config[pk]) is not type(want):
                out.append(f"{pk}: {app_config[pk]!r} is not a {type(want).__name__} like {want!r}")
            elif i >= n and app_config[pk] != want:
                out.append(f"{pk}: {app_config[pk]!r} after the last participant; must be {want!r}")
    out += [f"{key}: in pyproject.toml but not declared" for key in app_config if key not in declared_keys()]
    return out


def _key_of(field_name: str) -> str:
    for k, (sec, f) in KEYS.items():
        if f == field_name and sec == "":
            return k
    return field_name


def _coerce(value: Any, like: Any, key: str) -> Any:
    """A run-config value (bool/int/float/str) converted to the type of the field's default."""
    if isinstance(like, bool):
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise ValueError(f"{key}={value!r}: must be true or false")
    if isinstance(like, int):
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            raise ValueError(f"{key}={value!r}: must be an integer")
        try:
            return int(value)
        except (TypeError, ValueError):
            raise ValueError(f"{key}={value!r}: must be an integer") from None
    if isinstance(like, float):
        if isinstance(value, bool):
            raise ValueError(f"{key}={value!r}: must be a number")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ValueError(f"{key}={value!r}: must be a number (inf allowed)") from None
    if isinstance(like, tuple):
        items = value if isinstance(value, (list, tuple)) else [s.strip() for s in str(value).split(",")]
        return tuple(s for s in items if s)
    return str(value)


def federation_from_run_config(run_config: Mapping[str, Any]) -> FederationConfig:
    """FederationConfig from a Flower run config; unknown keys are ignored here (participant keys,
    Flower's own), bad values raise ValueError naming the key and the limit."""
    sections: dict[str, dict[str, Any]] = {"": {}, "objective": {}, "task": {}, "reverify": {}, "source_adapt": {}}
    defaults = {"": FederationConfig(), "objective": ObjectiveConfig(), "task": TaskSpec(),
                "reverify": ReverifyConfig(), "source_adapt": SourceAdaptConfig()}
    for key, value in run_config.items():
        if key in KEYS:
            sec, f = KEYS[key]
            like = getattr(defaults[sec], f)
            if isinstance(like, tuple) and not str(value).strip():
                continue                                    # "" = the default list
            sections[sec][f] = _coerce(value, like, key)
    max_new = sections[""].get("max_new_tokens", FederationConfig.max_new_tokens)
    sections["objective"].setdefault("norm_constant", max_new)
    try:
        objective = ObjectiveConfig(**sections["objective"])
        task = TaskSpec(**sections["task"])
        reverify = ReverifyConfig(**sections["reverify"])
        source_adapt = SourceAdaptConfig(**sections["source_adapt"])
    except ValueError as e:
        raise ValueError(_rename_fields(str(e))) from None
    return FederationConfig(**sections[""], objective=objective, task=task, reverify=reverify,
                            source_adapt=source_adapt)


def _rename_fields(msg: str) -> str:
    """'objective.trunc_c=...' -> 'trunc-c=...' so errors name the run-config key."""
    for key, (sec, f) in KEYS.items():
        if sec:
            msg = msg.replace(f"{sec}.{f}=", f"{key}=")
    return msg


def _first_set(*values: Any) -> Any:
    """The first value that is set: not None, not '' and not -1 ("inherit the run-wide value")."""
    for v in values[:-1]:
        if v is not None and v != "" and not (isinstance(v, (int, float)) and not isinstance(v, bool) and v == -1):
            return v
    return values[-1]


#: keys a population entry may set: every participant key but its id (``name``) and the node's folders
POPULATION_KEYS: tuple[str, ...] = tuple(k for k in PARTICIPANT_KEYS if k not in ("participant", "keys-dir", "state-dir"))


def population_members(run_config: Mapping[str, Any]) -> list[population.Member]:
    """The run config's ``population`` (``ftis_fed.config.population``), [] when it has none."""
    return population.members(str(run_config.get("population", "") or ""), POPULATION_KEYS)


def participant_names(run_config: Mapping[str, Any]) -> list[str]:
    """Simulation participants in partition order: the population's, else p0, p1, ... while
    ``p<i>-model`` is set."""
    members = population_members(run_config)
    if members:
        return [m.name for m in members]
    names = []
    for i in range(MAX_PARTICIPANTS):
        if not str(run_config.get(f"p{i}-model", "")).strip():
            break
        names.append(str(run_config.get(f"p{i}-participant", "") or f"p{i}"))
    return names


def participant_spec(run_config: Mapping[str, Any], node_config: Mapping[str, Any],
                     fed: FederationConfig) -> ParticipantSpec:
    """This node's participant: from ``p<partition-id>-*`` run-config keys (simulation), or from
    the node config's unprefixed keys (deployment, ``--node-config "participant=... model=..."``).
    Bad values raise ValueError naming the key as it was set (``p2-lr=...`` or ``lr=...``)."""
    deployment = "participant" in node_config
    members = population_members(run_config)
    member: population.Member | None = None
    if deployment:
        found = population.find(members, str(node_config["participant"]))   # its row, if the population has it
        member = found[1] if found else None
        # every node must reach the same num-partitions (it sets the prompt partition and, with
        # horizontal groups, the share ceil(G/N) receivers accept): the population's size, else
        # min-participants, never a value derived from the node's own partition-id
        pid = int(node_config.get("partition-id", found[0] if found else 0))
        n = int(node_config.get("num-partitions", len(members) if found else fed.min_participants))
        if not 0 <= pid < n:
            raise ValueError(f"partition-id={pid}: must be in [0, num-partitions={n}) (num-partitions "
                             f"{'as set' if 'num-partitions' in node_config else f'defaults to min-participants={n}'}"
                             "; set the same num-partitions in every node config)")

        def get(k: str, default: Any) -> Any:
            own = member.values.get(k) if member is not None else None
            return _first_set(node_config.get(k), own, run_config.get(k), default)

        def named(k: str) -> str:
            if member is not None and _first_set(node_config.get(k), None) is None and k in member.values:
                return member.key_name(k)
            return k
    else:
        if "partition-id" not in node_config:
            raise ValueError("node config has neither 'participant' (deployment) nor 'partition-id' (simulation)")
        pid, n = int(node_config["partition-id"]), int(node_config["num-partitions"])
        if members:
            if pid >= len(members):
                raise ValueError(f"partition-id={pid}: the population declares {len(members)} participants; "
                                 f"set num-supernodes={len(members)}")
            member = members[pid]

            def get(k: str, default: Any) -> Any:
                return _first_set(member.values.get(k), run_config.get(k), default)

            def named(k: str) -> str:
                return member.key_name(k) if _first_set(member.values.get(k), None) is not None else k
        else:
            names = participant_names(run_config)
            if pid >= len(names):
                raise ValueError(f"partition-id={pid}: the run config defines {len(names)} participants "
                                 f"(p0-model ... p{len(names) - 1}-model); set num-supernodes={len(names)}")

            def get(k: str, default: Any) -> Any:
                return _first_set(run_config.get(f"p{pid}-{k}"), run_config.get(k), default)

            def named(k: str) -> str:
                return f"p{pid}-{k}" if _first_set(run_config.get(f"p{pid}-{k}"), None) is not None else k
    base = PolicyConfig()
    kwargs = {}
    for key, f in POLICY_KEYS.items():
        v = get(key, None)
        if v is not None:
            kwargs[f] = _coerce(v, getattr(base, f), named(key))
    try:
        policy = PolicyConfig(**kwargs)
    except ValueError as e:
        msg = str(e)
        for key, f in POLICY_KEYS.items():
            msg = msg.replace(f"policy.{f}=", f"{named(key)}=")
        raise ValueError(msg) from None
    name = member.name if member is not None and not deployment else str(get("participant", "") or f"p{pid}")
    out = Path(fed.output_dir).resolve()
    keys_dir = str(Path(get("keys-dir", "") or fed.keys_dir or out / "keys").resolve())
    state_dir = str(Path(get("state-dir", "") or out / "participants" / name).resolve())
    return ParticipantSpec(name=name, policy=policy, partition_id=pid, num_partitions=n,
                           keys_dir=keys_dir, state_dir=state_dir,
                           byzantine=str(get("byzantine", "")), churn=_churn(get("churn", ""), named("churn"), deployment),
                           local_budget=_coerce(get("local-budget", fed.local_budget), 0, named("local-budget")),
                           peer_budget=_coerce(get("peer-budget", fed.peer_budget), 0, named("peer-budget")))


def _churn(value: Any, key: str, deployment: bool) -> str:
    """A participant's ``churn`` schedule, checked (ValueError naming ``key``); refused in a deployment,
    where nodes come and go by themselves."""
    text = str(value or "").strip()
    if text and deployment:
        raise ValueError(f"{key}={text!r}: churn simulates a node's absences in a simulation; in a deployment "
                         "nodes come and go by themselves (remove it from the node config)")
    parse_churn(text, key)
    return text


# ----------------------------------------------------------------------------- validation before a run

def models_to_build(run_config: Mapping[str, Any]) -> dict[str, list[str]]:
    """Simulation: the registered offline models the run's participants use that are not in the
    cache yet (built on first use, which can take minutes), each with the participants using it."""
    from ftis_fed.config.models_check import offline_model_names
    from ftis_fed.policies.store import is_built

    names = set(offline_model_names())
    fed = federation_from_run_config(run_config)
    members = participant_names(run_config)
    todo: dict[str, list[str]] = {}
    for i, who in enumerate(members):
        model = participant_spec(run_config, {"partition-id": i, "num-partitions": len(members)}, fed).policy.model
        if model in names and not is_built(model):
            todo.setdefault(model, []).append(who)
    return todo


def validate_run_config(run_config: Mapping[str, Any], *, check_models: bool | None = None,
                        explicit: Collection[str] = ()) -> FederationConfig:
    """The whole run configuration checked before anything starts (launcher and ServerApp): every key
    declared, every value within its limits, every simulated participant's spec built and its model
    resolvable offline, the data it reads loaded (``FederationConfig.check_data``). Raises ValueError with
    one line naming the key, the value and the limit.

    ``check_models``: None = only in simulation (``keys-dir`` = ''), where participants' models are
    loaded on this machine; in deployment each SuperNode names its own model. ``explicit``: the keys
    the user set (the launcher knows them): a ``p<i>-model`` among them after the end of the list is
    an error (it would be ignored); one from pyproject's default federation after a preset's end is not."""
    declared = declared_keys()
    for key in run_config:
        if key not in declared:
            m = re.match(r"^p(\d+)-(.+)$", key)
            if m and int(m.group(1)) >= MAX_PARTICIPANTS and m.group(2) in PER_PARTICIPANT_KEYS:
                raise ValueError(f"{key}: at most {MAX_PARTICIPANTS} participants (p0 ... p{MAX_PARTICIPANTS - 1}; "
                                 "MAX_PARTICIPANTS in ftis_fed/config/federation.py)")
            raise ValueError(f"{key}: not a run-config key{trl_hint(key)} (see docs/configuration.md)")
    fed = federation_from_run_config(run_config)
    members = population_members(run_config)
    if members:
        return _validate_population(run_config, fed, members, check_models, explicit)
    names = participant_names(run_config)
    for i in range(len(names) + 1, MAX_PARTICIPANTS):
        if f"p{i}-model" in explicit and str(run_config.get(f"p{i}-model", "")).strip():
            raise ValueError(f"p{i}-model={run_config[f'p{i}-model']!r}: ignored, because p{len(names)}-model is '' "
                             "(an empty p<i>-model ends the list of participants); number them without gaps")
    simulation = not fed.keys_dir
    if simulation and not names:
        raise ValueError("p0-model='': no participants (set p0-model, p1-model, ...)")
    if simulation and fed.min_participants > len(names):
        raise ValueError(f"min-participants={fed.min_participants}: more than the {len(names)} participants "
                         f"declared (p0-model ... p{len(names) - 1}-model)")
    seen: dict[str, int] = {}
    for i, name in enumerate(names):
        try:
            check_participant(name)
        except ValueError:
            raise ValueError(f"p{i}-participant={name!r}: must match [A-Za-z0-9][A-Za-z0-9._-]{{0,63}} "
                             "(it names the key files)") from None
        if name in seen:
            raise ValueError(f"p{i}-participant={name!r}: the same name as p{seen[name]}; names must be distinct")
        seen[name] = i
        spec = _checked_spec(run_config, fed, i, len(names), name)
        if check_models if check_models is not None else simulation:
            check_model(spec.policy.model, f"p{i}-model", name)
        longest = max(fed.max_new_tokens, fed.eval_max_new_tokens)
        if 0 < spec.policy.max_model_len <= longest:
            key = "max-model-len" if run_config.get(f"p{i}-max-model-len", -1) in (-1, "", None) else f"p{i}-max-model-len"
            raise ValueError(f"{key}={spec.policy.max_model_len} (participant {name}): must be more than "
                             f"max-new-tokens / eval-max-new-tokens ({longest}): the prompt and the completion must fit")
    if simulation:
        fed.completions_per_prompt(len(names))          # horizontal: each participant's share of G
    fed.check_data()
    return fed


def _checked_spec(run_config: Mapping[str, Any], fed: FederationConfig, i: int, n: int, name: str,
                  where: str = "") -> ParticipantSpec:
    """Simulated participant ``i`` of ``n``; an error names the participant (after ``where``)."""
    try:
        return participant_spec(run_config, {"partition-id": i, "num-partitions": n}, fed)
    except ValueError as e:
        head, sep, tail = str(e).partition(": ")
        raise ValueError(f"{where}{head} (participant {name}){sep}{tail}") from None


def _validate_population(run_config: Mapping[str, Any], fed: FederationConfig, members: list[population.Member],
                         check_models: bool | None, explicit: Collection[str]) -> FederationConfig:
    """``validate_run_config`` for a run config with a ``population``: no ``p<i>-*`` key set beside it,
    every member's spec built and (simulation) its model resolvable; errors name the entry and field."""
    source = f"population {run_config['population']}" if not str(run_config["population"]).lstrip().startswith("{") \
        else "population (inline JSON)"
    for key in explicit:
        m = re.match(r"^p(\d+)-(.+)$", key)
        if m and m.group(2) in PER_PARTICIPANT_KEYS:
            raise ValueError(f"{key}: the run config declares its participants in {source}; set their keys there "
                             "(an entry's field or overrides), not as p<i>-* keys")
    simulation = not fed.keys_dir
    if simulation and fed.min_participants > len(members):
        raise ValueError(f"min-participants={fed.min_participants}: more than the {len(members)} participants "
                         f"of {source}")
    for i, m in enumerate(members):
        spec = _checked_spec(run_config, fed, i, len(members), m.name, f"{source}: ")
        if check_models if check_models is not None else simulation:
            try:
                check_model(spec.policy.model, m.key_name("model"), m.name)
            except ValueError as e:
                raise ValueError(f"{source}: {e}") from None
    if simulation:
        fed.completions_per_prompt(len(members))
    return fed


def absolute_paths(run_config: Mapping[str, Any], node_config: Mapping[str, Any]) -> tuple[dict, dict]:
    """Copies with output-dir / keys-dir / state-dir made absolute against this process's working
    directory (the SuperLink's in simulation), so a participant process started elsewhere agrees."""
    rc, nc = dict(run_config), dict(node_config)
    for cfg in (rc, nc):
        for k in list(cfg):
            if (k in ("output-dir", "keys-dir", "state-dir", "gsm8k-data", "math500-data")
                    or k.endswith(("-keys-dir", "-state-dir"))) and cfg[k]:
                cfg[k] = str(Path(str(cfg[k])).resolve())
            elif k in ("task-data", "task-eval-data") and cfg[k] and Path(str(cfg[k])).expanduser().exists():
                cfg[k] = str(Path(str(cfg[k])).expanduser().resolve())      # a hub id stays as it is
            elif k == "task-rewards" and cfg[k]:
                cfg[k] = ",".join(absolute_spec(s) for s in parse_specs(str(cfg[k])))
    return rc, nc


def spec_from_jsonable(data: Mapping[str, Any]) -> ParticipantSpec:
    """A resolved participant spec back from ``to_jsonable(spec)`` (the ClientApp hands it to the
    participant's worker process, which does not resolve it again)."""
    return ParticipantSpec(**{**data, "policy": PolicyConfig(**data["policy"])})


def to_jsonable(obj: Any) -> Any:
    """Dataclasses -> plain dicts (the resolved config saved with every result)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, tuple):
        return list(obj)
    if isinstance(obj, float) and obj == float("inf"):
        return "inf"
    return obj
