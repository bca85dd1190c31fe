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
- ``lowlogprobs``: every generator log-prob set to ``LOW_LOGPROB`` = log(1e-4), a *plausible* lie
  (above ``objective.LOGP_GEN_FLOOR``, so the sample is not marked implausible): every token whose
  receiver probability exceeds 2e-4 gets the largest truncated weight C, and the k1 estimate of the
  sample's KL is negative, so the F filter keeps it whatever its advantage;
- ``payload``: poisoning with correct answers (``poison``): in a share of its groups
  (``attack-payload-share``) every completion the task's verifier scores as solved gets a fixed
  phrase (``attack-payload``, no digits) inserted before its EOS or its answer
  (``attack-payload-at``), re-checked with the verifier so
  that its reward is unchanged, and its claimed log-probs are the attacker's own model's scores of
  the new tokens (a consistent, plausible claim);
- ``flood``: the same batch re-signed ``flood`` times with fresh sequence numbers (``hostile_frames``).

Receivers must bound all of these (docs/security.md); tests, ``sims/byzantine.py`` (the reward
lies) and ``sims/poisoning.py`` (the payload) use this module to show that they do. ``all`` is the
Byzantine experiment's set (forge, inflate, logprobs, flood); ``payload`` needs the participant's
tokenizer, verifier and scorer (``payload_poisoner``), so it is named explicitly. ``Attacker`` is what a
participant with ``byzantine`` set sends instead of its honest frames.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import numpy as np

from ftis_fed.wire.batch import CompletionBatch, PromptGroup
from ftis_fed.trust.signing import sign_batch
from ftis_fed.wire.codec import WireOptions

KINDS = ("forge", "inflate", "logprobs", "lowlogprobs", "payload", "flood")
#: what ``all`` means: the reward and log-prob lies and the flood of the Byzantine experiment
ALL = ("forge", "inflate", "logprobs", "flood")
LOGPROB_FLOOR = -1e30
#: the ``lowlogprobs`` claim per token: log(1e-4), above ``objective.LOGP_GEN_FLOOR`` = log(1e-30)
LOW_LOGPROB = math.log(1e-4)


def parse_kinds(spec: str) -> tuple[str, ...]:
    """``"forge,inflate"`` / ``"all"`` -> the attack kinds; ValueError naming an unknown one."""
    kinds = tuple(k.strip() for k in spec.split(",") if k.strip())
    if kinds == ("all",):
        return ALL
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


def poisoned_group(index: int, share: float) -> bool:
    """Is the attacker's ``index``-th group (counted over the whole run) poisoned? Exactly
    floor(n * share) of any first n groups are, spread evenly: share 1/2 every other group, 1/4 every
    fourth."""
    return math.floor((index + 1) * share + 1e-9) > math.floor(index * share + 1e-9)


@dataclass(frozen=True)
class Poisoner:
    """What the ``payload`` attack needs of the attacking participant (``payload_poisoner``).

    payload_ids: the phrase in the attacker's tokenizer (the receivers' too: token level).
    share: share of groups poisoned (``poisoned_group``), in (0, 1].
    budget: max-new-tokens; a completion the payload would make longer is left as it is.
    at: ``end`` (before the EOS) or ``start`` (before the answer).
    eos_id: the attacker's EOS; only completions that ended with it get the payload (before it).
    decode(ids) -> text: the decoding receivers re-verify (special tokens skipped).
    solved(task_id, text, reference, prompt_text) -> bool: the task's verifier.
    score(prompt_ids, [completion ids, ...]) -> per-token log-probs of each completion under the
        attacker's own model and the run's sampling distribution: the claims it signs.
    """

    payload_ids: tuple[int, ...]
    share: float
    budget: int
    eos_id: int | None
    decode: Callable[[Sequence[int]], str]
    solved: Callable[[str, str, str, str], bool]
    score: Callable[[Sequence[int], Sequence[Sequence[int]]], Sequence[Sequence[float]]]
    at: str = "end"

    def insert(self, ids: Sequence[int]) -> list[int] | None:
        """``ids`` with the payload before its final EOS (``at = "end"``) or before its first token
        (``"start"``), or None (no EOS, or over the budget)."""
        ids = [int(t) for t in ids]
        if self.eos_id is None or not ids or ids[-1] != self.eos_id or len(ids) + len(self.payload_ids) > self.budget:
            return None
        if self.at == "start":
            return list(self.payload_ids) + ids
        return ids[:-1] + list(self.payload_ids) + [self.eos_id]

    def group(self, g: PromptGroup) -> tuple[PromptGroup, int]:
        """(the group with every solved completion carrying the payload, completions changed). A
        completion is changed only if it is solved before and after (its reward stays the same)."""
        ids = [c.tolist() for c in g.completion_ids]
        changed: dict[int, list[int]] = {}
        for i, c in enumerate(ids):
            new = self.insert(c)
            if new is None or not self.solved(g.task_id, self.decode(c), g.reference, g.prompt_text):
                continue
            if self.solved(g.task_id, self.decode(new), g.reference, g.prompt_text):
                changed[i] = new
        if not changed:
            return g, 0
        scores = self.score(g.prompt_ids.tolist(), [changed[i] for i in sorted(changed)])
        claims = dict(zip(sorted(changed), scores))
        comp = tuple(np.asarray(changed.get(i, c), dtype=np.int64) for i, c in enumerate(ids))
        lps = tuple(np.asarray(claims[i], dtype=np.float32)[:len(changed[i])] if i in changed else lp
                    for i, lp in enumerate(g.logprobs))
        texts = tuple(self.decode(changed[i]) if i in changed else t for i, t in enumerate(g.completion_texts))
        return dataclasses.replace(g, completion_ids=comp, logprobs=lps, completion_texts=texts), len(changed)


