"""Symbolic answer equivalence with ``math-verify``, bounded in time (MATH-500 rewards).

``math-verify`` (PyPI ``math-verify``, extra ``ftis-fed[math]``) parses LaTeX with sympy and
compares expressions symbolically (``\\frac{\\sqrt2}{2}`` = ``\\sqrt{2}/2``, ``(x+1)^2`` =
``x^2+2x+1``, intervals, tuples). Parsing and simplifying a hostile completion can take
arbitrarily long (``9^{9^{9^{9}}}``), and a reward is computed on every receiver for every peer
completion, so no call may stall a round:

- the comparison runs in a long-lived helper process (``SymbolicChecker``, started on first use:
  ``python -m ftis_fed.tasks.symbolic``, so it shares nothing with the caller's threads or torch state);
- each answer gets ``timeout_s`` seconds of wall time: math-verify's own time-outs
  (``signal.alarm`` inside the helper, half the limit in whole seconds, per parse and per
  comparison) usually end a slow answer gracefully; the hard limit in the caller kills the helper
  (SIGKILL) when it has not answered in ``timeout_s`` and starts a new one for the next answer;
- an answer that timed out, failed to parse or crashed the helper is *not equal* (reward 0).

Determinism: the exact path (``rewards.answers_match``) decides first and alone for integer
references, so GSM8K and every integer MATH-500 answer are re-verified bit-for-bit by receivers;
math-verify is only asked when the exact path says "different" and the reference is not an
integer. A time-out depends on the machine, so a sender and a receiver can disagree on such an
answer: the receiver's own verdict is what it trains on (``reverify-action = replace``), and the
disagreement is recorded against the sender like any other.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import select
import subprocess
import sys
import threading
import time
from functools import lru_cache
from pathlib import Path

log = logging.getLogger(__name__)

#: Seconds of wall time one answer may take (parsing both sides + comparing), >= 1.
DEFAULT_TIMEOUT_S = 2.0
#: Seconds the helper may take to start (import sympy + math-verify) before it counts as failed.
START_TIMEOUT_S = 120.0
#: Longest answer (either side) sent to math-verify; longer ones are not equal.
MAX_SYMBOLIC_CHARS = 400

EQUAL, DIFFERENT, TIMEOUT, ERROR = "equal", "different", "timeout", "error"
#: Answers the helper compares before it says "ready" (a fraction, a root, a polynomial, a decimal).
WARM_UP = (("\\sqrt{2}/2", "\\frac{\\sqrt{2}}{2}"), ("(x+1)^2", "x^2 + 2x + 1"), ("0.5", "\\frac{1}{2}"))


def require_math_verify() -> None:
    """ImportError naming the extra when ``math-verify`` is not installed."""
    try:
        import math_verify  # noqa: F401
    except ImportError as e:
        raise ImportError("MATH-500 answers are compared with math-verify: pip install 'ftis-fed[math]' "
                          f"(or pip install math-verify): {e}") from e


def _compare(pred: str, ref: str, inner_timeout: int | None) -> str:
    """In the helper: math-verify's verdict on ``pred`` against ``ref`` (both bare LaTeX answers)."""
    from math_verify import parse, verify

    timeout = inner_timeout if inner_timeout else None
    gold = parse(f"${ref}$", parsing_timeout=timeout)
    target = parse(f"${pred}$", parsing_timeout=timeout)
    if not gold or not target:
        return DIFFERENT
    return EQUAL if verify(gold, target, timeout_seconds=timeout) else DIFFERENT


def _serve() -> None:  # pragma: no cover - runs in the helper process (python -m ftis_fed.tasks.symbolic)
    """The helper's loop: one JSON ``[pred, ref]`` per stdin line -> one JSON status per stdout line."""
    import warnings

    warnings.filterwarnings("ignore")
    logging.disable(logging.CRITICAL)           # math-verify logs every time-out
    inner = int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1] != "none" else None
    import math_verify  # noqa: F401  (the slow import, before "ready")

    # sympy and math-verify's LaTeX grammar load lazily on the first parse and simplification (~2 s of
    # wall on a loaded 2-core machine, over a 1-2 s answer limit): done here, before "ready", so the
    # first real answer gets its whole limit (counted in start_timeout_s, not in timeout_s)
    for pred, ref in WARM_UP:
        try:
            _compare(pred, ref, inner)
        except Exception:                       # noqa: BLE001 - a warm-up only
            pass
    out = sys.stdout
    out.write('"ready"\n')
    out.flush()
    for line in sys.stdin:
        try:
            pred, ref = json.loads(line)
            status = _compare(str(pred), str(ref), inner)
        except Exception:                       # noqa: BLE001 - any failure is "not equal"
            status = ERROR
        out.write(json.dumps(status) + "\n")
        out.flush()


