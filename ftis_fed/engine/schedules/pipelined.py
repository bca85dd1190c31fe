"""``pipelined``: one message per round (``exchange``). It carries the peers' verified frames of
the previous round; the participant generates this round's batch, learns from it and from those
frames, and replies with its new frame, which the server verifies and keeps for the next round
(half the message latency; peers' samples one round older)."""

from __future__ import annotations

def pipelined_round(engine, rnd: int, stats) -> None:
    relay = engine.pending
    replies = engine.relay("exchange", relay, rnd, stats)
    engine.pending = engine.verify(replies, rnd, stats)
    stats.fed["fed/frames_verified"] = float(len(relay))
