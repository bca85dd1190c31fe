"""Rewards: hand-checked extraction, numeric equivalence (hypothesis), rules, verifier, TRL signature."""

from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ftis_fed.tasks.rewards import (
    RewardRule,
    Verifier,
    accuracy_reward,
    answers_match,
    extract_answer,
    extract_boxed,
    extract_gsm8k,
    extract_last_number,
    family_of,
    format_reward,
    gsm8k_reference,
    is_bare_number,
    normalize_latex,
    parse_number,
)

# ----------------------------------------------------------------------------- extraction


@pytest.mark.parametrize("text, expected", [
    ("42", "42"),
    ("The answer is 42.", "42"),
    ("84 + 7 = 91.", "91"),
    ("It costs $1,234 in total", "1,234"),
    ("1,2,3", "3"),
    ("x = -5", "-5"),
    ("47-8", "8"),                       # a hyphen after a digit is not a sign
    ("she ate 3/4 of it", "3/4"),
    ("about 0.50 litres", "0.50"),
    (r"so $\frac{3}{4}$", r"\frac{3}{4}"),
    ("result: \u22127", "\u22127"),      # unicode minus
    ("no digits here", None),
])
def test_extract_last_number(text, expected):
    assert extract_last_number(text) == expected


@pytest.mark.parametrize("text, expected", [
    (r"\boxed{42}", "42"),
    (r"first \boxed{1} then \boxed{2}", "2"),
    (r"$\boxed{\frac{\sqrt{3}}{2}}$", r"\frac{\sqrt{3}}{2}"),                      # nested braces
    (r"\boxed{\left( 3, \frac{\pi}{2} \right)}.", r"\left( 3, \frac{\pi}{2} \right)"),
    (r"\fbox{7}", "7"),
    (r"\boxed 5", "5"),
    (r"\boxed{unclosed", None),
    ("nothing", None),
])
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


def test_extract_gsm8k_and_reference():
    assert extract_gsm8k("So 9*2=18\n#### 18") == "18"
    assert extract_gsm8k("#### 1 \n#### 1,200\nthanks") == "1,200"
    assert extract_gsm8k("####") is None and extract_gsm8k("no marker 5") is None
    assert gsm8k_reference("He made $<<200000-130000=70000>>70,000\n#### 70000") == "70000"
    assert gsm8k_reference("#### 1,200") == "1200"
    with pytest.raises(ValueError, match="no '#### <answer>' marker"):
        gsm8k_reference("the answer is 5")


def test_extract_answer_order_and_unknown_extractor():
    text = r"#### 3 but really \boxed{4}, not 5"
    assert extract_answer(text) == "4"
    assert extract_answer(text, ("gsm8k", "boxed")) == "3 but really \\boxed{4}, not 5"
    assert extract_answer(text, ("last_number",)) == "5"
    with pytest.raises(ValueError, match=r"extractor 'regex' is unknown: valid extractors are \['boxed'"):
        extract_answer(text, ("regex",))


# ----------------------------------------------------------------------------- equivalence

@pytest.mark.parametrize("a, b", [
    ("1,234", "1234"), ("3/4", "0.75"), (r"\frac{3}{4}", "3/4"), (r"\dfrac{3}{4}", "0.75"), (r"\frac34", "0.75"),
    ("0.50", "1/2"), (".5", "0.5"), ("-3", "\u22123"), (r"-\frac{1}{2}", "-0.5"), (r"\frac{-1}{2}", "-1/2"),
    ("18.", "18"), ("$18", "18"), (r"\$18.00", "18"), ("18 dollars", "18"), ("5 cm.", "5"), (r"90^\circ", "90"),
    (r"\text{Evelyn}", "Evelyn"), (r"(3,\frac{\pi}{2})", r"\left( 3, \frac{\pi}{2} \right)"),
    (r"(0.5, 1)", r"\left(\frac{1}{2}, 1\right)"), ("1{,}000", "1000"), (r"\boxed{7}", "7"),
])
def test_equivalent_answers(a, b):
    assert answers_match(a, b) and answers_match(b, a)


