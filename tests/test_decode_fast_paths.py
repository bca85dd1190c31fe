"""The server's per-frame fast paths (#31: engine CPU per round) decide exactly what the general code
decides: the same values, or the same refusal with the same reason and message, on valid and
hostile input. Small varint runs are decoded in a Python loop (``codec._small_varints``) instead of
the vectorised decoder; a group's completions are checked with one min / max / isfinite over their
concatenation (``batch._completions_pass``) before the per-completion loop that names a failure."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ftis_fed.wire import batch as batch_mod, codec
from ftis_fed.wire.batch import BatchValidationError, make_group
from tests.test_wire import FAST, small_batch


def outcome(fn):
    """(values, None) or (None, (reason, message)) of ``fn()``."""
    try:
        return fn(), None
    except BatchValidationError as e:
        return None, (e.reason, str(e))


def varints_both(buf: bytes, count: int, monkeypatch, offset: int = 0):
    def read(small: int):
        monkeypatch.setattr(codec, "SMALL_VARINTS", small)
        r = codec._Reader(buf)
        r.pos = offset
        got, err = outcome(lambda: r.varints(count, "x").tolist())
        return got, err, r.pos if err is None else None

    return read(codec.SMALL_VARINTS), read(0)          # the fast path, the vectorised decoder alone


@FAST
@given(st.binary(max_size=60), st.integers(1, 20), st.integers(0, 3))
def test_small_varint_runs_decode_as_the_vectorised_decoder_does(buf, count, offset):
    with pytest.MonkeyPatch.context() as mp:
        fast, general = varints_both(buf, count, mp, min(offset, len(buf)))
    assert fast == general


@FAST
@given(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=40), st.sampled_from([b"", b"\x00", b"\x80", b"\xff\xff"]))
def test_canonical_runs_decode_to_their_values(values, tail):
    buf = codec._uvarints(values) + tail
    with pytest.MonkeyPatch.context() as mp:
        fast, general = varints_both(buf, len(values), mp)
    assert fast == general and fast[0] == values and fast[2] == len(buf) - len(tail)


@pytest.mark.parametrize("buf, count", [
    (bytes([0x80, 0x00]), 1),                          # not minimal
    (bytes([0xFF] * 5 + [0x01]), 1),                   # six bytes
    (bytes([0xFF, 0xFF, 0xFF, 0xFF, 0x10]), 1),        # 2**32
    (bytes([0x81, 0x01, 0x80]), 2),                    # ends inside the second
    (bytes([0x01] * 3), 4),                            # too few bytes
])
def test_a_bad_small_run_is_refused_with_the_general_message(buf, count, monkeypatch):
    fast, general = varints_both(buf, count, monkeypatch)
    assert fast == general and fast[1] is not None and fast[1][0] == "undecodable"


def _mutations(seed: int):
    """A valid batch and single-field corruptions of one completion of it."""
    b = small_batch(vocab=1000, lengths=(5, 0, 3), seed=seed)
    g = b.groups[0]

    def with_completion(i, ids=None, lp=None, also=None):
        cids, lps = list(g.completion_ids), list(g.logprobs)
        for j, (new_ids, new_lp) in {i: (ids, lp), **(also or {})}.items():
            cids[j] = cids[j] if new_ids is None else new_ids
            lps[j] = lps[j] if new_lp is None else new_lp
        return dataclasses.replace(b, groups=(dataclasses.replace(g, completion_ids=tuple(cids), logprobs=tuple(lps)),))

    n = len(g.completion_ids[2])
    yield b
    yield with_completion(2, ids=np.full(n, 1000))                              # id = vocab
    yield with_completion(2, ids=np.array([-1, 2, 3]))                          # negative id
    yield with_completion(2, ids=np.arange(n, dtype=np.int32))                  # another int dtype (valid)
    yield with_completion(2, ids=np.arange(n).astype(np.float64))               # float ids
    yield with_completion(2, ids=list(range(n)))                                # not an array
    yield with_completion(2, ids=np.arange(2 * n).reshape(2, n))                # 2-D
    yield with_completion(2, lp=np.zeros(n + 1, dtype=np.float32))              # shape mismatch
    yield with_completion(2, lp=np.full(n, np.nan, dtype=np.float32))           # NaN
    yield with_completion(2, lp=np.array([-1.0, np.inf, -2.0], dtype=np.float32))
    yield with_completion(2, lp=np.full(n, 0.5, dtype=np.float32))              # positive
    yield with_completion(2, lp=np.zeros(n, dtype=np.int64))                    # integer log-probs
    yield with_completion(2, lp=np.zeros(n, dtype=np.float64))                  # another float dtype (valid)
    yield with_completion(0, ids=np.full(5, 5000), lp=np.full(5, 1.0, dtype=np.float32))   # two faults, one named
    yield with_completion(2, lp=np.full(n, 0.5, dtype=np.float32), also={0: (np.full(5, 5000), None)})  # 0's named
    yield with_completion(1, ids=np.arange(40), lp=np.zeros(40, dtype=np.float32))  # longer than max_new_tokens


@pytest.mark.parametrize("seed", [0, 1])
def test_the_group_check_refuses_what_the_per_completion_loop_refuses_naming_the_same(seed, monkeypatch):
    batches = list(_mutations(seed))
    fast = [outcome(lambda: bool(b.validate(max_new_tokens=32))) for b in batches]
    monkeypatch.setattr(batch_mod, "_completions_pass", lambda *a: False)
    general = [outcome(lambda: bool(b.validate(max_new_tokens=32))) for b in batches]
    assert fast == general
    assert fast[0] == (True, None) and sum(err is not None for _, err in fast) >= 10    # the corruptions are refused


def test_a_decoded_frame_round_trips_through_the_fast_paths():
    b = small_batch(vocab=1000, lengths=(5, 0, 3), texts=False)
    frame = codec.encode_body(b, codec.WireOptions()) + bytes(codec.SIGNATURE_LEN)
    h, body, _ = codec.split_frame(frame)
    got = codec.decode_payload(h, body).validate()
    g, want = got.groups[0], b.groups[0]
    assert [c.tolist() for c in g.completion_ids] == [c.tolist() for c in want.completion_ids]
    assert g.prompt_ids.tolist() == want.prompt_ids.tolist()
    assert make_group(g.prompt_ids, g.completion_ids, g.logprobs, g.rewards, g.task_id, g.reference).size == 3
