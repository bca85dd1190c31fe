"""The server's per-round CPU cuts of #31 (second pass) leave what the engine does unchanged: the
rounds run with the objects alive after admission frozen (``gc.freeze``, ``core.freeze_startup_objects``)
and the run unfreezes them at its end."""

from __future__ import annotations

import pytest


# ---- the engine's rounds run with the startup objects frozen (gc.freeze), unfrozen at the end ----

def test_the_rounds_run_with_the_startup_objects_frozen_and_the_run_unfreezes_them(tmp_path):
    import gc

    from ftis_fed.engine.core import Engine
    from tests.test_engine import engine, fed_rows, trio

    seen = []
    real = Engine.run_round

    def spy(self, rnd):
        seen.append(gc.get_freeze_count())
        return real(self, rnd)

    gc.unfreeze()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Engine, "run_round", spy)
        assert engine(tmp_path, trio()).run() == 2
    assert len(seen) == 2 and min(seen) > 0 and gc.get_freeze_count() == 0
    assert all(r["fed/frames_relayed"] == 6 for r in fed_rows(tmp_path).values())


def test_a_disabled_collector_is_left_alone(tmp_path):
    import gc

    from tests.test_engine import engine, trio

    gc.unfreeze()
    gc.disable()
    try:
        assert engine(tmp_path, trio()).run() == 2
        assert gc.get_freeze_count() == 0 and not gc.isenabled()
    finally:
        gc.enable()
