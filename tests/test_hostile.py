"""Hostile but validly signed batches against the REAL receive path.

Real Ed25519 keys (``ftis_fed.trust.signing``), real wire encoding, ``receive`` (inbox -> task truth ->
re-scoring), and a real tokenizer and chat template (``tiny-llama``: SmolLM2's tokenizer on a tiny
random model, built offline into the model cache). One test per case of issue 10, each with the
outcome it must have: rejected with a named reason, or corrected, or bounded.
"""

from __future__ import annotations

import signal
import struct
from contextlib import contextmanager

import numpy as np
import pytest
import zstandard as zstd
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ftis_fed.trust.bounds import RETOKENIZE_FACTOR
from ftis_fed.wire import codec as wire
from ftis_fed.wire.batch import CompletionBatch, make_group
from ftis_fed.config.federation import FederationConfig, ParticipantSpec
from ftis_fed.trust.inbox import Inbox, InboxConfig
from ftis_fed.policies import PolicyConfig, build_policy
from ftis_fed.receive.frames import UNVERIFIED, ReceiverContext, receive
from ftis_fed.trust.reverify import ReverifyConfig
from ftis_fed.tasks.rewards import RewardRule, Verifier, answers_match, default_rules, extract_boxed
from ftis_fed.trust.signing import KeyDirectory, generate_keypair, sign_body
from ftis_fed.tasks.suite import TaskSpec, task_at
from ftis_fed.wire.codec import WireOptions, encode_body

RUN = "run-h"
KEYS = {p: Ed25519PrivateKey.generate() for p in ("alice", "bob", "carol")}
DIRECTORY = KeyDirectory({p: k.public_key() for p, k in KEYS.items()})
FED = FederationConfig(run_name=RUN, group_size=4, max_new_tokens=32,
                       task=TaskSpec(families=("add30", "sub30"), prompts_per_round=2))


@pytest.fixture(scope="module")
def policy():
    return build_policy(PolicyConfig(model="tiny-llama", micro_batch=8))


@pytest.fixture
def rx(policy):
    """(inbox, context) of receiver 'carol' for FED: a fresh receiver per test."""
    inbox = Inbox(DIRECTORY, InboxConfig(run_id=RUN, tokenizer_fp=policy.tokenizer_fp))
    return inbox, ReceiverContext.from_run(FED, policy, Verifier(), "carol")


def completion(policy, text: str) -> list[int]:
    return policy.tokenizer(text, add_special_tokens=False)["input_ids"] + [policy.tokenizer.eos_token_id]


def group_for(policy, task, answers, rewards=None, reference=None, prompt_ids=None, texts=None, prompt_text=None):
    """A group as an honest sender builds it (unless an argument says otherwise)."""
    ids = [completion(policy, a) for a in answers]
    decoded = [policy.tokenizer.decode(c, skip_special_tokens=True) for c in ids]
    if rewards is None:
        rewards = [Verifier().reward(task.task_id, t, task.reference, task.text) for t in decoded]
    return make_group(policy.format_prompt(task.text) if prompt_ids is None else prompt_ids, ids,
                      [np.full(len(c), -0.5) for c in ids], rewards, task.task_id,
                      task.reference if reference is None else reference,
                      task.text if prompt_text is None else prompt_text, decoded if texts is None else texts)


def batch(policy, groups, sender="alice", round=1, seq=None, **kw) -> CompletionBatch:
    fields = dict(sender=sender, run_id=RUN, round=round, seq=(round << 16) + 1 if seq is None else seq,
                  model_id="tiny-llama", tokenizer_fp=policy.tokenizer_fp, vocab_size=policy.vocab_size,
                  sampling=FED.sampling, groups=tuple(groups))
    fields.update(kw)
    return CompletionBatch(**fields)


def signed(b: CompletionBatch, options=WireOptions()) -> bytes:
    """Encode and sign WITHOUT validating, as a hostile sender does: only the signature is real."""
    return sign_body(encode_body(b, options), KEYS[b.sender])


