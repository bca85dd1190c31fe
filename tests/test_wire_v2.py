"""Wire format v2: compact header, prompt ids as a digest, packaged zstd dictionary, bounded decoding."""

from __future__ import annotations

import dataclasses
import struct

import numpy as np
import pytest
import zstandard as zstd
from hypothesis import given
from hypothesis import strategies as st

from ftis_fed.wire import codec as wire, dictionary as wiredict
from ftis_fed.wire.batch import BatchValidationError, CompletionBatch, SamplingParams, make_group, prompt_ids_digest
from ftis_fed.engine.relay import texts_differ
from ftis_fed.engine.validation import BadReply, ReplyLimits, check_variants
from ftis_fed.wire.codec import (
    FLAG_FP_HEX,
    FLAG_PROMPT_DIGEST,
    FLAG_TEXTS,
    FLAG_ZSTD,
    SIGNATURE_LEN,
    WireLimits,
    WireOptions,
    decode_frame,
    encode_body,
    parse_header,
    send_options,
)
from tests.test_wire import FAST, assert_same, batches, frame_of, small_batch

FP = "tok-0123456789abcdef"


def no_prompts(b: CompletionBatch) -> CompletionBatch:
    """What a v2 frame without prompt ids decodes to: empty prompt ids, their digest."""
    return dataclasses.replace(b, prompt_digest=prompt_ids_digest([g.prompt_ids for g in b.groups]),
                               groups=tuple(dataclasses.replace(g, prompt_ids=np.zeros(0, np.int64)) for g in b.groups))


@pytest.mark.parametrize("texts", [False, True])
def test_send_options_round_trip_without_prompt_ids(texts):
    b = dataclasses.replace(small_batch(), tokenizer_fp=FP)
    frame = frame_of(b, send_options(texts))
    h = parse_header(frame)
    assert h.version == 2 and h.flags & FLAG_PROMPT_DIGEST and h.flags & FLAG_FP_HEX
    assert bool(h.flags & FLAG_TEXTS) == texts and h.n_prompt_tokens == 0
    out = decode_frame(frame).validate()
    assert out.tokenizer_fp == FP and out.prompt_digest == h.prompt_digest
    assert_same(no_prompts(b), out, 8, texts)
    assert out.prompt_digest == prompt_ids_digest([g.prompt_ids for g in b.groups])


def test_v2_is_smaller_than_v1_and_its_header_compact():
    b = dataclasses.replace(small_batch(), tokenizer_fp=FP)
    v1 = frame_of(b, WireOptions(texts=False, version=1))
    v2 = frame_of(b, WireOptions(texts=False))
    digest = frame_of(b, send_options(False))
    h1, h2, hd = parse_header(v1), parse_header(v2), parse_header(digest)
    head = lambda f, h: h.body_len - h.payload_len  # noqa: E731
    assert head(v1, h1) == wire.FIXED_HEADER_LEN + len("alice" "run-1" "smollm2" + FP)
    # 5 magic+version, 4 flags/widths/dict, varints, strings, the fp as 8 bytes: 55 here for 88 + 37 in v1
    assert head(v2, h2) <= head(v1, h1) - 70 and head(digest, hd) <= head(v2, h2) + 8
    assert len(digest) < len(v2) < len(v1)


@FAST
@given(batches(), st.booleans(), st.booleans())
def test_v2_round_trips_with_and_without_prompt_ids(batch, compress, prompt_ids):
    batch.validate()
    opts = WireOptions(compress=compress, prompt_ids=prompt_ids)
    out = decode_frame(frame_of(batch, opts)).validate()
    assert_same(batch if prompt_ids else no_prompts(batch), out, 8)


REALS = st.one_of(st.floats(min_value=1e-300, max_value=1e300), st.sampled_from([0.7, 0.1 + 0.2, 1.0, 0.95, 1e-7, 2.5]))


@FAST
@given(REALS, st.floats(min_value=1e-6, max_value=1.0), st.integers(0, 2 ** 31), st.integers(1, 2 ** 31))
def test_sampling_parameters_travel_exactly(temperature, top_p, top_k, max_new):
    s = SamplingParams(temperature, top_p, top_k, max_new)
    b = dataclasses.replace(small_batch(), sampling=s)
    out = decode_frame(frame_of(b, send_options(False)))
    assert out.sampling == s and struct.pack("<d", out.sampling.temperature) == struct.pack("<d", temperature)


