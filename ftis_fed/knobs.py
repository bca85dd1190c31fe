"""One declaration per run-config key: a dataclass field made with ``knob``.

    lr: float = knob("lr", 0.0, "AdamW learning rate (> 0; 0 = auto).", per_participant=True)

The field's metadata carries the Flower run-config key (kebab-case), its help text and where the key
may be set; ``ftis_fed.config.keys`` derives from these declarations the key tables, the error names, the
reference in ``docs/configuration.md`` and the check against ``pyproject.toml`` (whose
``[tool.flwr.app.config]`` must declare every run-wide key with the same default, because Flower
rejects keys a run config does not declare). Standard library only: config classes import it.

Where a key may be set:

- ``run`` (default True): run-wide, ``key = <default>`` in ``[tool.flwr.app.config]``;
- ``per_participant``: also ``p<i>-<key>`` for every simulated participant i ("" or -1 there = the
  run-wide value), and unprefixed in a SuperNode's ``--node-config`` (deployment);
- a knob of ``PolicyConfig`` / ``ParticipantSpec`` with ``run=False`` and no ``per_participant``
  is a node-config key only (deployment).

A config dataclass checks its values in ``__post_init__`` with ``need``, whose error names the key:

    need(self, self.lr >= 0, "lr", "must be >= 0")     # ValueError: lr=-1.0: must be >= 0
"""

from __future__ import annotations

import dataclasses
from dataclasses import MISSING, Field
from typing import Any, Callable, Iterator, NamedTuple


def knob(key: str, default: Any = MISSING, help: str = "", *, default_factory: Callable[[], Any] | Any = MISSING,
         run: bool = True, per_participant: bool = False, before: Any = MISSING) -> Any:
    """A dataclass field declared as the run-config key ``key`` (see the module docstring). ``before``:
    where the key came with a default that is not what the code did before it, the value that did
    (a run recorded before the key existed does not name it, and ran as this: ``grid/pack.py``)."""
    if not help:
        raise ValueError(f"knob {key!r}: every key needs its help text")
    meta = {"key": key, "help": " ".join(help.split()), "run": run, "per_participant": per_participant,
            "before": before}
    if default_factory is not MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def need(obj: Any, ok: bool, field: str, limit: str) -> None:
    """ValueError ``<key>=<value>: <limit>`` unless ``ok``; ``<key>``: the run-config key declared by
    ``obj``'s ``field`` (its ``knob``), else the field's name."""
    if ok:
        return
    f = next((f for f in dataclasses.fields(obj) if f.name == field), None)
    key = f.metadata.get("key", field) if f is not None else field
    raise ValueError(f"{key}={getattr(obj, field)!r}: {limit}")


class Knob(NamedTuple):
    """One declared key: where it lives (``cls.field`` inside ``section`` of FederationConfig: '' for
    FederationConfig itself, ``objective`` / ``task`` / ``reverify`` for its config dataclasses,
    ``checks.<alias>`` for a receiver check's knobs)."""

    key: str
    cls: type
    field: str
    section: str
    default: Any
    help: str
    run: bool
    per_participant: bool
    before: Any = MISSING     # what runs recorded before the key existed did, where not ``default``


def default_of(f: Field) -> Any:
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    return MISSING


def knobs(cls: type, section: str = "") -> Iterator[Knob]:
    """The knobs declared by ``cls``; a field whose default is a config dataclass (``objective``,
    ``task``, ``reverify`` of FederationConfig) contributes its own knobs under its field name."""
    for f in dataclasses.fields(cls):
        if "key" in f.metadata:
            m = f.metadata
            yield Knob(m["key"], cls, f.name, section, default_of(f), m["help"], m["run"], m["per_participant"],
                       m.get("before", MISSING))
        elif f.default_factory is not MISSING and dataclasses.is_dataclass(f.default_factory):
            yield from knobs(f.default_factory, f.name)
