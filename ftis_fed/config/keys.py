"""The run config's key tables, derived from the declarations (``knob(...)`` fields), and its parse.

``federation_knobs`` / ``run_keys`` / ``run_knobs``: every key of a ``FederationConfig`` (its config
dataclasses' and each registered receiver check's included, ``receive/checks.check_knobs``) and every
run-wide key (``federation.py`` has the participant's tables: ``POLICY_KEYS``, ``PARTICIPANT_KEYS``,
``PER_PARTICIPANT_KEYS``); ``declared_keys``: what ``[tool.flwr.app.config]`` must declare;
``coerce``: a run-config value to its field's type; ``federation_from_run_config``: the run config ->
``FederationConfig`` (no I/O, no torch).
"""

from __future__ import annotations

from typing import Any, Mapping

from ftis_fed.config.federation import MAX_PARTICIPANTS, PER_PARTICIPANT_KEYS, FederationConfig, ParticipantSpec
from ftis_fed.knobs import Knob, knobs
from ftis_fed.learn.objective_config import ObjectiveConfig
from ftis_fed.policies.config import PolicyConfig
from ftis_fed.receive.checks import check_knobs
from ftis_fed.tasks.suite import TaskSpec
from ftis_fed.trust.reverify import ReverifyConfig


def federation_knobs() -> list[Knob]:
    """Every key of a ``FederationConfig``: its own and its config dataclasses' (``knobs``), and each
    registered receiver check's (section ``checks.<alias>``, ``receive/checks.check_knobs``)."""
    return [*knobs(FederationConfig),
            *(k for alias, cls in check_knobs().items() for k in knobs(cls, f"checks.{alias}"))]


def run_keys() -> dict[str, tuple[str, str]]:
    """run-config key -> (section, field). section '' = FederationConfig itself."""
    return {k.key: (k.section, k.field) for k in federation_knobs()}


def run_knobs() -> dict[str, Knob]:
    """Every run-wide key (declared unprefixed in ``[tool.flwr.app.config]``) -> its declaration."""
    out: dict[str, Knob] = {}
    for k in (*federation_knobs(), *knobs(PolicyConfig), *knobs(ParticipantSpec)):
        if k.run:
            if k.key in out:
                raise RuntimeError(f"run-config key {k.key!r} is declared twice: {out[k.key].cls.__name__}."
                                   f"{out[k.key].field} and {k.cls.__name__}.{k.field}")
            out[k.key] = k
    return out


def inherit_value(key: str) -> Any:
    """The ``p<i>-<key>`` value that means "the run-wide value": '' for strings, -1 for numbers."""
    declared = run_knobs()
    like = declared[key].default if key in declared else ""
    if isinstance(like, bool) or not isinstance(like, (int, float)):
        return ""
    return -1.0 if isinstance(like, float) else -1


def toml_default(k: Knob) -> Any:
    """A declaration's default as written in ``[tool.flwr.app.config]`` (lists: comma-separated, ''
    = the declared default)."""
    return "" if isinstance(k.default, tuple) else k.default


def declared_keys() -> set[str]:
    """Every key ``[tool.flwr.app.config]`` must declare (and may: Flower rejects any other)."""
    return set(run_knobs()) | {f"p{i}-{k}" for i in range(MAX_PARTICIPANTS) for k in PER_PARTICIPANT_KEYS}


def coerce(value: Any, like: Any, key: str) -> Any:
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
    declared = {k.key: k for k in federation_knobs()}
    classes = {"objective": ObjectiveConfig, "task": TaskSpec, "reverify": ReverifyConfig,
               **{f"checks.{alias}": cls for alias, cls in check_knobs().items()}}
    sections: dict[str, dict[str, Any]] = {"": {}, **{sec: {} for sec in classes}}
    for key, value in run_config.items():
        if key in declared:
            k = declared[key]
            if isinstance(k.default, tuple) and not str(value).strip():
                continue                                    # "" = the default list
            sections[k.section][k.field] = coerce(value, k.default, key)
    max_new = sections[""].get("max_new_tokens", FederationConfig.max_new_tokens)
    sections["objective"].setdefault("norm_constant", max_new)
    try:
        built = {sec: cls(**sections[sec]) for sec, cls in classes.items()}
    except ValueError as e:
        raise ValueError(_rename_fields(str(e))) from None
    return FederationConfig(**sections[""], objective=built["objective"], task=built["task"],
                            reverify=built["reverify"],
                            checks={sec.split(".", 1)[1]: v for sec, v in built.items() if sec.startswith("checks.")})


def _rename_fields(msg: str) -> str:
    """'objective.trunc_c=...' -> 'trunc-c=...' so errors name the run-config key."""
    for key, (sec, f) in run_keys().items():
        if sec:
            msg = msg.replace(f"{sec}.{f}=", f"{key}=")
    return msg


def first_set(*values: Any) -> Any:
    """The first value that is set: not None, not '' and not -1 ("inherit the run-wide value")."""
    for v in values[:-1]:
        if v is not None and v != "" and not (isinstance(v, (int, float)) and not isinstance(v, bool) and v == -1):
            return v
    return values[-1]
