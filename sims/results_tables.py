"""docs/RESULTS.md's tables, generated from the committed grids' ``summary.csv`` rows.

Each table in RESULTS.md sits between ``<!-- table: NAME -->`` and ``<!-- end table -->``;
``--write`` regenerates every marked table in place from ``docs/results/<grid>/summary.csv`` (which
``ftis-fed grid --summary-only`` rewrites byte for byte from the cells' files), ``--check`` fails
naming each table that differs (``tests/test_results_tables.py`` runs it):

    python -m sims.results_tables --check docs/RESULTS.md
    python -m sims.results_tables --write docs/RESULTS.md
    python -m sims.results_tables --print calibration
"""

from __future__ import annotations

import argparse
import csv
import math
import re
import sys
from pathlib import Path
from typing import Callable

from ftis_fed.grid.plan import method_order
from ftis_fed.grid.report import (EFFICIENCY_FIGURES, FILTER_FIGURES, FILTER_HEADERS, GUARD_FIGURES,
                                  GUARD_SCORE_FIGURES, GUARD_SCORE_HEADERS, efficiency_figures, filter_figures,
                                  guard_figures, guard_score_figures)

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
LEARNING = ("research-w", "research-w-spec", "research-w-het")
#: the base + specialist pair with the steps-checked reward (its own section: fewer seeds, a variant)
STEPS = "research-w-spec-steps"
#: the OOD-aware pair (claims 4-6: its OOD families start above 10 %)
OOD_PAIR = "research-w-ood"
#: the mixed pair: a specialist of another architecture and tokenizer (every peer batch re-tokenized)
MIXED_PAIR = "research-w-mixed"
#: the size pair: a third of the parameters beside micro-llama-w250, started at the same competence
SIZE_PAIR = "research-w-sizes"
#: the federation of four: research-w-het's pair, the size pair's small model and the mixed pair's specialist
FOUR = "research-w-four"
#: every learning-tier grid with a verdict column, in the order the document reads them
DECIDED = (*LEARNING, STEPS, OOD_PAIR, MIXED_PAIR, SIZE_PAIR, FOUR)
#: the learning-tier grids of the calibration and sample-efficiency tables (STEPS reads its own section)
TABLED = tuple(g for g in DECIDED if g != STEPS)
MICRO = ("research", "research-ood", "research-sizes", "research-mixed", "smollm2-check")
#: claim statements shortened in the verdict tables (the summaries' own text is longer)
SHORT = {"5": "the stronger partner loses OOD accuracy with F-TIS vs Alone",
         "6": "beyond the paper (F-TIS+guard, else the grid's F-TIS variant, named): no partner loses OOD vs "
              "Alone (≥ −1 point)"}


def rows(grid: str) -> list[dict]:
    with open(RESULTS / grid / "summary.csv", newline="") as fh:
        return list(csv.DictReader(fh))


def _known(v) -> bool:
    return v not in ("", "nan", None)


def _pt(x) -> str:
    return f"{100 * float(x):+.1f}"


def _iv(r: dict) -> str:
    return f"{_pt(r['diff'])} [{_pt(r['lo'])}, {_pt(r['hi'])}]"


def _tv(r: dict) -> str:
    return f"[{_pt(r['t_lo'])}, {_pt(r['t_hi'])}]" if _known(r.get("t_lo")) else "–"


def _table(head: list[str], body: list[str]) -> str:
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head), *body])


