"""Participant sampling per round and peer sampling per receiver: pure functions of who is present,
what each was asked before and the round's draw (:mod:`ftis_fed.engine.draw`).

**The draw.** Every round has a fresh 32-byte seed the server drew and committed to (its SHA-256
published) *before* the round, and reveals after it: a participant cannot know the order of a round
before its membership is fixed, so it cannot time its presence or pick its name to be asked with,
or to send to, a chosen victim; anyone with the revealed seeds and the rounds' members recomputes
every choice below (``order``, ``choose``, ``peer_plan`` are pure).

**Participant sampling** (``fraction-train`` with ``min-train-participants``, Flower's convention):
``m = min(N, max(minimum, ceil(fraction * N)))`` of the N participants present are asked in a round:
the m with the largest *lag* (fair share so far minus asks so far), ties in the round's draw order.
A participant present in a round earns ``m / N`` of fair share there (absent: nothing, and its lag
is kept until it is back). **Bound** (``tests/test_sampling.py``, joining, leaving and flapping
members): ``|asks - fair share| < 2`` for every participant after every round; without churn < 1,
so over R rounds with N and m fixed every participant is asked ``floor`` or ``ceil`` of R*m/N times
(exactly R*m/N whenever that is a whole number). A member flapping in and out moves the others' fair
share only by what its presence changes in m / N.

**Peer sampling** (``peers-per-round`` k): each receiver gets ``k`` distinct senders (participants
with a verified frame), never itself, and each sender reaches ``k`` receivers (or every other
receiver, when there are fewer): with as many senders as receivers both hold exactly; with fewer
receivers than senders some receivers take one more sender, with fewer senders some senders reach
one more receiver, so no verified frame goes unrelayed (the spread of reach is at most 1 and never
below min(k, receivers)). Senders and receivers are placed in the round's draw order and each
receiver takes the senders with the most receivers still to reach (a degree-balanced assignment,
O(N * k)). Relayed frames per round: about N * k instead of N * (N - 1). ``k = 0`` or
``k >= senders - 1``: every receiver gets every other sender, in the run's fixed ring order.
"""

from __future__ import annotations

import hashlib
import math
from collections import deque
from typing import Mapping, Sequence


def rank(seed: int, name: str) -> bytes:
    """A participant's place on the run's fixed ring (every-peer relays): a hash of the run seed and its name."""
    return hashlib.sha256(f"ftis-fed/ring/{seed}/{name}".encode()).digest()


def ring(names: Sequence[str], seed: int) -> list[str]:
    return sorted(set(names), key=lambda n: rank(seed, n))


def order(names: Sequence[str], draw: bytes, salt: str = "") -> list[str]:
    """``names`` in the order of a round's draw (a hash of the revealed seed, ``salt`` and each name)."""
    return sorted(set(names), key=lambda n: hashlib.sha256(draw + f"/{salt}/{n}".encode()).digest())


def seed_draw(seed: int, rnd: int) -> bytes:
    """A draw from the run seed alone (reproducible analyses and tests; the engine uses a committed one)."""
    return hashlib.sha256(f"ftis-fed/draw/{seed}/{rnd}".encode()).digest()


def sample_size(n: int, fraction: float, minimum: int) -> int:
    """How many of ``n`` participants a round asks (all when n <= minimum)."""
    if n <= 0:
        return 0
    return min(n, max(minimum, math.ceil(fraction * n - 1e-9)))


def choose(names: Sequence[str], m: int, lags: Mapping[str, float], draw: bytes) -> list[str]:
    """The ``m`` of ``names`` with the largest lag, ties in draw order (module docstring)."""
    pos = {n: i for i, n in enumerate(order(names, draw, "sample"))}
    return sorted(sorted(pos, key=lambda n: (-lags.get(n, 0.0), pos[n]))[:m], key=pos.__getitem__)


def credit(lags: Mapping[str, float], present: Sequence[str], chosen: Sequence[str]) -> dict[str, float]:
    """The lags after a round: every present participant earns m / N and pays 1 when asked."""
    out = dict(lags)
    present = set(present)
    if not present:
        return out
    share, asked = len(chosen) / len(present), set(chosen)
    for n in present:
        out[n] = out.get(n, 0.0) + share - (n in asked)
    return out