@pytest.mark.parametrize("a, b", [
    ("12", "21"), ("0.33", "1/3"), ("-3", "3"), ("1,234", "1.234"), ("3/4", "4/3"), (None, "1"), ("1", None),
    (r"\frac{\pi}{2}", r"\frac{\pi}{3}"), ("(1, 2)", "[1, 2]"), ("(1, 2)", "(1, 2, 3)"), ("", ""), ("5/0", "5"),
    ("2x", "2"), ("10^3", "10"),
])
def test_different_answers(a, b):
    assert not answers_match(a, b)


def test_parse_number_values():
    assert parse_number("1,234.5") == Fraction(24690, 20)
    assert parse_number(r"\frac{6}{8}") == Fraction(3, 4)
    assert parse_number("-0.125") == Fraction(-1, 8)
    for bad in ("abc", "1/0", "--3", "1,23", "3 + 4", "", None):
        assert parse_number(bad) is None, bad


ints = st.integers(min_value=-10**9, max_value=10**9)


@settings(max_examples=200, deadline=None)
@given(ints)
def test_formatted_integers_are_equivalent(n):
    ref = str(n)
    for form in (f"{n:,}", f"{n}.", f"{n}.00", f"${n:,}", f"{n} apples", f"{2 * n}/2", rf"\frac{{{3 * n}}}{{3}}",
                 rf"\boxed{{{n}}}"):
        assert answers_match(form, ref), form
    assert not answers_match(str(n + 1), ref)
    assert extract_last_number(f"So the total is {n:,}.") in (f"{n:,}",)


@settings(max_examples=200, deadline=None)
@given(st.integers(-10**6, 10**6), st.sampled_from([1, 2, 4, 5, 8, 10, 16, 20, 25, 40, 100, 1000]))
def test_terminating_decimals_equal_their_fractions(num, den):
    f = Fraction(num, den)
    dec = f"{float(f):.6f}"                       # exact for these denominators
    assert answers_match(dec, f"{num}/{den}")
    assert answers_match(dec, rf"\frac{{{num}}}{{{den}}}")
    assert parse_number(dec) == f


def test_normalize_latex():
    assert normalize_latex(r"\left( 3, \dfrac{\pi}{2} \right)") == r"(3,\frac{\pi}{2})"
    assert normalize_latex(r"$\text{ Evelyn}$.") == "Evelyn"


# ----------------------------------------------------------------------------- format & rules

def test_is_bare_number():
    assert is_bare_number("42") and is_bare_number(" 42.\n") and is_bare_number("-3/4") and is_bare_number("1,234")
    assert not is_bare_number("The answer is 42") and not is_bare_number("42 apples") and not is_bare_number("")


def test_rule_reward_values():
    plain = RewardRule(extract=("last_number",), format="bare_number")
    assert plain.score("42", "42") == 1.0
    assert plain.score("The answer is 42.", "42") == 1.0          # lenient by default
    assert plain.score("41", "42") == 0.0
    strict = RewardRule(extract=("last_number",), format="bare_number", require_format=True)
    assert strict.score("The answer is 42.", "42") == 0.0 and strict.score("42", "42") == 1.0
    bonus = RewardRule(extract=("last_number",), format="bare_number", format_bonus=0.1)
    assert bonus.score("41", "42") == pytest.approx(0.1) and bonus.score("42", "42") == pytest.approx(1.1)
    assert bonus.check("41", "42") == (False, pytest.approx(0.1))
    with pytest.raises(ValueError, match=r"reward_rule.format='xml': valid formats are"):
        RewardRule(format="xml")
    with pytest.raises(ValueError, match=r"reward_rule.format_bonus=-1: must be finite and >= 0"):
        RewardRule(format_bonus=-1)


def test_verifier_by_family_prefix():
    v = Verifier()
    assert family_of("add30/train/0/17") == "add30"
    assert v.reward("add30/train/0/17", "The sum is 55.", "55") == 1.0
    assert v.reward("gsm8k/test/3", "9 times 60 is 540 meters\n#### 540", "540") == 1.0
    assert v.reward("gsm8k/test/3", "#### 540\nActually 541", "540") == 1.0       # the marker wins
    assert v.reward("math500/test/algebra/2584.json", r"so $\boxed{\dfrac{14}{3}}$", r"\frac{14}{3}") == 1.0
    assert v.reward("math500/test/algebra/2584.json", r"so $\boxed{\frac{14}{5}}$", r"\frac{14}{3}") == 0.0
    with pytest.raises(ValueError, match=r"no reward rule for family 'chess'; known families are \[.*'gsm8k'"):
        v.reward("chess/train/0/1", "e4", "e4")
    assert not v.knows("chess/1")
    lenient = Verifier(fallback=RewardRule())
    assert lenient.knows("chess/1") and lenient.reward("chess/1", "12", "12") == 1.0


