"""Whole-run checks before anything starts: ``validate_run_config`` (launcher and ServerApp: every key
declared, every value within its limits, every simulated participant's spec built and its model
resolvable offline, the data the run reads loaded), ``models_to_build`` (the offline models the cache
still lacks) and ``pyproject_disagreements`` (``[tool.flwr.app.config]`` against the declarations)."""

from __future__ import annotations

import re
from typing import Any, Collection, Mapping

from ftis_fed.config import population
from ftis_fed.config.federation import MAX_PARTICIPANTS, PER_PARTICIPANT_KEYS, FederationConfig, ParticipantSpec
from ftis_fed.config.keys import declared_keys, federation_from_run_config, inherit_value, run_knobs, toml_default
from ftis_fed.config.models_check import check_model, offline_model_names
from ftis_fed.config.participants import (participant_names, participant_spec, participant_value, population_members,
                                          simulated)
from ftis_fed.config.trl_names import trl_hint
from ftis_fed.trust.signing import check_participant

def pyproject_disagreements(app_config: Mapping[str, Any]) -> list[str]:
    """Every way ``[tool.flwr.app.config]`` (``app_config``) differs from the declarations: a key
    missing, a key not declared, a default or a TOML type that differs, a participant slot beyond the
    default federation that does not mean "the run-wide value". Empty when they agree."""
    out = []
    for key, k in run_knobs().items():
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


def models_to_build(run_config: Mapping[str, Any]) -> dict[str, list[str]]:
    """Simulation: the registered offline models the run's participants use that are not in the
    cache yet (built on first use, which can take minutes), each with the participants using it.
    Reads each participant's ``model`` only (``participant_value``), not its whole spec."""
    from ftis_fed.policies.store import is_built                  # the model store: only when asked

    names = set(offline_model_names())
    members = population_members(run_config)
    who_all = participant_names(run_config)
    todo: dict[str, list[str]] = {}
    for i, who in enumerate(who_all):
        model = participant_value(simulated(run_config, i, len(who_all), members), "model")
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
