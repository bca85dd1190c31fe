"""Participant sampling per round and peer sampling per receiver: pure, deterministic from the run seed.

**Participant sampling** (``fraction-train`` with ``min-train-participants``, Flower's convention):
``m = min(N, max(minimum, ceil(fraction * N)))`` of the N admitted participants are asked in a round.
They are consecutive positions of a *ring* (participants ordered by a hash of seed and name), the
window moving by m each round: every participant is asked once every ceil(N / m) rounds, all equally
often over N / gcd(N, m) rounds, and a participant joining or leaving moves no one else on the ring.

**Peer sampling** (``peers-per-round`` k): the round's senders (participants with a verified frame)
on the same ring, n of them. A receiver at ring position c gets the senders at distances
``d_t = ((off + t - 1) mod (n - 1)) + 1``, t = 1..k, with ``off = round * k mod (n - 1)``: never itself,
and for each distance the map receiver -> sender is a rotation of the ring, so **every sender reaches
exactly k receivers per round** when the receivers are the senders (the sync schedule with every frame
verified); the distances cover 1..n-1 evenly, so over n - 1 rounds **every receiver gets every peer
exactly k times**. A receiver without a frame of its own this round takes the position its rank
would have. Relayed frames per round: N * k instead of N * (N - 1).
"""

from __future__ import annotations

import hashlib
import math
from bisect import bisect_left
from typing import Mapping, Sequence


def rank(seed: int, name: str) -> bytes:
    """A participant's place on the ring: a hash of the run seed and its name (stable across joins)."""
    return hashlib.sha256(f"ftis-fed/ring/{seed}/{name}".encode()).digest()


def ring(names: Sequence[str], seed: int) -> list[str]:
    return sorted(set(names), key=lambda n: rank(seed, n))


def sample_size(n: int, fraction: float, minimum: int) -> int:
    """How many of ``n`` participants a round asks (all when n <= minimum)."""
    if n <= 0:
        return 0
    return min(n, max(minimum, math.ceil(fraction * n - 1e-9)))


def sample_participants(names: Sequence[str], fraction: float, minimum: int, seed: int, rnd: int) -> list[str]:
    """The participants asked in round ``rnd`` (module docstring), in ring order."""
    order = ring(names, seed)
    m = sample_size(len(order), fraction, minimum)
    if m >= len(order):
        return order
    start = ((rnd - 1) * m) % len(order)
    return [order[(start + j) % len(order)] for j in range(m)]


def peer_plan(senders: Sequence[str], receivers: Sequence[str], k: int, seed: int, rnd: int) -> dict[str, list[str]]:
    """receiver -> the senders whose frames it gets this round (module docstring); k <= 0 = every
    other sender. Each list in ring order of distance."""
    order = ring(senders, seed)
    n = len(order)
    out: dict[str, list[str]] = {}
    if k <= 0 or n <= 1 or k >= n - 1:
        for r in receivers:
            out[r] = [s for s in order if s != r]
        return out
    pos = {s: i for i, s in enumerate(order)}
    keys = [rank(seed, s) for s in order]
    off = (rnd * k) % (n - 1)
    dists = [((off + t) % (n - 1)) + 1 for t in range(k)]
    for r in receivers:
        if r in pos:
            c = pos[r]
            out[r] = [order[(c + d) % n] for d in dists]
        else:                                            # no frame of its own: where its rank would sit,
            c = bisect_left(keys, rank(seed, r))         # k of all n senders, shifting by k each round
            out[r] = [order[(c + (rnd * k + t) % n) % n] for t in range(k)]
    return out


def reach(plan: Mapping[str, Sequence[str]]) -> dict[str, int]:
    """sender -> how many receivers got its frame under ``plan``."""
    out: dict[str, int] = {}
    for got in plan.values():
        for s in got:
            out[s] = out.get(s, 0) + 1
    return out
