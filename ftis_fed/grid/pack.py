"""Packing: the finished cells of one grid folder added to another grid of the same experiment, as
if one ``ftis-fed grid`` had run them all — for seeds run in another folder, at another time or on
another machine (``ftis-fed grid --seeds 5 --seed-from 5 --out B`` next to a committed A, then
``ftis-fed grid --pack B --out A``).

Nothing is taken on trust: the two grids must record the same preset, run-config items and metric
(``GRID_KEYS``); every packed cell's run configuration must equal the destination's except for what
makes a cell that cell (``CELL_KEYS``: seed, method, grouping, its own folder, its shared
evaluation flag); the union must pass the summary's own checks (``check_weights``: the same
model weights; ``check_starts``: a seed's first samples equal whatever the method); and where both
folders carry the evaluation before round 1 (``records.shared_start``) it must be the same. A cell
the destination already has is kept as it is (skipped, never overwritten). Each packed cell is
copied to ``<name>.packing``, renamed into place, and given its ``done.json`` last, so an
interrupted pack leaves no half cell that counts as finished (a grid run moves such a folder aside).
What a cell keeps is what ``compact_cell`` keeps (``KEPT``) and its ``done.json``; its ``run.log.gz``
stays in the source folder.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable

from ftis_fed.grid.metric import recorded_metric
from ftis_fed.grid.plan import Cell, discover_cells, method_order
from ftis_fed.grid.records import check_starts, check_weights, initial_rows, shared_start
from ftis_fed.grid.run import KEPT

#: grid.json keys two grids must share to be one experiment (the transport may differ: one engine).
GRID_KEYS = ("preset", "run_config", "metric")
#: run/config.json entries (dotted paths) that differ between the cells of one grid by design.
CELL_KEYS = ("seed", "task.seed", "objective.mode", "objective.advantage_groups", "output_dir", "eval_initial")


#: grid.json's key naming the command that writes a folder's summary where that is not ``ftis-fed grid``
#: (``sims.poisoning``'s attack tables): ``ftis-fed grid`` neither runs, packs nor summarises cells there.
SUMMARY_BY = "summary_by"


class PackError(ValueError):
    """Two grid folders that are not one experiment, a cell that does not belong, or a folder whose
    summary another tool writes (``SUMMARY_BY``)."""


def grid_json(out: Path) -> dict:
    """``out``'s grid.json ({} where there is none), for ``ftis-fed grid`` to run, pack or summarise
    cells there; PackError where it names another tool as the writer of the folder's summary."""
    path = out / "grid.json"
    meta = json.loads(path.read_text()) if path.exists() else {}
    if by := meta.get(SUMMARY_BY):
        raise PackError(f"{path} says its summary is written by `{by} --out {out}` ({SUMMARY_BY}): ftis-fed grid "
                        "neither runs, packs nor summarises cells there")
    return meta


def _meta(out: Path) -> dict:
    if not (out / "grid.json").exists():
        raise PackError(f"{out / 'grid.json'}: no grid.json (not a grid folder written by ftis-fed grid)")
    return {**grid_json(out), "metric": recorded_metric(out)}           # a grid from before --metric: greedy


def _config(cell_dir: Path) -> dict:
    path = cell_dir / "run" / "config.json"
    if not path.exists():
        raise PackError(f"{path}: missing (a finished cell keeps its run configuration)")
    return json.loads(path.read_text())


def _without(cfg: dict, paths: tuple[str, ...]) -> dict:
    cfg = json.loads(json.dumps(cfg))
    for dotted in paths:
        *parents, leaf = dotted.split(".")
        node = cfg
        for p in parents:
            node = node.get(p, {}) if isinstance(node, dict) else {}
        if isinstance(node, dict):
            node.pop(leaf, None)
    return cfg


_ABSENT = object()


def _leaves(cfg, path: str = "") -> dict:
    """``cfg`` as dotted paths -> values (nested settings flattened)."""
    if isinstance(cfg, dict):
        return {k: v for key, sub in cfg.items() for k, v in _leaves(sub, f"{path}.{key}".lstrip(".")).items()}
    return {path: cfg}


def _shown(v) -> str:
    return "absent" if v is _ABSENT else repr(v)


def _defaults() -> dict[str, tuple]:
    """Each setting's values a run recorded before the setting existed may have run with: today's
    default, and what the code did before it where its knob declares that (``knob(..., before=...)``:
    ``source-adapt-shadow-loss`` came with ``alone``, the shadow had trained with ``run``; which of the
    two an older run did depends on its other settings, here whether it ran the shadow at all)."""
    from ftis_fed.config.federation import FederationConfig, to_jsonable
    from ftis_fed.config.keys import federation_knobs
    from ftis_fed.knobs import MISSING

    out = {k: (v,) for k, v in _leaves(to_jsonable(FederationConfig())).items()}
    for k in federation_knobs():
        if k.before is not MISSING:
            path = f"{k.section}.{k.field}".lstrip(".")
            out[path] = (*out.get(path, ()), k.before)
    return out


