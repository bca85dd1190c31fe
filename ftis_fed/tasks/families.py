"""Procedural arithmetic task families: what one problem of each kind looks like.

A family is a pure generator ``make(rng) -> Problem``: it draws operands from a ``random.Random``
and returns the question, the integer answer and a *content key* (the operands and template that
define the problem, without cosmetic choices such as names). The key decides the split a problem
belongs to (see ``suite.split_of``), so a problem's train/eval membership is a property of its
content, never of the seed or index that happened to draw it.

Families come in three kinds:

- **in-distribution** (``ID_FAMILIES``): the training mixture, bare two-operand arithmetic in one
  shape ("What is 17 + 25?", "What is 25 - 17?"). Its sub-families are what non-IID ("expertise")
  partitions hand to different participants.
- **extra** (``EXTRA_FAMILIES``): trainable, but outside the default mixture: ``add1`` (one-digit
  addition, 47 % for sampled SmolLM2) is what the tiny test models and the arithmetic specialist
  learn from; select it with ``task-families``.
- **out-of-distribution** (``OOD_FAMILIES``): different in kind (word problems, three operands,
  multiplication, counting on), held out for evaluation only.

Difficulty is calibrated to SmolLM2-135M-Instruct (``sims/calibrate_tasks.py``, figures in
``docs/tasks.md``): a family the model never solves gives GRPO no signal, one it always solves
teaches nothing.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

#: Appended to every procedural question: the reply format the format reward checks.
INSTRUCTION = "Reply with just the number."


@dataclass(frozen=True)
class Problem:
    """One drawn problem: ``question`` (no instruction), integer ``answer``, content ``key``."""

    question: str
    answer: int
    key: tuple
    #: a worked solution that ends with the answer ("7+8=15; 4+3+1=8; so 85"), for families whose
    #: replies show their steps; "" = the reply is the bare answer.
    solution: str = ""


@dataclass(frozen=True)
class Family:
    """A named problem generator.

    name: the family id, the first component of every task id (``add30/train/0/17``).
    kind: ``id`` (training mixture), ``extra`` (trainable, not in the default mixture) or ``ood``
        (held-out evaluation only).
    description: one line for docs and error messages.
    make: ``rng -> Problem``; must only use ``rng`` for randomness (determinism).
    eval_percent: share (percent, 1-99) of the problem space held out for evaluation; defaults to 20
        for ID families and 50 for OOD families (never trained on, so their eval sets may be larger).
    instruction: what follows the question in the prompt (``INSTRUCTION``: the bare number).
    """

    name: str
    kind: str
    description: str
    make: Callable[[random.Random], Problem]
    eval_percent: int = 0
    instruction: str = INSTRUCTION

    def __post_init__(self) -> None:
        if self.kind not in ("id", "extra", "ood"):
            raise ValueError(f"family {self.name!r}: kind={self.kind!r} must be 'id', 'extra' or 'ood'")
        if self.eval_percent == 0:
            object.__setattr__(self, "eval_percent", 50 if self.kind == "ood" else 20)
        if not 1 <= self.eval_percent <= 99:
            raise ValueError(f"family {self.name!r}: eval_percent={self.eval_percent} must be in [1, 99]")


# ----------------------------------------------------------------------------- in-distribution

def _add30(rng: random.Random) -> Problem:
    a, b = rng.randint(1, 29), rng.randint(1, 29)
    return Problem(f"What is {a} + {b}?", a + b, (a, b))


def _sub30(rng: random.Random) -> Problem:
    a, b = rng.randint(1, 29), rng.randint(1, 29)
    a, b = max(a, b), min(a, b)
    return Problem(f"What is {a} - {b}?", a - b, (a, b))


def _add1(rng: random.Random) -> Problem:
    a, b = rng.randint(1, 9), rng.randint(1, 9)
    return Problem(f"What is {a} + {b}?", a + b, (a, b))


#: The instruction of the worked families: the steps, then the number (the reward reads the last number).
WORKED_INSTRUCTION = "Work it out digit by digit, then give the number."


def _add99(rng: random.Random) -> Problem:
    """Two-digit addition with its column steps: ones (carry), tens, the sum."""
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    ones = a % 10 + b % 10
    carry = ones // 10
    tens = a // 10 + b // 10 + carry
    steps = f"{a % 10}+{b % 10}={ones}; {a // 10}+{b // 10}+{carry}={tens}; so {a + b}"
    return Problem(f"What is {a} + {b}?", a + b, (a, b), steps)


def _sub99(rng: random.Random) -> Problem:
    """Two-digit subtraction (result >= 0) with its column steps: ones (borrow), tens, the difference."""
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    a, b = max(a, b), min(a, b)
    borrow = int(a % 10 < b % 10)
    ones = a % 10 + 10 * borrow - b % 10
    tens = a // 10 - b // 10 - borrow
    steps = f"{a % 10 + 10 * borrow}-{b % 10}={ones}; {a // 10}-{b // 10}-{borrow}={tens}; so {a - b}"
    return Problem(f"What is {a} - {b}?", a - b, (a, b), steps)


# ----------------------------------------------------------------------------- out-of-distribution

_NAMES = ("Tom", "Mia", "Sam", "Ava", "Leo", "Zoe", "Max", "Ivy", "Ben", "Eva")
_THINGS = ("apples", "marbles", "stickers", "pencils", "cookies", "books", "coins", "shells")

_WORD_ADD = (
    "{n} has {a} {t}. {n} gets {b} more {t}. How many {t} does {n} have now?",
    "There are {a} {t} in a box. Someone puts {b} more {t} in the box. How many {t} are in the box now?",
    "{n} found {a} {t} on Monday and {b} {t} on Tuesday. How many {t} did {n} find in total?",
)
_WORD_SUB = (
    "{n} has {a} {t}. {n} gives away {b} {t}. How many {t} does {n} have left?",
    "There are {a} {t} in a box. Someone takes {b} {t} out of the box. How many {t} are left in the box?",
    "{n} had {a} {t} and lost {b} of them. How many {t} does {n} have now?",
)


def _word(templates: tuple[str, ...], op: str) -> Callable[[random.Random], Problem]:
    def make(rng: random.Random) -> Problem:
        ti = rng.randrange(len(templates))
        n, t = rng.choice(_NAMES), rng.choice(_THINGS)
        if op == "+":
            a, b = rng.randint(2, 20), rng.randint(2, 9)
            ans = a + b
        else:
            b = rng.randint(2, 9)
            a = rng.randint(b + 1, 20)
            ans = a - b
        return Problem(templates[ti].format(n=n, t=t, a=a, b=b), ans, (ti, a, b))

    return make


def _add3(rng: random.Random) -> Problem:
    a, b, c = rng.randint(2, 9), rng.randint(2, 9), rng.randint(2, 9)
    return Problem(f"What is {a} + {b} + {c}?", a + b + c, (a, b, c))


def _mul15(rng: random.Random) -> Problem:
    a, b = rng.randint(2, 15), rng.randint(2, 15)
    return Problem(f"What is {a} times {b}?", a * b, (a, b))


def _next(rng: random.Random) -> Problem:
    a = rng.randint(10, 998)
    return Problem(f"What number comes right after {a}?", a + 1, (a,))


#: Every family, by name. Order matters only for docs and default mixtures.
FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("add30", "id", "addition, operands 1-29, e.g. 'What is 17 + 25?'", _add30),
    Family("sub30", "id", "subtraction, operands 1-29, result >= 0, e.g. 'What is 25 - 17?'", _sub30),
    Family("add1", "extra", "one-digit addition, e.g. 'What is 3 + 4?' (81 problems)", _add1),
    Family("add99", "extra", "two-digit addition with worked column steps (8,100 problems), e.g. 'What is 47 + 38?' "
           "-> '7+8=15; 4+3+1=8; so 85'", _add99, instruction=WORKED_INSTRUCTION),
    Family("sub99", "extra", "two-digit subtraction, result >= 0, with worked column steps (4,095 problems), e.g. "
           "'What is 52 - 17?' -> '12-7=5; 5-1-1=3; so 35'", _sub99, instruction=WORKED_INSTRUCTION),
    Family("word_add", "ood", "one-step addition word problem, numbers up to 20", _word(_WORD_ADD, "+")),
    Family("word_sub", "ood", "one-step subtraction word problem, numbers up to 20", _word(_WORD_SUB, "-")),
    Family("add3", "ood", "three one-digit operands, e.g. 'What is 4 + 7 + 5?'", _add3),
    Family("mul15", "ood", "multiplication in words, operands 2-15, e.g. 'What is 6 times 13?'", _mul15),
    Family("next", "ood", "successor, e.g. 'What number comes right after 399?'", _next),
)}

ID_FAMILIES: tuple[str, ...] = tuple(n for n, f in FAMILIES.items() if f.kind == "id")
OOD_FAMILIES: tuple[str, ...] = tuple(n for n, f in FAMILIES.items() if f.kind == "ood")
EXTRA_FAMILIES: tuple[str, ...] = tuple(n for n, f in FAMILIES.items() if f.kind == "extra")


def get_family(name: str) -> Family:
    """The family called ``name``; a ValueError lists the valid names otherwise."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(f"task family {name!r} is unknown: valid families are {sorted(FAMILIES)}") from None