def honest(policy, sender="alice", round=1, seq=None, index=0) -> CompletionBatch:
    tasks = [task_at("add30", "train", 0, index), task_at("sub30", "train", 0, index)]
    groups = [group_for(policy, t, [t.reference, "12", f"It is {t.reference}", "no idea"]) for t in tasks]
    return batch(policy, groups, sender, round, seq)


def rejected(recv, reason: str, sender: str = "alice") -> bool:
    return (recv.metrics.get(f"offpolicy/rejected/{reason}") == 1
            and recv.metrics.get(f"trust/{sender}/rejected/{reason}") == 1 and not recv.batches)


@contextmanager
def hard_limit(seconds: int):
    """Fail (not hang) if the block runs for minutes: the inputs below would take hours if the work
    were quadratic or unbounded; this is a backstop, not a timing measurement."""
    def boom(*_):
        raise TimeoutError(f"still running after {seconds} s: the work is not bounded")
    old = signal.signal(signal.SIGALRM, boom)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


# ----------------------------------------------------------------------------- the honest baseline

def test_an_honest_batch_is_accepted_as_sent(policy, rx):
    b = honest(policy)
    recv = receive([signed(b)], 1, *rx)
    assert recv.metrics["offpolicy/accepted"] == 1 and recv.metrics["trust/alice/accepted"] == 1
    assert recv.metrics["trust/alice/rewards_corrected"] == 0 and recv.metrics["trust/alice/forged_references"] == 0
    assert recv.metrics["trust/alice/texts_disagree"] == 0
    got = recv.batches[0]
    assert [g.rewards.tolist() for g in got.groups] == [g.rewards.tolist() for g in b.groups] == [[1, 0, 1, 0]] * 2
    assert all(np.array_equal(a.prompt_ids, c.prompt_ids) for a, c in zip(got.groups, b.groups))


def test_another_tokenizer_is_checked_on_its_texts(policy, rx):
    t = task_at("add30", "train", 0, 3)
    g = group_for(policy, t, [t.reference, "0", "1", "2"], rewards=[1, 1, 1, 1])    # 3 inflated
    recv = receive([signed(batch(policy, [g], tokenizer_fp="tok-other"))], 1, *rx)
    assert recv.metrics["offpolicy/accepted"] == 1 and recv.metrics["trust/alice/rewards_corrected"] == 3
    assert recv.batches[0].groups[0].rewards.tolist() == [1, 0, 0, 0]


# ----------------------------------------------------------------------------- receiver-side truth

def test_forged_reference_is_ignored_and_the_true_answer_recomputed(policy, rx):
    t = task_at("add30", "train", 0, 0)
    assert t.task_id == "add30/train/0/0" and t.reference == "33"
    forged = group_for(policy, t, ["38"] * 4, rewards=[1.0] * 4, reference="38")
    recv = receive([signed(batch(policy, [forged]))], 1, *rx)
    assert recv.metrics["trust/alice/forged_references"] == 1
    assert recv.metrics["trust/alice/rewards_corrected"] == 4 and recv.metrics["trust/alice/disagreements"] == 4
    g = recv.batches[0].groups[0]
    assert g.rewards.tolist() == [0.0] * 4 and g.reference == "33"
    # under reverify-action = drop the batch goes instead
    inbox, ctx = rx
    import dataclasses
    drop = dataclasses.replace(ctx, reverify=ReverifyConfig(action="drop"))
    recv = receive([signed(batch(policy, [forged], seq=9 << 16))], None, Inbox(DIRECTORY, inbox.config), drop)
    assert rejected(recv, "reward_disagreement")


