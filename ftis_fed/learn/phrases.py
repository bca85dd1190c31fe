"""The phrase check: a peer's rewarded samples that carry a phrase the receiver itself never says.

A payload riding on correct answers (docs/security.md, "Poisoning with correct answers") is one fixed
phrase repeated across prompts whose answers differ. When its tokens are ones the receiver already
gives some probability to (a leading ``0`` before an arithmetic answer is 6-9 nats, an honest peer's
answer digits 15-20), the surprisal check (``peer-surprisal-max``) cannot see it: what gives it away
is the repetition. The receiver counts, per sender, in how many of that sender's *rewarded*
completions (reward above its group's mean: the ones the update pushes up) each character n-gram
occurs, and the same over its *own* sampled completions, across the run so far. An n-gram is
**flagged** for a sender when it is in at least ``min_share`` of the sender's rewarded completions
(and at least ``min_count`` of them) and ``ratio`` times more often than in the receiver's own
(Laplace-smoothed); once flagged, it stays flagged for that sender. A rewarded peer completion that
contains a flagged n-gram is dropped from the update (weight 0) when one of those n-grams is
**unearned**: the receiver deletes it, re-scores the text with its own verifier, and the reward
stays. An honest specialist's answers may start with a digit the receiver rarely starts with;
deleting it breaks the answer, deleting a payload does not.

Nothing the sender claims is used: the receiver's own samples are the reference, its own verifier
decides what a phrase is worth. Memory is bounded per sender whatever it sends: n-grams are counted
with lossy counting (Manku & Motwani, 2002; error at most ``min_share / 2`` of a peer's completions
counted, ``min_share / (2 ratio)`` of the receiver's own), so a peer's counter holds about
2 / min_share completions' worth of n-grams beyond its frequent ones (40 at the default 5 %), the
receiver's own 2 ratio / min_share (320 at ratio 8), and only the first ``MAX_CHARS`` characters of
a completion are read.

Pure apart from the counters' state: ``ngrams``, ``LossyCounter``, ``PhraseMonitor.flagged``,
``strip_phrase`` and ``unearned`` take texts and a reward function; the update's step (count, flag,
drop the unearned) is the receiver check ``receive/phrase.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

#: markers of a completion's start and end, so a phrase at either edge is its own n-gram
START, END = "\x02", "\x03"
#: the n-gram lengths counted (characters, markers included): 2 for a one-character phrase at an edge
SIZES = (2, 4, 8)
#: characters of a completion read (the rest is not counted or searched)
MAX_CHARS = 2048


def ngrams(text: str, sizes: Sequence[int] = SIZES, max_chars: int = MAX_CHARS) -> set[str]:
    """The distinct character n-grams of ``START + text + END`` (the first ``max_chars`` characters of
    ``text``), of every length in ``sizes``."""
    s = START + text[:max_chars] + END
    return {s[i:i + n] for n in sizes for i in range(len(s) - n + 1)}


@dataclass
class LossyCounter:
    """Document frequencies of n-grams by lossy counting: after ``add`` of n documents, every n-gram
    in more than ``eps * n`` of them is held, with a count short by at most ``eps * n``."""

    eps: float
    n: int = 0
    counts: dict[str, list[int]] = field(default_factory=dict)       # n-gram -> [count, max undercount]

    def add(self, grams: Iterable[str]) -> None:
        self.n += 1
        bucket = math.ceil(self.n * self.eps)
        for g in grams:
            c = self.counts.get(g)
            if c is None:
                self.counts[g] = [1, bucket - 1]
            else:
                c[0] += 1
        if self.n % max(1, math.ceil(1 / self.eps)) == 0:           # end of a bucket: prune the rare
            self.counts = {g: c for g, c in self.counts.items() if c[0] + c[1] > bucket}

    def to_json(self) -> dict:
        return {"n": self.n, "counts": self.counts}

    @classmethod
    def from_json(cls, eps: float, state: dict) -> "LossyCounter":
        return cls(eps, int(state["n"]), {str(g): [int(c[0]), int(c[1])] for g, c in state["counts"].items()})

    def count(self, g: str) -> int:
        """The documents holding ``g`` as counted (short by at most ``eps * n``)."""
        c = self.counts.get(g)
        return c[0] if c is not None else 0


@dataclass
class PhraseMonitor:
    """One receiver's phrase statistics: its own completions and each peer's rewarded ones.

    The peers' counters have error ``min_share / 2``; the receiver's own ``min_share / (2 ratio)``, so
    that a phrase it says in less than that share (and so may not hold) is still ``ratio`` times
    rarer than any phrase that can be flagged: its share is estimated from below (what is held),
    never from above. Flags are sticky: a phrase flagged for a sender stays flagged for the run, so
    an attack that shifts the receiver's own behaviour towards its phrase cannot lift the flag."""

    ratio: float
    min_share: float = 0.05
    min_count: int = 8
    own: LossyCounter = None                                     # type: ignore[assignment]
    peers: dict[str, LossyCounter] = field(default_factory=dict)
    sticky: dict[str, set[str]] = field(default_factory=dict)    # sender -> its phrases flagged so far

    def __post_init__(self) -> None:
        if self.own is None:
            self.own = LossyCounter(self.own_eps)

    @property
    def own_eps(self) -> float:
        return self.min_share / (2 * self.ratio)

    @property
    def peer_eps(self) -> float:
        return self.min_share / 2

    @classmethod
    def from_config(cls, cfg) -> "PhraseMonitor | None":
        """The monitor of the phrase check's knobs (``receive/phrase.PhraseKnobs``: ``ratio``,
        ``min_share``, ``min_count``), or None when the check is off."""
        if cfg.ratio <= 0:
            return None
        return cls(cfg.ratio, cfg.min_share, cfg.min_count)

    def to_json(self) -> dict:
        """The counters and flags, for the resume checkpoint."""
        return {"own": self.own.to_json(), "peers": {k: c.to_json() for k, c in self.peers.items()},
                "sticky": {k: sorted(v) for k, v in self.sticky.items()}}

    @classmethod
    def from_json(cls, cfg, state: dict) -> "PhraseMonitor":
        mon = cls.from_config(cfg)
        mon.own = LossyCounter.from_json(mon.own_eps, state["own"])
        mon.peers = {str(k): LossyCounter.from_json(mon.peer_eps, v) for k, v in state.get("peers", {}).items()}
        mon.sticky = {str(k): set(map(str, v)) for k, v in state.get("sticky", {}).items()}
        return mon

    def observe_own(self, texts: Iterable[str]) -> None:
        for t in texts:
            self.own.add(ngrams(t))

    def observe_peer(self, sender: str, rewarded_texts: Iterable[str]) -> None:
        counter = self.peers.setdefault(sender, LossyCounter(self.peer_eps))
        for t in rewarded_texts:
            counter.add(ngrams(t))

    def flagged(self, sender: str) -> set[str]:
        """The n-grams ``sender``'s rewarded completions repeat and the receiver's own do not (now or
        at any earlier call)."""
        out = self.sticky.setdefault(sender, set())
        c = self.peers.get(sender)
        for g, (count, _) in (c.counts.items() if c is not None and c.n else ()):
            if g in out or count < self.min_count or count / c.n < self.min_share:
                continue
            own = (self.own.count(g) + 1) / (self.own.n + 1)       # Laplace-smoothed, from below
            if count / c.n >= self.ratio * own:
                out.add(g)
        return set(out)


