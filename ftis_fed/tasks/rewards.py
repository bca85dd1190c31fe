"""Verifiable rewards: answer extraction, numeric equivalence, and the ``Verifier`` every node uses.

Senders compute rewards with a :class:`Verifier`; receivers re-compute them with their own
(``ftis_fed.trust.reverify``). Both go through the same pure functions here, so an honest sender and a
receiver with the same rules always agree.

Pieces, bottom up:

- extraction: ``extract_boxed`` (last ``\\boxed{...}``, nested braces), ``extract_gsm8k`` (after the
  last ``####``), ``extract_last_number``; ``extract_answer`` tries several in order.
- equivalence: ``parse_number`` (``1,234``, ``-3``, ``0.50``, ``3/4``, ``\\frac{3}{4}``, ``$18``,
  ``42.``, ``18 dollars`` ...) to an exact ``Fraction``; ``answers_match`` compares numerically when
  both sides parse, otherwise as normalised LaTeX strings (element-wise for tuples). MATH-500's
  rule adds math-verify (``ftis_fed.tasks.symbolic``, bounded per answer) for non-integer references
  the exact path calls different.
- rules: a :class:`RewardRule` per task family (which extractors, which format check, whether the
  format is required); :class:`Verifier` maps a task id's family prefix (``add30/train/0/17`` ->
  ``add30``) to its rule.
- bounded work: whatever a peer sends, extraction is linear-time (``extract_boxed`` is one pass)
  and comparison recursion-free with hard limits (``MAX_ANSWER_CHARS``, ``MAX_NUMBER_CHARS``,
  ``MAX_NESTING``).
- TRL: ``accuracy_reward`` / ``format_reward`` have TRL's reward-function signature
  ``fn(prompts, completions, **kwargs) -> list[float]``; a rule may wrap any such function
  (``RewardRule(fn=...)``), and ``Verifier.as_trl_reward()`` turns a verifier into one.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from fractions import Fraction

from ftis_fed.tasks.answers import (  # noqa: F401  (re-exported: the extractors are part of the rewards API)
    _NUM, EXTRACTORS, completion_text, extract_answer, extract_boxed, extract_gsm8k, extract_last_number,
    gsm8k_reference,
)

from ftis_fed.tasks.scores import GroupScores

RewardFn = Callable[..., list]

# ----------------------------------------------------------------------------- equivalence

#: Hard limits that keep every comparison cheap whatever a peer sends: an answer (extracted or
#: reference) longer than this matches nothing; a number longer than MAX_NUMBER_CHARS is not parsed;
#: tuples / intervals compare element-wise at most MAX_NESTING levels deep.
MAX_ANSWER_CHARS = 1000
MAX_NUMBER_CHARS = 200
MAX_NESTING = 8

#: What may follow a number and still leave it one number: \text{..}, degrees, percent, or unit words
#: after a space (two letters or more, so ``2x`` is not the number 2).
_UNIT = r"(?:\s*\\(?:text|mbox|mathrm)\{[^{}]*\}|\s*\^\s*\{?\\circ\}?|\s*°|\s*\\?%|\s+[A-Za-z]{2,}(?:\s+[A-Za-z]+)*)"
_NUMBER_FULL_RE = re.compile(
    rf"^(?P<sign>[-+]?)\s*(?:(?P<frac>\\[dt]?frac\s*\{{\s*(?P<fn>-?\d+(?:\.\d+)?)\s*\}}\s*\{{\s*(?P<fd>-?\d+(?:\.\d+)?)\s*\}})"
    rf"|(?P<sfrac>\\[dt]?frac(?P<sn>\d)(?P<sd>\d))"
    rf"|(?P<slash>(?P<pn>{_NUM})\s*/\s*(?P<pd>{_NUM}))"
    rf"|(?P<num>{_NUM}))"
    rf"(?:{_UNIT})?\s*\.?$"
)


def _strip_wrappers(s: str) -> str:
    s = s.strip().replace("\u2212", "-").replace("{,}", "").replace("\\!", "").replace("\\,", "")
    s = s.replace("\\$", "").replace("$", "").strip()
    for _ in range(3):  # \boxed{...} / \text{...} / {...} around a whole answer
        m = re.fullmatch(r"\\(?:boxed|text|mathrm|mbox)\s*\{(.*)\}|\{(.*)\}", s)
        if not m:
            break
        s = (m.group(1) if m.group(1) is not None else m.group(2)).strip()
    return s


def parse_number(s: str | None) -> Fraction | None:
    """``s`` as an exact number, or None when it is not one number (possibly with a unit)."""
    if s is None or len(str(s)) > MAX_ANSWER_CHARS:
        return None
    s = _strip_wrappers(str(s))
    if len(s) > MAX_NUMBER_CHARS:
        return None
    m = _NUMBER_FULL_RE.match(s)
    if not m:
        return None
    try:
        if m.group("frac"):
            den = Fraction(m.group("fd"))
            val = Fraction(m.group("fn")) / den if den else None
        elif m.group("sfrac"):
            den = Fraction(m.group("sd"))
            val = Fraction(m.group("sn")) / den if den else None
        elif m.group("slash"):
            den = Fraction(m.group("pd").replace(",", ""))
            val = Fraction(m.group("pn").replace(",", "")) / den if den else None
        else:
            val = Fraction(m.group("num").replace(",", ""))
    except (ValueError, ZeroDivisionError):
        return None
    if val is None:
        return None
    return -val if m.group("sign") == "-" else val


def normalize_latex(s: str) -> str:
    """A canonical string form for non-numeric answers (spacing, ``\\left``, ``\\dfrac``, ...)."""
    s = _strip_wrappers(s)
    s = re.sub(r"\\(?:left|right|displaystyle)\b", "", s)
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    s = re.sub(r"\\text\{\s*([^{}]*)\}", r"\1", s)
    s = re.sub(r"\^\s*\{?\\circ\}?|°", "", s)
    s = re.sub(r"\\[;:, ]", "", s)
    s = s.replace("\\!", "")
    s = re.sub(r"\s+", "", s)
    return s.rstrip(".")


def _split_top_level(s: str) -> list[str] | None:
    """``(a, b)`` / ``[a,b]`` / ``a, b`` -> [a, b] at bracket depth 0; None if no top-level comma."""
    s = s.strip()
    if len(s) >= 2 and s[0] in "([" and s[-1] in ")]":
        s = s[1:-1]
    parts, depth, cur = [], 0, []
    for ch in s:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return parts if len(parts) > 1 else None


def answers_match(pred: str | None, ref: str | None, rel_tol: float = 0.0) -> bool:
    """True when ``pred`` and ``ref`` denote the same answer.

    Numbers compare exactly as fractions (``"0.50" == "1/2" == "\\frac{1}{2}"``, ``"1,234" ==
    "1234"``), or within ``rel_tol`` when it is > 0 (0 by default: a reward must not call 10**9 and
    10**9 - 1 equal); anything else compares as ``normalize_latex`` strings, tuples and
    intervals element-wise.

    Bounded work, whatever the inputs: no recursion (an explicit work list), tuples nested at most
    ``MAX_NESTING`` deep, and an answer longer than ``MAX_ANSWER_CHARS`` matches nothing. Each level
    of nesting is one linear pass over the parts, so the cost is O(MAX_NESTING * length).
    """
    if pred is None or ref is None or len(pred) > MAX_ANSWER_CHARS or len(ref) > MAX_ANSWER_CHARS:
        return False
    work: list[tuple[str, str, int]] = [(pred, ref, 0)]
    while work:
        a_s, b_s, depth = work.pop()
        if not _same_leaf_or_split(a_s, b_s, depth, rel_tol, work):
            return False
    return True


def _same_leaf_or_split(pred: str, ref: str, depth: int, rel_tol: float, work: list) -> bool:
    """One comparison of ``answers_match``: True if equal, or if split into element pairs (pushed on
    ``work``, to be compared in turn); False when they differ."""
    a, b = parse_number(pred), parse_number(ref)
    if a is not None and b is not None:
        if a == b:
            return True
        if rel_tol > 0:
            try:
                return math.isclose(float(a), float(b), rel_tol=rel_tol, abs_tol=0.0)
            except OverflowError:
                return False
        return False
    na, nb = normalize_latex(pred), normalize_latex(ref)
    if na == nb and na:
        return True
    if depth >= MAX_NESTING:
        return False
    pa, pb = _split_top_level(na), _split_top_level(nb)
    if pa and pb and len(pa) == len(pb) and na[:1] == nb[:1] and na[-1:] == nb[-1:]:
        work.extend((x, y, depth + 1) for x, y in zip(pa, pb))
        return True
    return False


def is_integer_answer(ref: str | None) -> bool:
    """The reference is one integer (``42``, ``-3``, ``1,234``, ``\boxed{7}``): the exact path decides."""
    v = parse_number(ref)
    return v is not None and v.denominator == 1


# ----------------------------------------------------------------------------- format checks

def is_bare_number(text: str) -> bool:
    """The whole reply is one number (``"42"``, ``"42."``, ``" -3/4 "``): "Reply with just the number"."""
    s = _strip_wrappers(text)
    return parse_number(s) is not None and not re.search(r"[A-Za-z]{2,}", re.sub(r"\\[dt]?frac", "", s))


FORMATS: dict[str, Callable[[str], bool]] = {
    "none": lambda text: True,
    "bare_number": is_bare_number,
    "gsm8k": lambda text: extract_gsm8k(text) is not None,
    "boxed": lambda text: extract_boxed(text) is not None,
}


# ----------------------------------------------------------------------------- rules & verifier

@dataclass(frozen=True)
class RewardRule:
    """How completions of one task family are scored.

    extract: extractor names (``EXTRACTORS``) tried in order to find the final answer.
    format: the format check (``FORMATS``): ``none``, ``bare_number``, ``gsm8k`` or ``boxed``.
    require_format: if True, a correct answer in the wrong format scores 0 (the paper's binary
        "format and answer correct"); default False (small models rarely follow formats at first).
    format_bonus: added to the reward when the format check passes, >= 0 (0.0: binary reward).
    fn: optional TRL-signature reward function used *instead* of the built-in check. It is called as
        TRL's GRPOTrainer calls it, with keywords: ``fn(prompts=[p], completions=[c], reference=[r],
        answer=[r], solution=[r], task_id=[t])``; a None or non-finite result counts as 0.
    conversational: with ``fn``, pass prompt and completion as chat messages
        (``[{"role": "assistant", "content": text}]``), as TRL's own reward functions expect (True);
        False passes plain strings.
    symbolic: when the exact comparison (``answers_match``) says "different" and the reference is
        not an integer, ask math-verify (``ftis_fed.tasks.symbolic.symbolic_equal``: a helper process,
        bounded time per answer). Integer references always take the exact path alone.
    solution: optional task id -> the family's worked solution (``task-reward-steps``): a completion
        then solves the task only when it *is* that solution (stripped), its steps checked and not only
        its last number; None (default) checks the answer alone.
    """

    extract: tuple[str, ...] = ("boxed", "gsm8k", "last_number")
    format: str = "none"
    require_format: bool = False
    format_bonus: float = 0.0
    fn: RewardFn | None = None
    conversational: bool = True
    symbolic: bool = False
    solution: Callable[[str], str] | None = None

    def __post_init__(self) -> None:
        for name in self.extract:
            if name not in EXTRACTORS:
                raise ValueError(f"reward_rule.extract has {name!r}: valid extractors are {sorted(EXTRACTORS)}")
        if self.format not in FORMATS:
            raise ValueError(f"reward_rule.format={self.format!r}: valid formats are {sorted(FORMATS)}")
        if not (math.isfinite(self.format_bonus) and self.format_bonus >= 0):
            raise ValueError(f"reward_rule.format_bonus={self.format_bonus!r}: must be finite and >= 0")

    def check(self, completion: str, reference: str, task_id: str = "", prompt: str = "") -> tuple[bool, float]:
        """(solved, reward) of one completion against ``reference``; ``solved`` ignores the bonus.

        With ``fn``, solved means a reward > 0 (a non-finite reward from ``fn`` counts as 0).
        """
        if self.fn is not None:
            if self.conversational:
                p, c = [{"role": "user", "content": prompt}], [{"role": "assistant", "content": completion}]
            else:
                p, c = prompt, completion
            out = self.fn(prompts=[p], completions=[c], reference=[reference], answer=[reference],
                          solution=[reference], task_id=[task_id])
            value = float(out[0]) if out and out[0] is not None else 0.0
            value = value if math.isfinite(value) else 0.0
            return value > 0, value
        fmt_ok = FORMATS[self.format](completion)
        pred = extract_answer(completion, self.extract)
        correct = answers_match(pred, reference)
        if not correct and self.symbolic and pred is not None and not is_integer_answer(reference):
            from ftis_fed.tasks.symbolic import symbolic_equal                # math-verify, only when needed

            correct = symbolic_equal(pred.strip(), reference.strip())
        solved = correct and (fmt_ok or not self.require_format)
        if solved and self.solution is not None:
            solved = completion.strip() == self.solution(task_id).strip()
        return solved, (1.0 if solved else 0.0) + (self.format_bonus if fmt_ok else 0.0)

    def score(self, completion: str, reference: str, task_id: str = "", prompt: str = "") -> float:
        """The reward of one completion against ``reference``."""
        return self.check(completion, reference, task_id, prompt)[1]


def default_rules() -> dict[str, RewardRule]:
    """The built-in rules: procedural families take the last number; GSM8K / MATH-500 prefer their markers."""
    from ftis_fed.tasks.families import FAMILIES

    procedural = RewardRule(extract=("last_number",), format="bare_number")
    rules = {name: procedural for name in FAMILIES}
    rules["gsm8k"] = RewardRule(extract=("gsm8k", "boxed", "last_number"), format="gsm8k")
    rules["math500"] = RewardRule(extract=("boxed", "last_number"), format="boxed", symbolic=True)
    return rules


def family_of(task_id: str) -> str:
    """The family prefix of a task id: everything before the first ``/``."""
    return task_id.split("/", 1)[0]


@dataclass(frozen=True)
class Verifier:
    """Task id + completion + reference -> reward, the same on senders and receivers.

    rules: family name -> RewardRule (default ``default_rules()``).
    fallback: rule for families not in ``rules``; None (default) makes unknown families an error,
        so a receiver never silently scores a task it does not know.
    """

    rules: Mapping[str, RewardRule] = field(default_factory=default_rules)
    fallback: RewardRule | None = None

    def knows(self, task_id: str) -> bool:
        return family_of(task_id) in self.rules or self.fallback is not None

    def rule_for(self, task_id: str) -> RewardRule:
        fam = family_of(task_id)
        rule = self.rules.get(fam, self.fallback)
        if rule is None:
            raise ValueError(f"task_id={task_id!r}: no reward rule for family {fam!r}; "
                             f"known families are {sorted(self.rules)}")
        return rule

    def check(self, task_id: str, completion, reference: str, prompt: str = "") -> tuple[bool, float]:
        """(solved, reward) of one completion: see ``RewardRule.check``."""
        return self.rule_for(task_id).check(completion_text(completion), reference, task_id, prompt)

    def reward(self, task_id: str, completion, reference: str, prompt: str = "") -> float:
        """The reward of one completion of task ``task_id`` against ``reference``."""
        return self.check(task_id, completion, reference, prompt)[1]

    def group_rewards(self, task_id: str, completions, reference: str, prompt: str = "",
                      completion_ids=None) -> list[float]:
        """The rewards of one task's completions (a rule with ``group_rewards``, such as a user task's
        TRL functions, scores them in one call, and may answer NaN: no reward for that sample)."""
        rule = self.rule_for(task_id)
        texts = [completion_text(c) for c in completions]
        if hasattr(rule, "group_rewards"):
            return [float(r) for r in rule.group_rewards(task_id, texts, completion_ids)]
        return [rule.check(t, reference, task_id, prompt)[1] for t in texts]

    def group_scores(self, task_id: str, completions, reference: str, prompt: str = "",
                     completion_ids=None) -> GroupScores:
        """``group_rewards`` with which completions solve the task (the rule's ``check``, or a user
        task's solved function) and, for a user task, each function's own rewards."""
        rule = self.rule_for(task_id)
        texts = [completion_text(c) for c in completions]
        if hasattr(rule, "group_scores"):
            return rule.group_scores(task_id, texts, completion_ids)
        checks = [rule.check(t, reference, task_id, prompt) for t in texts]
        return GroupScores(tuple(float(r) for _, r in checks), tuple(bool(ok) for ok, _ in checks))

    def as_trl_reward(self) -> RewardFn:
        """This verifier as a TRL reward function; needs ``task_id`` and ``reference`` (or ``answer``) columns."""
        def verifier_reward(prompts, completions, **kwargs) -> list[float]:
            refs = _references(kwargs, len(completions))
            ids = kwargs.get("task_id")
            if ids is None:
                raise ValueError("verifier_reward needs a 'task_id' column (family prefix picks the rule)")
            return [self.reward(t, c, r, completion_text(p) if p is not None else "")
                    for t, c, r, p in zip(ids, completions, refs, prompts or [None] * len(completions))]
        return verifier_reward


# ----------------------------------------------------------------------------- TRL-signature functions

def _references(kwargs: dict, n: int) -> list[str]:
    """The reference answers from TRL kwargs: ``reference``, else ``answer``, else ``solution``.

    A GSM8K ``answer`` column (full solution ending ``#### 42``) is reduced to its final answer; a
    MATH ``solution`` column to its last ``\\boxed{}``.
    """
    for key in ("reference", "answer", "solution"):
        if kwargs.get(key) is not None:
            refs = [str(r) for r in kwargs[key]]
            break
    else:
        raise ValueError("reward function needs a 'reference', 'answer' or 'solution' keyword (one per completion)")
    if len(refs) != n:
        raise ValueError(f"{len(refs)} references for {n} completions")
    out = []
    for r in refs:
        if "####" in r:
            r = gsm8k_reference(r)
        elif "\\boxed" in r:
            r = extract_boxed(r) or r
        out.append(r)
    return out


def accuracy_reward(prompts, completions, **kwargs) -> list[float]:
    """1.0 when the completion's final answer (boxed, ####, else last number) matches the reference."""
    refs = _references(kwargs, len(completions))
    return [1.0 if answers_match(extract_answer(completion_text(c)), r) else 0.0
            for c, r in zip(completions, refs)]


def format_reward(prompts, completions, **kwargs) -> list[float]:
    """1.0 when the completion states a final answer in a checkable format: boxed, ``####``, or a bare number."""
    def ok(text: str) -> bool:
        return extract_boxed(text) is not None or extract_gsm8k(text) is not None or is_bare_number(text)
    return [1.0 if ok(completion_text(c)) else 0.0 for c in completions]
