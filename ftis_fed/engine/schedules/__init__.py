"""Round schedules, registered by name (the run-config key ``scheme``).

A schedule is one function ``run_round(engine, rnd, stats)`` that decides who is asked what in
one round, using the engine's steps (``engine.generate``, ``engine.relay``, ``engine.verify``,
``engine.pending``); the engine does the rest (admission, deadlines, dropouts, budgets, metrics,
evaluation, state). Adding one: a new module here with its ``run_round`` function, its entry in
``SCHEDULES`` below, and a test in ``tests/test_engine.py``; code outside the package (a plugin, a
test) adds one with ``register_schedule``.
"""

from __future__ import annotations

from typing import Callable

from ftis_fed.engine.schedules import pipelined, sync

RoundFn = Callable[["Engine", int, "RoundStats"], None]          # engine.core's (not imported: core imports this)

SCHEDULES: dict[str, RoundFn] = {"sync": sync.sync_round, "pipelined": pipelined.pipelined_round}


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

