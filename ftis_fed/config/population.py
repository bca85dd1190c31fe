"""A federation declared as a population: one table of participants, or of groups of them.

    # sims/populations/swarm.toml        (run config: population = "sims/populations/swarm.toml")
    [defaults]                           # optional: what every entry starts from
    adapter = "full"

    [[participants]]                     # a group: micro-s-0 ... micro-s-31
    name = "micro-s"
    count = 32
    model = "tiny-llama"

    [[participants]]
    name = "micro-m"
    count = 16
    model = "tiny-llama-b"
    adapter = "lora"
    overrides = { "3" = { lr = 1e-4 } }  # per participant: its index in the entry -> its own keys

    [[participants]]                     # 256 LoRA participants on one base, ranks and rates drawn
    name = "lora"
    count = 256
    model = "micro-llama-s"
    adapter = "lora"
    share-base = true                    # one copy of the base per worker process
    draw = { lora-r = [4, 8, 16], lr = [5e-4, 1e-3] }

    [[participants]]                     # count 1 (default): the name is the participant's id
    name = "smol"
    model = "smollm2"

The same structure in JSON (``.json``) or YAML (``.yaml`` / ``.yml``), or inline JSON as the value
of the ``population`` run-config key itself (it starts with ``{``). A file path is relative to the
app folder (the one holding ``pyproject.toml`` and ``ftis_fed/``: in ``flwr run`` the app bundle's
copy, which carries .toml/.json/.yaml files), or absolute.

A ``model`` that is a local folder should be an absolute path (workers run in the app bundle's
folder). An entry's keys are any participant key (``participant_keys``: the per-participant keys and every
policy key, e.g. ``lr``, ``micro-batch``), which win over the run-wide values. No cap on the
number of participants but memory. Errors are one line naming the source, the entry (``participants[2]``)
and the field. Nothing here imports the rest of the config (``participants.py`` passes the keys in).

``draw`` gives keys a list of values each participant of the entry takes one of: the value at
SHA-256(participant name, key) mod the list's length (so the same name always draws the same value,
whatever the count or order). An override wins over a draw, a draw over the entry's own keys.
"""

from __future__ import annotations

import hashlib
import json
import re
import tomllib
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Collection, Mapping

#: fields of an entry that are not participant keys
ENTRY_FIELDS = ("name", "count", "overrides", "draw")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
#: the most participants a population may declare, over all its entries (every node expands the
#: table: 10^6 took 10.8 s on each, 10^9 ran out of memory; docs/scale.md measures up to 4,096)
MAX_POPULATION = 16384


@dataclass(frozen=True)
class Member:
    """One participant of a population: its id, its own keys (entry defaults + entry + override),
    and where it was declared (``participants[2]``, for error messages)."""

    name: str
    values: Mapping[str, Any]
    where: str
    origin: Mapping[str, str]                   # key -> where it was set (``participants[2].lr``, ``defaults.lr``)

    def key_name(self, key: str) -> str:
        """How errors name one of its keys: ``participants[2].lr`` (or ``...overrides.3.lr``)."""
        return self.origin.get(key, f"{self.where}.{key}")


def app_dir() -> Path:
    """The app folder: the parent of the ``ftis_fed`` package (in ``flwr run``, the bundle's copy)."""
    return Path(__file__).resolve().parents[2]


def members(value: str, participant_keys: Collection[str], base: Path | None = None) -> list[Member]:
    """The population named by the ``population`` run-config ``value`` ('' = none: []), in
    partition order. ValueError, one line naming the source, entry and field."""
    value = str(value).strip()
    if not value:
        return []
    if value.startswith("{"):
        return list(_parse_cached(value, "json", "population (inline JSON)", tuple(sorted(participant_keys))))
    path = Path(value).expanduser()
    if not path.is_absolute():
        path = (base or app_dir()) / path
    try:
        stamp = path.stat().st_mtime_ns
    except OSError:
        raise ValueError(f"population={value!r}: no such file ({path}); give a .toml/.json/.yaml file in the app "
                         "folder (relative to it) or an absolute path") from None
    kind = {".toml": "toml", ".json": "json", ".yaml": "yaml", ".yml": "yaml"}.get(path.suffix.lower())
    if kind is None:
        raise ValueError(f"population={value!r}: must be a .toml, .json or .yaml file (Flower app bundles carry "
                         "those), or inline JSON starting with '{'")
    return list(_cached(str(path), stamp, kind, f"population {value}", tuple(sorted(participant_keys))))


@lru_cache(maxsize=16)
def _cached(path: str, stamp: int, kind: str, source: str, keys: tuple[str, ...]) -> tuple[Member, ...]:
    return _parse(Path(path).read_text(), kind, source, keys)


