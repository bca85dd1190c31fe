"""Receivers re-verify claimed rewards: honest batches pass, inflated ones are caught and handled."""

import numpy as np
import pytest

from ftis_fed.wire.batch import CompletionBatch, SamplingParams, make_group
from ftis_fed.trust.reverify import ReverifyConfig, recompute_rewards, reverify
from ftis_fed.tasks.rewards import Verifier
from ftis_fed.tasks.suite import make_tasks


def encode(text: str) -> list[int]:
    """A byte-level 'tokenizer': ids are UTF-8 bytes (vocab 256); ``decode`` is its exact inverse."""
    return list(text.encode())


def decode(ids) -> str:
    return bytes(int(i) for i in ids).decode()


def build_batch(replies: list[list[str]], claimed: list[list[float]], with_texts: bool = True,
                families=("add30", "sub30")) -> CompletionBatch:
    prompts = [make_tasks(f, "train", 1, seed=0)[0] for f in families]  # one group per family
    groups = []
    for prompt, texts, rewards in zip(prompts, replies, claimed):
        ids = [encode(t) for t in texts]
        groups.append(make_group(encode(prompt.text), ids, [np.full(len(c), -0.5) for c in ids], rewards,
                                 prompt.task_id, prompt.reference, prompt.text,
                                 texts if with_texts else ()))
    return CompletionBatch("alice", "run-1", 0, 0, "byte-model", "tok-bytes", 256,
                           SamplingParams(temperature=0.7, max_new_tokens=64), tuple(groups)).validate()


def honest_and_inflated():
    """Two groups of 4 completions; the inflated copy claims 1.0 for every completion."""
    prompts = make_tasks("add30", "train", 1, 0) + make_tasks("sub30", "train", 1, 0)
    r0, r1 = prompts[0].reference, prompts[1].reference
    replies = [[r0, f"The answer is {r0}.", "12", "I am not sure"],
               [f"{r1}", "0", f"It is {int(r1) + 1}", f"{r1}."]]
    truth = [[1.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 1.0]]
    return replies, truth, [[1.0] * 4, [1.0] * 4]


def test_honest_batch_agrees_everywhere():
    replies, truth, _ = honest_and_inflated()
    batch = build_batch(replies, truth)
    res = reverify(batch, Verifier())
    assert res.metrics["reward/checked"] == 8 and res.metrics["reward/disagreements"] == 0
    assert res.metrics["reward/replaced"] == 0 and res.metrics["reward/dropped"] == 0
    assert [g.rewards.tolist() for g in res.batch.groups] == truth
    assert all(a.all() for a in res.agree)


@pytest.mark.parametrize("action", ["replace", "downweight", "drop", "off"])
def test_inflated_rewards_are_caught(action):
    replies, truth, inflated = honest_and_inflated()
    batch = build_batch(replies, inflated)
    res = reverify(batch, Verifier(), ReverifyConfig(action=action))
    m = res.metrics
    assert m["reward/checked"] == 8
    assert m["reward/disagreements"] == 4 and m["reward/inflated"] == 4 and m["reward/deflated"] == 0
    assert m["reward/disagreement_rate"] == pytest.approx(0.5)
    assert m["reward/claimed_mean"] == 1.0 and m["reward/recomputed_mean"] == pytest.approx(0.5)
    assert [r.tolist() for r in res.recomputed] == truth
    assert [a.tolist() for a in res.agree] == [[t == 1.0 for t in row] for row in truth]
    if action == "replace":
        assert [g.rewards.tolist() for g in res.batch.groups] == truth
        assert m["reward/replaced"] == 4
        assert [g.rewards.tolist() for g in batch.groups] == inflated  # the received batch is untouched
        res.batch.validate()
    elif action == "downweight":
        assert res.batch is batch
        assert [w.tolist() for w in res.weights] == truth          # wrong claims get weight 0
    elif action == "drop":
        assert res.batch is None and m["reward/dropped"] == 1
    else:
        assert res.batch is batch and res.weights is None


