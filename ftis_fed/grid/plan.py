"""The grid's plan: which cells a grid runs (method × advantage grouping × seed, variants), and the
finished cells an output folder holds.

A *cell* is one federation run of a preset with ``loss-mode``, ``advantage-groups`` and ``seed`` set;
a *variant* is a method plus extra run-config items, written ``MODE+VARIANT`` in ``--modes``
(``VARIANTS``; ``--variant NAME:key=value,...`` defines more).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from ftis_fed.learn.modes import MODES                 # the loss modes, in the paper's order

#: variant name -> extra run-config items of its cells (``MODE+NAME`` in ``--modes``).
VARIANTS: dict[str, dict] = {"adapt": {"source-adapt": "kl"}, "guard": {"source-adapt": "guard"},
                             "shadow": {"source-adapt": "shadow"}}


@dataclass(frozen=True)
class Cell:
    """One run of the grid: a method (``loss-mode``, optionally a named variant carrying extra
    run-config items), an advantage grouping and a seed."""

    mode: str
    groups: str
    seed: int
    variant: str = ""
    extra: tuple[tuple[str, object], ...] = ()
    #: ``eval-initial`` of this run (None: the preset's). Set by ``run_grid`` when the grid shares one
    #: initial evaluation; not part of the cell's identity (name, equality).
    eval_initial: bool | None = field(default=None, compare=False)

    @property
    def label(self) -> str:
        """``mode`` or ``mode+variant``."""
        return f"{self.mode}+{self.variant}" if self.variant else self.mode

    @property
    def name(self) -> str:
        return f"{self.label}__{self.groups}__s{self.seed}"

    @property
    def method(self) -> str:
        """The method as tables show it: the label, suffixed ``/h`` for horizontal groups."""
        return self.label if self.groups == "vertical" else f"{self.label}/h"

    def run_config(self, out_dir: Path) -> dict:
        """The cell's run-config items on top of the preset: the method, the grouping, and the seed as
        both the sampling ``seed`` and the ``task-seed`` (each seed trains on other prompts; the
        held-out sets stay fixed: the grid sets ``eval-seed``). Horizontal cells also take the shared
        prompts (``task-scheme = "shared"``): the paper's horizontal mode has every participant
        complete the same prompts, so a preset's partition (e.g. ``expertise`` in ``paper``) holds
        for its vertical cells only (a horizontal run with another scheme is a config error)."""
        rc = {**dict(self.extra), "loss-mode": self.mode, "advantage-groups": self.groups, "seed": self.seed,
              "task-seed": self.seed, "output-dir": str(out_dir)}
        if self.groups == "horizontal":
            rc["task-scheme"] = "shared"
        if self.eval_initial is not None:
            rc["eval-initial"] = self.eval_initial
        return rc

    def run_config_items(self, out_dir: Path) -> list[str]:
        """``run_config`` as ``--run-config`` items (``key=<JSON value>``), as the cell runners pass them."""
        return [f"{k}={json.dumps(v)}" for k, v in self.run_config(out_dir).items()]


def parse_variant(spec: str) -> tuple[str, dict]:
    """``NAME:key=value,key=value`` (values as TOML scalars: 1.5, true, or bare strings) -> (NAME, items)."""
    import tomllib

    name, sep, body = spec.partition(":")
    if not sep or not name.strip() or "+" in name or "__" in name:
        raise ValueError(f"--variant {spec!r}: must be NAME:key=value[,key=value] (NAME without '+' or '__')")
    items = {}
    for item in filter(None, (x.strip() for x in body.split(","))):
        k, eq, v = item.partition("=")
        if not eq or not k.strip():
            raise ValueError(f"--variant {spec!r}: {item!r} is not key=value")
        try:
            items[k.strip()] = tomllib.loads(f"v = {v.strip()}")["v"]
        except tomllib.TOMLDecodeError:
            items[k.strip()] = v.strip()
    if not items:
        raise ValueError(f"--variant {spec!r}: no key=value items")
    return name.strip(), items


def plan(modes: Sequence[str], seeds: int, groups: Sequence[str] = ("vertical",),
         horizontal_modes: Sequence[str] | None = None, variants: dict[str, dict] | None = None,
         seed_from: int = 0) -> list[Cell]:
    """The cells in run order: seed-major, so an interrupted grid has whole seeds to compare.
    Seeds ``seed_from`` .. ``seed_from + seeds - 1``.

    modes: loss modes, or ``MODE+VARIANT`` for a mode with a variant's extra run-config items.
    horizontal_modes: the modes also run with ``advantage-groups=horizontal`` when ``groups``
    includes it (default: all of ``modes``).
    variants: name -> extra items (default ``VARIANTS``).
    """
    variants = VARIANTS if variants is None else variants
    bad = [m for m in modes if m.partition("+")[0] not in MODES]
    if bad:
        raise ValueError(f"--modes: {bad[0]!r} is not a loss mode (one of {', '.join(MODES)})")
    unknown = [m for m in modes if m.partition("+")[2] and m.partition("+")[2] not in variants]
    if unknown:
        raise ValueError(f"--modes: {unknown[0]!r}: no variant {unknown[0].partition('+')[2]!r} "
                         f"(known: {', '.join(variants) or 'none'}; define one with --variant NAME:key=value)")
    if seeds < 1:
        raise ValueError(f"--seeds={seeds}: must be >= 1")
    if seed_from < 0:
        raise ValueError(f"--seed-from={seed_from}: must be >= 0")
    for g in groups:
        if g not in ("vertical", "horizontal"):
            raise ValueError(f"--groups: {g!r} must be vertical or horizontal")
    hmodes = set(modes if horizontal_modes is None else horizontal_modes)
    cells = []
    for s in range(seed_from, seed_from + seeds):
        for g in groups:
            for m in modes:
                if g == "horizontal" and m not in hmodes:
                    continue
                mode, _, var = m.partition("+")
                cells.append(Cell(mode, g, s, var, tuple(sorted(variants.get(var, {}).items())) if var else ()))
    return cells


def min_eval_size(delta: float, p: float = 0.5, z: float = 2.0) -> int:
    """Prompts per evaluation set so that two independent pass@1 estimates that differ by ``delta``
    are ``z`` standard errors of their difference apart: ``n = 2 p (1 - p) (z / delta)^2``."""
    if not 0 < delta < 1 or not 0 < p < 1:
        raise ValueError(f"delta={delta}, p={p}: both must lie in (0, 1)")
    return math.ceil(2 * p * (1 - p) * (z / delta) ** 2)


def method_order(method: str) -> tuple[int, str]:
    base = method.removesuffix("/h").partition("+")[0]
    return (list(MODES).index(base) if base in MODES else len(MODES), method)



def plan_order(cell: Cell) -> tuple:
    """Sort key of the plan's order: seed, vertical before horizontal, the paper's method order."""
    return (cell.seed, cell.groups != "vertical", method_order(cell.label))


def discover_cells(out: Path) -> list[Cell]:
    """The finished cells in ``out/cells`` (``<label>__<groups>__s<seed>`` with a ``done.json``), in
    plan order (seed, grouping, method): what ``--summary-only`` summarises."""
    cells = []
    for done in (out / "cells").glob("*/done.json"):
        label, groups, seed = done.parent.name.split("__")
        mode, _, var = label.partition("+")
        cells.append(Cell(mode, groups, int(seed.removeprefix("s")), var))
    return sorted(cells, key=plan_order)