def test_ids_are_scored_not_the_texts_beside_them(policy, rx):
    t = task_at("add30", "train", 0, 1)
    g = group_for(policy, t, ["banana split"] * 4, rewards=[1.0] * 4, texts=[t.reference] * 4)  # true texts, junk ids
    recv = receive([signed(batch(policy, [g]))], 1, *rx)
    assert recv.metrics["trust/alice/texts_disagree"] == 4 and recv.metrics["trust/alice/rewards_corrected"] == 4
    out = recv.batches[0].groups[0]
    assert out.rewards.tolist() == [0.0] * 4 and out.completion_texts == ("banana split",) * 4
    assert rx[0].strikes["alice"] == 1                                   # one strike for the batch


def test_texts_that_disagree_with_their_ids_are_a_strike_even_with_true_rewards(policy, rx):
    t = task_at("add30", "train", 0, 1)
    g = group_for(policy, t, [t.reference, "1", "2", "3"], texts=["banana", "1", "2", "3"])
    recv = receive([signed(batch(policy, [g]))], 1, *rx)
    assert recv.metrics["trust/alice/texts_disagree"] == 1 and recv.metrics["trust/alice/rewards_corrected"] == 0
    assert recv.metrics["trust/alice/accepted"] == 1 and rx[0].strikes["alice"] == 1


def test_garbage_prompt_ids_are_refused(policy, rx):
    t = task_at("add30", "train", 0, 2)
    junk = np.random.default_rng(0).integers(0, 1000, 40)
    recv = receive([signed(batch(policy, [group_for(policy, t, ["1"] * 4, prompt_ids=junk)]))], 1, *rx)
    assert rejected(recv, "prompt_mismatch")


def test_another_tokenizers_prompt_text_must_be_the_tasks(policy, rx):
    t = task_at("add30", "train", 0, 2)
    g = group_for(policy, t, ["1"] * 4, prompt_text="What is 2 + 2? Reply with just the number.")
    recv = receive([signed(batch(policy, [g], tokenizer_fp="tok-other"))], 1, *rx)
    assert rejected(recv, "prompt_mismatch")


@pytest.mark.parametrize("family, split, reason", [
    ("add30", "eval", "eval_task"),          # held-out item of a trained family
    ("add3", "train", "eval_task"),          # out-of-distribution family: evaluation only
    ("add1", "train", "unknown_task"),       # not one of this run's task-families
])
def test_eval_and_foreign_task_ids_are_refused(policy, rx, family, split, reason):
    t = task_at(family, split, 0, 0)
    recv = receive([signed(batch(policy, [group_for(policy, t, [t.reference] * 4)]))], 1, *rx)
    assert rejected(recv, reason)


def test_unknown_and_duplicate_task_ids_are_refused(policy, rx):
    t = task_at("add30", "train", 0, 0)
    g = group_for(policy, t, ["1"] * 4)
    import dataclasses
    for i, (groups, reason) in enumerate([([dataclasses.replace(g, task_id="gsm8k/train/7")], "unknown_task"),
                                          ([dataclasses.replace(g, task_id="gsm8k/test/7")], "eval_task"),
                                          ([dataclasses.replace(g, task_id="add30/train/1/0")], "unknown_task"),
                                          ([g, g], "duplicate_task")]):
        recv = receive([signed(batch(policy, groups, round=1 + i))], 1 + i, *rx)
        assert rejected(recv, reason), (groups[0].task_id, recv.metrics)


# ----------------------------------------------------------------------------- receiver-side bounds

def test_ids_beyond_the_receivers_vocabulary_are_refused_whatever_the_header_says(policy, rx):
    t = task_at("add30", "train", 0, 0)
    g = group_for(policy, t, ["1"] * 4)
    g = make_group(g.prompt_ids, [np.array([5, policy.vocab_size + 7, 2**31])] * 4, [np.full(3, -0.5)] * 4,
                   [0.0] * 4, g.task_id, g.reference, g.prompt_text, ["1"] * 4)
    recv = receive([signed(batch(policy, [g], vocab_size=2**32))], 1, *rx)
    assert rejected(recv, "id_out_of_range")


