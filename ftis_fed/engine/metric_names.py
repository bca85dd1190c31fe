"""Which of a participant's metric names the server keeps: bounded per reply and per run.

Every new metric name becomes a column of ``metrics.csv`` (rewritten with the union of columns) and
of every sink; a participant inventing thousands of names per round would slow the server's metrics
writer every round from then on. ``MetricNames.admit`` keeps a name the participant has sent
before, and a new one while it is at most ``max_name_chars`` long, the reply has brought fewer than
``max_new_per_reply`` new names and the participant fewer than ``max_names`` in all; the rest are
dropped (and counted), never the reply.
"""

from __future__ import annotations

from collections.abc import Mapping

#: Longest metric name kept (characters); the project's longest is ~60 (``trust/<sender>/rejected/<reason>``).
MAX_METRIC_NAME_CHARS = 128
#: New names one reply may add (an honest first learn reply of 8 participants brings ~150).
MAX_NEW_METRIC_NAMES = 512
#: Names one participant may have over the whole run.
MAX_METRIC_NAMES = 4096


class MetricNames:
    """Per participant, the metric names it has been allowed so far."""

    def __init__(self, max_name_chars: int = MAX_METRIC_NAME_CHARS, max_new_per_reply: int = MAX_NEW_METRIC_NAMES,
                 max_names: int = MAX_METRIC_NAMES):
        self.max_name_chars, self.max_new_per_reply, self.max_names = max_name_chars, max_new_per_reply, max_names
        self.known: dict[str, set[str]] = {}

    def admit(self, participant: str, metrics: Mapping[str, float]) -> tuple[dict[str, float], int]:
        """-> (the metrics kept, how many were dropped)."""
        known = self.known.setdefault(participant, set())
        out, new, dropped = {}, 0, 0
        for k, v in metrics.items():
            if k not in known:
                if len(k) > self.max_name_chars or new >= self.max_new_per_reply or len(known) >= self.max_names:
                    dropped += 1
                    continue
                known.add(k)
                new += 1
            out[k] = v
        return out, dropped
