"""Every knob of a run, built from the Flower run config (and a SuperNode's node config) in one place.

Run-config keys are kebab-case and declared with their defaults in ``pyproject.toml``
(``[tool.flwr.app.config]``); ``KEYS`` below maps each key to its dataclass field. Participants:

- simulation: participant ``i`` (Flower partition id ``i``) reads ``p<i>-<key>`` (e.g. ``p2-quant``)
  and falls back to the run-wide ``<key>``;
- deployment: a SuperNode's ``--node-config`` gives ``participant``, ``model``, ``adapter``, ...,
  ``keys-dir`` and ``state-dir`` for its own participant (unprefixed), falling back to the run config.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from .batch import SamplingParams
from .objective import ObjectiveConfig
from .policies.config import PolicyConfig
from .reverify import ReverifyConfig
from .source_weights import SourceAdaptConfig
from .tasks.suite import TaskSpec


@dataclass(frozen=True)
class FederationConfig:
    """The schedule and the shared settings of a run.

    num_rounds [num-rounds]: rounds to run, >= 1.
    scheme [scheme]: ``sync`` (the paper: phase 1 every participant generates and returns a signed
        batch; phase 2 each receives its peers' batches of the same round and updates) or
        ``pipelined`` (one exchange per round: each participant generates, then trains on its new
        batch and its peers' batches of the previous round, which arrive with the same message).
    min_participants [min-participants]: participants that must be connected before round 1 and
        reply in a round for it to count as complete, >= 1.
    wait_for_participants_s [wait-for-participants-s]: how long to wait for them to connect and
        answer hello (their first message, which loads their model), > 0.
    round_timeout_s [round-timeout-s]: per phase; a participant that has not replied by then is
        treated as dropped for that round (the round finishes with the replies it has), > 0.
    group_size [group-size]: G, completions per prompt, >= 2.
    temperature / top_p / top_k / max_new_tokens [temperature, top-p, top-k, max-new-tokens]:
        the sampling distribution every participant generates (and scores) with.
    local_budget [local-budget]: own completions a participant trains on per round (0 = all).
    peer_budget [peer-budget]: peers' completions the server relays to a participant per round, whole
        signed batches only (0 = all).
    wire_texts [wire-texts]: ``auto`` (send completion texts only when tokenizers differ in the run),
        ``always`` or ``never``.
    max_batch_tokens [max-batch-tokens]: larger batches are rejected (``too_large``), >= 1.
    eval_every [eval-every]: greedy pass@1 on held-out ID/OOD sets before round 1 and every k
        rounds and after the last (0 = never).
    eval_size [eval-size]: prompts in the held-out ID set (the eval split of task-families), >= 1;
        checked at start against the distinct problems the families have.
    eval_ood_size [eval-ood-size]: prompts per OOD family set (five families), >= 0; 0 = eval_size.
    eval_max_new_tokens [eval-max-new-tokens]: >= 1.
    run_name [run-name]: the run id batches are signed for (kept across a resume), non-empty.
    output_dir [output-dir]: results folder (metrics, plots, server state, participants' checkpoints
        in simulation); relative paths are resolved against the SuperLink's working directory.
    resume [resume]: continue from ``output_dir``'s saved state instead of starting fresh.
    keys_dir [keys-dir]: folder with ``public/<participant>.pub`` (and, on each node, its own
        ``private/<participant>.key``); '' = simulation: generate a fresh set in output_dir/keys.
    threads [threads]: torch threads per participant process (0 = cores / participants).
    worker_idle_timeout_s [worker-idle-timeout-s]: a participant process with no request for this
        long exits (the end-of-run message normally stops it first), > 0.
    seed [seed]: base seed of sampling (round and participant are mixed in), >= 0.
    """

    num_rounds: int = 3
    scheme: str = "sync"
    min_participants: int = 2
    wait_for_participants_s: float = 120.0
    round_timeout_s: float = 900.0
    group_size: int = 4
    temperature: float = 0.7
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 32
    local_budget: int = 0
    peer_budget: int = 0
    wire_texts: str = "auto"
    max_batch_tokens: int = 1 << 20
    eval_every: int = 0
    eval_size: int = 32
    eval_ood_size: int = 0
    eval_max_new_tokens: int = 16
    run_name: str = "ftis-fed"
    output_dir: str = "outputs/default"
    resume: bool = False
    keys_dir: str = ""
    threads: int = 0
    worker_idle_timeout_s: float = 1800.0
    seed: int = 0
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    task: TaskSpec = field(default_factory=TaskSpec)
    reverify: ReverifyConfig = field(default_factory=ReverifyConfig)
    source_adapt: SourceAdaptConfig = field(default_factory=SourceAdaptConfig)

    def __post_init__(self) -> None:
        def need(ok: bool, f: str, limit: str) -> None:
            if not ok:
                raise ValueError(f"{_key_of(f)}={getattr(self, f)!r}: {limit}")

        need(self.num_rounds >= 1, "num_rounds", "must be >= 1")
        need(self.scheme in ("sync", "pipelined"), "scheme", "must be 'sync' or 'pipelined'")
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
        need(bool(self.run_name), "run_name", "must be non-empty")
        need(self.threads >= 0, "threads", "must be >= 0 (0 = auto)")
        need(self.worker_idle_timeout_s > 0, "worker_idle_timeout_s", "must be > 0")
        need(self.seed >= 0, "seed", "must be >= 0")
        self.sampling  # validates temperature / top-p / top-k / max-new-tokens
        if self.eval_every > 0:                                 # the held-out sets must exist: fail now, not mid-run
            try:
                self.eval_sets()
            except ValueError as e:
                raise ValueError(f"eval-size={self.eval_size} / eval-ood-size={self.eval_ood_size} with "
                                 f"task-families={','.join(self.task.families)}: {e}") from None

    def eval_sets(self) -> dict:
        """The held-out sets every participant evaluates on: ID = the families trained on."""
        from .tasks.suite import eval_sets

        return eval_sets(self.eval_size, seed=self.task.seed, id_families=self.task.families,
                         n_ood=self.eval_ood_size or None)

    @property
    def sampling(self) -> SamplingParams:
        try:
            return SamplingParams(self.temperature, self.top_p, self.top_k, self.max_new_tokens)
        except ValueError as e:
            raise ValueError(str(e).replace("sampling.", "").replace("_", "-")) from None


@dataclass(frozen=True)
class ParticipantSpec:
    """One participant: who it is, what it runs, where its keys and state live.

    name [participant]: its id (names its key files), ``[A-Za-z0-9][A-Za-z0-9._-]*``.
    policy: its PolicyConfig (keys ``model``, ``backend``, ``adapter``, ``quant``, ``lr``, ...).
    partition_id / num_partitions: which task partition it generates from.
    keys_dir [keys-dir]: public keys of the run in ``public/``, its own key in ``private/``.
    state_dir [state-dir]: where its checkpoint (trainable weights, optimizer, counters) goes.
    local_budget [local-budget] / peer_budget [peer-budget]: this participant's budgets (default:
        the run-wide values; see FederationConfig).
    fault [fault]: fault injection for tests: '' or ``<raise|exit|hang>:<generate|learn|evaluate>:<round>``.
    """

    name: str
    policy: PolicyConfig
    partition_id: int
    num_partitions: int
    keys_dir: str
    state_dir: str
    fault: str = ""
    local_budget: int = 0
    peer_budget: int = 0

    def __post_init__(self) -> None:
        if self.local_budget < 0 or self.peer_budget < 0:
            raise ValueError(f"local-budget={self.local_budget}, peer-budget={self.peer_budget}: must be >= 0")
        if self.fault:
            parts = self.fault.split(":")
            if (len(parts) != 3 or parts[0] not in ("raise", "exit", "hang")
                    or parts[1] not in ("generate", "learn", "evaluate") or not parts[2].isdigit()):
                raise ValueError(f"fault={self.fault!r}: must be '' or <raise|exit|hang>:<generate|learn|evaluate>:<round>")


# ----------------------------------------------------------------------------- key tables

#: run-config key -> (section, field). section '' = FederationConfig itself.
KEYS: dict[str, tuple[str, str]] = {
    **{f.name.replace("_", "-"): ("", f.name) for f in dataclasses.fields(FederationConfig)
       if f.name not in ("objective", "task", "reverify", "source_adapt")},
    "loss-mode": ("objective", "mode"), "ratio-level": ("objective", "ratio_level"),
    "trunc-c": ("objective", "trunc_c"), "clip-eps": ("objective", "clip_eps"),
    "filter-g": ("objective", "filter_g"), "kl-estimator": ("objective", "kl_estimator"),
    "length-norm": ("objective", "length_norm"), "log-ratio-clamp": ("objective", "log_ratio_clamp"),
    "advantage-groups": ("objective", "advantage_groups"), "scale-rewards": ("objective", "scale_rewards"),
    "task-scheme": ("task", "scheme"), "task-families": ("task", "families"), "task-skew": ("task", "skew"),
    "task-alpha": ("task", "alpha"), "task-seed": ("task", "seed"), "prompts-per-round": ("task", "prompts_per_round"),
    "reverify-action": ("reverify", "action"), "reverify-tol": ("reverify", "tol"),
    "reverify-max-disagreement": ("reverify", "max_disagreement"),
    "reverify-disagree-weight": ("reverify", "disagree_weight"),
    "reverify-on-unverifiable": ("reverify", "on_unverifiable"),
    "source-adapt": ("source_adapt", "mode"), "source-adapt-tau": ("source_adapt", "tau"),
    "source-adapt-decay": ("source_adapt", "decay"),
}

#: participant key -> PolicyConfig field (plus the ParticipantSpec keys handled apart).
POLICY_KEYS: dict[str, str] = {
    "model": "model", "backend": "backend", "adapter": "adapter", "quant": "quant", "lora-r": "lora_r",
    "lora-alpha": "lora_alpha", "lora-dropout": "lora_dropout", "lr": "lr", "weight-decay": "weight_decay",
    "max-grad-norm": "max_grad_norm", "micro-batch": "micro_batch", "logit-chunk": "logit_chunk",
    "grad-checkpointing": "grad_checkpointing", "dtype": "dtype", "policy-seed": "seed", "model-id": "name",
}
PARTICIPANT_KEYS = ("participant", "fault", "keys-dir", "state-dir", "local-budget", "peer-budget", *POLICY_KEYS)
MAX_PARTICIPANTS = 16


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


def participant_names(run_config: Mapping[str, Any]) -> list[str]:
    """Simulation participants in partition order: p0, p1, ... while ``p<i>-model`` is set."""
    names = []
    for i in range(MAX_PARTICIPANTS):
        if not str(run_config.get(f"p{i}-model", "")).strip():
            break
        names.append(str(run_config.get(f"p{i}-participant", "") or f"p{i}"))
    return names


def participant_spec(run_config: Mapping[str, Any], node_config: Mapping[str, Any],
                     fed: FederationConfig) -> ParticipantSpec:
    """This node's participant: from ``p<partition-id>-*`` run-config keys (simulation), or from
    the node config's unprefixed keys (deployment, ``--node-config "participant=... model=..."``)."""
    deployment = "participant" in node_config
    if deployment:
        pid = int(node_config.get("partition-id", 0))
        n = int(node_config.get("num-partitions", max(fed.min_participants, pid + 1)))

        def get(k: str, default: Any) -> Any:
            return _first_set(node_config.get(k), run_config.get(k), default)
    else:
        if "partition-id" not in node_config:
            raise ValueError("node config has neither 'participant' (deployment) nor 'partition-id' (simulation)")
        pid, n = int(node_config["partition-id"]), int(node_config["num-partitions"])
        names = participant_names(run_config)
        if pid >= len(names):
            raise ValueError(f"partition-id={pid}: the run config defines {len(names)} participants "
                             f"(p0-model ... p{len(names) - 1}-model); set num-supernodes={len(names)}")

        def get(k: str, default: Any) -> Any:
            return _first_set(run_config.get(f"p{pid}-{k}"), run_config.get(k), default)
    base = PolicyConfig()
    kwargs = {}
    for key, f in POLICY_KEYS.items():
        v = get(key, None)
        if v is not None:
            kwargs[f] = _coerce(v, getattr(base, f), key)
    name = str(get("participant", "") or f"p{pid}")
    out = Path(fed.output_dir).resolve()
    keys_dir = str(Path(get("keys-dir", "") or fed.keys_dir or out / "keys").resolve())
    state_dir = str(Path(get("state-dir", "") or out / "participants" / name).resolve())
    return ParticipantSpec(name=name, policy=PolicyConfig(**kwargs), partition_id=pid, num_partitions=n,
                           keys_dir=keys_dir, state_dir=state_dir, fault=str(get("fault", "")),
                           local_budget=_coerce(get("local-budget", fed.local_budget), 0, "local-budget"),
                           peer_budget=_coerce(get("peer-budget", fed.peer_budget), 0, "peer-budget"))


def absolute_paths(run_config: Mapping[str, Any], node_config: Mapping[str, Any]) -> tuple[dict, dict]:
    """Copies with output-dir / keys-dir / state-dir made absolute against this process's working
    directory (the SuperLink's in simulation), so a participant process started elsewhere agrees."""
    rc, nc = dict(run_config), dict(node_config)
    for cfg in (rc, nc):
        for k in list(cfg):
            if (k in ("output-dir", "keys-dir", "state-dir") or k.endswith(("-keys-dir", "-state-dir"))) and cfg[k]:
                cfg[k] = str(Path(str(cfg[k])).resolve())
    return rc, nc


def to_jsonable(obj: Any) -> Any:
    """Dataclasses -> plain dicts (the resolved config saved with every result)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, tuple):
        return list(obj)
    if isinstance(obj, float) and obj == float("inf"):
        return "inf"
    return obj


def _docstring_entries(cls) -> dict[str, str]:
    """'[key]: text' entries of a config dataclass docstring -> {key: text} (continuation lines joined).
    An entry may document several keys: 'a [k1] / b [k2]: text'."""
    import re

    out: dict[str, str] = {}
    current: list[str] = []
    text: list[str] = []
    for line in (cls.__doc__ or "").splitlines():
        m = re.match(r"^\s{4}(\S.*?\[[a-z0-9-]+(?:, [a-z0-9-]+)*\].*?):\s*(.*)$", line)
        if m and "[" in m.group(1):
            for k in current:
                out.setdefault(k, " ".join(text))
            keys = re.findall(r"\[([a-z0-9, -]+)\]", m.group(1))
            current = [k.strip() for group in keys for k in group.split(",")]
            text = [m.group(2).strip()]
        elif current and line.startswith("        "):
            text.append(line.strip())
        else:
            for k in current:
                out.setdefault(k, " ".join(text))
            current, text = [], []
    for k in current:
        out.setdefault(k, " ".join(text))
    return out


def config_reference(run_config: Mapping[str, Any]) -> str:
    """Markdown table of every run-config key: default (from ``run_config``, i.e. pyproject) and
    meaning (from the dataclass docstrings). ``python -m ftis_fed.config`` prints it."""
    docs: dict[str, str] = {}
    for cls in (FederationConfig, ObjectiveConfig, TaskSpec, ReverifyConfig, SourceAdaptConfig, PolicyConfig,
                ParticipantSpec):
        for k, v in _docstring_entries(cls).items():
            docs.setdefault(k, v)
    docs["model-id"] = docs.get("model-id", "label recorded in batches as the generator's model id")
    lines = ["| key | default | meaning |", "|---|---|---|"]
    for key, value in run_config.items():
        m = __import__("re").match(r"^p(\d+)-(.+)$", key)
        if m:
            continue
        lines.append(f"| `{key}` | `{value!r}` | {docs.get(key, '')} |")
    per = sorted({__import__("re").sub(r"^p\d+-", "", k) for k in run_config if __import__("re").match(r"^p\d+-", k)})
    lines += ["", "Per participant (simulation), for i = 0, 1, ...: `p<i>-<key>` with <key> one of "
              + ", ".join(f"`{k}`" for k in per) + " (\"\" or -1 = the run-wide value; `p<i>-model = \"\"` ends "
              "the list). Deployment: the same keys, unprefixed, in the SuperNode's `--node-config`, plus "
              "`partition-id` and `num-partitions`.", ""]
    for k in per:
        if k in docs:
            lines.append(f"- `{k}`: {docs[k]}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # pragma: no cover - documentation generator
    import sys
    import tomllib

    cfg = tomllib.loads(Path(sys.argv[1] if len(sys.argv) > 1 else "pyproject.toml").read_text())
    print("# Configuration reference\n\nGenerated by `python -m ftis_fed.config` from `pyproject.toml` and the "
          "config dataclasses' docstrings (`tests/test_config.py` checks it is current).\n")
    print(config_reference(cfg["tool"]["flwr"]["app"]["config"]))