def test_a_million_token_completion_is_refused_from_the_header(policy, rx, decompressions):
    """1,048,560 tokens in a run with max-new-tokens 32, the header claiming max_new_tokens 2**20."""
    t = task_at("add30", "train", 0, 0)
    n = 1_048_560
    g = make_group(policy.format_prompt(t.text), [np.ones(n, dtype=np.int64)], [np.full(n, -0.5)], [1.0],
                   t.task_id, t.reference, t.text, ["1"])
    import dataclasses
    b = batch(policy, [g], sampling=dataclasses.replace(FED.sampling, max_new_tokens=1 << 20))
    recv = receive([signed(b, WireOptions(zstd_level=1))], 1, *rx)
    assert rejected(recv, "too_large") and decompressions == []
    # one token over the run's max-new-tokens, within every size bound: refused on its length
    g33 = group_for(policy, t, ["1"] * 4)
    g33 = dataclasses.replace(g33, completion_ids=(np.ones(33, dtype=np.int64),) * 4,
                              logprobs=(np.full(33, -0.5, dtype=np.float32),) * 4)
    recv = receive([signed(batch(policy, [g33], round=2, sampling=b.sampling))], 2, *rx)
    assert rejected(recv, "length_mismatch")


def test_cross_tokenizer_texts_are_bounded(policy, rx, decompressions):
    t = task_at("add30", "train", 0, 0)
    huge = group_for(policy, t, ["1"] * 4, texts=["7" * 540_000] + ["1"] * 3)
    recv = receive([signed(batch(policy, [huge], tokenizer_fp="tok-other"))], 1, *rx)
    assert rejected(recv, "too_large") and decompressions == []            # refused from the header
    limit = rx[1].bounds.max_text_chars
    assert limit == 32 * 32
    over = group_for(policy, t, ["1"] * 4, texts=["7" * (limit + 1)] + ["1"] * 3)
    recv = receive([signed(batch(policy, [over], round=2, tokenizer_fp="tok-other"))], 2, *rx)
    assert rejected(recv, "text_too_long")


def test_a_decompression_bomb_is_refused_before_decompressing(policy, rx, decompressions):
    """A 4 KB signed frame whose payload would decompress to 122 MiB (v1: fixed header offsets)."""
    body = bytearray(encode_body(honest(policy), WireOptions(texts=False, version=1)))
    raw_len = 122 << 20
    bomb = zstd.ZstdCompressor(level=3).compress(bytes(raw_len))
    head_len = len(body) - struct.unpack_from("<I", body, wire.header_offset("payload_len")[0])[0]
    struct.pack_into("<I", body, wire.header_offset("raw_len")[0], raw_len)
    struct.pack_into("<I", body, wire.header_offset("payload_len")[0], len(bomb))
    frame = sign_body(bytes(body[:head_len]) + bomb, KEYS["alice"])
    assert len(frame) < 8 << 10
    recv = receive([frame], 1, *rx)
    assert rejected(recv, "too_large") and decompressions == []
    assert rx[1].bounds.max_raw_bytes < 1 << 20                           # the run's bound, not 128 MiB


def test_a_65536_group_frame_is_refused_from_the_header(policy, rx, decompressions):
    t = task_at("add30", "train", 0, 0)
    g = make_group([1], [[2]], [[-0.5]], [1.0], t.task_id, t.reference)
    frame = signed(batch(policy, [g] * 65_536), WireOptions(texts=False))
    assert len(frame) < 64 << 10
    recv = receive([frame], 1, *rx)
    assert rejected(recv, "too_large") and decompressions == []


def test_the_run_sampling_distribution_is_required(policy, rx):
    import dataclasses
    b = dataclasses.replace(honest(policy), sampling=dataclasses.replace(FED.sampling, temperature=1.0))
    assert rejected(receive([signed(b)], 1, *rx), "wrong_sampling")


