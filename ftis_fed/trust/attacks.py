"""A validly signing but hostile participant, for tests and the Byzantine experiment.

A signature proves who sent a batch, not that what it says is true. ``corrupt`` turns an honest
batch into what a registered attacker could send, keeping it a *valid* batch (it passes
``CompletionBatch.validate`` and is signed with the attacker's real key):

- ``forge``: every group's reference answer replaced by a wrong one that the attacker's own rewards
  agree with (rewards 1 for every completion), so a receiver that trusted the sender's reference
  would find no disagreement;
- ``inflate``: every completion's reward set to 1 (the reference left alone);
- ``logprobs``: every generator log-prob set to ``LOGPROB_FLOOR`` (a finite value <= 0 that honest
  sampling never produces: it makes ratios pi/pi_gen astronomically large and drives the KL estimate
  used by the F filter far negative);
- ``flood``: the same batch re-signed ``flood`` times with fresh sequence numbers (``hostile_frames``).

Receivers must bound all of these (docs/security.md); tests and ``sims/byzantine.py`` use this
module to show that they do.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

import numpy as np

from ftis_fed.wire.batch import CompletionBatch, PromptGroup
from ftis_fed.trust.signing import sign_batch
from ftis_fed.wire.codec import WireOptions

KINDS = ("forge", "inflate", "logprobs", "flood")
LOGPROB_FLOOR = -1e30


def parse_kinds(spec: str) -> tuple[str, ...]:
    """``"forge,inflate"`` / ``"all"`` -> the attack kinds; ValueError naming an unknown one."""
    kinds = tuple(k.strip() for k in spec.split(",") if k.strip())
    if kinds == ("all",):
        return KINDS
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        raise ValueError(f"byzantine={spec!r}: {bad[0]!r} is not an attack (one of {', '.join(KINDS)}, or all)")
    return kinds


def wrong_answer(reference: str) -> str:
    """A plausible but wrong answer: an integer moved by 5, anything else with a digit appended."""
    try:
        return str(int(reference.strip()) + 5)
    except ValueError:
        return reference + "1"


def _corrupt_group(g: PromptGroup, kinds: Iterable[str]) -> PromptGroup:
    kinds = set(kinds)
    changes: dict = {}
    if "forge" in kinds:
        changes["reference"] = wrong_answer(g.reference)
    if kinds & {"forge", "inflate"}:
        changes["rewards"] = np.ones(g.size, dtype=np.float32)
    if "logprobs" in kinds:
        changes["logprobs"] = tuple(np.full(lp.shape, LOGPROB_FLOOR, dtype=np.float32) for lp in g.logprobs)
    return dataclasses.replace(g, **changes)


def corrupt(batch: CompletionBatch, kinds: Iterable[str]) -> CompletionBatch:
    """The hostile version of ``batch`` (still a valid batch; ``flood`` is applied at signing)."""
    kinds = tuple(kinds)
    out = dataclasses.replace(batch, groups=tuple(_corrupt_group(g, kinds) for g in batch.groups))
    return out.validate()


def hostile_frames(batch: CompletionBatch, key, kinds: Iterable[str], flood: int = 200,
                   options: WireOptions = WireOptions()) -> list[bytes]:
    """Signed frames an attacker sends for one round: the corrupted batch, and with ``flood`` that
    many copies under strictly increasing sequence numbers (each one valid on its own)."""
    kinds = tuple(kinds)
    bad = corrupt(batch, kinds)
    copies = flood if "flood" in kinds else 1
    return [sign_batch(dataclasses.replace(bad, seq=bad.seq + i), key, options) for i in range(copies)]
