"""The claims a grid decides, as data: one ``Claim`` per row of ``CLAIMS`` (the paper's claims 1–5,
the beyond-the-paper goals), and ``verdicts`` that decides each from the paired per-prompt intervals.

To add a claim, add a row. A claim compares method ``a`` with method ``b`` (``a − b``) on one held-out
set (``id`` / ``ood``; or ``updates``: ``a``'s update ratio to reach ``b``'s final ID accuracy,
``grid.efficiency``, a ratio rather than points) for some participants (``who``: every participant, or the stronger partner
before training) with one rule over each participant's 95 % interval (``RULES``) and one way of
combining the participants' verdicts (``all`` of them must hold, or ``any`` one):

- ``at_least``: held if the lower bound is ≥ ``margin``; not held if the upper bound is < ``margin``;
- ``greater``: held if the lower bound is > ``margin``; not held if the upper bound is ≤ ``margin``;
- ``less``: held if the upper bound is < ``margin``; not held if the lower bound is ≥ ``margin``;
- ``at_most``: held if the upper bound is ≤ ``margin``; not held if the lower bound is > ``margin``;
- else inconclusive; a participant for which neither method solved a single prompt of the set (0 for
  both: a floor at which the claim cannot show) is inconclusive too.

``{stronger}`` and ``{beyond}`` in a row's text are filled in per grid: the participant with the
highest ID accuracy before training, and the beyond-the-paper method run (``BEYOND``, else the first
``F-TIS+…`` variant of the grid).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ftis_fed.grid.stats import INCONCLUSIVE, MISSING, all_of, any_of, at_least, greater_than, less_than

REFERENCE = "F-TIS"
BASELINE = "alone"
#: The method of the beyond-the-paper claim (6), as ``--modes`` names it; the first variant of F-TIS
#: present in a grid when this one is not.
BEYOND = "F-TIS+guard"


@dataclass(frozen=True)
class Claim:
    """One row of the verdict table (see the module docstring)."""

    id: str
    statement: str
    a: str
    b: str
    set: str
    rule: str                 # a key of RULES
    combine: str              # "all" or "any"
    how: str                  # the rule in words, as the table prints it
    margin: float = 0.0
    who: str = "all"          # "all" participants, or the "stronger" partner before training
    only_if_run: bool = False  # a row only when the grid ran a and b (the horizontal claim)


def at_most(lo: float, hi: float, bound: float) -> str:
    """Claim "value <= bound": ``at_least`` of the negated interval."""
    return at_least(-hi, -lo, -bound)


RULES = {"at_least": at_least, "greater": greater_than, "less": less_than, "at_most": at_most}
COMBINE = {"all": all_of, "any": any_of}

CLAIMS: tuple[Claim, ...] = (
    Claim("1", "F-TIS final ID ≥ Alone − 1 point, for every participant", REFERENCE, BASELINE, "id",
          "at_least", "all", "held: every lower bound ≥ −1; not held: some upper bound < −1", margin=-0.01),
    Claim("2a", "noIS degrades or collapses relative to F-TIS (ID, some participant)", REFERENCE, "noIS", "id",
          "greater", "any", "held: some lower bound > 0; not held: every upper bound ≤ 0"),
    Claim("2b", "VIS degrades or collapses relative to F-TIS (ID, some participant)", REFERENCE, "VIS", "id",
          "greater", "any", "held: some lower bound > 0; not held: every upper bound ≤ 0"),
    Claim("3", "the filter contributes: F-TIS > TIS (ID, some participant)", REFERENCE, "TIS", "id", "greater",
          "any", "held: some lower bound > 0; not held: every upper bound ≤ 0"),
    Claim("4", "F-TIS gains OOD accuracy over Alone (some participant)", REFERENCE, BASELINE, "ood", "greater",
          "any", "held: some lower bound > 0; not held: every upper bound ≤ 0"),
    Claim("5", "the stronger partner ({stronger}) loses OOD accuracy with F-TIS vs Alone", REFERENCE, BASELINE,
          "ood", "less", "all", "held: upper bound < 0; not held: lower bound ≥ 0", who="stronger"),
    Claim("6", "beyond the paper ({beyond}): no partner loses OOD vs Alone (≥ −1 point)", "{beyond}", BASELINE,
          "ood", "at_least", "all", "held: every lower bound ≥ −1; not held: some upper bound < −1", margin=-0.01),
    Claim("h", "horizontal groups: F-TIS/h ID ≥ Alone/h − 1 point (Alone/h: the full group of the shared "
          "prompts), every participant", REFERENCE + "/h", BASELINE + "/h", "id", "at_least", "all", "as claim 1",
          margin=-0.01, only_if_run=True),
    Claim("7", "beyond the paper: with its peers' samples a participant reaches Alone's final ID accuracy in "
          "≤ 60 % of Alone's updates (some participant)", REFERENCE, BASELINE, "updates", "at_most", "any",
          "held: some t upper bound of the update ratio ≤ 0.6; not held: every lower bound > 0.6", margin=0.6),
)


def verdicts(paired: Sequence[dict], participants: Sequence[str], stronger: str | None,
             beyond: str | None, claims: Sequence[Claim] = CLAIMS) -> list[dict]:
    """The verdict table: one row per claim (``claims``), each held / not held / inconclusive from the
    95 % intervals (``lo``, ``hi``) of ``paired`` (rows of ``grid.tables.paired_prompt_table`` and of
    ``grid.efficiency.efficiency_table``)."""
    by = {(r["a"], r["b"], r["participant"], r["set"]): r for r in paired}
    fill = {"stronger": stronger or "none: the participants tie before training", "beyond": beyond or "none run"}
    rows = []
    for c in claims:
        a = (beyond or "?") if c.a == "{beyond}" else c.a
        if c.only_if_run and not any(r["a"] == a and r["b"] == c.b for r in paired):
            continue
        ps = participants if c.who == "all" else [stronger] if stronger else ["?"]
        rule = RULES[c.rule]
        vs, texts = [], []
        for p in ps:
            r = by.get((a, c.b, p, c.set))
            if r is None:
                vs.append(MISSING)
                texts.append(f"{p}: –")
                continue
            floor = c.set != "updates" and r["a_acc"] == 0 and r["b_acc"] == 0   # nothing solved: untestable
            vs.append(INCONCLUSIVE if floor else rule(r["lo"], r["hi"], c.margin))
            if c.set == "updates":
                value = f"{r['diff']:.2f} [{r['lo']:.2f}, {r['hi']:.2f}], reached in {r['reached']}"
            else:
                value = "0 % for both (floor)" if floor else \
                    f"{100 * r['diff']:+.1f} [{100 * r['lo']:+.1f}, {100 * r['hi']:+.1f}]"
            texts.append(f"{p}: {value} ({r['seeds']} seed{'s' if r['seeds'] != 1 else ''})")
        rows.append({"claim": c.id, "statement": c.statement.format(**fill),
                     "comparison": f"{a} − {c.b}, {c.set.upper()}", "verdict": COMBINE[c.combine](vs),
                     "interval": "; ".join(texts), "rule": c.how})
    return rows
