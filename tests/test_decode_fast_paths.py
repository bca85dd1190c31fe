"""The server's per-frame fast paths (#31: engine CPU per round) decide exactly what the general code
decides: the same values, or the same refusal with the same reason and message, on valid and
hostile input. Small varint runs are decoded in a Python loop (``codec._small_varints``) instead of
the vectorised decoder; a group's completions are checked with one min / max / isfinite over their
concatenation (``batch._completions_pass``) before the per-completion loop that names a failure; a
header's varints are read in one pass (``codec._varint_run``), a payload's strings without naming
each field (``codec._strings_fast``), and a decoded batch is checked over its flat arrays
(``CompletionBatch.validate(flat=...)``, ``batch._flat_pass``) before group by group. Each declines
to the general code wherever it would refuse, so that code names the refusal."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ftis_fed.wire import batch as batch_mod, codec
from ftis_fed.wire.batch import BatchValidationError, CompletionBatch, SamplingParams, make_group
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


# ---- the whole decoder: one-pass header varints, string sections, small log-prob runs, flat checks ----

def canonical(batch) -> tuple:
    """Every value of a decoded batch, exactly (dtypes and bytes of its arrays)."""
    arr = lambda a: (a.dtype.str, a.shape, a.tobytes())  # noqa: E731
    groups = tuple((arr(g.prompt_ids), tuple(map(arr, g.completion_ids)), tuple(map(arr, g.logprobs)), arr(g.rewards),
                    g.task_id, g.reference, g.prompt_text, g.completion_texts) for g in batch.groups)
    return (batch.sender, batch.run_id, batch.round, batch.seq, batch.model_id, batch.tokenizer_fp, batch.vocab_size,
            batch.sampling, batch.prompt_digest, batch.eos_id, groups)


TIGHT = dict(max_new_tokens=4, max_text_chars=3, max_prompt_chars=5, max_string_chars=3, max_prompt_tokens=6,
             max_group_size=2, max_chars_per_token=1)


def decoded(frame: bytes, fast: bool, bounds: dict | None = None):
    """parse + decode + validate ``frame`` with every fast path (``fast``) or none of them."""
    with pytest.MonkeyPatch.context() as mp:
        if not fast:
            mp.setattr(codec, "SMALL_VARINTS", 0)
            mp.setattr(codec, "_strings_fast", lambda *a: None)
            mp.setattr(codec, "_varint_run", lambda *a: None)

        def run():
            h, body, _ = codec.split_frame(frame)
            b, flat = codec.decode_payload_flat(h, body)
            b.validate(1 << 20, flat=flat if fast else None, **(bounds or {}))
            return canonical(b)

        return outcome(run)


OPTIONS = [codec.WireOptions(compress=False), codec.WireOptions(compress=False, texts=False),
           codec.WireOptions(compress=False, prompt_ids=False), codec.WireOptions(compress=False, logp="f32"),
           codec.WireOptions(compress=False, version=1), codec.WireOptions()]


@FAST
@given(st.sampled_from(range(len(OPTIONS))), st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)),
                                                       min_size=1, max_size=3),
       st.booleans())
def test_a_corrupted_frame_decodes_or_is_refused_as_without_the_fast_paths(opt, edits, tight):
    b = small_batch(vocab=1000, lengths=(5, 0, 3))
    frame = bytearray(codec.encode_body(b, OPTIONS[opt]) + bytes(codec.SIGNATURE_LEN))
    for pos, value in edits:                              # any byte of header or payload
        frame[pos % (len(frame) - codec.SIGNATURE_LEN)] = value
    bounds = TIGHT if tight else None
    assert decoded(bytes(frame), True, bounds) == decoded(bytes(frame), False, bounds)


def test_an_intact_frame_decodes_the_same_through_the_fast_paths():
    for opts in OPTIONS:
        frame = codec.encode_body(small_batch(vocab=1000), opts) + bytes(codec.SIGNATURE_LEN)
        fast, general = decoded(frame, True), decoded(frame, False)
        assert fast == general and fast[1] is None


def _hostile_batches():
    """Batches that encode but break one rule each (the encoder does not validate)."""
    b = small_batch(vocab=1000, lengths=(5, 0, 3))
    g = b.groups[0]

    def group(**kw):
        return dataclasses.replace(b, groups=(g, dataclasses.replace(g, **kw)))

    lp = [x.copy() for x in g.logprobs]
    yield b
    yield group(completion_ids=(g.completion_ids[0], g.completion_ids[1], np.array([1, 2, 1000])))   # id = vocab
    yield group(prompt_ids=np.array([999, 1000]))                                   # prompt id = vocab
    for bad in (np.nan, np.inf, -np.inf, 0.5, -300.0):                              # escaped codes; -300: valid
        lp2 = [x.copy() for x in lp]
        lp2[2][1] = bad
        yield group(logprobs=tuple(lp2))
    yield group(rewards=np.array([1.0, np.inf, 0.0], dtype=np.float32))
    yield group(rewards=np.array([1.0, np.nan, 0.0], dtype=np.float32))            # NaN: no reward (valid)
    yield group(task_id="")
    yield group(reference="a long reference")
    yield group(prompt_text="a long prompt text")
    yield group(completion_texts=("ok", "", "toolong"))
    yield group(completion_texts=("ab", "x", "ab"))                                 # "x" for 0 ids
    long = np.arange(6)
    yield group(completion_ids=(g.completion_ids[0], g.completion_ids[1], long),
                logprobs=(lp[0], lp[1], -np.ones(6, dtype=np.float32)))             # 6 > max-new-tokens 4
    yield dataclasses.replace(b, groups=(g, dataclasses.replace(g, completion_ids=g.completion_ids[:2],
                                                                logprobs=g.logprobs[:2], rewards=g.rewards[:2],
                                                                completion_texts=g.completion_texts[:2])))


@pytest.mark.parametrize("opts", [codec.WireOptions(), codec.WireOptions(logp="f32"), codec.WireOptions(version=1),
                                  codec.WireOptions(prompt_ids=False, texts=False)])
@pytest.mark.parametrize("bounds", [None, TIGHT, dict(TIGHT, max_new_tokens=16, max_string_chars=64,
                                                      max_text_chars=64, max_prompt_chars=64, max_group_size=8,
                                                      max_prompt_tokens=8, max_chars_per_token=None)])
def test_the_flat_check_refuses_what_the_group_checks_refuse_naming_the_same(opts, bounds):
    outcomes = []
    for b in _hostile_batches():
        frame = codec.encode_body(b, opts) + bytes(codec.SIGNATURE_LEN)
        fast, general = decoded(frame, True, bounds), decoded(frame, False, bounds)
        assert fast == general
        outcomes.append(fast[1])
    assert (outcomes[0] is None) == (bounds is not TIGHT)          # the honest batch, within loose bounds
    assert sum(e is not None for e in outcomes) >= 6               # the hostile ones are refused


def test_fixed_point_log_probs_need_no_check_but_escaped_ones_do():
    b = next(_hostile_batches())
    h, body, _ = codec.split_frame(codec.encode_body(b, codec.WireOptions()) + bytes(codec.SIGNATURE_LEN))
    _, flat = codec.decode_payload_flat(h, body)
    assert flat.free_logprobs.size == 0 and flat.logprobs.size == b.num_completion_tokens
    bad = dataclasses.replace(b, groups=(dataclasses.replace(b.groups[0], logprobs=(
        np.array([-1, -2, np.nan, -1, -1], dtype=np.float32),) + b.groups[0].logprobs[1:]),))
    h, body, _ = codec.split_frame(codec.encode_body(bad, codec.WireOptions()) + bytes(codec.SIGNATURE_LEN))
    got, flat = codec.decode_payload_flat(h, body)
    assert flat.free_logprobs.size == 1 and np.isnan(flat.free_logprobs[0])
    with pytest.raises(BatchValidationError, match=r"groups\[0\]\.logprobs\[0\]: NaN") as e:
        got.validate(flat=flat)
    assert e.value.reason == "nonfinite_logprob"


def test_a_log_prob_code_above_0xffff_is_refused_by_the_small_run_too():
    g = make_group([1, 2], [[3, 4]], [[-0.5, -255.9]], [1.0], "add/id/1", "42")     # -255.9 nats: code 0xFFE6, 3 bytes
    b = CompletionBatch("alice", "run-1", 3, 7, "m", "tok-x", 1000, SamplingParams(0.7, 0.9, 50, 16), (g,))
    body = bytearray(codec.encode_body(b, codec.WireOptions(compress=False, texts=False)))
    at = bytes(body).index(bytes([0xE6, 0xFF, 0x03]))
    body[at + 2] = 0x04                                                  # bit 16 set: above 0xFFFF
    frame = bytes(body) + bytes(codec.SIGNATURE_LEN)
    fast, general = decoded(frame, True), decoded(frame, False)
    assert fast == general and fast[1][0] == "undecodable" and fast[1][1].endswith("above 65535")