def sample_participants(names: Sequence[str], fraction: float, minimum: int, lags: Mapping[str, float],
                        draw: bytes) -> list[str]:
    """The participants asked in a round (module docstring), in draw order (all of them, sorted, when
    the sample is everyone)."""
    names = sorted(set(names))
    m = sample_size(len(names), fraction, minimum)
    return names if m >= len(names) else choose(names, m, lags, draw)


def peer_plan(senders: Sequence[str], receivers: Sequence[str], k: int, seed: int, rnd: int,
              draw: bytes | None = None) -> dict[str, list[str]]:
    """receiver -> the senders whose frames it gets this round (module docstring); k <= 0 = every
    other sender. ``draw``: the round's revealed seed (None: ``seed_draw(seed, rnd)``)."""
    fixed = ring(senders, seed)
    n = len(fixed)
    recv = list(dict.fromkeys(receivers))
    if k <= 0 or n <= 1 or k >= n - 1:
        return {r: [s for s in fixed if s != r] for r in recv}
    draw = seed_draw(seed, rnd) if draw is None else draw
    snd, rcv = order(fixed, draw, "senders"), order(recv, draw, "receivers")
    in_s, in_r = set(snd), set(rcv)
    want = {r: k for r in rcv}                                   # k <= n - 2: every receiver can take k
    reach_of = {s: min(k, len(rcv) - (s in in_r)) for s in snd}
    extra = sum(reach_of.values()) - len(rcv) * k
    _spread(want, rcv, extra, {r: n - (r in in_s) for r in rcv})                    # receivers take more
    _spread(reach_of, snd, -extra, {s: len(rcv) - (s in in_r) for s in snd})        # senders reach more
    # buckets[c]: senders with c receivers still to reach, in draw order; each receiver takes the fullest
    top = max(reach_of.values(), default=0)
    buckets = [deque() for _ in range(top + 1)]
    for s in snd:
        buckets[reach_of[s]].append(s)
    out: dict[str, list[str]] = {}
    for r in rcv:
        got: list[tuple[int, str]] = []
        skipped = None
        c = top
        while len(got) < want[r] and c > 0:
            if not buckets[c]:
                c -= 1
                continue
            s = buckets[c].popleft()
            if s == r:
                skipped = (c, s)
                continue
            got.append((c, s))
        if skipped is not None:
            buckets[skipped[0]].appendleft(skipped[1])
        for c_s, s in got:
            if c_s > 1:
                buckets[c_s - 1].append(s)
        while top > 0 and not buckets[top]:
            top -= 1
        out[r] = [s for _, s in got]
        if len(got) < want[r]:
            _repair(out, r, want[r], buckets)
    return out


def _spread(counts: dict[str, int], names: list[str], extra: int, cap: Mapping[str, int]) -> None:
    """Add ``extra`` (if > 0) one at a time over ``names`` in turn, none above its ``cap``."""
    while extra > 0:
        moved = False
        for nm in names:
            if extra and counts[nm] < cap[nm]:
                counts[nm] += 1
                extra -= 1
                moved = True
        if not moved:
            return


def _repair(out: dict[str, list[str]], r: str, want: int, buckets: list[deque]) -> None:
    """Receiver ``r`` is short while the senders left with receivers to reach are ``r`` itself or
    already ``r``'s: an earlier receiver ``q`` gives ``r`` one of its senders and takes such a sender
    ``x`` instead (every list stays distinct, never its own receiver)."""
    while len(out[r]) < want:
        left = [(c, x) for c in range(len(buckets) - 1, 0, -1) for x in buckets[c]]
        for c, x in left:
            for q, got in out.items():
                if q in (r, x) or x in got:
                    continue
                give = next((s for s in got if s != r and s not in out[r]), None)
                if give is not None:
                    got[got.index(give)] = x
                    out[r].append(give)
                    buckets[c].remove(x)
                    if c > 1:
                        buckets[c - 1].append(x)
                    break
            else:
                continue
            break
        else:
            return


def reach(plan: Mapping[str, Sequence[str]]) -> dict[str, int]:
    """sender -> how many receivers got its frame under ``plan``."""
    out: dict[str, int] = {}
    for got in plan.values():
        for s in got:
            out[s] = out.get(s, 0) + 1
    return out
