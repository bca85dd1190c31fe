"""Round schedules, registered by name (the run-config key ``scheme``).

A schedule is one function ``run_round(engine, rnd, stats)`` that decides who is asked what in
one round, using the engine's steps (``engine.generate``, ``engine.relay``, ``engine.verify``,
``engine.pending``); the engine does the rest (admission, deadlines, dropouts, budgets, metrics,
evaluation, state). Adding one: a new module here with ``@register_schedule("name")``, its import
below, and a test in ``tests/test_engine.py``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:                                   # pragma: no cover
    from ..core import Engine, RoundStats

RoundFn = Callable[["Engine", int, "RoundStats"], None]

SCHEDULES: dict[str, RoundFn] = {}


def register_schedule(name: str) -> Callable[[RoundFn], RoundFn]:
    def deco(fn: RoundFn) -> RoundFn:
        if name in SCHEDULES:
            raise ValueError(f"schedule {name!r} is already registered")
        SCHEDULES[name] = fn
        return fn
    return deco


def get_schedule(name: str) -> RoundFn:
    try:
        return SCHEDULES[name]
    except KeyError:
        raise ValueError(f"scheme={name!r}: no such schedule (registered: {', '.join(sorted(SCHEDULES))})") from None


from . import pipelined, sync  # noqa: E402,F401  (registration)
