"""A receiver's path from peers' signed frames to the batches it trains on (the receiver room's first step;
``ftis_fed/receive/checks.py`` then runs the registered checks on their samples).

Trust nothing a peer says that the receiver can check itself; no peer's input can end or stall the
round. For each frame, on its own (``receive``):

1. ``Inbox.accept`` with the receiver's own ``ReceiveBounds``: signature, quarantine, run, replay and
   round, one frame per sender per round, declared sizes before decompressing, content validation
   (max-new-tokens, text lengths, group size), the run's sampling, the tokenizer, ids below the
   receiver's vocabulary. The frame's sequence number is spent once its signature holds.
2. Not the receiver's own batch relayed back (``own_batch_relayed``).
3. Task truth (``receiver_copy``), per group: with horizontal groups the task id must be one of the
   round's shared prompts, the receiver's own prompts of that round (``unshared_task``: the sender's
   word is never taken for it, and a mixed group must not take in another prompt's completions); the
   task id must name a train item of this run
   (``TaskResolver``: ``eval_task`` / ``unknown_task``), once per batch (``duplicate_task``); the
   prompt must be the receiver's own rendering of that task: same tokenizer, the prompt ids equal
   ``render(task.text)`` (a wire-v2 frame without prompt ids: the digest of every group's
   ``render(task.text)`` equals the batch's ``prompt_digest``, and the rendered ids are used);
   another tokenizer, the prompt text equals ``task.text`` (``prompt_mismatch``). The group's
   reference, prompt text and completion texts are replaced by the receiver's own: the task's reference, the task's text, and the texts that will be trained
   on (same tokenizer: ``decode`` of the ids, never the carried texts; another tokenizer: the
   carried texts, which are what gets re-tokenized, at most ``max_retokenized_tokens`` per
   completion and ``max_retokenized_batch_tokens`` per batch in the receiver's tokenizer:
   ``retokenized_too_long``).
4. Rewards recomputed on that copy (``reverify``: replace / downweight / drop / off), within the
   batch's time budget (``reverify-time-budget-s``: ``time_budget``). Reward functions that take
   ``completion_ids`` get the ids of the text the receiver will train on: the sender's ids (same
   tokenizer: the text is their decoding), or the receiver's own tokenization of the carried text
   (another tokenizer; never that sender's ids, which nothing here trains on).

Any failure drops that frame with a named reason (an unexpected exception: ``internal_error``);
the other frames go on. Every outcome is recorded per sender under ``trust/<sender>/...``
(``trust/_unverified/...`` before a signature holds: a claimed sender is not yet a sender), and a
sender whose signed batches disagree (claimed rewards or references, texts that are not the decoded
ids) or are refused for a reason it controls (``Inbox.charge``: not one of ``NOT_THE_SENDERS_FAULT``;
``time_budget`` counts) ``reverify-quarantine-after`` times is ignored for the rest of the run
(``quarantined``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from ftis_fed.wire.batch import BatchValidationError, CompletionBatch, prompt_ids_digest
from ftis_fed.trust.bounds import ReceiveBounds
from ftis_fed.trust.inbox import Accepted, Inbox
from ftis_fed.trust.reverify import ReverifyConfig, reverify
from ftis_fed.tasks.rewards import Verifier
from ftis_fed.tasks.resolve import TaskRefused, TaskResolver

log = logging.getLogger(__name__)

#: Trust-record key for rejections before a signature holds (participant names cannot start with "_").
UNVERIFIED = "_unverified"

@dataclass(frozen=True)
class ReceiverContext:
    """Everything a receiver checks peers' batches with, all of it its own.

    name: the receiver's participant id. bounds: its ``ReceiveBounds``. tasks: its ``TaskResolver``.
    verifier: its reward rules. reverify: what to do with disagreeing rewards.
    render(task_text) -> prompt ids: its chat template applied to a task's text.
    decode(ids) -> text: its tokenizer's decoding (special tokens skipped), as the sender's verifier saw it.
    tokenizer_fp: its tokenizer fingerprint.
    shared_tasks: horizontal groups: the task ids of the round's shared prompts (its own prompts of
        the round); a group for any other task is refused (``unshared_task``). None: not checked
        (vertical groups, where each participant has its own prompts).
    encode(text) -> ids: its tokenizer (no special tokens), to bound what another tokenizer's texts
        re-tokenize to (``retokenized_too_long``) before anything is trained on them. None: not bounded.
    """

    name: str
    bounds: ReceiveBounds
    tasks: TaskResolver
    verifier: Verifier
    reverify: ReverifyConfig
    render: Callable[[str], Sequence[int]]
    decode: Callable[[Sequence[int]], str]
    tokenizer_fp: str
    shared_tasks: frozenset[str] | None = None
    encode: Callable[[str], Sequence[int]] | None = None

    @classmethod
    def from_run(cls, fed, policy, verifier: Verifier, name: str, known_tasks=None, shared_tasks=None,
                 **bounds) -> "ReceiverContext":
        """A participant's context: run ``fed`` (FederationConfig), its ``policy`` (tokenizer, template,
        vocabulary), its ``verifier``. known_tasks: benchmark train items it loaded (TaskResolver.known;
        None: ``fed.task.known_tasks()``, its own copy of the run's benchmark file);
        shared_tasks: the round's shared task ids (horizontal groups) or None;
        ``bounds``: overrides of ``ReceiveBounds.from_run``."""
        tok = policy.tokenizer
        return cls(name=name, bounds=ReceiveBounds.from_run(fed, policy.vocab_size, **bounds),
                   tasks=run_tasks(fed, known_tasks),
                   verifier=verifier, reverify=fed.reverify, render=policy.format_prompt,
                   decode=lambda ids: tok.decode(list(ids), skip_special_tokens=True),
                   tokenizer_fp=policy.tokenizer_fp,
                   encode=lambda text: tok(text, add_special_tokens=False)["input_ids"],
                   shared_tasks=frozenset(shared_tasks) if shared_tasks is not None else None)


@dataclass
class Received:
    """What a receiver keeps of one delivery of peers' frames.

    batches: the receiver's own copies of the accepted batches (its references, prompts, texts and
        recomputed rewards), in arrival order, ready for ``training.samples_from_batches``.
    weights: per batch, None or per group (G,) completion weights (``reverify-action = downweight``).
    seconds: per batch, the wall-clock seconds its checks here took (of ``time_budget_s``; the
        receiver checks' re-scoring gets the rest, ``receive/phrase.py``).
    metrics: ``offpolicy/received``, ``offpolicy/accepted``, ``offpolicy/rejected/<reason>``,
        ``reward/peer_checked``, ``reward/peer_disagreements`` and the per-sender trust record
        ``trust/<sender>/{accepted, rejected/<reason>, rewards_corrected, disagreements,
        forged_references, texts_disagree, quarantined}``.
    """

    batches: list[CompletionBatch] = field(default_factory=list)
    weights: list[tuple[np.ndarray, ...] | None] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    seconds: list[float] = field(default_factory=list)

    def seconds_of(self, batch: CompletionBatch) -> float:
        """The part of ``batch``'s time budget its checks here spent (0 for a batch not received here)."""
        return next((t for b, t in zip(self.batches, self.seconds) if b is batch), 0.0)

    def weights_of(self, batch: CompletionBatch) -> tuple[np.ndarray, ...] | None:
        """The re-verification weights of ``batch`` (one of ``batches``, by identity), or None."""
        return next((w for b, w in zip(self.batches, self.weights) if b is batch), None)


@dataclass
class _Truth:
    """What building the receiver's copy found (counts of groups / completions)."""

    forged_references: int = 0
    texts_disagree: int = 0
    own_ids: list = field(default_factory=list)     # per group: another tokenizer's texts in the receiver's ids, or None


def run_tasks(fed, known_tasks=None) -> TaskResolver:
    """The train tasks of run ``fed`` as this node resolves them (``TaskResolver``); known_tasks:
    benchmark train items it loaded (None: ``fed.task.known_tasks()``, its own copy of the file)."""
    return TaskResolver(tuple(fed.task.families), int(fed.task.seed),
                        dict(fed.task.known_tasks() if known_tasks is None else known_tasks), fed.task.source)


def resolve_task(task_id: str, where: str, tasks: TaskResolver, seen: set[str],
                 shared: frozenset[str] | None = None):
    """One group's task as this node knows it, or BatchValidationError: ``duplicate_task`` (already in
    ``seen``, which it is added to), ``unshared_task`` (not in ``shared``, when given), ``eval_task`` /
    ``unknown_task`` (``TaskResolver``)."""
    if task_id in seen:
        raise BatchValidationError("duplicate_task", f"{where}.task_id={task_id[:64]!r}: appears twice in one batch")
    seen.add(task_id)
    if shared is not None and task_id not in shared:
        raise BatchValidationError("unshared_task", f"{where}.task_id={str(task_id)[:64]!r}: not one of this "
                                                    "round's shared prompts (advantage-groups=horizontal)")
    try:
        return tasks.resolve(task_id)
    except TaskRefused as e:
        raise BatchValidationError(e.reason, f"{where}: {e}") from None


def receiver_copy(acc: Accepted, ctx: ReceiverContext, deadline: float | None = None) -> tuple[CompletionBatch, _Truth]:
    """The batch as the receiver will score and train on it; BatchValidationError if a task or prompt
    is not the receiver's own (see module docstring, step 3)."""
    truth, groups, seen, retokenized = _Truth(), [], set(), 0
    renders: dict[str, np.ndarray] = {}
    digest = acc.batch.prompt_digest           # wire v2 without prompt ids: check the receiver's renderings
    for gi, g in enumerate(acc.batch.groups):
        where = f"groups[{gi}]"
        task = resolve_task(g.task_id, where, ctx.tasks, seen, ctx.shared_tasks)
        truth.forged_references += int(g.reference != task.reference)
        if acc.token_level:
            own = renders.get(task.text)
            if own is None:
                own = renders[task.text] = np.asarray(ctx.render(task.text), dtype=np.int64)
            if not digest and (g.prompt_ids.shape != own.shape or not np.array_equal(g.prompt_ids, own)):
                raise BatchValidationError("prompt_mismatch", f"{where}.prompt_ids: not this receiver's rendering "
                                                              f"of task {g.task_id!r} ({g.prompt_ids.size} ids, "
                                                              f"expected {own.size})")
            texts = tuple(ctx.decode(ids.tolist()) for ids in g.completion_ids)
            truth.own_ids.append(None)
            if g.completion_texts:
                truth.texts_disagree += sum(a != b for a, b in zip(texts, g.completion_texts))
            g = dataclasses.replace(g, prompt_ids=own)
        else:
            if g.prompt_text != task.text:
                raise BatchValidationError("prompt_mismatch", f"{where}.prompt_text: not the text of task "
                                                              f"{g.task_id!r}")
            texts = tuple(g.completion_texts)
            ids = None
            if ctx.encode is not None:
                n, ids = _retokenized_within(texts, ctx, where, retokenized)
                retokenized += n
            truth.own_ids.append(ids)
        groups.append(dataclasses.replace(g, reference=task.reference, prompt_text=task.text, completion_texts=texts))
        if deadline is not None and time.monotonic() > deadline:
            raise BatchValidationError("time_budget", f"{where}: checking the batch ran past its time budget")
    if digest and acc.token_level:
        own_digest = prompt_ids_digest([g.prompt_ids for g in groups])
        if own_digest != digest:
            raise BatchValidationError("prompt_mismatch", f"prompt_digest {digest.hex()}: the batch's prompts are "
                                                          f"not this receiver's renderings of its tasks "
                                                          f"({own_digest.hex()}: another chat template or system "
                                                          "prompt?)")
    batch = dataclasses.replace(acc.batch, groups=tuple(groups), prompt_digest=b"" if acc.token_level else digest)
    return batch, truth


def _retokenized_within(texts: Sequence[str], ctx: ReceiverContext, where: str,
                        so_far: int) -> tuple[int, tuple[list[int], ...]]:
    """Tokens the receiver's tokenizer makes of one group's completion texts, and those ids per
    completion (what its reward functions get as ``completion_ids``); BatchValidationError
    ``retokenized_too_long`` above ``max_retokenized_tokens`` per completion or, with ``so_far``
    (the batch's earlier groups), ``max_retokenized_batch_tokens`` per batch."""
    b, n, out = ctx.bounds, 0, []
    for i, t in enumerate(texts):
        out.append([int(x) for x in ctx.encode(t)])
        k = len(out[-1])
        if k > b.max_retokenized_tokens:
            raise BatchValidationError("retokenized_too_long", f"{where}.completion_texts[{i}]: {len(t)} characters "
                                                               f"re-tokenize to {k} tokens here: limit "
                                                               f"{b.max_retokenized_tokens} per completion")
        n += k
        if so_far + n > b.max_retokenized_batch_tokens:
            raise BatchValidationError("retokenized_too_long", f"{where}: the batch's texts re-tokenize to more than "
                                                               f"{b.max_retokenized_batch_tokens} tokens here")
    return n, tuple(out)


def receive(frames: Iterable[bytes | None], round: int | None, inbox: Inbox, ctx: ReceiverContext) -> Received:
    """Verify, check and re-score peers' frames of ``round``, each on its own (see module docstring).

    inbox: the receiver's long-lived Inbox (keys, replay guard, frames per round, quarantine).
    """
    out = Received()
    frames = list(frames)
    m: Counter[str] = Counter()
    m["offpolicy/received"] = len(frames)
    m["offpolicy/accepted"] = 0
    for frame in frames:
        sender, reason = UNVERIFIED, None
        t0 = time.monotonic()
        try:
            acc = inbox.accept(frame, expected_round=round, bounds=ctx.bounds)
            sender = acc.sender
            if sender == ctx.name:
                raise BatchValidationError("own_batch_relayed", "the receiver's own batch came back from the relay")
            deadline = t0 + ctx.bounds.time_budget_s
            local, truth = receiver_copy(acc, ctx, deadline)
            res = reverify(local, ctx.verifier, ctx.reverify, deadline=deadline, own_ids=truth.own_ids)
            dis = int(res.metrics["reward/disagreements"])
            m["reward/peer_checked"] += res.metrics["reward/checked"]
            m["reward/peer_disagreements"] += dis
            m[f"trust/{sender}/disagreements"] += dis
            m[f"trust/{sender}/forged_references"] += truth.forged_references
            m[f"trust/{sender}/texts_disagree"] += truth.texts_disagree
            corrected = res.metrics["reward/replaced"] if ctx.reverify.action == "replace" else dis
            m[f"trust/{sender}/rewards_corrected"] += int(corrected)
            if dis or truth.forged_references or truth.texts_disagree:
                inbox.strikes[sender] += 1
            if res.batch is None:
                raise BatchValidationError("reward_disagreement", f"{dis} claimed rewards disagree with this "
                                                                  "receiver's: batch dropped (reverify-action=drop)")
            out.batches.append(res.batch)
            out.weights.append(res.weights)
            out.seconds.append(time.monotonic() - t0)
            m["offpolicy/accepted"] += 1
            m[f"trust/{sender}/accepted"] += 1
        except BatchValidationError as e:
            reason = e.reason
            if e.sender is not None:
                sender = e.sender
        except Exception as e:                                  # noqa: BLE001 - one batch, never the round
            reason = "internal_error"
            log.warning("batch from %s dropped: %s: %s", sender, type(e).__name__, str(e)[:200])
        if reason is not None:
            m[f"offpolicy/rejected/{reason}"] += 1
            m[f"trust/{sender}/rejected/{reason}"] += 1
            if sender != UNVERIFIED and reason != "reward_disagreement":    # that one was struck above
                inbox.charge(sender, reason, 0)
        if sender != UNVERIFIED and inbox.quarantine_if_due(sender, ctx.reverify.quarantine_after):
            log.warning("sender %s quarantined after %d refused or disagreeing batches", sender, inbox.strikes[sender])
        if sender != UNVERIFIED:
            m[f"trust/{sender}/quarantined"] = float(sender in inbox.quarantined)
    out.metrics = {k: float(v) for k, v in m.items()}
    return out