def calibration(grids=(*TABLED, *MICRO)) -> str:
    """Alone's gain per participant with the start's greedy / sampled pass@1 and pass@k."""
    body = []
    for g in grids:
        rs = rows(g)
        start = {r["participant"]: r for r in rs if r["kind"] == "start" and r["set"] == "id"}
        for r in rs:
            if r["kind"] != "gain" or r["method"] != "alone" or r["set"] != "id":
                continue
            s = start.get(r["participant"], {})
            greedy = f"{float(s['greedy']):.3f}" if _known(s.get("greedy")) else "–"
            sampled = (f"{float(s['sampled']):.3f} | {float(s['pass_at_k']):.3f} ({s['k']})"
                       if _known(s.get("sampled")) else "– | –")
            body.append(f"| `{g}` | {r.get('metric') or 'greedy'} | {r['participant']} | {r['prompts']} | {greedy} | "
                        f"{sampled} | {r['seeds']} | {float(r['start']):.3f} → {float(r['final']):.3f} | "
                        f"**{_iv(r)}** | {_tv(r)} | {r['gained']}/{r['seeds']} |")
    return _table(["grid", "metric", "participant", "ID prompts", "greedy pass@1", "sampled pass@1", "pass@k (k)",
                   "alone: seeds", "ID before → after", "alone's gain [95 % CI]", "t over seeds", "seeds gained"], body)


def gains(grid: str) -> str:
    """Final − before training per method and participant, ID and per ID family."""
    rs = rows(grid)
    by = {(r["method"], r["participant"], r["set"]): r for r in rs if r["kind"] == "gain"}
    fams = sorted({r["set"] for r in rs if r["kind"] == "gain" and r["set"].startswith("id:")})
    body = []
    for r in rs:
        if r["kind"] == "gain" and r["set"] == "id":
            f = " | ".join(_iv(by[k]) if (k := (r["method"], r["participant"], s)) in by else "–" for s in fams)
            body.append(f"| {r['method']} | {r['participant']} | {r['seeds']} | {float(r['start']):.3f} → "
                        f"{float(r['final']):.3f} | {_iv(r)} | {_tv(r)} | {r['gained']}/{r['seeds']} | {f} |")
    return _table(["method", "participant", "seeds", "ID before → after", "gain [95 % CI]", "t over seeds",
                   "seeds gained", *fams], body)


def verdicts(grids) -> str:
    """One row per claim, one column per grid: the verdict and its intervals."""
    v = {g: {r["claim"]: r for r in rows(g) if r["kind"] == "verdict"} for g in grids}
    body = []
    def cell(r: dict) -> str:
        method = r["comparison"].split(" − ")[0]
        named = f" ({method})" if r["claim"] == "6" and method != "F-TIS+guard" and "?" not in method else ""
        return f"**{r['verdict']}**{named}: {r['interval']}"

    order: list[str] = []                 # every grid's claims: a claim only some grids have (1s:<variant>)
    for g in grids:                       # after the claim that precedes it in that grid
        for prev, c in zip([None, *v[g]], v[g]):
            if c not in order:
                order.insert(order.index(prev) + 1 if prev in order else len(order), c)
    for c in order:
        first = next(v[g][c] for g in grids if c in v[g])
        cells = ["–" if c not in v[g] else cell(v[g][c]) for g in grids]
        body.append(f"| {c} {SHORT.get(c, first['statement'])} | " + " | ".join(cells) + " |")
    return _table(["claim", *(f"`{g}`" for g in grids)], body)


def paired(grid: str) -> str:
    """Paired per-prompt differences A − B on ID (pigeonhole interval, t over seeds, seeds won)."""
    body = [f"| {r['a']} − {r['b']} | {r['participant']} | {r['seeds']} | {_iv(r)} | {_tv(r)} | "
            f"{r['a_wins']}/{r['b_wins']} |"
            for r in rows(grid) if r["kind"] == "paired_prompts" and r["set"] == "id"]
    return _table(["A − B", "participant", "seeds", "ID [95 % CI]", "t over seeds", "seeds won A/B"], body)