def test_common_sampling_values_take_two_bytes():
    assert wire._real(0.7) == b"\x01\x07" and wire._real(1.0) == b"\x00\x01" and len(wire._real(0.1 + 0.2)) == 9


# ------------------------------------------------------------------------- hostile v2 headers

def v2_head(*, flags=FLAG_PROMPT_DIGEST, width=2, bits=8, dict_id=0, counts=(1, 1, 0, 1), raw_len=0,
            payload_len=None, strings=("alice", "run-1", "m", "tok"), digest=bytes(8), varint_override=None) -> bytes:
    """A v2 header laid out by hand (module docstring of ftis_fed.wire.codec), to build hostile frames."""
    v = wire._uvarint
    fields = [v(1), v(1), v(49152), wire._real(0.7), wire._real(1.0), v(0), v(16), *map(v, counts), v(raw_len),
              v(raw_len if payload_len is None else payload_len)]
    if varint_override:
        i, raw = varint_override
        fields[i] = raw
    out = wire.MAGIC + bytes([2, flags, width, bits, dict_id]) + b"".join(fields)
    out += b"".join(wire._vstr(s) for s in strings)
    return out + (digest if flags & FLAG_PROMPT_DIGEST else b"")


def _reason(frame: bytes, limits: WireLimits = WireLimits()) -> str:
    with pytest.raises(BatchValidationError) as e:
        decode_frame(frame, limits).validate()
    return e.value.reason


@pytest.mark.parametrize("kw,reason", [
    ({"flags": 0x80 | FLAG_PROMPT_DIGEST}, "undecodable"),
    ({"width": 3}, "undecodable"),
    ({"bits": 7}, "undecodable"),
    ({"dict_id": 99, "flags": FLAG_ZSTD | FLAG_PROMPT_DIGEST}, "unsupported_version"),
    ({"dict_id": 1}, "undecodable"),                                         # dictionary without zstd
    ({"counts": (1, 1, 5, 1)}, "undecodable"),                               # prompt tokens in a digest frame
    ({"counts": (1, 1, 0, 2 ** 31)}, "too_large"),
    ({"counts": (2 ** 40, 1, 0, 1)}, "too_large"),
    ({"raw_len": 2 ** 62}, "too_large"),
    ({"strings": ("a" * 5000, "run-1", "m", "tok"), "raw_len": 100}, "too_large"),
    ({"varint_override": (0, b"\x80\x00")}, "undecodable"),                  # non-minimal varint
    ({"varint_override": (0, b"\xff" * 11)}, "undecodable"),                 # endless varint
    ({"varint_override": (3, b"\x1f\x01")}, "undecodable"),                  # decimal scale 31
])
def test_v2_header_checked_before_reading(kw, reason):
    head = v2_head(**kw)
    assert _reason(head + bytes(SIGNATURE_LEN)) == reason


def test_v2_truncated_header_and_wrong_frame_length():
    good = frame_of(small_batch(), send_options(True))
    h = parse_header(good)
    for cut in range(5, h.body_len - h.payload_len):
        assert _reason(good[:cut] + bytes(SIGNATURE_LEN)) == "undecodable"
    assert _reason(good + b"\x00") == "undecodable"


def test_v2_decompression_is_capped_and_dictionary_frames_too():
    bomb = zstd.ZstdCompressor(level=3).compress(bytes(64 << 20))
    head = v2_head(flags=FLAG_PROMPT_DIGEST | FLAG_ZSTD, raw_len=1024, payload_len=len(bomb))
    assert _reason(head + bomb + bytes(SIGNATURE_LEN)) == "undecodable"
    d = wiredict.dictionary(wiredict.DEFAULT)
    bomb = zstd.ZstdCompressor(level=3, dict_data=d, write_dict_id=False).compress(bytes(64 << 20))
    head = v2_head(flags=FLAG_PROMPT_DIGEST | FLAG_ZSTD, dict_id=1, raw_len=1024, payload_len=len(bomb))
    assert _reason(head + bomb + bytes(SIGNATURE_LEN)) == "undecodable"
    head = v2_head(flags=FLAG_PROMPT_DIGEST | FLAG_ZSTD, dict_id=1, raw_len=64 << 20, payload_len=len(bomb))
    assert _reason(head + bomb + bytes(SIGNATURE_LEN), WireLimits(max_raw_bytes=1 << 20)) == "too_large"