# ----------------------------------------------------------------------------- budgets per sender

def test_a_rejected_frame_cannot_be_resent(policy, rx):
    t = task_at("add30", "eval", 0, 0)
    bad = signed(batch(policy, [group_for(policy, t, [t.reference] * 4)]))
    assert rejected(receive([bad], 1, *rx), "eval_task")
    recv = receive([bad] * 4096, 1, *rx)                                  # 4096 resends: all replays
    assert recv.metrics["offpolicy/rejected/replay"] == 4096 and not recv.batches
    # the sender's one frame of the round is spent too: a fresh, honest frame of round 1 is refused
    assert rejected(receive([signed(honest(policy, seq=(1 << 16) + 2))], 1, *rx), "too_many_frames")


def test_two_hundred_frames_from_one_sender_yield_one_batch(policy, rx):
    frames = [signed(honest(policy, seq=(1 << 16) + i, index=i)) for i in range(200)]
    frames.append(signed(honest(policy, sender="bob")))
    recv = receive(frames, 1, *rx)
    assert recv.metrics["trust/alice/accepted"] == 1 and recv.metrics["trust/bob/accepted"] == 1
    assert recv.metrics["trust/alice/rejected/too_many_frames"] == 199
    assert [b.sender for b in recv.batches] == ["alice", "bob"]


def test_unsigned_rejections_are_not_charged_to_the_claimed_sender(policy, rx):
    b = honest(policy, sender="bob")
    forged = sign_body(encode_body(b), KEYS["alice"])                 # claims bob, signed by alice
    recv = receive([forged, signed(b)], 1, *rx)
    assert recv.metrics[f"trust/{UNVERIFIED}/rejected/bad_signature"] == 1
    assert recv.metrics["trust/bob/accepted"] == 1                      # bob's real frame still gets through


# ----------------------------------------------------------------------------- bounded work

