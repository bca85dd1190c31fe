"""The hostile-participant helper produces valid, validly signed, but lying batches."""

from __future__ import annotations

import numpy as np
import pytest

from ftis_fed.trust.attacks import LOGPROB_FLOOR, corrupt, hostile_frames, parse_kinds, wrong_answer
from ftis_fed.wire.batch import CompletionBatch, SamplingParams, make_group
from ftis_fed.trust.bounds import ReceiveBounds
from ftis_fed.trust.inbox import Inbox, InboxConfig
from ftis_fed.trust.signing import ReplayGuard, generate_keypair, key_paths, load_key_directory, load_private_key


def _batch(seq: int = 1) -> CompletionBatch:
    g = make_group([1, 2, 3], [[5, 6], [7]], [[-0.5, -0.1], [-2.0]], [0.0, 0.0], "add30/train/0/0", "33",
                   "What is 10 + 23?", ("38", "33"))
    return CompletionBatch("mallory", "run", 1, seq, "m", "tok-x", 100, SamplingParams(0.7, 1.0, 0, 8), (g,))


def test_kinds():
    assert parse_kinds("all") == ("forge", "inflate", "logprobs", "flood")
    assert parse_kinds("forge, flood") == ("forge", "flood")
    with pytest.raises(ValueError, match="'poison' is not an attack"):
        parse_kinds("forge,poison")
    assert wrong_answer("33") == "38" and wrong_answer("x") == "x1"


def test_corrupted_batch_lies_consistently_and_is_still_valid():
    bad = corrupt(_batch(), ("forge", "logprobs"))
    g = bad.groups[0]
    assert g.reference == "38"
    assert np.all(g.rewards == 1.0)
    assert all(np.all(lp == np.float32(LOGPROB_FLOOR)) for lp in g.logprobs)
    assert [c.tolist() for c in g.completion_ids] == [[5, 6], [7]]        # the tokens are untouched


def test_hostile_frames_are_validly_signed_and_floods_use_fresh_seqs(tmp_path):
    generate_keypair("mallory", tmp_path)
    key = load_private_key(key_paths("mallory", tmp_path).private)
    frames = hostile_frames(_batch(seq=10), key, ("inflate", "flood"), flood=5)
    assert len(frames) == 5
    keys = load_key_directory(tmp_path / "public")
    # the signatures hold and every copy is fresh: an inbox without a per-round frame limit takes all five
    accepted, rejected = Inbox(keys, InboxConfig(run_id="run"), ReplayGuard()).accept_many(frames, expected_round=1)
    assert rejected == {} and [a.batch.seq for a in accepted] == [10, 11, 12, 13, 14]
    assert all(a.batch.sender == "mallory" and np.all(a.batch.groups[0].rewards == 1.0) for a in accepted)
    # what stops a flood is a rule, not cryptography: one frame per sender per round
    bounds = ReceiveBounds(vocab_size=None, max_new_tokens=8, max_groups=1, max_group_size=2,
                           max_completion_tokens=16)
    accepted, rejected = Inbox(keys, InboxConfig(run_id="run"), ReplayGuard()).accept_many(frames, 1, bounds)
    assert [a.batch.seq for a in accepted] == [10] and rejected == {"too_many_frames": 4}