@FAST
@given(st.binary(min_size=0, max_size=300), st.booleans())
def test_random_payload_behind_a_valid_v2_header_raises_only_batch_validation_error(payload, digest):
    head = v2_head(flags=FLAG_PROMPT_DIGEST if digest else 0, counts=(1, 1, 0 if digest else 2, 3),
                   raw_len=len(payload))
    try:
        decode_frame(head + payload + bytes(SIGNATURE_LEN)).validate()
    except BatchValidationError:
        pass


def test_payload_varints_are_bounded_and_canonical():
    r = wire._Reader(bytes([0x80, 0x00]))
    with pytest.raises(BatchValidationError, match="not minimal"):
        r.varints(1, "x")
    with pytest.raises(BatchValidationError, match="above 2"):
        wire._Reader(bytes([0xFF, 0xFF, 0xFF, 0xFF, 0x10])).varints(1, "x")
    with pytest.raises(BatchValidationError, match="1 of 2 varints"):
        wire._Reader(bytes([0x81, 0x01, 0x80])).varints(2, "x")
    with pytest.raises(BatchValidationError, match="at most 5 bytes"):
        wire._Reader(bytes([0x80] * 5 + [0x01])).varints(1, "x")
    vals = np.array([0, 1, 127, 128, 300, 2 ** 21, 2 ** 32 - 1])
    assert wire._Reader(wire._uvarints(vals)).varints(vals.size, "x").tolist() == vals.tolist()
    r = wire._Reader(wire._uvarints(vals))
    assert [r.varint("x") for _ in vals] == vals.tolist()                  # the scalar reader agrees
    for bad, why in [(b"\x80\x00", "not minimal"), (b"\xff\xff\xff\xff\x10", "above 2"),
                     (b"\x80" * 5 + b"\x01", "too long"), (b"\x80", "ends inside")]:
        with pytest.raises(BatchValidationError, match=why):
            wire._Reader(bad).varint("x")


# ------------------------------------------------------------------------- dictionary

def test_dictionary_is_used_when_smaller_and_checked_against_its_hash(monkeypatch):
    b = small_batch()
    with_dict = parse_header(frame_of(b, send_options(False)))
    plain = parse_header(frame_of(b, WireOptions(texts=False, prompt_ids=False, dictionary=False)))
    assert with_dict.dict_id in (0, wiredict.DEFAULT) and plain.dict_id == 0
    assert with_dict.payload_len <= plain.payload_len
    raw = wiredict.raw_bytes(wiredict.DEFAULT)
    changed = raw[:-1] + bytes([raw[-1] ^ 1])           # one bit of the shipped bytes flipped
    monkeypatch.setattr(wiredict, "raw_bytes", lambda dict_id: changed)
    wiredict.dictionary.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="SHA-256"):
            wiredict.dictionary(wiredict.DEFAULT)
    finally:
        wiredict.dictionary.cache_clear()


# ------------------------------------------------------------------------- the two variants

def _limits() -> ReplyLimits:
    return ReplyLimits(max_frame_bytes=1 << 20)


def test_v2_variants_pass_the_boundary_and_a_changed_digest_does_not():
    b = small_batch()
    frames = (frame_of(b, send_options(False)), frame_of(b, send_options(True)))
    check_variants(frames, (False, True), _limits())
    other = dataclasses.replace(b, groups=(dataclasses.replace(b.groups[0], prompt_ids=b.groups[0].prompt_ids + 1),
                                           b.groups[1]))
    with pytest.raises(BadReply) as e:
        check_variants((frames[0], frame_of(other, send_options(True))), (False, True), _limits())
    assert e.value.reason == "variant_mismatch" and "prompt_digest" in str(e.value)
    plain, texts = decode_frame(frames[0]), decode_frame(frame_of(other, send_options(True)))
    assert texts_differ(plain, texts) == "prompt_digest"
    assert texts_differ(plain, decode_frame(frames[1])) == ""


def test_a_digest_batch_cannot_be_reencoded_with_prompt_ids():
    out = decode_frame(frame_of(small_batch(), send_options(False)))
    with pytest.raises(BatchValidationError) as e:
        encode_body(out, WireOptions())
    assert e.value.reason == "missing_field"
    assert decode_frame(frame_of(out, send_options(False))).prompt_digest == out.prompt_digest