def ood(grid: str) -> str:
    """OOD before → after per method and participant (all OOD prompts, then each family's mean), and
    the paired OOD differences A − B with each family's (the OOD-aware pair's claims 4–6)."""
    rs = rows(grid)
    fams = sorted({r["set"] for r in rs if r["kind"] == "start" and r["set"].startswith("ood:")
                   and any(float(x["sampled"] if _known(x.get("sampled")) else x["greedy"]) > 0
                           for x in rs if x["kind"] == "start" and x["set"] == r["set"])})
    start = {(r["participant"], r["set"]): float(r["sampled"] if _known(r.get("sampled")) else r["greedy"])
             for r in rs if r["kind"] == "start"}
    final = {(r["method"], r["participant"], r["set"]): float(r["mean"]) for r in rs if r["kind"] == "family"}
    body = []
    for r in rs:
        if r["kind"] == "gain" and r["set"] == "ood":
            f = " | ".join(f"{start[(r['participant'], s)]:.3f} → {final[(r['method'], r['participant'], s)]:.3f}"
                           for s in fams)
            body.append(f"| {r['method']} | {r['participant']} | {r['seeds']} | {float(r['start']):.3f} → "
                        f"{float(r['final']):.3f} | {_iv(r)} | {_tv(r)} | {f} |")
    gains_ = _table(["method", "participant", "seeds", "OOD before → after", "gain [95 % CI]", "t over seeds",
                     *fams], body)
    by = {(r["a"], r["b"], r["participant"], r["set"]): r for r in rs if r["kind"] == "paired_prompts"}
    body = [f"| {r['a']} − {r['b']} | {r['participant']} | {r['seeds']} | {_iv(r)} | {_tv(r)} | "
            f"{r['a_wins']}/{r['b_wins']} | "
            + " | ".join(_iv(by[k]) if (k := (r["a"], r["b"], r["participant"], f)) in by else "–"
                         for f in fams) + " |"
            for r in rs if r["kind"] == "paired_prompts" and r["set"] == "ood"]
    head = ["A − B", "participant", "seeds", "OOD [95 % CI]", "t over seeds", "seeds won A/B", *fams]
    return gains_ + "\n\n" + _table(head, body)


def efficiency(grids=TABLED) -> str:
    """Updates to reach alone's final level, over alone's updates (held-out ID and training reward)."""
    body = []
    for g in grids:
        for r in rows(g):
            if r["kind"] == "efficiency" and r["b"] == "alone":
                measure = "held-out ID" if r["set"] == "updates" else "training reward"
                f = {k: float(r[k]) if _known(r[k]) else math.nan for k in EFFICIENCY_FIGURES}
                body.append(f"| `{g}` | {r['a']} | {r['participant']} | {measure} | {r['seeds']} | {r['reached']} | "
                            f"{efficiency_figures(f)} | {r['ratios']} |")
    return _table(["grid", "method", "participant", "measure", "seeds", "reached", "mean ratio [95 % t]", "per seed"],
                  body)


def _peer_table(grids, kind: str, figures: tuple[str, ...], cells: Callable[[dict], str],
                headers: list[str]) -> str:
    """One row per summary.csv row of ``kind`` (the grids' per receiver x peer tables): grid, method,
    receiver, peer, seeds, then the row's ``figures`` read back as floats and formatted by ``cells``."""
    body = [f"| `{g}` | {r['method']} | {r['participant']} | {r['peer']} | {r['seeds']} | "
            f"{cells({k: float(r[k]) for k in figures})} |"
            for g in grids for r in rows(g) if r["kind"] == kind]
    return _table(["grid", "method", "receiver", "peer", "seeds", *headers], body)


def filters(grids=(*DECIDED, *MICRO)) -> str:
    """Per-sample summed KL of peer samples at each receiver: quantiles, share ≥ g, share dropped."""
    return _peer_table(grids, "filter", FILTER_FIGURES, filter_figures, list(FILTER_HEADERS))


def guards(grids=(*DECIDED, *MICRO)) -> str:
    """What ``source-adapt = guard`` did to each peer's samples (the grids' "guard" rows): the share of
    rounds whose update kept the peers and the peer's alignment weight, each with its per-seed range."""
    return _peer_table(grids, "guard", GUARD_FIGURES, guard_figures,
                       ["kept peers [per seed]", "weight [per seed]", "weight 0", "cos peer", "cos own"])


