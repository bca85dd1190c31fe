"""A simulated participant's churn schedule: the ``churn`` key (simulation only).

    churn = "join=3 absent=5,7 away=9-10 leave=14"

Space-separated ``kind=rounds``; rounds are ``r``, ``a-b`` (inclusive) or a comma list of them:

- ``join=r``: its node connects at round r's boundary, not before (a **late joiner**; default 1);
- ``absent=...``: rounds in which its node stays connected but answers nothing usable (its ClientApp
  replies an error to each request of the round: the round is **skipped**, counted as an absence
  towards ``retire-after-rounds``);
- ``away=...``: rounds in which its node is not connected (a **leave**; back the round after the
  range: a **rejoin**, said hello again with a fresh challenge before it is asked anything);
- ``leave=r``: its node goes away at round r and does not come back.

It models what the engine's membership (``ftis_fed.engine.membership``) handles in a deployment,
where nodes come and go by themselves: ``strategies.churn`` lists a node to the engine only in the
rounds its participant is connected, and ``clients.client_app`` answers an absent round with an
error. Nothing here imports the rest of the project.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

#: the largest round a schedule may name
MAX_ROUND = 1_000_000
#: the most round ranges one kind may list
MAX_RANGES = 64
KINDS = ("join", "absent", "away", "leave")
#: the Flower message type (``query.<PROBE>``) and record by which ``strategies.churn`` asks a simulated
#: node which participant it is; the ClientApp answers it from the run config
PROBE = "churn"
_ITEM = re.compile(r"^(\d+)(?:-(\d+))?$")

Ranges = tuple[tuple[int, int], ...]


def _within(rnd: int, ranges: Ranges) -> bool:
    return any(a <= rnd <= b for a, b in ranges)


@dataclass(frozen=True)
class Churn:
    """A parsed schedule (module docstring); the default: connected and answering every round."""

    join: int = 1
    absent: Ranges = ()
    away: Ranges = ()
    leave: int = 0                              # 0: never
    text: str = field(default="", compare=False)  # as it was written (logs)

    def connected(self, rnd: int) -> bool:
        """Is its node connected in round ``rnd`` (listed at that round's boundary)?"""
        return rnd >= self.join and not _within(rnd, self.away) and not (self.leave and rnd >= self.leave)

    def answers(self, rnd: int) -> bool:
        """Does it answer requests of round ``rnd`` (False: an absent round, or not connected)?"""
        return self.connected(rnd) and not _within(rnd, self.absent)

    @property
    def any(self) -> bool:
        return self != Churn()


def _rounds(text: str, key: str, kind: str) -> Ranges:
    out = []
    items = text.split(",")
    if len(items) > MAX_RANGES:
        raise ValueError(f"{key}: {kind}= lists {len(items)} rounds or ranges: limit {MAX_RANGES}")
    for item in items:
        m = _ITEM.match(item.strip())
        if not m:
            raise ValueError(f"{key}: {kind}={text!r}: {item.strip()!r} is not a round (r) or a range (a-b)")
        a = int(m.group(1))
        b = int(m.group(2)) if m.group(2) is not None else a
        if not 1 <= a <= b <= MAX_ROUND:
            raise ValueError(f"{key}: {kind}={text!r}: {item.strip()!r}: rounds must satisfy 1 <= a <= b <= {MAX_ROUND}")
        out.append((a, b))
    return tuple(sorted(out))


def parse_churn(text: str, key: str = "churn") -> Churn:
    """``text`` -> Churn ('' = none). ValueError naming ``key`` (how the key was set, e.g.
    ``p2-churn`` or ``participants[1].churn``), the kind and the limit."""
    text = str(text or "").strip()
    if not text:
        return Churn()
    got: dict[str, str] = {}
    for part in text.split():
        kind, eq, value = part.partition("=")
        if not eq or kind not in KINDS:
            raise ValueError(f"{key}={text!r}: {part!r}: expected kind=rounds with kind one of {', '.join(KINDS)}")
        if kind in got:
            raise ValueError(f"{key}={text!r}: {kind}= is given twice")
        got[kind] = value
    join = leave = 0
    for kind in ("join", "leave"):
        if kind in got:
            r = _rounds(got[kind], key, kind)
            if len(r) != 1 or r[0][0] != r[0][1]:
                raise ValueError(f"{key}: {kind}={got[kind]!r}: must be one round")
            if kind == "join":
                join = r[0][0]
            else:
                leave = r[0][0]
    join = join or 1
    absent = _rounds(got["absent"], key, "absent") if "absent" in got else ()
    away = _rounds(got["away"], key, "away") if "away" in got else ()
    if leave and leave <= join:
        raise ValueError(f"{key}={text!r}: leave={leave} must come after join={join}")
    for kind, ranges in (("absent", absent), ("away", away)):
        if ranges and ranges[0][0] < join:
            raise ValueError(f"{key}={text!r}: {kind}= names round {ranges[0][0]}, before join={join}")
    both = sorted(max(a1, a2) for a1, b1 in absent for a2, b2 in away if max(a1, a2) <= min(b1, b2))
    if both:
        raise ValueError(f"{key}={text!r}: round {both[0]} is both absent (connected, not answering) and away "
                         "(not connected)")
    return Churn(join=join, absent=absent, away=away, leave=leave, text=text)