def test_validation_of_digest_batches():
    b = no_prompts(small_batch())
    b.validate()
    with pytest.raises(BatchValidationError) as e:
        dataclasses.replace(b, prompt_digest=b"\x00" * 7).validate()
    assert e.value.reason == "bad_header"
    g = make_group([1, 2], [[3]], [[-0.1]], [0.0], "t", "r")
    with pytest.raises(BatchValidationError) as e:
        dataclasses.replace(b, groups=(g,)).validate()                      # ids AND a digest
    assert e.value.reason == "length_mismatch"


# ------------------------------------------------------------------------- bench

def test_bench_reports_v2_frames_levers_and_reuses_saved_rollouts(tmp_path):
    from ftis_fed.bench.wire import load_rollouts, run_bench_wire

    path = tmp_path / "rollouts.json"
    r = run_bench_wire("synthetic", n_prompts=2, group_size=2, max_new_tokens=16, repeats=1, rollouts_file=str(path))
    assert path.exists() and r["ids_exact"] and r["max_logprob_error"] <= 2e-3
    assert set(r["lever_bytes_saved"]) == {"v2_header", "prompt_digest", "dictionary"}
    assert r["frame_bytes"] == r["v1_frame_bytes"] - sum(r["lever_bytes_saved"].values())
    assert r["bytes_per_token"] < r["v1_bytes_per_token"] < r["paper_bytes_per_token"]
    assert r["lever_bytes_saved"]["v2_header"] > 0 and r["lever_bytes_saved"]["prompt_digest"] > 0
    assert r["fixed_bytes"] + r["payload_bytes"] == r["frame_bytes"] and r["run_id_bytes"] == len("bench-run") + 1
    again = run_bench_wire("synthetic", n_prompts=2, group_size=2, max_new_tokens=16, repeats=1,
                           rollouts_file=str(path))
    assert again["generate_s"] == 0.0 and again["frame_bytes"] == r["frame_bytes"]
    rs = load_rollouts(path)
    assert all(lp.dtype == np.float32 for roll in rs.rollouts for lp in roll.logprobs)


def test_v2_logprob_codes_above_the_escape_are_refused():
    """v2 log-prob codes are LEB128 varints: a code above 0xFFFF cannot come from quantize_logprobs."""
    v = wire._uvarint
    for code, ok in ((0xFFFE, True), (0x10000, False)):
        payload = (v(1) + v(1) + struct.pack("<f", 0.0) + struct.pack("<H", 7) + v(code)     # size, length, reward, id
                   + wire._vstr("t") + wire._vstr(""))                                    # task id, reference
        frame = v2_head(counts=(1, 1, 0, 1), raw_len=len(payload)) + payload + bytes(SIGNATURE_LEN)
        if ok:
            assert decode_frame(frame).groups[0].logprobs[0][0] == np.float32(-0xFFFE / 256)
        else:
            assert _reason(frame) == "undecodable"


def test_the_senders_eos_id_travels_in_the_signed_header_and_is_bounded():
    """Issue 18: the generator's EOS id is carried (FLAG_EOS_ID, one varint), not inferred; a frame
    without it decodes to None (older senders); an id at or above vocab_size is refused."""
    b = dataclasses.replace(small_batch(vocab=100), tokenizer_fp=FP)
    plain = frame_of(b, send_options(False))
    with_eos = frame_of(dataclasses.replace(b, eos_id=99), send_options(False))
    assert not parse_header(plain).flags & wire.FLAG_EOS_ID and decode_frame(plain).eos_id is None
    h = parse_header(with_eos)
    assert h.flags & wire.FLAG_EOS_ID and h.eos_id == 99
    assert decode_frame(with_eos).validate().eos_id == 99
    assert len(with_eos) - len(plain) <= 5                                   # a varint: bytes/token unchanged
    with pytest.raises(BatchValidationError, match="eos_id"):
        encode_body(dataclasses.replace(b, eos_id=100), send_options(False))
    # a header whose eos varint (its last byte here) is >= vocab_size: refused by the reader
    body = bytearray(encode_body(dataclasses.replace(b, eos_id=1), WireOptions(texts=False, compress=False)))
    h1 = parse_header(bytes(body) + bytes(SIGNATURE_LEN))
    at = h1.body_len - h1.payload_len - 1
    assert h1.eos_id == 1 and body[at] == 1
    body[at] = 0x7F
    with pytest.raises(BatchValidationError, match="eos_id=127"):
        parse_header(bytes(body) + bytes(SIGNATURE_LEN))
