"""The claims a grid decides, as data: one ``Claim`` per row of ``CLAIMS`` (the paper's claims 1–5,
the beyond-the-paper goals 1s, 6, 7, 7r), and ``verdicts`` that decides each from the paired per-prompt
intervals.

To add a claim, add a row. A claim compares method ``a`` with method ``b`` (``a − b``) on one held-out
set (``id`` / ``ood``; or ``updates`` / ``updates:reward``: ``a``'s update ratio to reach ``b``'s final
ID accuracy or training reward, ``grid.efficiency``, a ratio rather than points) for some participants (``who``: every participant, or the stronger partner
before training) with one rule over each participant's 95 % interval and one way of combining the
participants' verdicts (``all`` of them must hold, or ``any`` one).

**The verdict rule** is stated once, in ``grid.stats.Rule`` (the four of ``RULES``: ``at_least``,
``greater``, ``less``, ``at_most``): held when the interval's bound lies on the claim's side of the
margin, not held when its other bound lies on the other side, else inconclusive. The interval it reads
is ``grid.stats.verdict_bounds``: the union of the pigeonhole-bootstrap and the paired-t-over-seeds
95 % intervals (t tails for the seed component). The summary's rule
column is ``rule_words`` of the same data. A participant for which both methods score 0 on the set (a
floor at which the claim cannot show) is inconclusive too; so is one, in a claim whose two methods
differ by one mechanism (``alike_is_untested``: claims 2a, 2b and 3), for which they score alike on
every prompt of every seed (per-prompt differences all 0, ``discord`` 0: they ran the same updates, as
F-TIS and TIS do where the filter drops nothing, so the mechanism never acted and the claim was not
tested; an outcome claim such as 1s keeps its verdict: a shadow that ends as alone did holds it), and
one compared on a single seed (its interval covers the prompts' draw only; an update ratio has no
interval there). The rule reads only the interval, so it is the same for whichever metric the grid
summarises (``grid.metric``: greedy or sampled pass@1).

``{stronger}`` and ``{beyond}`` in a row's text are filled in per grid: the participant with the
highest ID accuracy before training, and the beyond-the-paper method run (``BEYOND``, else the first
``F-TIS+…`` variant of the grid). A grid that ran the shadow with other knobs too (a variant such as
``F-TIS+shadowid``) decides claim 1s for each such method in a row of its own (``with_shadow_variants``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

from ftis_fed.grid.efficiency import UPDATE_SETS
from ftis_fed.grid.stats import INCONCLUSIVE, MISSING, RULES, all_of, any_of, verdict_bounds

REFERENCE = "F-TIS"
BASELINE = "alone"
#: The method of the beyond-the-paper claim (6), as ``--modes`` names it; the first variant of F-TIS
#: present in a grid when this one is not.
BEYOND = "F-TIS+guard"
#: The receiver guard on the trajectory (``source-adapt = shadow``), as the built-in variant names it: its
#: claim (1s) is claim 1 for it, a row only in grids that ran it.
SHADOW = "F-TIS+shadow"


@dataclass(frozen=True)
class Claim:
    """One row of the verdict table (see the module docstring)."""

    id: str
    statement: str
    a: str
    b: str
    set: str
    rule: str                 # a key of grid.stats.RULES
    combine: str              # "all" or "any"
    margin: float = 0.0
    who: str = "all"          # "all" participants, or the "stronger" partner before training
    only_if_run: bool = False  # a row only when the grid ran a and b (the horizontal claim)
    # a and b differ by one mechanism (the filter, the truncation, the ratio): alike on every prompt of
    # every seed, they ran the same updates, the mechanism never acted and the claim was not tested
    alike_is_untested: bool = False


COMBINE = {"all": all_of, "any": any_of}

CLAIMS: tuple[Claim, ...] = (
    Claim("1", "F-TIS final ID ≥ Alone − 1 point, for every participant", REFERENCE, BASELINE, "id",
          "at_least", "all", margin=-0.01),
    Claim("1s", "beyond the paper: F-TIS+shadow (reset to its alone-trained shadow when it validates "
          "confidently below it) final ID ≥ Alone − 1 point, for every participant", SHADOW, BASELINE, "id",
          "at_least", "all", margin=-0.01, only_if_run=True),
    Claim("2a", "noIS degrades or collapses relative to F-TIS (ID, some participant)", REFERENCE, "noIS", "id",
          "greater", "any", alike_is_untested=True),
    Claim("2b", "VIS degrades or collapses relative to F-TIS (ID, some participant)", REFERENCE, "VIS", "id",
          "greater", "any", alike_is_untested=True),
    Claim("3", "the filter contributes: F-TIS > TIS (ID, some participant)", REFERENCE, "TIS", "id", "greater",
          "any", alike_is_untested=True),
    Claim("4", "F-TIS gains OOD accuracy over Alone (some participant)", REFERENCE, BASELINE, "ood", "greater",
          "any"),
    Claim("5", "the stronger partner ({stronger}) loses OOD accuracy with F-TIS vs Alone", REFERENCE, BASELINE,
          "ood", "less", "all", who="stronger"),
    Claim("6", "beyond the paper ({beyond}): no partner loses OOD vs Alone (≥ −1 point)", "{beyond}", BASELINE,
          "ood", "at_least", "all", margin=-0.01),
    Claim("h", "horizontal groups: F-TIS/h ID ≥ Alone/h − 1 point (Alone/h: the full group of the shared "
          "prompts), every participant", REFERENCE + "/h", BASELINE + "/h", "id", "at_least", "all",
          margin=-0.01, only_if_run=True),
    Claim("7", "beyond the paper: with its peers' samples a participant reaches Alone's final ID accuracy in "
          "≤ 60 % of Alone's updates (some participant)", REFERENCE, BASELINE, "updates", "at_most", "any",
          margin=0.6),
    Claim("7r", "the same on the training reward (its own training prompts' on-policy sampled pass@1, "
          "10-round mean; every round, not only the evaluated ones)", REFERENCE, BASELINE, "updates:reward",
          "at_most", "any", margin=0.6),
)


def with_shadow_variants(shadow_methods: Sequence[str], claims: Sequence[Claim] = CLAIMS) -> tuple[Claim, ...]:
    """``claims`` with claim 1s repeated, right after it, for every other method of ``shadow_methods``
    (those whose cells ran ``source-adapt = shadow`` with other knobs, e.g. ``F-TIS+shadowid``): its
    id ``1s`` plus the variant's name after the ``+`` (``1s:shadowid``), the same rule on that method.
    Without such methods, ``claims`` as they are."""
    extra = [m for m in shadow_methods if m != SHADOW]
    out: list[Claim] = []
    for c in claims:
        out.append(c)
        if c.a == SHADOW:
            out += [replace(c, id=f"{c.id}:{m.split('+', 1)[-1]}", a=m,
                            statement=c.statement.replace(f"{SHADOW} (", f"{m} (with its variant's knobs; ", 1))
                    for m in extra]
    return tuple(out)


def rule_words(c: Claim, claims: Sequence[Claim] = CLAIMS) -> str:
    """The rule column of claim ``c``: its ``Rule``'s words with the combination's quantifiers (``all``:
    held if every part holds, not held if some part fails; ``any``: the other way round; none for the
    one stronger partner) and the margin in points (a ratio for ``updates``, whose interval is the t
    interval of the update ratio); ``as claim N`` for the horizontal twin (``/h``) of an earlier claim
    with the same rule."""
    for e in claims:
        if e is c:
            break
        if (c.a, c.b) == (e.a + "/h", e.b + "/h") and (c.set, c.rule, c.combine, c.margin, c.who) == \
                (e.set, e.rule, e.combine, e.margin, e.who):
            return f"as claim {e.id}"
    quantifiers = ("", "") if c.who != "all" else ("every", "some") if c.combine == "all" else ("some", "every")
    if c.set in UPDATE_SETS:
        return RULES[c.rule].words(f"{c.margin:g}", quantifiers, ("t ", " of the update ratio"))
    return RULES[c.rule].words(f"{100 * c.margin:g}".replace("-", "−"), quantifiers)


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
            floor = c.set not in UPDATE_SETS and r["a_acc"] == 0 and r["b_acc"] == 0   # both 0: untestable
            same = c.alike_is_untested and not floor and r.get("discord") == 0         # alike on every prompt
            one = c.set not in UPDATE_SETS and r["seeds"] < 2          # no seed component in the interval
            lo, hi = verdict_bounds(r)
            vs.append(INCONCLUSIVE if floor or same or one else rule.decide(lo, hi, c.margin))
            if c.set in UPDATE_SETS:
                value = f"{r['diff']:.2f} [{lo:.2f}, {hi:.2f}], reached in {r['reached']}"
            else:
                value = "0 % for both (floor)" if floor else "alike on every prompt of every seed (untested)" \
                    if same else f"{100 * r['diff']:+.1f} [{100 * lo:+.1f}, {100 * hi:+.1f}]"
            texts.append(f"{p}: {value} ({r['seeds']} seed{'s' if r['seeds'] != 1 else ''}"
                         f"{': no seed component, inconclusive' if one else ''})")
        rows.append({"claim": c.id, "statement": c.statement.format(**fill),
                     "comparison": f"{a} − {c.b}, {c.set.upper()}", "verdict": COMBINE[c.combine](vs),
                     "interval": "; ".join(texts), "rule": rule_words(c, claims)})
    return rows