def _differences(a: dict, b: dict) -> tuple[list[str], list[str]]:
    """The settings in which run configurations ``a`` and ``b`` differ, and those only one of them
    records that are left out as another code version's: cells run before a setting existed do not
    record it, so a setting recorded on one side only counts as a difference unless it holds what the
    older code did (``_defaults``: today's default, or the value its knob names); one today's code no
    longer has (renamed) is named, not compared."""
    la, lb, defaults = _leaves(a), _leaves(b), None
    diffs, versions = [], []
    for k in sorted(set(la) | set(lb)):
        va, vb = la.get(k, _ABSENT), lb.get(k, _ABSENT)
        if va == vb:
            continue
        if va is _ABSENT or vb is _ABSENT:
            defaults = defaults if defaults is not None else _defaults()
            value = vb if va is _ABSENT else va
            if k not in defaults:
                versions.append(k)
                continue
            if value in defaults[k]:
                continue
        diffs.append(f"{k} = {_shown(va)} (here {_shown(vb)})")
    return diffs, versions


def check_config(cell: Cell, cfg: dict, ref_cell: Cell, ref: dict, where: str = "the destination",
                 echo: Callable[[str], None] = print) -> None:
    """``cfg`` (a packed cell's run configuration) equals ``ref`` (a destination cell's) outside
    ``CELL_KEYS``; a reference of another method also leaves out the method's own settings
    (``objective``, ``checks``: where the loss mode and the built-in variants' items land). A new
    variant whose items change other settings (``2G``'s ``prompts-per-round``) is refused until the
    destination holds a cell of it: run that first cell into the grid itself. Cells of another code
    version compare as ``_differences`` says. PackError naming the entries."""
    skip = CELL_KEYS if ref_cell.label == cell.label else CELL_KEYS + ("objective", "checks")
    diffs, versions = _differences(_without(cfg, skip), _without(ref, skip))
    if diffs:
        raise PackError(f"{cell.name}: its run configuration differs from {ref_cell.name}'s in {where}: "
                        + "; ".join(diffs[:5]) + (f" (+{len(diffs) - 5} more)" if len(diffs) > 5 else ""))
    if versions:
        echo(f"[pack] {cell.name}: settings recorded by one code version only, not compared: {', '.join(versions)}")


def _initial_values(cell_dir: Path) -> dict:
    """The evaluation before round 1, per participant, without its timing."""
    return {r["participant"]: {k: v for k, v in r.items() if k != "eval/seconds"} for r in initial_rows(cell_dir)}


def merged_meta(meta: dict, cells: list[Cell], variants: dict | None = None) -> dict:
    """``meta`` (a grid.json) describing ``cells`` (every finished cell of the folder): the methods,
    groupings and seeds they cover, in plan order, and their names; ``meta``'s variants and those of
    ``variants`` it lacks, after them (a definition ``meta`` has is its cells', never replaced or
    moved)."""
    labels = sorted({c.label for c in cells}, key=method_order)
    seeds = sorted({c.seed for c in cells})
    known = meta.get("modes") or []
    own = meta.get("variants") or {}
    return {**meta, "modes": [m for m in known if m in labels] + [m for m in labels if m not in known],
            "groups": [g for g in ("vertical", "horizontal") if any(c.groups == g for c in cells)],
            "seeds": len(seeds) if seeds == list(range(len(seeds))) else seeds,
            "variants": {**own, **{k: v for k, v in (variants or {}).items() if k not in own}},
            "cells": [c.name for c in cells]}


def relative_run_dir(cell_dir: Path, cwd: Path) -> str:
    """A cell's run folder as recorded in its config.json: relative to ``cwd`` when inside it (the
    committed grids record ``docs/results/<grid>/cells/<cell>/run``), else absolute."""
    run = (cell_dir / "run").resolve()
    try:
        return str(run.relative_to(cwd.resolve()))
    except ValueError:
        return str(run)