def _parse(text: str, kind: str, source: str, keys: tuple[str, ...]) -> tuple[Member, ...]:
    def fail(msg: str) -> ValueError:
        return ValueError(f"{source}: {msg}")

    try:
        if kind == "toml":
            data = tomllib.loads(text)
        elif kind == "json":
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except Exception as e:                              # noqa: BLE001 - any parser's error, one line
        raise fail(f"not valid {kind.upper()} ({' '.join(str(e).split())})") from None
    if not isinstance(data, dict):
        raise fail("must be a table with a 'participants' list (and optionally 'defaults')")
    extra = sorted(set(data) - {"participants", "defaults"})
    if extra:
        raise fail(f"{extra[0]!r}: unknown top-level field (only 'participants' and 'defaults')")
    known = set(keys)
    defaults = data.get("defaults", {})
    if not isinstance(defaults, dict):
        raise fail("defaults: must be a table of participant keys")
    for k in defaults:
        _check_key(k, known, "defaults", fail)
    entries = data.get("participants")
    if not isinstance(entries, list) or not entries:
        raise fail("participants: must be a non-empty list of entries ([[participants]] in TOML)")
    out: list[Member] = []
    seen: dict[str, str] = {}
    for i, entry in enumerate(entries):
        where = f"participants[{i}]"
        if not isinstance(entry, dict):
            raise fail(f"{where}: must be a table (name, count, participant keys, overrides)")
        name = entry.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise fail(f"{where}.name={name!r}: must match [A-Za-z0-9][A-Za-z0-9._-]{{0,63}} (it names the key files)")
        count = entry.get("count", 1)
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise fail(f"{where}.count={count!r}: must be an integer >= 1")
        if len(out) + count > MAX_POPULATION:
            raise fail(f"{where}.count={count}: the population would have {len(out) + count} participants, "
                       f"limit {MAX_POPULATION}")
        own = {k: v for k, v in entry.items() if k not in ENTRY_FIELDS}
        for k in own:
            _check_key(k, known, where, fail)
        overrides = entry.get("overrides", {})
        if not isinstance(overrides, dict):
            raise fail(f"{where}.overrides: must be a table of index -> participant keys")
        for idx, ov in overrides.items():
            j = str(idx)
            if not j.isdigit() or int(j) >= count:
                raise fail(f"{where}.overrides.{j}: not an index of this entry (0 ... {count - 1})")
            if not isinstance(ov, dict):
                raise fail(f"{where}.overrides.{j}: must be a table of participant keys")
            for k in ov:
                _check_key(k, known, f"{where}.overrides.{j}", fail)
        draw = entry.get("draw", {})
        if not isinstance(draw, dict):
            raise fail(f"{where}.draw: must be a table of participant key -> list of values")
        for k, vals in draw.items():
            _check_key(k, known, f"{where}.draw", fail)
            if not isinstance(vals, list) or not vals:
                raise fail(f"{where}.draw.{k}={vals!r}: must be a non-empty list of values to draw from")
        by_index = {int(str(j)): ov for j, ov in overrides.items()}
        for j in range(count):
            pname = name if count == 1 else f"{name}-{j}"
            if len(pname) > 64:
                raise fail(f"{where}.name={name!r}: {pname!r} is longer than 64 characters")
            if pname in seen:
                raise fail(f"{where}.name={name!r}: participant {pname!r} is also declared by {seen[pname]}; "
                           "names must be distinct")
            seen[pname] = where
            ov = by_index.get(j, {})
            origin = {k: f"defaults.{k}" for k in defaults}
            origin.update({k: f"{where}.{k}" for k in own})
            drawn = {k: vals[_draw_index(pname, k, len(vals))] for k, vals in draw.items()}
            origin.update({k: f"{where}.draw.{k}" for k in drawn})
            origin.update({k: f"{where}.overrides.{j}.{k}" for k in ov})
            values = {**defaults, **own, **drawn, **ov}
            for k, v in values.items():
                if not isinstance(v, (bool, int, float, str)):
                    raise fail(f"{origin[k]}={v!r}: must be a string, number or boolean")
            out.append(Member(pname, values, where, origin))
    return tuple(out)


_parse_cached = lru_cache(maxsize=16)(_parse)


def _draw_index(participant: str, key: str, n: int) -> int:
    """Which of ``n`` values participant ``participant`` draws for ``key`` (``draw``)."""
    return int.from_bytes(hashlib.sha256(f"{participant}\0{key}".encode()).digest()[:8], "big") % n


def _check_key(key: Any, known: set[str], where: str, fail) -> None:
    if key == "participant":
        raise fail(f"{where}.participant: use 'name' (with 'count', participants are named <name>-<index>)")
    if key not in known:
        raise fail(f"{where}.{key}: not a participant key (see docs/configuration.md, 'Participants')")


def find(ms: list[Member], name: str) -> tuple[int, Member] | None:
    """(partition index, member) of participant ``name``, or None."""
    for i, m in enumerate(ms):
        if m.name == name:
            return i, m
    return None
