"""Reading a finished cell: its metrics rows, final and initial evaluations, defects, and the
per-prompt evaluation records (what the paired statistics are computed from)."""

from __future__ import annotations

import gzip
import hashlib
import json
from collections import defaultdict
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from ftis_fed.grid.metric import GREEDY, Metric


def read_rows(path: Path) -> list[dict]:
    """The JSON lines of ``path``, or of ``path.gz`` (a compacted cell) when ``path`` is not there."""
    gz = path.with_name(path.name + ".gz")
    if path.exists():
        text = path.read_text()
    elif gz.exists():
        text = gzip.decompress(gz.read_bytes()).decode()
    else:
        return []
    return [json.loads(line) for line in text.splitlines() if line.strip()]


#: parsed metrics files by (file name, SHA-256 of its bytes): ``cell_rows``' cache (at most ``_ROWS_KEPT``)
_ROWS: dict[tuple[str, str], tuple[dict, ...]] = {}
_ROWS_KEPT = 512


def cell_rows(cell_dir: Path) -> list[dict]:
    """A cell's metrics rows (``read_rows`` of ``cell_dir/run/metrics.jsonl``), parsed once per content
    of the file however many tables read them (a summary reads each cell's rows ~8 times; hashing the
    bytes costs a small part of parsing them). The row dicts are shared between callers: read them,
    never change them."""
    path = Path(cell_dir) / "run" / "metrics.jsonl"
    f = path if path.exists() else path.with_name(path.name + ".gz")
    if not f.exists():
        return []
    data = f.read_bytes()
    key = (f.name, hashlib.sha256(data).hexdigest())
    if key not in _ROWS:
        if len(_ROWS) >= _ROWS_KEPT:
            _ROWS.pop(next(iter(_ROWS)))                      # the oldest entry
        text = gzip.decompress(data).decode() if f.name.endswith(".gz") else data.decode()
        _ROWS[key] = tuple(json.loads(line) for line in text.splitlines() if line.strip())
    return list(_ROWS[key])


def forget_cell_rows() -> None:
    """Empty ``cell_rows``' cache (a summary does when it is written: a grid's rows need not stay)."""
    _ROWS.clear()


def participant_rows(rows: Iterable[dict], phase: str) -> list[dict]:
    """The rows of ``phase`` (``eval`` / ``train``) written by participants (not ``_federation``)."""
    return [r for r in rows if r.get("phase") == phase and not str(r.get("participant", "")).startswith("_")]


def final_eval(rows: Iterable[dict]) -> dict[str, dict]:
    """participant -> its evaluation row of the last evaluated round after training (round >= 1; the
    evaluation before round 1 is never a cell's result)."""
    last: dict[str, dict] = {}
    for r in participant_rows(rows, "eval"):
        p = r["participant"]
        if int(r.get("round", 0)) >= 1 and (p not in last or int(r["round"]) >= int(last[p]["round"])):
            last[p] = r
    return last


def cell_defects(rows: Sequence[dict]) -> list[str]:
    """Why a run that exited 0 is still not a result of its method (empty: none): a round in which a
    participant was dropped, failed, or had frames rejected (``_federation`` rows), or a participant
    that was evaluated but did not train, on samples, in every round. A run whose participants were
    all dropped still evaluates its untrained models — it must not count as a finished cell."""
    fed = [r for r in rows if r.get("phase") == "train" and r.get("participant") == "_federation"]
    out = []
    for r in fed:
        bad = {k: v for k, v in r.items()
               if (k.startswith("fed/dropped/") or k in ("fed/generate_failures", "fed/train_failures", "fed/rejected"))
               and num(v) > 0}
        if "fed/complete" in r and num(r["fed/complete"]) == 0:
            bad["fed/complete"] = r["fed/complete"]
        if bad:
            out.append(f"round {r.get('round')}: " + ", ".join(f"{k}={v}" for k, v in sorted(bad.items())))
    rounds = sorted({int(r["round"]) for r in fed})
    trained = {(r["participant"], int(r["round"])) for r in participant_rows(rows, "train")
               if num(r.get("train/samples")) > 0}
    for p in sorted({r["participant"] for r in participant_rows(rows, "eval")}):
        missing = [k for k in rounds if (p, k) not in trained]
        if missing or not rounds:
            out.append(f"{p} did not train in round(s) {missing or 'any'}")
    return out


