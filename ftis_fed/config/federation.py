"""Every knob of a run, declared in one place: the run's dataclasses and their checks.

Why ~400 lines: ``FederationConfig`` holds the run's key declarations (each key declared once, with
its help text, where other engineers add theirs) and their checks; everything else the run config
needs is its own module.

Each run-config key is declared once, as a dataclass field made with ``ftis_fed.knobs.knob`` (key,
default, help): ``FederationConfig`` below, ``ObjectiveConfig``, ``TaskSpec``, ``ReverifyConfig``,
``PolicyConfig``, ``ParticipantSpec`` and each receiver check's knobs (``FederationConfig.checks``,
``ftis_fed/receive/``). This module declares and checks (as TRL's ``GRPOConfig`` does); around it:

- ``keys.py``: the key tables derived from the declarations, the value coercion and the parse
  (``federation_from_run_config``);
- ``participants.py``: participant resolution (``participant_names``, ``participant_spec``: ``p<i>-*``
  keys, a ``population``, a SuperNode's node config);
- ``validation.py``: the whole-run check before a run starts (``validate_run_config``, the data it
  reads included, ``FederationConfig.check_data``), the models to build, the check of ``pyproject.toml``;
- ``reference.py`` the docs generator (docs/configuration.md), ``models_check.py`` the check that
  models resolve offline (HF cache probing), ``gpu_shares.py`` a participant's GPU memory share,
  ``population.py`` the population table.

Constructing a config does no I/O and imports no torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping

from ftis_fed.config.churn import Churn, parse_churn
from ftis_fed.knobs import knob, knobs, need as knob_need
from ftis_fed.learn.modes import MODES
from ftis_fed.learn.objective_config import ObjectiveConfig
from ftis_fed.metrics.sinks import parse_report_to
from ftis_fed.policies.config import PolicyConfig
from ftis_fed.receive.checks import checked_knobs, default_check_knobs
from ftis_fed.tasks.benchmarks import eval_pool
from ftis_fed.tasks.suite import TaskSpec, eval_sets
from ftis_fed.tasks.symbolic import require_math_verify
from ftis_fed.trust.attacks import parse_kinds
from ftis_fed.trust.reverify import ReverifyConfig
from ftis_fed.wire.batch import SamplingParams


@dataclass(frozen=True)
class FederationConfig:
    """The schedule and the shared settings of a run: every field a run-config key (``knob``), plus
    the objective's, the task suite's and the re-verification's keys in their own dataclasses, and
    each receiver check's in its own (``checks``)."""

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
        simulation: this many participants share one worker process (partition ids dealt round-robin
        to ceil(N / this) processes, so a phase's first messages start them all at once), so
        torch and the libraries are loaded once per process instead of once per participant (memory,
        docs/scale.md); 1 = a process each. Co-hosted participants are served one request at a time;
        an error in one is that participant's error reply only, but a crash or hang of one also drops
        its process-mates from that phase (each dropped and, after the restart, rejoining on its own).
        Co-hosted participants share the first one's device. >= 1; deployment nodes always run one.""")
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    task: TaskSpec = field(default_factory=TaskSpec)
    reverify: ReverifyConfig = field(default_factory=ReverifyConfig)
    #: alias -> the knobs of each registered receiver check that has knobs (``receive/checks.py``:
    #: its ``knobs`` dataclass, e.g. ``checks["phrase"].ratio`` = ``peer-phrase-ratio``); the checks
    #: not given take their defaults
    checks: Mapping[str, Any] = field(default_factory=default_check_knobs)

    def __post_init__(self) -> None:
        def need(ok: bool, f: str, limit: str) -> None:
            knob_need(self, ok, f, limit)                 # ValueError naming the key: num-rounds=0: ...

        object.__setattr__(self, "checks", checked_knobs(self.checks))
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


# ----------------------------------------------------------------------------- the participant's key tables (derived)

#: participants a simulation can declare: p0 ... p{MAX_PARTICIPANTS - 1}, each declared in pyproject.toml
MAX_PARTICIPANTS = 8


#: participant key -> PolicyConfig field.
POLICY_KEYS: dict[str, str] = {k.key: k.field for k in knobs(PolicyConfig)}


#: every key a participant resolves (from p<i>-<key>, its node config or the run-wide value).
PARTICIPANT_KEYS: tuple[str, ...] = (*(k.key for k in knobs(ParticipantSpec)), *POLICY_KEYS)


#: keys declared per simulated participant as p<i>-<key>.
PER_PARTICIPANT_KEYS: tuple[str, ...] = tuple(k.key for k in (*knobs(ParticipantSpec), *knobs(PolicyConfig))
                                              if k.per_participant)


# ----------------------------------------------------------------------------- JSON

def spec_from_jsonable(data: Mapping[str, Any]) -> ParticipantSpec:
    """A resolved participant spec back from ``to_jsonable(spec)`` (the ClientApp hands it to the
    participant's worker process, which does not resolve it again)."""
    return ParticipantSpec(**{**data, "policy": PolicyConfig(**data["policy"])})


def to_jsonable(obj: Any) -> Any:
    """Dataclasses -> plain dicts (the resolved config saved with every result)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, Mapping):
        return {k: to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, tuple):
        return list(obj)
    if isinstance(obj, float) and obj == float("inf"):
        return "inf"
    return obj