def guard_scores(grids=(*DECIDED, *MICRO)) -> str:
    """What decided between the guard's two candidate updates (the grids' "guard_score" rows): the
    per-round score difference's mean [per seed] and spread, per validation group, and the share of
    rounds each group dropped the peers."""
    body = [f"| `{g}` | {r['method']} | {r['participant']} | {r['group']} | {r['seeds']} | "
            f"{guard_score_figures({k: float(r[k]) for k in GUARD_SCORE_FIGURES})} |"
            for g in grids for r in rows(g) if r["kind"] == "guard_score"]
    return _table(["grid", "method", "receiver", "group", "seeds", *GUARD_SCORE_HEADERS], body)


def seeds(grids=(*DECIDED, "smollm2-check")) -> str:
    """The finished seeds of each method per grid (what "more seeds" in the readings is measured against)."""
    body = []
    for g in grids:
        n: dict[str, int] = {}
        for r in rows(g):
            if r["kind"] == "mean_sd":
                n[r["method"]] = max(n.get(r["method"], 0), int(r["seeds"]))
        body.append(f"| `{g}` | " + ", ".join(f"{m} {n[m]}" for m in sorted(n, key=method_order)) + " |")
    return _table(["grid", "method: seeds finished"], body)


TABLES: dict[str, Callable[[], str]] = {
    "calibration": calibration,
    "verdicts-learning": lambda: verdicts(DECIDED),
    **{f"gains-{g}": (lambda g=g: gains(g)) for g in DECIDED},
    **{f"paired-{g}": (lambda g=g: paired(g)) for g in DECIDED},
    f"ood-{OOD_PAIR}": lambda: ood(OOD_PAIR),
    "efficiency": efficiency,
    "filter": filters,
    "guard": guards,
    "guard-scores": guard_scores,
    "seeds": seeds,
    "verdicts-micro": lambda: verdicts(MICRO),
}
#: a marked table: its start marker line, its body (possibly empty; never across another marker), its end
BLOCK = re.compile(r"(<!-- table: ([\w-]+) -->\n)((?:(?!<!-- (?:end )?table).)*?)(\n?<!-- end table -->)", re.S)


def regenerate(text: str) -> tuple[str, list[str]]:
    """``text`` with every marked table regenerated, and the names of those that changed. A marker
    naming no table is a ValueError."""
    changed = []

    def fill(m: re.Match) -> str:
        name = m.group(2)
        if name not in TABLES:
            raise ValueError(f"<!-- table: {name} -->: no such table (known: {', '.join(TABLES)})")
        new = TABLES[name]()
        if new != m.group(3):
            changed.append(name)
        return m.group(1) + new + "\n" + m.group(4).lstrip("\n")

    return BLOCK.sub(fill, text), changed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", metavar="MD", help="fail when a marked table of MD differs from its summaries")
    mode.add_argument("--write", metavar="MD", help="regenerate every marked table of MD in place")
    mode.add_argument("--print", metavar="NAME", choices=sorted(TABLES), help="print one table")
    a = ap.parse_args(argv)
    if a.print:
        print(TABLES[a.print]())
        return 0
    path = Path(a.check or a.write)
    text = path.read_text()
    new, changed = regenerate(text)
    if a.write:
        path.write_text(new)
        print(f"{path}: {len(BLOCK.findall(text))} tables, regenerated: {', '.join(changed) or 'none changed'}")
        return 0
    if changed:
        print(f"{path}: tables that differ from the committed summaries: {', '.join(changed)} "
              f"(python -m sims.results_tables --write {path})", file=sys.stderr)
        return 1
    print(f"{path}: {len(BLOCK.findall(text))} tables equal to the committed summaries")
    return 0


if __name__ == "__main__":
    sys.exit(main())
