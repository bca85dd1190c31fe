"""Participant resolution: which participants a run config declares and what each one runs.

- simulation: participant ``i`` (Flower partition id ``i``) reads ``p<i>-<key>`` (e.g. ``p2-quant``)
  and falls back to the run-wide ``<key>``; or, with a ``population`` (``population.py``: one table of
  participants or groups, no cap), its row of the table;
- deployment: a SuperNode's ``--node-config`` gives ``participant``, ``model``, ``adapter``, ...,
  ``keys-dir`` and ``state-dir`` for its own participant (unprefixed), falling back to its population
  row (when the population has it) and the run config.

``participant_spec`` builds a ``ParticipantSpec`` (``federation.py``: the declarations and their
checks); ``participant_value`` reads one key of a simulated participant without building its spec.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from ftis_fed.config import population
from ftis_fed.config.churn import parse_churn
from ftis_fed.config.federation import (MAX_PARTICIPANTS, PARTICIPANT_KEYS, POLICY_KEYS, FederationConfig,
                                        ParticipantSpec)
from ftis_fed.config.keys import coerce, first_set
from ftis_fed.policies.config import PolicyConfig
from ftis_fed.tasks.reward_funcs import absolute_spec, parse_specs

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


@dataclass(frozen=True)
class Lookup:
    """Where one participant reads its keys: ``get(key, default)`` is the first value that is set
    (``first_set``) of its node config (deployment), its population row, its ``p<i>-<key>``
    (numbered simulation) and the run-wide key, else ``default``; ``named(key)`` is the key as it was
    set, for errors (``p2-lr``, ``participants[1].lr``, ``lr``)."""

    pid: int
    n: int
    member: population.Member | None
    deployment: bool
    get: Callable[[str, Any], Any]
    named: Callable[[str], str]


def lookup(run_config: Mapping[str, Any], node_config: Mapping[str, Any], min_participants: int) -> Lookup:
    """This node's ``Lookup``: from the node config's unprefixed keys (deployment: ``participant`` set;
    ``num-partitions`` defaults to the population's size, else ``min_participants``), or participant
    ``partition-id`` of the simulation (its population row, else its ``p<i>-*`` keys)."""
    members = population_members(run_config)
    if "participant" in node_config:
        found = population.find(members, str(node_config["participant"]))   # its row, if the population has it
        member = found[1] if found else None
        # every node must reach the same num-partitions (it sets the prompt partition and, with
        # horizontal groups, the share ceil(G/N) receivers accept): the population's size, else
        # min-participants, never a value derived from the node's own partition-id
        pid = int(node_config.get("partition-id", found[0] if found else 0))
        n = int(node_config.get("num-partitions", len(members) if found else min_participants))
        if not 0 <= pid < n:
            raise ValueError(f"partition-id={pid}: must be in [0, num-partitions={n}) (num-partitions "
                             f"{'as set' if 'num-partitions' in node_config else f'defaults to min-participants={n}'}"
                             "; set the same num-partitions in every node config)")

        def get(k: str, default: Any) -> Any:
            own = member.values.get(k) if member is not None else None
            return first_set(node_config.get(k), own, run_config.get(k), default)

        def named(k: str) -> str:
            if member is not None and first_set(node_config.get(k), None) is None and k in member.values:
                return member.key_name(k)
            return k
        return Lookup(pid, n, member, True, get, named)
    if "partition-id" not in node_config:
        raise ValueError("node config has neither 'participant' (deployment) nor 'partition-id' (simulation)")
    return simulated(run_config, int(node_config["partition-id"]), int(node_config["num-partitions"]), members)


def simulated(run_config: Mapping[str, Any], pid: int, n: int,
              members: list[population.Member] | None = None) -> Lookup:
    """The ``Lookup`` of simulated participant ``pid`` of ``n`` (``members``: the population, read
    from the run config when not given)."""
    members = population_members(run_config) if members is None else members
    if members:
        if pid >= len(members):
            raise ValueError(f"partition-id={pid}: the population declares {len(members)} participants; "
                             f"set num-supernodes={len(members)}")
        member = members[pid]

        def get(k: str, default: Any) -> Any:
            return first_set(member.values.get(k), run_config.get(k), default)

        def named(k: str) -> str:
            return member.key_name(k) if first_set(member.values.get(k), None) is not None else k
        return Lookup(pid, n, member, False, get, named)
    names = participant_names(run_config)
    if pid >= len(names):
        raise ValueError(f"partition-id={pid}: the run config defines {len(names)} participants "
                         f"(p0-model ... p{len(names) - 1}-model); set num-supernodes={len(names)}")

    def get_numbered(k: str, default: Any) -> Any:
        return first_set(run_config.get(f"p{pid}-{k}"), run_config.get(k), default)

    def named_numbered(k: str) -> str:
        return f"p{pid}-{k}" if first_set(run_config.get(f"p{pid}-{k}"), None) is not None else k
    return Lookup(pid, n, None, False, get_numbered, named_numbered)


def participant_value(at: Lookup, key: str) -> Any:
    """One policy key of a participant (``at``), coerced to its field's type, without building its
    whole spec (e.g. every participant's ``device`` for the GPU shares); the default when unset."""
    like = getattr(_POLICY_DEFAULTS, POLICY_KEYS[key])
    v = at.get(key, None)
    return like if v is None else coerce(v, like, at.named(key))


_POLICY_DEFAULTS = PolicyConfig()


def participant_spec(run_config: Mapping[str, Any], node_config: Mapping[str, Any],
                     fed: FederationConfig) -> ParticipantSpec:
    """This node's participant: from ``p<partition-id>-*`` run-config keys or its population row
    (simulation), or from the node config's unprefixed keys (deployment, ``--node-config
    "participant=... model=..."``). Bad values raise ValueError naming the key as it was set
    (``p2-lr=...`` or ``lr=...``)."""
    at = lookup(run_config, node_config, fed.min_participants)
    get, named = at.get, at.named
    kwargs = {}
    for key, f in POLICY_KEYS.items():
        v = get(key, None)
        if v is not None:
            kwargs[f] = coerce(v, getattr(_POLICY_DEFAULTS, f), named(key))
    try:
        policy = PolicyConfig(**kwargs)
    except ValueError as e:
        msg = str(e)
        for key, f in POLICY_KEYS.items():
            msg = msg.replace(f"policy.{f}=", f"{named(key)}=")
        raise ValueError(msg) from None
    name = at.member.name if at.member is not None and not at.deployment else str(get("participant", "") or f"p{at.pid}")
    out = Path(fed.output_dir).resolve()
    keys_dir = str(Path(get("keys-dir", "") or fed.keys_dir or out / "keys").resolve())
    state_dir = str(Path(get("state-dir", "") or out / "participants" / name).resolve())
    return ParticipantSpec(name=name, policy=policy, partition_id=at.pid, num_partitions=at.n,
                           keys_dir=keys_dir, state_dir=state_dir,
                           byzantine=str(get("byzantine", "")),
                           churn=_churn(get("churn", ""), named("churn"), at.deployment),
                           local_budget=coerce(get("local-budget", fed.local_budget), 0, named("local-budget")),
                           peer_budget=coerce(get("peer-budget", fed.peer_budget), 0, named("peer-budget")))


def _churn(value: Any, key: str, deployment: bool) -> str:
    """A participant's ``churn`` schedule, checked (ValueError naming ``key``); refused in a deployment,
    where nodes come and go by themselves."""
    text = str(value or "").strip()
    if text and deployment:
        raise ValueError(f"{key}={text!r}: churn simulates a node's absences in a simulation; in a deployment "
                         "nodes come and go by themselves (remove it from the node config)")
    parse_churn(text, key)
    return text


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
