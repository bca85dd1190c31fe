"""Answer extraction: pure, linear-time functions that pull the final answer out of a completion
(``extract_boxed``: the last ``\\boxed{...}`` with nested braces, one pass; ``extract_gsm8k``: after
the last ``####``; ``extract_last_number``) and GSM8K's reference answers. Used by the rewards
(``ftis_fed.tasks.rewards``) and the benchmark loaders (``ftis_fed.tasks.benchmarks``), which is why it
depends on neither."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

# ----------------------------------------------------------------------------- extraction

_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
_BOXED_BARE_RE = re.compile(r"\\boxed\s+([^\s$]+)")
_BRACE_RE = re.compile(r"[{}]")
_NUM = r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+"
_LAST_NUM_RE = re.compile(
    r"(?P<frac>-?\\[dt]?frac\s*\{\s*-?\d+(?:\.\d+)?\s*\}\s*\{\s*-?\d+(?:\.\d+)?\s*\})"
    rf"|(?P<num>(?:(?<![\w)])[-\u2212])?(?:{_NUM})(?:\s*/\s*\d+(?![\d.]))?)"
)


def completion_text(completion) -> str:
    """A completion as plain text: TRL passes ``str`` or a list of chat messages."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        return str(completion.get("content", ""))
    if isinstance(completion, (list, tuple)):
        return "".join(completion_text(m) for m in completion)
    raise TypeError(f"completion of type {type(completion).__name__}: expected str or chat messages")


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces matched; None if absent.

    One pass over ``text`` (linear time, no recursion): every ``{`` is pushed on a stack, every ``}``
    closes the innermost open one; the answer is the closed ``\\boxed{`` that opens last. An
    unclosed ``\\boxed{`` is skipped, as if it were not there.
    """
    boxed_opens = {m.end() - 1 for m in _BOXED_RE.finditer(text)}      # index of each boxed "{"
    if boxed_opens:
        stack: list[int] = []
        best: tuple[int, int] | None = None                             # (start, end) of the content
        for m in _BRACE_RE.finditer(text):
            i, ch = m.start(), m.group()
            if ch == "{":
                stack.append(i)
            elif stack:
                j = stack.pop()
                if j in boxed_opens and (best is None or j + 1 > best[0]):
                    best = (j + 1, i)
        if best is not None:
            return text[best[0]:best[1]].strip()
    bare = _BOXED_BARE_RE.findall(text)
    return bare[-1].strip() if bare else None


def extract_gsm8k(text: str) -> str | None:
    """What follows the last ``####`` on its line (GSM8K's answer marker); None if absent or empty."""
    idx = text.rfind("####")
    if idx < 0:
        return None
    ans = text[idx + 4:].strip().split("\n", 1)[0].strip()
    return ans or None


def extract_last_number(text: str) -> str | None:
    """The last number in ``text`` (``1,234``, ``-5``, ``0.5``, ``3/4``, ``\\frac{3}{4}``); None if none."""
    matches = list(_LAST_NUM_RE.finditer(text))
    return matches[-1].group(0).strip() if matches else None


EXTRACTORS: dict[str, Callable[[str], str | None]] = {
    "boxed": extract_boxed,
    "gsm8k": extract_gsm8k,
    "last_number": extract_last_number,
}


def extract_answer(text: str, order: Sequence[str] = ("boxed", "gsm8k", "last_number")) -> str | None:
    """The first answer found by the extractors named in ``order`` (keys of ``EXTRACTORS``)."""
    for name in order:
        if name not in EXTRACTORS:
            raise ValueError(f"extractor {name!r} is unknown: valid extractors are {sorted(EXTRACTORS)}")
        ans = EXTRACTORS[name](text)
        if ans is not None:
            return ans
    return None


def gsm8k_reference(solution: str) -> str:
    """The reference answer of a GSM8K ``answer`` field (``"... #### 1,234"`` -> ``"1234"``)."""
    ans = extract_gsm8k(solution)
    if ans is None:
        raise ValueError(f"GSM8K answer field has no '#### <answer>' marker: {solution[-80:]!r}")
    return ans.replace(",", "").replace("$", "").strip()
