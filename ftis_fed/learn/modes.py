"""The named loss modes (run-config key ``loss-mode``): each an importance-weight rule plus a filter
switch. Plain data, no torch: the objective (``learn.objective``), the config checks and the
experiment command (``ftis-fed grid``) read the same table."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mode:
    weight: str        # key of objective.IMPORTANCE_WEIGHTS
    filtered: bool     # apply the F filter
    local_only: bool   # drop peers' samples (Alone)


#: loss mode -> its rule, in the paper's order (alone, the three weights, then their filtered forms)
MODES: dict[str, Mode] = {
    "alone": Mode("none", filtered=False, local_only=True),
    "noIS": Mode("none", filtered=False, local_only=False),
    "VIS": Mode("vis", filtered=False, local_only=False),
    "TIS": Mode("tis", filtered=False, local_only=False),
    "F-noIS": Mode("none", filtered=True, local_only=False),
    "F-VIS": Mode("vis", filtered=True, local_only=False),
    "F-TIS": Mode("tis", filtered=True, local_only=False),
}