# ----------------------------------------------------------------------------- TRL signature

def test_trl_signature_functions_with_gsm8k_columns():
    completions = [[{"role": "assistant", "content": "She makes 9 * 2 = 18 dollars.\n#### 18"}],
                   [{"role": "assistant", "content": "#### 19"}],
                   "18"]
    answer = ["Janet sells 9 eggs.\nShe makes $<<9*2=18>>18.\n#### 18"] * 3
    # called as GRPOTrainer calls it: keywords, plus extra columns it ignores
    assert accuracy_reward(prompts=["q"] * 3, completions=completions, answer=answer, trainer_state=None) == [1.0, 0.0, 1.0]
    assert format_reward(["q"] * 3, completions + ["I think 18"]) == [1.0, 1.0, 1.0, 0.0]
    assert accuracy_reward(["q"], [r"\boxed{\frac{1}{2}}"], solution=[r"so \boxed{0.5}"]) == [1.0]
    with pytest.raises(ValueError, match="needs a 'reference', 'answer' or 'solution' keyword"):
        accuracy_reward(["q"], ["1"])


def test_verifier_as_trl_reward_and_rules_wrapping_trl_functions():
    fn = Verifier().as_trl_reward()
    out = fn(prompts=["What is 2 + 3?"] * 2, completions=["5", [{"role": "assistant", "content": "6"}]],
             task_id=["add30/train/0/1"] * 2, reference=["5", "5"])
    assert out == [1.0, 0.0]
    trl_rewards = pytest.importorskip("trl.rewards")
    rule = RewardRule(fn=trl_rewards.think_format_reward)          # TRL's own function, unchanged
    v = Verifier(rules={"think": rule})
    assert v.reward("think/0", "<think>\nadd them\n</think>\n5", "5") == 1.0
    assert v.reward("think/0", "5", "5") == 0.0
    plain = RewardRule(fn=accuracy_reward, conversational=False)
    assert plain.score("it is 12", "12") == 1.0 and plain.check("it is 13", "12") == (False, 0.0)


# ----------------------------------------------------------------------------- bounded work

def _extract_boxed_reference(text: str):
    """The obvious (quadratic) definition: the last boxed start whose braces close."""
    import re

    starts = [m.end() for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text)]
    for start in reversed(starts):
        depth = 1
        for i in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                return text[start:i].strip()
    bare = re.findall(r"\\boxed\s+([^\s$]+)", text)
    return bare[-1].strip() if bare else None


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(["\\boxed{", "\\fbox{", "{", "}", "7", " ", "\\boxed 3", "x"]), max_size=30))
def test_linear_extract_boxed_equals_the_obvious_definition(parts):
    text = "".join(parts)
    assert extract_boxed(text) == _extract_boxed_reference(text)


def test_comparisons_have_hard_limits():
    from ftis_fed.tasks.rewards import MAX_ANSWER_CHARS, MAX_NESTING, MAX_NUMBER_CHARS

    assert parse_number("1" * MAX_NUMBER_CHARS) == int("1" * MAX_NUMBER_CHARS)
    assert parse_number("1" * (MAX_NUMBER_CHARS + 1)) is None
    long = "x" * (MAX_ANSWER_CHARS + 1)
    assert not answers_match(long, long)
    nest = lambda d, leaf: "(1," * d + leaf + ")" * d  # noqa: E731
    assert answers_match(nest(MAX_NESTING - 1, "(1, 2)"), nest(MAX_NESTING - 1, "(1,2.0)"))  # MAX_NESTING levels
    assert not answers_match(nest(MAX_NESTING, "(1, 2)"), nest(MAX_NESTING, "(1,2.0)"))
    assert answers_match("1" * 150, "1" * 150, rel_tol=1e-9) and not answers_match("1" * 150, "2" * 150, rel_tol=1e-9)
