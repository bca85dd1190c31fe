"""``sync`` (the paper's): every participant generates and returns a signed frame (``generate``);
the server verifies them; each participant then learns from its own batch and its peers'
frames of the same round (``learn``)."""

from __future__ import annotations

def sync_round(engine, rnd: int, stats) -> None:
    frames = engine.generate(rnd, stats)
    engine.relay("learn", frames, rnd, stats)
    stats.fed["fed/frames_verified"] = float(len(frames))