def pack(src: Path, dest: Path, echo: Callable[[str], None] = print, cwd: Path | None = None) -> list[str]:
    """Add ``src``'s finished cells that ``dest`` lacks to ``dest`` (both grid folders; a ``dest``
    that does not exist yet, or holds no grid, becomes a copy of ``src``'s grid); returns the
    names packed. Raises PackError (nothing copied) when the grids are not one experiment or a cell
    does not belong (the module's checks). ``dest``'s grid.json then describes every cell it holds;
    its summary is the caller's to rewrite (``--summary-only``)."""
    src, dest, cwd = src.resolve(), dest.resolve(), (cwd or Path.cwd())
    if src == dest:
        raise PackError(f"--pack {src}: the same folder as --out")
    smeta = _meta(src)
    have = {c.name: c for c in discover_cells(dest)}
    fresh = not (dest / "grid.json").exists() and not have
    dmeta = smeta if fresh else _meta(dest)          # a new grid folder: the source's grid, its cells checked
    for k in GRID_KEYS:
        if smeta.get(k) != dmeta.get(k):
            raise PackError(f"grid.json {k}: {smeta.get(k)!r} in {src} but {dmeta.get(k)!r} in {dest}: "
                            "not one experiment")
    if smeta.get("transport") != dmeta.get("transport"):
        echo(f"[pack] note: cells run through {smeta.get('transport')} in {src.name}, {dmeta.get('transport')} in "
             f"{dest.name} (the same engine; grid.json keeps {dmeta.get('transport')})")
    if not have and not fresh:
        raise PackError(f"{dest}: a grid.json but no finished cell to pack into")
    src_cells = discover_cells(src)
    new = [c for c in src_cells if c.name not in have]
    if not new and fresh:
        raise PackError(f"{src}: no finished cell to pack")
    # each cell's configuration against the destination's (a new folder: the source's first cell)
    refs = ({h.name: (h, dest / "cells" / h.name) for h in have.values()}
            or {new[0].name: (new[0], src / "cells" / new[0].name)})
    for c in src_cells:
        if c.name in have:
            echo(f"[pack] {c.name}: already in {dest.name}, kept as it is")
    svar, dvar = smeta.get("variants") or {}, dmeta.get("variants") or {}
    for c in new:
        if c.variant and c.variant in dvar and svar.get(c.variant) != dvar[c.variant]:
            raise PackError(f"variant {c.variant!r}: {svar.get(c.variant)} in {src} but {dvar[c.variant]} in {dest}")
        ref, ref_dir = next((r for r in refs.values() if r[0].label == c.label), next(iter(refs.values())))
        check_config(c, _config(src / "cells" / c.name), ref, _config(ref_dir),
                     "the destination" if have else "the source (the destination is new)", echo)
    with tempfile.TemporaryDirectory() as tmp:               # the union, as links: the summary's own checks
        union = Path(tmp)
        (union / "cells").mkdir()
        (union / "grid.json").write_text(json.dumps(dmeta))
        for name in have:
            os.symlink(dest / "cells" / name, union / "cells" / name)
        for c in new:
            os.symlink(src / "cells" / c.name, union / "cells" / c.name)
        union_cells = discover_cells(union)
        check_weights([c.name for c in union_cells], union)
        check_starts(union_cells, union)
    starts = [n for n in (shared_start(dest) if have else None, shared_start(src)) if n]
    if len(starts) == 2:
        a, b = _initial_values(dest / "cells" / starts[0]), _initial_values(src / "cells" / starts[1])
        if a != b:
            raise PackError(f"the evaluation before round 1 differs: {starts[0]} in {dest} and {starts[1]} in {src} "
                            "(other held-out prompts or other models)")
    (dest / "cells").mkdir(parents=True, exist_ok=True)
    for c in new:
        final = dest / "cells" / c.name
        part = final.with_name(f"{c.name}.packing")
        shutil.rmtree(part, ignore_errors=True)
        (part / "run").mkdir(parents=True)
        for name in KEPT:
            if (src / "cells" / c.name / "run" / name).exists():
                shutil.copy(src / "cells" / c.name / "run" / name, part / "run" / name)
        cfg = _config(src / "cells" / c.name)
        cfg["output_dir"] = relative_run_dir(final, cwd)
        (part / "run" / "config.json").write_text(json.dumps(cfg, indent=1))
        if final.exists():                          # unfinished (no done.json): kept aside, as the grid does
            aside = final.with_name(f"{c.name}.interrupted-{int(time.time())}")
            final.rename(aside)
            echo(f"[pack] {c.name}: an unfinished folder there moved to {aside.name}")
        part.rename(final)
        shutil.copy(src / "cells" / c.name / "done.json", final / "done.json")      # last: now it counts
        echo(f"[pack] {c.name}: packed into {dest}")
    used = {c.variant for c in new if c.variant}    # the source's definitions of what the packed cells ran
    meta = merged_meta(dmeta, discover_cells(dest), {k: v for k, v in svar.items() if k in used})
    (dest / "grid.json").write_text(json.dumps(meta, indent=1))
    return [c.name for c in new]