def shared_start(out: Path, names: Iterable[str] | None = None) -> str | None:
    """The cell whose evaluation before round 1 is the grid's shared one: the first finished cell by
    name (of ``names``; default every cell in ``out``) that has one, any grouping or method, since the
    models before training are the same (``check_weights``); None if none. The one rule behind
    ``initial_eval``, the gain table's fallback start and the start table."""
    if names is None:
        names = [d.parent.name for d in (out / "cells").glob("*/done.json")]
    for name in sorted(names):
        if (out / "cells" / name / "done.json").exists() and initial_rows(out / "cells" / name):
            return name
    return None


def initial_rows(cell_dir: Path) -> list[dict]:
    return [r for r in participant_rows(cell_rows(cell_dir), "eval") if int(r.get("round", -1)) == 0]


def initial_eval(out: Path) -> dict[str, dict]:
    """participant -> its evaluation row before round 1, from the grid's shared start (``shared_start``);
    {} if no cell has one."""
    name = shared_start(out)
    return {r["participant"]: r for r in initial_rows(out / "cells" / name)} if name else {}


class MixedWeights(ValueError):
    """Cells of one grid whose participants started from different model weights."""


def check_weights(cell_names: Iterable[str], out: Path) -> None:
    """Every finished cell's participant started from the same weights (the ``model_weights``
    fingerprint its train rows carry; cells run before it was recorded carry none and are not
    compared): else ``MixedWeights`` naming the participant, each fingerprint and its cells. A gain
    read against another build's evaluation before training is not a result (docs/models.md)."""
    seen: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for name in cell_names:
        fps = {(r["participant"], r.get("model_weights") or "")
               for r in participant_rows(cell_rows(out / "cells" / name), "train")}
        for p, fp in sorted(fps):
            if fp:
                seen[p][fp].append(name)
    bad = {p: by for p, by in seen.items() if len(by) > 1}
    if bad:
        raise MixedWeights("cells started from different model weights (rebuild the model and re-run the odd cells): "
                           + "; ".join(f"{p}: " + ", ".join(f"{fp} in {', '.join(cs[:4])}{' ...' if len(cs) > 4 else ''}"
                                                            for fp, cs in sorted(by.items()))
                                       for p, by in sorted(bad.items())))


class MixedStarts(MixedWeights):
    """Cells of one seed whose participants' first training samples differ where they cannot."""


def _training_only_keys() -> frozenset[str]:
    """Run-config keys that change only what a participant does with its samples (the objective's and
    per-source adaptation's knobs), never the samples of its first round."""
    from ftis_fed.knobs import knobs
    from ftis_fed.learn.objective_config import ObjectiveConfig
    from ftis_fed.learn.source_weights import SourceAdaptConfig

    return frozenset(k.key for cls in (ObjectiveConfig, SourceAdaptConfig) for k in knobs(cls))


def check_starts(cells: Iterable, out: Path) -> None:
    """Cells (``grid.plan.Cell``) of one seed with vertical groups, run without a variant or with one
    that sets only training knobs (``_training_only_keys``: ``filter-sign``, ``source-adapt``, ...),
    generate a participant's first round from the same weights, prompts and sampling seed whatever
    their method, so its round-1 samples are the same (``reward/mean`` and ``gen/tokens`` of its
    round-1 train row, where it carries both, equal): else ``MixedStarts`` naming the participant and
    each cell. It catches cells run from other weights that carry no fingerprint (``check_weights``:
    cells made before it was recorded). Horizontal cells are not compared: there a shared method
    splits a group's completions among the senders."""
    training_only = _training_only_keys()
    grid = out / "grid.json"
    declared = (json.loads(grid.read_text()).get("variants") or {}) if grid.exists() else {}
    seen: dict[tuple, dict[tuple, list[str]]] = defaultdict(lambda: defaultdict(list))
    for c in cells:
        # a variant's keys: the cell's own (planned), else grid.json's declaration (``discover_cells``
        # names the variant only); an undeclared variant is not compared
        keys = ({k for k, _ in c.extra} or set(declared.get(c.variant, {"?": None}))) if c.variant else set()
        if c.groups != "vertical" or not keys <= training_only:
            continue
        for r in participant_rows(cell_rows(out / "cells" / c.name), "train"):
            if int(r.get("round", 0)) == 1 and r.get("reward/mean") is not None and r.get("gen/tokens") is not None:
                seen[(c.seed, r["participant"])][(r["reward/mean"], r["gen/tokens"])].append(c.name)
    bad = {k: by for k, by in seen.items() if len(by) > 1}
    if bad:
        raise MixedStarts("cells of one seed started from different first samples, so from different weights (re-run "
                          "the odd cells): " + "; ".join(
                              f"seed {seed}, {p}: " + ", ".join(
                                  f"reward {_g(rw)}, {_g(tok)} tokens in "
                                  f"{', '.join(cs[:4])}{' ...' if len(cs) > 4 else ''}"
                                  for (rw, tok), cs in sorted(by.items(), key=lambda kv: -len(kv[1])))
                              for (seed, p), by in sorted(bad.items())))