class SymbolicChecker:
    """math-verify in a helper process, ``timeout_s`` seconds per answer (see module docstring).

    inner_timeout: also use math-verify's own ``signal.alarm`` time-outs inside the helper (True);
        False leaves only the caller's hard limit (tests use it to check that limit alone holds).
    Counters: ``calls``, ``timeouts``, ``restarts`` (helpers started).
    The helper is ``python -m ftis_fed.tasks.symbolic`` (a plain subprocess: nothing of the caller's
    process, its threads or its ``__main__`` is copied or re-imported).
    """

    def __init__(self, timeout_s: float = DEFAULT_TIMEOUT_S, inner_timeout: bool = True,
                 start_timeout_s: float = START_TIMEOUT_S):
        if not timeout_s >= 1:
            raise ValueError(f"timeout_s={timeout_s!r}: must be >= 1 (math-verify counts whole seconds)")
        self.timeout_s = float(timeout_s)
        self.inner = max(1, int(timeout_s) // 2) if inner_timeout else None
        self.start_timeout_s = start_timeout_s
        self.calls = self.timeouts = self.restarts = 0
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()

    def _readline(self, timeout: float) -> str | None:
        """One line of the helper's stdout within ``timeout`` seconds, else None."""
        assert self._proc is not None and self._proc.stdout is not None
        ready, _, _ = select.select([self._proc.stdout], [], [], timeout)
        return self._proc.stdout.readline() if ready else None

    def _start(self) -> None:
        require_math_verify()
        root = str(Path(__file__).resolve().parent.parent)            # this ftis_fed, wherever it lives
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p),
               "OMP_NUM_THREADS": "1"}
        self._proc = subprocess.Popen([sys.executable, "-m", "ftis_fed.tasks.symbolic", str(self.inner or "none")],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                      text=True, bufsize=1, env=env)
        self.restarts += 1
        line = self._readline(self.start_timeout_s)
        if not line or json.loads(line) != "ready":
            self._stop()
            raise RuntimeError(f"the math-verify helper did not start within {self.start_timeout_s:.0f} s")

    def _stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait(5)
            for f in (self._proc.stdin, self._proc.stdout):
                if f is not None:
                    f.close()
        self._proc = None

    def check(self, pred: str, ref: str) -> str:
        """``equal``, ``different``, ``timeout`` or ``error`` for answer ``pred`` against ``ref``."""
        if len(pred) > MAX_SYMBOLIC_CHARS or len(ref) > MAX_SYMBOLIC_CHARS:
            return DIFFERENT
        with self._lock:
            self.calls += 1
            if self._proc is None or self._proc.poll() is not None:
                self._stop()
                self._start()
            try:
                self._proc.stdin.write(json.dumps([pred, ref]) + "\n")
                self._proc.stdin.flush()
                line = self._readline(self.timeout_s)
            except (OSError, ValueError):
                self._stop()
                return ERROR
            if line is None:
                self.timeouts += 1
                self._stop()                             # a stuck helper is killed, a new one serves the next
                return TIMEOUT
            try:
                status = json.loads(line)
            except ValueError:
                status = None
            if status not in (EQUAL, DIFFERENT, ERROR):
                self._stop()
                return ERROR
            return status

    def equal(self, pred: str, ref: str) -> bool:
        return self.check(pred, ref) == EQUAL

    def close(self) -> None:
        with self._lock:
            self._stop()


_CHECKER: SymbolicChecker | None = None
_CHECKER_LOCK = threading.Lock()


def default_checker() -> SymbolicChecker:
    """This process's checker (``DEFAULT_TIMEOUT_S`` per answer), started on first use."""
    global _CHECKER
    with _CHECKER_LOCK:
        if _CHECKER is None:
            _CHECKER = SymbolicChecker()
            atexit.register(_CHECKER.close)
        return _CHECKER


@lru_cache(maxsize=8192)
def symbolic_equal(pred: str, ref: str) -> bool:
    """math-verify's verdict with the process's checker, cached per (pred, ref) so a process gives one
    answer one verdict for the whole run (a time-out included)."""
    t0 = time.monotonic()
    status = default_checker().check(pred, ref)
    if status == TIMEOUT:
        log.warning("math-verify timed out after %.1f s on an answer (%d chars): not equal",
                    time.monotonic() - t0, len(pred))
    return status == EQUAL


if __name__ == "__main__":  # pragma: no cover - the helper process
    _serve()