def test_drop_threshold_and_downweight_value():
    replies, truth, _ = honest_and_inflated()
    one_lie = [row[:] for row in truth]
    one_lie[0][2] = 1.0                                   # 1 of 8 claims inflated
    batch = build_batch(replies, one_lie)
    assert reverify(batch, Verifier(), ReverifyConfig(action="drop", max_disagreement=0.2)).batch is batch
    assert reverify(batch, Verifier(), ReverifyConfig(action="drop", max_disagreement=0.1)).batch is None
    w = reverify(batch, Verifier(), ReverifyConfig(action="downweight", disagree_weight=0.25)).weights
    assert w[0].tolist() == [1.0, 1.0, 0.25, 1.0] and w[1].tolist() == [1.0] * 4


def test_deflated_claims_count_as_disagreements_too():
    replies, truth, _ = honest_and_inflated()
    zeros = [[0.0] * 4, [0.0] * 4]
    res = reverify(build_batch(replies, zeros), Verifier())
    m = res.metrics
    assert [g.rewards.tolist() for g in res.batch.groups] == truth    # replaced upward too
    assert m["reward/disagreements"] == 4 and m["reward/deflated"] == 4 and m["reward/inflated"] == 0


def test_decode_callback_when_texts_are_not_carried():
    replies, truth, inflated = honest_and_inflated()
    batch = build_batch(replies, inflated, with_texts=False)
    # no texts and no decoder: nothing can be checked; rejected by default, trusted on request
    res = reverify(batch, Verifier(), ReverifyConfig(action="replace"))
    assert res.metrics["reward/checked"] == 0 and res.metrics["reward/unverifiable"] == 8
    assert res.metrics["reward/disagreement_rate"] == 1.0
    assert all(g.rewards.tolist() == [0.0] * 4 for g in res.batch.groups)
    trusted = reverify(batch, Verifier(), ReverifyConfig(action="replace", on_unverifiable="trust"))
    assert [g.rewards.tolist() for g in trusted.batch.groups] == inflated
    assert trusted.metrics["reward/disagreement_rate"] == 0.0
    # with the sender's tokenizer, decoding the ids recovers the texts and catches the inflation
    res = reverify(batch, Verifier(), decode=decode, tokenizer_fp="tok-bytes")
    assert res.metrics["reward/checked"] == 8 and res.metrics["reward/inflated"] == 4
    assert [g.rewards.tolist() for g in res.batch.groups] == truth
    # a different tokenizer must not decode someone else's ids
    res = reverify(batch, Verifier(), ReverifyConfig(action="drop"), decode=decode, tokenizer_fp="tok-other")
    assert res.metrics["reward/checked"] == 0 and res.batch is None


def test_unknown_family_is_unverifiable():
    replies, truth, _ = honest_and_inflated()
    batch = build_batch(replies, truth)
    only_add = Verifier(rules={"add30": Verifier().rules["add30"]})
    rec = recompute_rewards(batch, only_add)
    assert rec[0].tolist() == truth[0] and np.isnan(rec[1]).all()
    m = reverify(batch, only_add, ReverifyConfig(action="drop", on_unverifiable="trust")).metrics
    assert m["reward/unverifiable"] == 4 and m["reward/dropped"] == 0


def test_config_errors_name_field_and_limit():
    with pytest.raises(ValueError, match=r"reverify.action='ban': must be one of"):
        ReverifyConfig(action="ban")
    with pytest.raises(ValueError, match=r"reverify.max_disagreement=1.0: must be in \[0, 1\)"):
        ReverifyConfig(max_disagreement=1.0)
    with pytest.raises(ValueError, match=r"reverify.tol=-1: must be finite and >= 0"):
        ReverifyConfig(tol=-1)
    with pytest.raises(ValueError, match=r"reverify.quarantine_after=-1: must be an integer >= 0"):
        ReverifyConfig(quarantine_after=-1)


def test_rescoring_past_its_deadline_drops_the_batch_with_a_reason():
    """The deadline is checked after every completion: past it, ``time_budget``; before it, no effect."""
    import time

    from ftis_fed.wire.batch import BatchValidationError

    replies, truth, _ = honest_and_inflated()
    batch = build_batch(replies, truth)
    with pytest.raises(BatchValidationError) as e:
        reverify(batch, Verifier(), deadline=time.monotonic() - 1.0)
    assert e.value.reason == "time_budget"
    res = reverify(batch, Verifier(), deadline=time.monotonic() + 3600.0)
    assert [g.rewards.tolist() for g in res.batch.groups] == truth