def _g(v: float) -> str:
    return f"{v:g}"


def num(v) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return float("nan")



def prompt_records(cell_dir: Path, name: str = "eval_prompts.jsonl.gz") -> list[dict]:
    """The per-prompt evaluation records of a cell (``participant.EVAL_PROMPTS``, compacted into
    ``run/eval_prompts.jsonl.gz``, or still in the participants' folders); ``name`` =
    ``participant.UNCHOSEN_EVAL_PROMPTS``: those of the final evaluation of the model a shadow's last
    check did not choose (none: [])."""
    run = cell_dir / "run"
    paths = [run / name] if (run / name).exists() else \
        sorted(run.glob(f"participants/*/{name}"), key=lambda p: p.parent.name)
    out = []
    for path in paths:
        out += [json.loads(x) for x in gzip.decompress(path.read_bytes()).decode().splitlines() if x.strip()]
    return out


def evaluation_records(records: Sequence[dict], rnd: int | None = None) -> list[dict]:
    """The records of one evaluation per participant: round ``rnd``, or each participant's last
    evaluation after training (``None``: its last round >= 1), in file order."""
    last: dict[str, int] = {}
    for r in records:
        k = int(r["round"])
        if (rnd is None and k >= 1) or k == rnd:
            last[r["participant"]] = max(last.get(r["participant"], -1), k)
    return [r for r in records if r["participant"] in last and int(r["round"]) == last[r["participant"]]]


def prompt_vectors(records: Sequence[dict], rnd: int | None = None,
                   metric: Metric = GREEDY) -> dict[str, dict[str, tuple[tuple, np.ndarray]]]:
    """participant -> set key -> (task ids, per-prompt values (N,) float) of one evaluation: round
    ``rnd``, or each participant's last evaluation after training (``None``). The values are
    ``metric``'s (``Metric.prompt_values``: greedy 0/1 solved flags, or sampled solved/k). Set keys:
    ``id`` and ``ood`` (every OOD family, in name order: its mean is ``eval/ood/<metric>`` when the
    families' sets are equally large), ``id:<family>`` per ID family (from the task ids) and
    ``ood:<family>``. Raises ``MissingMetric`` for a record without the metric."""
    by: dict[str, dict[str, tuple[list, list]]] = defaultdict(dict)
    for r in evaluation_records(records, rnd):
        p = r["participant"]
        ids, ok = list(r["ids"]), metric.prompt_values(r)
        name = r["set"]
        sets = by[p]
        if name == "id":
            sets["id"] = (ids, ok)
            for fam in dict.fromkeys(t.split("/")[0] for t in ids):
                sel = [i for i, t in enumerate(ids) if t.split("/")[0] == fam]
                sets[f"id:{fam}"] = ([ids[i] for i in sel], [ok[i] for i in sel])
        else:
            sets[f"ood:{name}"] = (ids, ok)
    out: dict[str, dict[str, tuple[tuple, np.ndarray]]] = {}
    for p, sets in by.items():
        oods = sorted(k for k in sets if k.startswith("ood:"))
        if oods:
            sets["ood"] = ([t for k in oods for t in sets[k][0]], [o for k in oods for o in sets[k][1]])
        out[p] = {k: (tuple(ids), np.asarray(ok, dtype=np.float64)) for k, (ids, ok) in sorted(sets.items())}
    return out

