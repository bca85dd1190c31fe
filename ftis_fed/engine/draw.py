"""The rounds' draws: a fresh random seed per round, committed before the round, revealed after it.

The server draws round r+1's 32-byte seed while round r ends and publishes its commitment,
``commitment(seed) = SHA-256("ftis-fed/draw/" + seed)``, in round r's federation row
(``fed/draw_commit_next``; round 1's in the console line at the start and in ``server_state.json``);
round r+1's row reveals the seed (``fed/draw_seed``). Participant and peer sampling
(:mod:`ftis_fed.engine.sampling`) of a round depend only on who is present, the lags and that
seed: no participant knows it before the round's membership is fixed, and anyone with the rows
checks ``verify(seed, commitment)`` and recomputes who was asked and who got whose frame. The
unrevealed seed is kept in ``server_state.json`` (the server's own file), so a resumed run keeps
its commitment.
"""

from __future__ import annotations

import hashlib
import secrets
from typing import Callable


def commitment(seed: bytes) -> str:
    """The published hash of a round's seed (hex)."""
    return hashlib.sha256(b"ftis-fed/draw/" + seed).hexdigest()


def verify(seed_hex: str, commitment_hex: str) -> bool:
    """Whether a revealed seed (hex) is the one committed to: what an auditor checks."""
    try:
        return commitment(bytes.fromhex(seed_hex)) == commitment_hex
    except ValueError:
        return False


class Draws:
    """``take()`` the seed of the round that starts (committed to already) and commit to the next."""

    def __init__(self, entropy: Callable[[int], bytes] = secrets.token_bytes, upcoming: bytes | None = None):
        self.entropy = entropy
        self.upcoming = upcoming if upcoming is not None else entropy(32)

    @property
    def committed(self) -> str:
        """The commitment of the next round's seed (published before that round)."""
        return commitment(self.upcoming)

    def take(self) -> bytes:
        seed, self.upcoming = self.upcoming, self.entropy(32)
        return seed

    def to_json(self) -> str:
        return self.upcoming.hex()

    @classmethod
    def from_json(cls, upcoming: str, entropy: Callable[[int], bytes] = secrets.token_bytes) -> "Draws":
        return cls(entropy, bytes.fromhex(upcoming))