def test_extract_boxed_is_linear():
    """'\\boxed{' x 300,000 (2.1 MB): quadratic extraction would scan 4.5e10 characters (hours)."""
    text = "\\boxed{" * 300_000
    with hard_limit(120):
        assert extract_boxed(text) is None
        assert extract_boxed(text + "7}") == "7"
        assert extract_boxed("\\boxed{1} " * 100_000 + "\\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"


def test_deeply_nested_answers_compare_without_recursion():
    """A 2.4 KB nested reference raised RecursionError; now comparisons are bounded (MAX_NESTING)."""
    ref = "(1," * 600 + "1" + ")" * 600
    pred = "(1," * 600 + "2" + ")" * 600
    assert len(ref) > 2400
    with hard_limit(60):
        assert answers_match(pred, ref) is False
        assert answers_match(ref, ref) is False                       # longer than MAX_ANSWER_CHARS: no match
        deep = "(1," * 200 + "1" + ")" * 200                          # 801 characters, 200 levels
        assert answers_match(deep, deep) is True                      # equal strings still match
        assert answers_match(deep, deep.replace("(1,1)", "(1,2)")) is False
        assert answers_match("(" * 100_000 + "1" + ")" * 100_000, "1") is False
    assert answers_match("(1, (2, 3))", "(1,(2,3))") and not answers_match("(1, (2, 3))", "(1,(2,4))")


def test_a_deeply_nested_reference_in_a_batch_is_bounded(policy, rx):
    t = task_at("add30", "train", 0, 0)
    nested = "(1," * 600 + "1" + ")" * 600
    recv = receive([signed(batch(policy, [group_for(policy, t, [t.reference] * 4, reference=nested)]))], 1, *rx)
    assert rejected(recv, "too_large")                                 # a reference is <= 256 characters


def test_the_time_budget_drops_the_batch_not_the_round(policy, rx):
    import dataclasses
    inbox, ctx = rx
    slow = dataclasses.replace(ctx, bounds=dataclasses.replace(ctx.bounds, time_budget_s=1e-9),
                               reverify=ReverifyConfig(quarantine_after=2))
    assert rejected(receive([signed(honest(policy))], 1, inbox, slow), "time_budget")
    assert inbox.strikes["alice"] == 1 and "alice" not in inbox.quarantined     # charged to its sender
    assert rejected(receive([signed(honest(policy, round=2))], 2, inbox, slow), "time_budget")
    assert inbox.quarantined == {"alice"}                  # a sender whose batches always time out stops costing


def test_emoji_texts_of_another_tokenizer_are_bounded_by_their_retokenized_length(policy, rx):
    """768 characters of emoji per completion (32 ids x 24 characters: within the text and
    characters-per-id bounds) re-tokenize to thousands of tokens here: refused before training,
    charged to the sender; a text that re-tokenizes within the run's bound is accepted."""
    t = task_at("add30", "train", 0, 0)
    emoji = "\U0001F600\U0001F680\U0001F9E0" * 256
    assert len(emoji) == 768 and len(rx[1].encode(emoji)) > 2000
    g = group_for(policy, t, ["1"] * 4, texts=[emoji] * 4)
    g = dataclasses_replace(g, completion_ids=(np.ones(32, dtype=np.int64),) * 4,
                            logprobs=(np.full(32, -0.5, dtype=np.float32),) * 4)
    with hard_limit(60):
        recv = receive([signed(batch(policy, [g], tokenizer_fp="tok-other"))], 1, *rx)
    assert rejected(recv, "retokenized_too_long") and rx[0].strikes["alice"] == 1
    assert rx[1].bounds.max_retokenized_tokens == RETOKENIZE_FACTOR * 32 + 1 == 129   # 2,000+ tokens refused
    fine = group_for(policy, t, [t.reference, "1", "2", "3"])
    recv = receive([signed(batch(policy, [fine], round=2, tokenizer_fp="tok-other"))], 2, *rx)
    assert recv.metrics["offpolicy/accepted"] == 1


def test_a_frame_of_another_run_is_refused(policy, rx):
    """Same sender, same keys, same round and seq, signed for an earlier run of the same run name."""
    recv = receive([signed(batch(policy, honest(policy).groups, run_id=RUN + "@" + "0" * 32))], 1, *rx)
    assert recv.metrics["offpolicy/rejected/wrong_run"] == 1 and not recv.batches
    assert receive([signed(honest(policy))], 1, *rx).metrics["offpolicy/accepted"] == 1   # seq not spent by it


def test_quarantine_after_repeated_disagreements(policy):
    import dataclasses
    inbox = Inbox(DIRECTORY, InboxConfig(run_id=RUN, tokenizer_fp=policy.tokenizer_fp))
    ctx = ReceiverContext.from_run(dataclasses.replace(FED, reverify=ReverifyConfig(quarantine_after=2)),
                                   policy, Verifier(), "carol")
    t = task_at("add30", "train", 0, 0)
    for rnd in (1, 2):
        forged = group_for(policy, t, ["38"] * 4, rewards=[1.0] * 4, reference="38")
        recv = receive([signed(batch(policy, [forged], round=rnd))], rnd, inbox, ctx)
        assert recv.metrics["trust/alice/accepted"] == 1                # corrected, still used
    assert recv.metrics["trust/alice/quarantined"] == 1
    recv = receive([signed(honest(policy, round=3)), signed(honest(policy, sender="bob", round=3))], 3, inbox, ctx)
    assert recv.metrics["trust/alice/rejected/quarantined"] == 1 and recv.metrics["trust/bob/accepted"] == 1


def test_a_failing_peer_batch_leaves_the_others_trained_on(policy, tmp_path):
    """A reward function that raises on one peer's completions (any exception while checking a
    batch): that batch is dropped as internal_error; the other peer's batch is trained on."""
    for p in ("alice", "bob", "carol"):
        generate_keypair(p, tmp_path / "keys")
    from ftis_fed.participant import Participant

    spec = ParticipantSpec(name="carol", policy=PolicyConfig(model="tiny-llama"), partition_id=2, num_partitions=3,
                           keys_dir=str(tmp_path / "keys"), state_dir=str(tmp_path / "carol"))
    me = Participant(spec, FED, policy=policy)

    def fragile(prompts, completions, **kw):
        text = completions[0][0]["content"]
        if "BOOM" in text:
            raise RuntimeError("reward function crashed")
        return [1.0 if answers_match(text.strip(), kw["reference"][0]) else 0.0]

    me.verifier = Verifier(rules={**default_rules(), "add30": RewardRule(fn=fragile)})
    from ftis_fed.trust.signing import load_private_key
    keys = {p: load_private_key(tmp_path / "keys" / "private" / f"{p}.key") for p in ("alice", "bob")}

    def signed_by(b):
        return sign_body(encode_body(b), keys[b.sender])

    t = task_at("add30", "train", 0, 0)
    boom = batch(policy, [group_for(policy, t, ["BOOM"] * 4, rewards=[0.0] * 4)], sender="alice")
    good = honest(policy, sender="bob")
    metrics = me.learn(1, [signed_by(boom), signed_by(good)])
    assert metrics["offpolicy/rejected/internal_error"] == 1 and metrics["trust/alice/rejected/internal_error"] == 1
    assert metrics["trust/bob/accepted"] == 1 and metrics["offpolicy/accepted"] == 1
    assert metrics["train/peer_samples"] == 8 and metrics["offpolicy/bob/samples"] == 8
    assert np.isfinite(metrics["train/loss"])


# ----------------------------------------------------------------------------- the pieces on their own

def test_task_ids_resolve_to_the_receivers_own_tasks():
    from ftis_fed.tasks import TaskRefused, TaskResolver
    from ftis_fed.tasks.benchmarks import load_gsm8k

    r = TaskResolver(("add30", "sub30"), 0)
    assert r.resolve("add30/train/0/0") == task_at("add30", "train", 0, 0)
    for tid, reason in [("add30/eval/0/0", "eval_task"), ("word_add/train/0/0", "eval_task"),
                        ("math500/test/precalculus/1.json", "eval_task"), ("gsm8k/test/0", "eval_task"),
                        ("gsm8k/train/0", "unknown_task"), ("add30/train/0/007", "unknown_task"),
                        ("add30/train/0/-1", "unknown_task"), ("add30/train/0/" + "9" * 19, "unknown_task"),
                        ("add30/dev/0/0", "unknown_task"), ("add30/train/0", "unknown_task"),
                        ("nope/train/0/0", "unknown_task"), ("x" * 200, "unknown_task")]:
        with pytest.raises(TaskRefused) as e:
            r.resolve(tid)
        assert e.value.reason == reason, tid
    # GSM8K train items: only those the receiver loaded itself, and then its own copy
    from pathlib import Path
    known = {p.task_id: p for p in load_gsm8k(Path(__file__).parent / "fixtures" / "gsm8k", "train")}
    assert TaskResolver(("add30",), 0, known).resolve("gsm8k/train/0") == known["gsm8k/train/0"]
    with pytest.raises(TaskRefused) as e:
        TaskResolver(("add30",), 0, known).resolve("gsm8k/test/0")
    assert e.value.reason == "eval_task"


def test_bounds_come_from_the_run_config_not_the_header():
    from ftis_fed.trust.bounds import ReceiveBounds

    b = ReceiveBounds.from_run(FED, 49152)
    assert (b.vocab_size, b.max_new_tokens, b.max_groups, b.max_group_size) == (49152, 32, 2, 4)
    assert b.max_completion_tokens == 2 * 4 * 32 and b.max_text_chars == 32 * 32 and b.sampling == FED.sampling
    limits = b.wire_limits()
    assert limits.max_groups == 2 and limits.max_completions == 8 and limits.max_tokens == 256
    assert limits.max_raw_bytes == b.max_raw_bytes < limits.max_frame_bytes < 1 << 20
    with pytest.raises(ValueError, match="max_groups=0: must be >= 1"):
        ReceiveBounds(vocab_size=None, max_new_tokens=1, max_groups=0, max_group_size=1, max_completion_tokens=1)


# ------------------------------------------------------------------------- wire v2: prompt digest

def test_v2_frame_without_prompt_ids_is_checked_by_its_digest_and_gets_the_receivers_rendering(policy, rx):
    """An honest v2 frame carries only the digest of its prompt ids; the receiver renders the prompts
    from the task ids, checks the digest, and trains on its own rendering."""
    b = honest(policy)
    frame = signed(b, wire.send_options(False))
    assert wire.parse_header(frame).n_prompt_tokens == 0
    recv = receive([frame], 1, *rx)
    assert recv.metrics["offpolicy/accepted"] == 1, recv.metrics
    got = recv.batches[0]
    assert got.prompt_digest == b""
    for g, own in zip(got.groups, b.groups):
        assert np.array_equal(g.prompt_ids, own.prompt_ids) and g.prompt_ids.size


def test_v2_prompt_digest_mismatch_is_prompt_mismatch(policy, rx):
    """The sender generated from other prompt ids than the receiver's rendering: the digest differs."""
    t = task_at("add30", "train", 0, 2)
    junk = np.random.default_rng(0).integers(0, 1000, 40)
    frame = signed(batch(policy, [group_for(policy, t, ["1"] * 4, prompt_ids=junk)]), wire.send_options(False))
    assert rejected(receive([frame], 1, *rx), "prompt_mismatch")


def test_another_chat_template_with_the_same_tokenizer_is_caught_by_the_digest(policy, rx):
    """The tokenizer fingerprint covers the vocabulary and special tokens, not the chat template: a
    sender with the same tokenizer but another system prompt has the receiver's fingerprint, so only
    the digest of the prompt ids tells the prompts apart."""
    t = task_at("add30", "train", 0, 2)
    other = policy.tokenizer.apply_chat_template([{"role": "system", "content": "You are a pirate."},
                                                  {"role": "user", "content": t.text}],
                                                 add_generation_prompt=True, tokenize=True, return_dict=False)
    assert list(other) != policy.format_prompt(t.text)
    b = batch(policy, [group_for(policy, t, ["1"] * 4, prompt_ids=list(other))])
    assert b.tokenizer_fp == rx[1].tokenizer_fp
    assert rejected(receive([signed(b, wire.send_options(False))], 1, *rx), "prompt_mismatch")


def test_a_forged_digest_is_prompt_mismatch(policy, rx):
    """Empty prompt ids and a made-up digest (what a hostile v2 sender can sign): prompt_mismatch."""
    import dataclasses

    b = honest(policy)
    forged = dataclasses.replace(b, prompt_digest=bytes(8), groups=tuple(
        dataclasses.replace(g, prompt_ids=np.zeros(0, np.int64)) for g in b.groups))
    assert rejected(receive([signed(forged, wire.send_options(False))], 1, *rx), "prompt_mismatch")


def test_v2_frame_with_texts_for_another_tokenizer_is_used_at_sequence_level(policy, rx):
    """Another tokenizer's v2 frame (texts, no prompt ids): checked by its prompt text, as before."""
    b = dataclasses_replace(honest(policy), tokenizer_fp="tok-other")
    recv = receive([signed(b, wire.send_options(True))], 1, *rx)
    assert recv.metrics["offpolicy/accepted"] == 1, recv.metrics
    assert all(g.prompt_text and g.completion_texts for g in recv.batches[0].groups)


def dataclasses_replace(obj, **kw):
    import dataclasses

    return dataclasses.replace(obj, **kw)