def poison(batch: CompletionBatch, poisoner: Poisoner, first_group: int) -> tuple[CompletionBatch, int]:
    """(``batch`` with its poisoned groups carrying the payload, completions changed); the batch's
    groups are the attacker's groups ``first_group``, ``first_group + 1``, ... of the run."""
    groups, n = [], 0
    for k, g in enumerate(batch.groups):
        if poisoned_group(first_group + k, poisoner.share):
            g, changed = poisoner.group(g)
            n += changed
        groups.append(g)
    return dataclasses.replace(batch, groups=tuple(groups)).validate(), n


def _corrupt_group(g: PromptGroup, kinds: Iterable[str]) -> PromptGroup:
    kinds = set(kinds)
    changes: dict = {}
    if "forge" in kinds:
        changes["reference"] = wrong_answer(g.reference)
    if kinds & {"forge", "inflate"}:
        changes["rewards"] = np.ones(g.size, dtype=np.float32)
    if "logprobs" in kinds:
        changes["logprobs"] = tuple(np.full(lp.shape, LOGPROB_FLOOR, dtype=np.float32) for lp in g.logprobs)
    elif "lowlogprobs" in kinds:
        changes["logprobs"] = tuple(np.full(lp.shape, LOW_LOGPROB, dtype=np.float32) for lp in g.logprobs)
    return dataclasses.replace(g, **changes)


def corrupt(batch: CompletionBatch, kinds: Iterable[str], poisoner: Poisoner | None = None,
            first_group: int = 0) -> CompletionBatch:
    """The hostile version of ``batch`` (still a valid batch; ``flood`` is applied at signing).
    ``payload`` (applied first, so a log-prob lie overrides its claims) needs ``poisoner``."""
    kinds = tuple(kinds)
    if "payload" in kinds:
        if poisoner is None:
            raise ValueError("the payload attack needs a Poisoner (the attacker's tokenizer, verifier, scorer)")
        batch, _ = poison(batch, poisoner, first_group)
    out = dataclasses.replace(batch, groups=tuple(_corrupt_group(g, kinds) for g in batch.groups))
    return out.validate()


def hostile_frames(batch: CompletionBatch, key, kinds: Iterable[str], flood: int = 200,
                   options: WireOptions = WireOptions(), poisoner: Poisoner | None = None,
                   first_group: int = 0) -> list[bytes]:
    """Signed frames an attacker sends for one round: the corrupted batch, and with ``flood`` that
    many copies under strictly increasing sequence numbers (each one valid on its own)."""
    kinds = tuple(kinds)
    bad = corrupt(batch, kinds, poisoner, first_group)
    copies = flood if "flood" in kinds else 1
    return [sign_batch(dataclasses.replace(bad, seq=bad.seq + i), key, options) for i in range(copies)]


class Attacker:
    """A participant's hostile side (``byzantine`` set, the security experiments): what it sends instead
    of its honest signed batch. One frame per round of the corrupted batch; with ``flood`` every even
    round is instead a flood of re-signed copies (which the server refuses whole: a reply carries one
    frame), so the other attacks still reach the odd rounds. With ``payload`` the batch is poisoned
    first (``poison``; ``attack/payload_completions`` counts the completions that carry the payload).

    spec: the ``byzantine`` value; key: the participant's signing key; poisoner: () -> the ``payload``
    attack's ``Poisoner`` (the participant's tokenizer, verifier and model; built on first use)."""

    def __init__(self, spec: str, key, poisoner: Callable[[], Poisoner]):
        self.kinds = parse_kinds(spec)
        self.key = key
        self._make_poisoner = poisoner
        self._poisoner: Poisoner | None = None

    def frames(self, batch: CompletionBatch, round: int, options: WireOptions,
               metrics: dict[str, float]) -> list[bytes]:
        """The frames sent for ``batch`` of ``round``; their sequence numbers run from ``batch.seq``."""
        flood = "flood" in self.kinds and round % 2 == 0
        lies = tuple(k for k in self.kinds if k not in ("flood", "payload")) + (("flood",) if flood else ())
        if "payload" in self.kinds:
            if self._poisoner is None:
                self._poisoner = self._make_poisoner()
            batch, n = poison(batch, self._poisoner, (round - 1) * len(batch.groups))
            metrics["attack/payload_completions"] = float(n)
        return hostile_frames(batch, self.key, lies, flood=200, options=options)


def payload_poisoner(fed, policy, verifier, name: str) -> Poisoner:
    """The ``payload`` attack of participant ``name`` with its ``policy`` (tokenizer, scoring) and
    ``verifier``: the run's ``attack-payload`` in its tokens, its claims its own model's log-probs of the
    new tokens. ValueError when the run sets no ``attack-payload``."""
    tok = policy.tokenizer
    if not fed.attack_payload:
        raise ValueError(f"participant {name!r}: byzantine='payload' needs attack-payload (the phrase)")

    def score(prompt_ids, completions):
        out = policy.score_padded([prompt_ids] * len(completions), completions, fed.sampling, False)   # (b,T)
        return [row[:len(c)] for row, c in zip(out.tolist(), completions)]

    return Poisoner(tuple(tok(fed.attack_payload, add_special_tokens=False)["input_ids"]),
                    fed.attack_payload_share, fed.max_new_tokens, getattr(tok, "eos_token_id", None),
                    lambda ids: tok.decode(list(ids), skip_special_tokens=True),
                    lambda task, text, ref, prompt: bool(verifier.check(task, text, ref, prompt)[0]),
                    score, fed.attack_payload_at)