def strip_phrase(text: str, phrase: str) -> str:
    """``text`` with every occurrence of ``phrase`` deleted (its edge markers match the text's start
    and end only)."""
    s = (START + text + END).replace(phrase, (START if phrase.startswith(START) else "") +
                                     (END if phrase.endswith(END) else ""))
    return s.replace(START, "").replace(END, "")


def contains(text: str, phrases: set[str]) -> list[str]:
    """The flagged phrases ``text`` holds (as counted: its first ``MAX_CHARS`` characters, with
    markers), longest first."""
    if not phrases:
        return []
    held = phrases & ngrams(text, sizes=sorted({len(p) for p in phrases}))
    return sorted(held, key=lambda p: (-len(p), p))


def unearned(text: str, phrases: set[str], reward: float, score: Callable[[str], float],
             max_tries: int = 16) -> str | None:
    """A flagged phrase of ``text`` that its reward does not need: deleting it (``strip_phrase``)
    leaves the receiver's own score of the text at ``reward`` or above. None when every phrase tried
    (the ``max_tries`` longest it holds) carries the reward, e.g. an honest specialist's leading digit,
    whose deletion breaks the answer. A phrase whose scoring raises counts as carrying it."""
    for p in contains(text, phrases)[:max_tries]:
        try:
            if float(score(strip_phrase(text, p))) >= float(reward):
                return p
        except Exception:
            continue
    return None


def rewarded(rewards: Sequence[float]) -> list[bool]:
    """Per completion of a group: its reward is above the group's mean (its advantage is positive)."""
    if not len(rewards):
        return []
    mean = sum(float(r) for r in rewards) / len(rewards)
    return [float(r) > mean + 1e-9 for r in rewards]
