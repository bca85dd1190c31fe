"""Wire format: exact ids, bounded log-prob error, strict and bounded decoding of hostile bytes."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import zstandard as zstd
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ftis_fed.wire.batch import BatchValidationError, CompletionBatch, SamplingParams, make_group
from ftis_fed.wire.codec import (
    FLAG_ZSTD,
    LOGP_ESCAPE,
    PAPER_OPTIONS,
    SIGNATURE_LEN,
    WireLimits,
    WireOptions,
    decode_frame,
    header_offset,
    send_options,
    dequantize_logprobs,
    encode_body,
    id_width_for,
    parse_header,
    quantize_logprobs,
)

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def frame_of(batch: CompletionBatch, options: WireOptions = WireOptions()) -> bytes:
    """Unsigned tests only need a frame shape: body + a dummy signature."""
    return encode_body(batch, options) + bytes(SIGNATURE_LEN)


def small_batch(vocab: int = 49152, texts: bool = True, lengths=(5, 0, 3), seed: int = 0) -> CompletionBatch:
    rng = np.random.default_rng(seed)
    comps = [rng.integers(0, vocab, size=n) for n in lengths]
    lps = [-rng.exponential(1.0, size=n) for n in lengths]
    g = make_group(rng.integers(0, vocab, size=7), comps, lps, [1.0, 0.0, 0.5][:len(lengths)],
                   "add/id/1", "42", "What is 40 + 2?" if texts else "",
                   [f"c{i} ✓" for i in range(len(lengths))] if texts else ())
    return CompletionBatch("alice", "run-1", 3, 7, "smollm2", "tok-x", vocab,
                           SamplingParams(0.7, 0.9, 50, 16), (g, g))


def assert_same(a: CompletionBatch, b: CompletionBatch, bits: int | None = 8, texts: bool = True) -> None:
    for f in ("sender", "run_id", "round", "seq", "model_id", "tokenizer_fp", "vocab_size", "sampling"):
        assert getattr(a, f) == getattr(b, f), f
    assert len(a.groups) == len(b.groups)
    for ga, gb in zip(a.groups, b.groups):
        assert np.array_equal(ga.prompt_ids, gb.prompt_ids)
        assert len(ga.completion_ids) == len(gb.completion_ids)
        for x, y in zip(ga.completion_ids, gb.completion_ids):
            assert x.dtype == y.dtype == np.int64 and np.array_equal(x, y)
        for x, y in zip(ga.logprobs, gb.logprobs):
            assert y.dtype == np.float32 and x.shape == y.shape
            if bits is None:
                assert np.array_equal(x, y, equal_nan=True)
            elif x.size:
                assert np.abs(x.astype(np.float64) - y).max() <= 2.0 ** -(bits + 1)
        assert np.array_equal(ga.rewards, gb.rewards)
        assert (ga.task_id, ga.reference) == (gb.task_id, gb.reference)
        if texts:
            assert (ga.prompt_text, ga.completion_texts) == (gb.prompt_text, gb.completion_texts)
        else:
            assert (gb.prompt_text, gb.completion_texts) == ("", ())


@pytest.mark.parametrize("options", [WireOptions(), WireOptions(texts=False), WireOptions(compress=False),
                                     WireOptions(logp_frac_bits=12), PAPER_OPTIONS])
def test_round_trip(options):
    b = small_batch()
    out = decode_frame(frame_of(b, options)).validate()
    bits = None if options.logp == "f32" else options.logp_frac_bits
    assert_same(b, out, bits, options.texts)


def test_encoding_is_canonical_and_idempotent():
    b = small_batch()
    body = encode_body(b)
    assert encode_body(b) == body                                   # deterministic
    again = decode_frame(body + bytes(SIGNATURE_LEN))
    assert encode_body(again) == body                               # re-encoding a decoded batch


def test_id_width_for_vocab():
    assert [id_width_for(v - 1) for v in (2, 256, 257, 49152, 65536, 65537, 2 ** 32)] == [1, 1, 2, 2, 2, 4, 4]
    with pytest.raises(BatchValidationError) as e:
        id_width_for(2 ** 32)
    assert e.value.reason == "id_out_of_range"


def test_smollm2_ids_take_two_bytes_and_paper_format_takes_eight():
    b = small_batch(texts=False, lengths=(64, 64, 64))
    assert parse_header(frame_of(b)).id_width == 2
    h = parse_header(frame_of(b, PAPER_OPTIONS))
    assert h.id_width == 4 and not h.flags & FLAG_ZSTD
    assert h.raw_len >= 8 * b.num_completion_tokens


def test_encoder_refuses_what_it_cannot_represent():
    b = small_batch()
    g = b.groups[0]
    neg = CompletionBatch(**{**b.__dict__, "groups": (make_group(g.prompt_ids, [[-1]], [[0.0]], [0.0], "t", "r"),)})
    with pytest.raises(BatchValidationError) as e:
        encode_body(neg)
    assert e.value.reason == "id_out_of_range"
    short = CompletionBatch(**{**b.__dict__, "groups": (make_group(g.prompt_ids, [[1, 2]], [[0.0]], [0.0], "t", "r"),)})
    with pytest.raises(BatchValidationError) as e:
        encode_body(short)
    assert e.value.reason == "length_mismatch"
    with pytest.raises(BatchValidationError) as e:
        encode_body(CompletionBatch(**{**b.__dict__, "round": 2 ** 64}))
    assert e.value.reason == "bad_header"


# ------------------------------------------------------------------------- hypothesis: round trip

VOCABS = st.one_of(st.integers(2, 300), st.integers(2, 2 ** 32), st.sampled_from([2, 256, 257, 65536, 65537, 2 ** 32]))
LOGPS = st.one_of(
    st.floats(-1.0, 0.0, width=32),
    st.floats(-300.0, 0.0, width=32),
    st.sampled_from([0.0, -0.0, -255.99, -256.0, -1e30, -3.4e38, -1e-9, -2 ** -9, -(2 ** -9) * 3]),
)


@st.composite
def batches(draw):
    vocab = draw(VOCABS)
    ids = st.integers(0, vocab - 1)
    groups = []
    for gi in range(draw(st.integers(1, 3))):
        G = draw(st.integers(1, 4))
        comps = [draw(st.lists(ids, min_size=0, max_size=12)) for _ in range(G)]
        lps = [[draw(LOGPS) for _ in c] for c in comps]
        texts = draw(st.booleans())
        groups.append(make_group(
            draw(st.lists(ids, min_size=1, max_size=8)), comps, lps,
            draw(st.lists(st.floats(-10, 10, width=32), min_size=G, max_size=G)),
            draw(st.text(min_size=1, max_size=8)), draw(st.text(max_size=8)),
            draw(st.text(max_size=10)) if texts else "",
            [draw(st.text(max_size=10)) for _ in range(G)] if texts else ()))
    return CompletionBatch(draw(st.text(min_size=1, max_size=10)), "run", draw(st.integers(0, 2 ** 40)),
                           draw(st.integers(0, 2 ** 63 - 1)), "m", "tok", vocab, SamplingParams(1.0, 1.0, 0, 12),
                           tuple(groups))


@FAST
@given(batches(), st.booleans(), st.sampled_from([8, 10, 16]))
def test_ids_round_trip_exactly_and_logprob_error_is_bounded(batch, compress, bits):
    batch.validate()
    out = decode_frame(frame_of(batch, WireOptions(compress=compress, logp_frac_bits=bits))).validate()
    assert_same(batch, out, bits)


@FAST
@given(st.lists(st.floats(allow_nan=True, allow_infinity=True, width=32), max_size=200), st.integers(8, 16))
def test_quantization_error_bound(values, bits):
    lp = np.asarray(values, dtype=np.float32)
    codes, escapes = quantize_logprobs(lp, bits)
    back = dequantize_logprobs(codes, escapes, bits)
    esc = codes == LOGP_ESCAPE
    assert np.array_equal(back[esc], lp[esc], equal_nan=True)                     # escaped: exact
    ok = ~esc
    assert np.all(np.abs(back[ok].astype(np.float64) - lp[ok]) <= 2.0 ** -(bits + 1))
    assert np.all(back[ok] <= 0)
    in_range = np.isfinite(lp) & (lp <= 0) & (lp >= -0xFFFE / 2.0 ** bits)       # 8 bits: 255.99 nats
    assert not np.any(esc & in_range)                                             # no needless escapes


# ------------------------------------------------------------------------- hostile bytes

@FAST
@given(st.binary(max_size=400))
def test_random_bytes_raise_only_batch_validation_error(data):
    with pytest.raises(BatchValidationError):
        decode_frame(data)


V1 = WireOptions(version=1)
_GOOD = frame_of(small_batch(), V1)                    # v1: the fixed-offset header tests below poke at it
_GOOD_RAW = frame_of(small_batch(), WireOptions(compress=False, version=1))
_GOOD2 = frame_of(small_batch(), send_options(True))                        # v2, digest, dictionary
_GOOD2_RAW = frame_of(small_batch(), WireOptions(compress=False, prompt_ids=False))
_GOOD2_IDS = frame_of(small_batch(), WireOptions(dictionary=False))          # v2 with prompt ids, plain zstd


@settings(max_examples=300, deadline=None)
@given(st.sampled_from([_GOOD, _GOOD_RAW, _GOOD2, _GOOD2_RAW, _GOOD2_IDS]),
       st.lists(st.tuples(st.integers(0, 10 ** 6), st.integers(0, 255)), min_size=1, max_size=4),
       st.integers(0, 10 ** 6))
def test_mutated_frames_raise_only_batch_validation_error(frame, edits, cut):
    data = bytearray(frame)
    for pos, val in edits:
        data[pos % len(data)] = val
    data = bytes(data[: max(cut % (len(data) + 8), 0)]) if cut % 3 == 0 else bytes(data)
    try:
        decode_frame(data).validate()
    except BatchValidationError:
        pass


@FAST
@given(st.binary(min_size=0, max_size=300))
def test_random_payload_behind_a_valid_header_raises_only_batch_validation_error(payload):
    h = parse_header(_GOOD_RAW)
    head = _set(_GOOD_RAW[:h.body_len - h.payload_len], raw_len=len(payload), payload_len=len(payload),
                n_groups=1, n_completions=0, n_prompt_tokens=0, n_completion_tokens=0)
    try:
        decode_frame(head + payload + bytes(SIGNATURE_LEN)).validate()
    except BatchValidationError:
        pass


def _set(frame: bytes, **fields) -> bytes:
    """A copy of ``frame`` with fixed header fields overwritten."""
    out = bytearray(frame)
    for name, value in fields.items():
        off, code = header_offset(name)
        struct.pack_into("<" + code, out, off, value)
    return bytes(out)


@pytest.mark.parametrize("fields,reason", [
    ({"version": 3}, "unsupported_version"),
    ({"flags": 0x80}, "undecodable"),
    ({"id_width": 3}, "undecodable"),
    ({"logp_frac_bits": 7}, "undecodable"),
    ({"raw_len": 2 ** 32 - 1}, "too_large"),
    ({"n_completion_tokens": 2 ** 31}, "too_large"),
    ({"n_groups": 2 ** 31}, "too_large"),
    ({"len_sender": 5000}, "too_large"),
    ({"payload_len": 10}, "undecodable"),
])
def test_header_limits_checked_before_reading(fields, reason):
    with pytest.raises(BatchValidationError) as e:
        decode_frame(_set(_GOOD, **fields))
    assert e.value.reason == reason


def test_decompression_is_capped_by_the_declared_size():
    """A zstd bomb: 64 MiB of zeros compresses to a few KB; the header says 1 KB -> rejected, no alloc."""
    h = parse_header(_GOOD)
    head = _GOOD[:h.body_len - h.payload_len]
    bomb = zstd.ZstdCompressor(level=3).compress(bytes(64 << 20))
    with pytest.raises(BatchValidationError) as e:
        decode_frame(_set(head, payload_len=len(bomb)) + bomb + bytes(SIGNATURE_LEN))
    assert e.value.reason == "undecodable" and "declares" in str(e.value)
    # raw_len honest but above the limit: refused from the header alone
    with pytest.raises(BatchValidationError) as e:
        decode_frame(_set(head, payload_len=len(bomb), raw_len=64 << 20) + bomb + bytes(SIGNATURE_LEN),
                     WireLimits(max_raw_bytes=1 << 20))
    assert e.value.reason == "too_large"


def test_trailing_bytes_after_the_zstd_frame_are_rejected():
    h = parse_header(_GOOD)
    payload = _GOOD[h.body_len - h.payload_len:h.body_len] + b"\x00"
    with pytest.raises(BatchValidationError) as e:
        head = _set(_GOOD[:h.body_len - h.payload_len], payload_len=len(payload))
        decode_frame(head + payload + bytes(SIGNATURE_LEN))
    assert e.value.reason == "undecodable"


def test_limits_apply_to_frames_and_tokens():
    with pytest.raises(BatchValidationError) as e:
        decode_frame(_GOOD, WireLimits(max_frame_bytes=100))
    assert e.value.reason == "too_large"
    with pytest.raises(BatchValidationError) as e:
        decode_frame(_GOOD, WireLimits(max_tokens=5))
    assert e.value.reason == "too_large"


def test_bench_runs_on_synthetic_rollouts():
    from ftis_fed.bench.wire import run_bench_wire

    r = run_bench_wire("synthetic", n_prompts=2, group_size=2, max_new_tokens=16, repeats=1)
    assert r["ids_exact"] and r["max_logprob_error"] <= 2e-3
    assert r["bytes_per_token"] < r["paper_bytes_per_token"]


def test_stricter_limits_apply_to_an_already_parsed_header():
    """A receiver parses with loose limits to verify the signature, then holds the authenticated
    header to its own run's bounds before decompressing (``check_header_limits``)."""
    from ftis_fed.wire.codec import check_header_limits

    h = parse_header(_GOOD)
    check_header_limits(h, WireLimits())
    for limits in (WireLimits(max_groups=1), WireLimits(max_completions=5), WireLimits(max_raw_bytes=10),
                   WireLimits(max_tokens=7), WireLimits(max_prompt_tokens=13), WireLimits(max_frame_bytes=100)):
        with pytest.raises(BatchValidationError) as e:
            check_header_limits(h, limits)
        assert e.value.reason == "too_large", limits


def test_a_group_carries_no_texts_or_one_per_completion():
    """n_texts is 0 or the group's size: a frame cannot make the decoder read more strings than completions."""
    b = small_batch()
    g = b.groups[0]
    bad = CompletionBatch(b.sender, b.run_id, b.round, b.seq, b.model_id, b.tokenizer_fp, b.vocab_size, b.sampling,
                          (make_group(g.prompt_ids, g.completion_ids, g.logprobs, g.rewards, g.task_id, g.reference,
                                      g.prompt_text, ["only one"]),))
    with pytest.raises(BatchValidationError) as e:
        decode_frame(frame_of(bad))
    assert e.value.reason == "undecodable" and "n_texts" in str(e.value)
