"""The grid's headline metric (``ftis-fed grid --metric``): which held-out pass@1 every table, curve,
efficiency row and verdict of a summary reads.

- ``greedy`` (the default): the greedy reply of each held-out prompt; metrics rows
  ``eval/<set>/accuracy``, per prompt the ``solved`` flag (0 or 1).
- ``sampled``: pass@1 at the sampling temperature estimated from the ``k`` completions sampled per
  prompt (``eval-samples = k``; DeepSeek-R1's pass@1 estimate); metrics rows
  ``eval/<set>/sampled_accuracy``, per prompt ``sampled / k`` (a value in [0, 1]: the record's count of
  solved completions over ``k``).

A cell measured without samples (``eval-samples = 0``) has no sampled records: ``MissingMetric``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


class MissingMetric(ValueError):
    """A cell's records do not carry the metric the summary reads (or carry it malformed)."""


@dataclass(frozen=True)
class Metric:
    """One headline metric: its name (``--metric``), the suffix of its metrics-row keys, and what the
    summary calls it."""

    name: str
    field: str
    words: str

    def key(self, s: str) -> str:
        """The metrics-row key of held-out set ``s`` (``id``, ``ood``, ``ood/<family>``)."""
        return f"eval/{s}/{self.field}"

    @property
    def keys(self) -> tuple[str, str]:
        """The ID and OOD keys the tables show."""
        return self.key("id"), self.key("ood")

    def prompt_values(self, record: dict) -> list:
        """The per-prompt values of one evaluation record (``participant.write_eval_prompts``): greedy,
        the ``solved`` flags (bools); sampled, ``sampled[i] / k`` (floats in [0, 1])."""
        if self.name == "greedy":
            return [c == "1" for c in record["solved"]]
        k, counts = record.get("k"), record.get("sampled")
        where = f"participant {record.get('participant')}, round {record.get('round')}, set {record.get('set')}"
        if not k or counts is None:
            raise MissingMetric(f"{where}: no sampled completions (k / sampled) in the record")
        if len(counts) != len(record["ids"]) or any(not 0 <= c <= k for c in counts):
            raise MissingMetric(f"{where}: sampled counts must be one per prompt ({len(record['ids'])}), "
                                f"each in [0, k={k}]")
        return [c / k for c in counts]


GREEDY = Metric("greedy", "accuracy", "greedy pass@1")
SAMPLED = Metric("sampled", "sampled_accuracy", "sampled pass@1")
#: ``--metric`` name -> Metric, the default first.
BY_NAME = {m.name: m for m in (GREEDY, SAMPLED)}


def metric(name: str | None) -> Metric:
    """``--metric`` / grid.json ``metric`` -> Metric; None (an older grid.json without it) = greedy."""
    if name is None:
        return GREEDY
    if name not in BY_NAME:
        raise ValueError(f"metric {name!r}: must be one of {', '.join(BY_NAME)}")
    return BY_NAME[name]


def recorded_metric(out: Path) -> str:
    """The metric name ``out/grid.json`` records; ``greedy`` where it records none or there is none
    (grids written before ``--metric`` existed)."""
    path = Path(out) / "grid.json"
    return (json.loads(path.read_text()).get("metric") if path.exists() else None) or "greedy"
