"""Completion batches <-> compact, versioned, strictly bounded bytes (wire format v2; v1 read).

Why one module of ~900 lines: the byte layout of both versions, their bounds and both directions
(encode, decode) must be read side by side; splitting them would put a format's writer and reader in
two files that must change together.

A *frame* is what travels: ``body || signature`` where ``body = header || payload`` and the
64-byte Ed25519 signature is made and checked by :mod:`ftis_fed.trust.signing`. This module only lays
the bytes out and reads them back; it never trusts a length it has not checked against
:class:`WireLimits` first, and every failure is a :class:`BatchValidationError` (reason
``undecodable``, ``unsupported_version`` or ``too_large``).

Version 1 header (little-endian, ``_FIXED`` = 88 bytes, then 4 UTF-8 strings of the declared lengths):

    magic "FTIS" | version u8 | flags u8 | id_width u8 | logp_frac_bits u8 |
    round u64 | seq u64 | vocab_size u64 | temperature f64 | top_p f64 | top_k u32 |
    max_new_tokens u32 | n_groups u32 | n_completions u32 | n_prompt_tokens u32 |
    n_completion_tokens u32 | raw_len u32 | payload_len u32 |
    len(sender) u16 | len(run_id) u16 | len(model_id) u16 | len(tokenizer_fp) u16 |
    sender | run_id | model_id | tokenizer_fp

Version 1 payload (``raw_len`` bytes; zstd-compressed to ``payload_len`` bytes when ``FLAG_ZSTD``):

    groups       n_groups x (u32 prompt_len, u32 group_size)
    lengths      n_completions x u32                 completion lengths T_i
    rewards      n_completions x f32
    prompt_ids   n_prompt_tokens x id_width          each group's prompt once
    comp_ids     n_completion_tokens x id_width      all completions, concatenated
    logprobs     FLAG_LOGP_F32: n_completion_tokens x f32 (lossless)
                 else: u16 codes c = round(-logp * 2**logp_frac_bits) as two byte planes
                 (all low bytes, then all high bytes), then one f32 per escape code 0xFFFF
                 (values outside [-(0xFFFE / 2**bits), 0], non-finite or positive: kept exactly)
    strings      per group: str task_id, str reference          (str = u32 length + UTF-8)
    texts        FLAG_TEXTS only: per group: str prompt_text, u32 n_texts, n_texts x str

Version 2 (what participants send, ``send_options``; v1 frames are still read): the same sections
with canonical LEB128 varints for counts, sizes, string lengths and log-prob codes (<= 0xFFFF), a
compact header (``_header_v2``: magic, version 2, flags, id_width, logp_frac_bits, dict_id, then
varints / exact decimal reals / strings, the tokenizer fingerprint as 8 raw bytes when it is
``tok-<16 hex>``), optionally no prompt ids but their 8-byte digest in the header
(``FLAG_PROMPT_DIGEST``), and zstd optionally with the packaged dictionary ``dict_id``
(``wiredict``). Layout tables: docs/wire.md.

The fixed-point code has step 2**-bits nats, so the log-prob error is <= 2**-(bits+1): 1.95e-3 at
the default (and minimum accepted) 8 bits.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from itertools import accumulate

import numpy as np
import zstandard as zstd

from ftis_fed.wire.batch import (
    DEFAULT_MAX_TOKENS,
    BatchValidationError,
    CompletionBatch,
    FlatGroups,
    PromptGroup,
    PROMPT_DIGEST_LEN,
    SamplingParams,
    prompt_ids_digest,
)

MAGIC = b"FTIS"
VERSION = 2                 # what encode_body writes by default
VERSIONS = (1, 2)           # what parse_header reads (v1: frames of older runs, fixed-width header)
SIGNATURE_LEN = 64

FLAG_ZSTD = 0x01       # payload is one zstd frame (content size declared, no trailing bytes)
FLAG_TEXTS = 0x02      # payload carries prompt_text and completion_texts
FLAG_LOGP_F32 = 0x04   # log-probs stored as raw float32 instead of fixed-point codes
FLAG_PROMPT_DIGEST = 0x08  # v2: no prompt ids, an 8-byte digest of them in the header instead
FLAG_FP_HEX = 0x10     # v2: tokenizer_fp "tok-<16 hex>" stored as its 8 raw bytes
FLAG_EOS_ID = 0x20     # v2: the generator's EOS token id, a varint at the end of the header
_KNOWN_FLAGS = FLAG_ZSTD | FLAG_TEXTS | FLAG_LOGP_F32
_KNOWN_FLAGS_V2 = _KNOWN_FLAGS | FLAG_PROMPT_DIGEST | FLAG_FP_HEX | FLAG_EOS_ID
#: v2 tries the packaged zstd dictionary only on payloads up to this size (it pays on small ones;
#: a second level-19 pass over a large payload would cost time for nothing).
DICTIONARY_MAX_RAW = 64 << 10

LOGP_ESCAPE = 0xFFFF
MIN_LOGP_FRAC_BITS, MAX_LOGP_FRAC_BITS = 8, 16
_ID_DTYPES = {1: np.dtype("<u1"), 2: np.dtype("<u2"), 4: np.dtype("<u4")}

#: The fixed part of the header, in order: (field, struct code); all little-endian.
HEADER_FIELDS = (
    ("magic", "4s"), ("version", "B"), ("flags", "B"), ("id_width", "B"), ("logp_frac_bits", "B"),
    ("round", "Q"), ("seq", "Q"), ("vocab_size", "Q"), ("temperature", "d"), ("top_p", "d"),
    ("top_k", "I"), ("max_new_tokens", "I"), ("n_groups", "I"), ("n_completions", "I"),
    ("n_prompt_tokens", "I"), ("n_completion_tokens", "I"), ("raw_len", "I"), ("payload_len", "I"),
    ("len_sender", "H"), ("len_run_id", "H"), ("len_model_id", "H"), ("len_tokenizer_fp", "H"),
)
_HEADER = struct.Struct("<" + "".join(code for _, code in HEADER_FIELDS))
_FIXED = _HEADER.size
#: Bytes of the fixed part of the header (before the four strings).
FIXED_HEADER_LEN = _FIXED
#: Longest header of either version with strings of at most 1024 bytes (``WireLimits``' default):
#: v1 88 + 4 x 1024; v2 9 fixed + 11 varints of <= 10 bytes + 2 reals of <= 9 + 4 strings with a
#: <= 3-byte length + the 8-byte prompt digest.
MAX_HEADER_LEN = max(_FIXED + 4 * 1024, 9 + 11 * 10 + 2 * 9 + 4 * (3 + 1024) + 8)


def header_offset(name: str) -> tuple[int, str]:
    """(byte offset, struct code) of a fixed header field, e.g. for tests and other readers."""
    names = [n for n, _ in HEADER_FIELDS]
    i = names.index(name)
    return struct.calcsize("<" + "".join(c for _, c in HEADER_FIELDS[:i])), HEADER_FIELDS[i][1]
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


@dataclass(frozen=True)
class WireOptions:
    """How a sender encodes a batch.

    texts: include prompt_text / completion_texts (needed only across tokenizers).
    compress: zstd the payload (kept only where it is smaller than the raw payload).
    zstd_level: 1..22; 19 (default) costs ~ms per 4k tokens and saves ~5% over 3.
    logp: ``fixed`` (step 2**-logp_frac_bits nats, error <= half a step) or ``f32`` (lossless).
    logp_frac_bits: 8..16; 8 gives step 3.9e-3 and maximum error 1.95e-3 nats. The u16 code
        covers [-(0xFFFE / 2**bits), 0]: 255.99 nats at 8 bits, 1 nat at 16 (the rest is escaped).
    id_width: 0 = the narrowest of 1/2/4 bytes the vocabulary allows; or force 1, 2 or 4.
    version: 2 (compact header, varints; default) or 1 (the fixed-width layout of older runs).
    prompt_ids: carry each group's prompt ids (True), or only an 8-byte digest of them (False, v2):
        a receiver with the sender's tokenizer renders the prompts from the task ids itself and
        checks the digest (``receive.py``: ``prompt_mismatch``); no one else uses the ids.
    dictionary: v2: also try zstd with the packaged dictionary (``wiredict``) and keep the smaller.
    """

    texts: bool = True
    compress: bool = True
    zstd_level: int = 19
    logp: str = "fixed"
    logp_frac_bits: int = 8
    id_width: int = 0
    version: int = VERSION
    prompt_ids: bool = True
    dictionary: bool = True

    def __post_init__(self) -> None:
        if self.version not in VERSIONS:
            raise ValueError(f"WireOptions.version={self.version}: must be one of {VERSIONS}")
        if self.version == 1 and not self.prompt_ids:
            raise ValueError("WireOptions.prompt_ids=False needs version 2 (v1 always carries prompt ids)")
        if self.logp not in ("fixed", "f32"):
            raise ValueError(f"WireOptions.logp={self.logp!r}: must be 'fixed' or 'f32'")
        if not MIN_LOGP_FRAC_BITS <= self.logp_frac_bits <= MAX_LOGP_FRAC_BITS:
            raise ValueError(f"WireOptions.logp_frac_bits={self.logp_frac_bits}: must be in "
                             f"[{MIN_LOGP_FRAC_BITS}, {MAX_LOGP_FRAC_BITS}]")
        if self.id_width not in (0, 1, 2, 4):
            raise ValueError(f"WireOptions.id_width={self.id_width}: must be 0 (auto), 1, 2 or 4")
        if not 1 <= self.zstd_level <= 22:
            raise ValueError(f"WireOptions.zstd_level={self.zstd_level}: must be in [1, 22]")


#: The paper's format for comparison: 4-byte ids, float32 log-probs, no compression, no texts.
PAPER_OPTIONS = WireOptions(texts=False, compress=False, logp="f32", id_width=4, version=1)

def send_options(texts: bool) -> WireOptions:
    """The options a participant signs its batch with (``texts`` per variant): v2 without prompt ids
    (receivers render them and check the digest), the packaged dictionary where it pays."""
    return WireOptions(texts=texts, prompt_ids=False)


@dataclass(frozen=True)
class WireLimits:
    """What a receiver is willing to read; every declared size is checked before allocating.

    max_frame_bytes: the whole signed frame. max_raw_bytes: the decompressed payload.
    max_tokens / max_prompt_tokens: completion / prompt tokens in one batch.
    max_groups / max_completions: prompt groups / completions in one batch.
    max_string_bytes: each header string (sender, run_id, model_id, tokenizer_fp).
    """

    max_frame_bytes: int = 64 << 20
    max_raw_bytes: int = 128 << 20
    max_tokens: int = DEFAULT_MAX_TOKENS
    max_prompt_tokens: int = DEFAULT_MAX_TOKENS
    max_groups: int = 1 << 16
    max_completions: int = 1 << 20
    max_string_bytes: int = 1024


@dataclass(frozen=True)
class WireHeader:
    """The parsed header of a frame (not yet authenticated: see ``signing.verify_frame``)."""

    version: int
    flags: int
    id_width: int
    logp_frac_bits: int
    round: int
    seq: int
    vocab_size: int
    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int
    n_groups: int
    n_completions: int
    n_prompt_tokens: int
    n_completion_tokens: int
    raw_len: int
    payload_len: int
    sender: str
    run_id: str
    model_id: str
    tokenizer_fp: str
    body_len: int           # header + payload: the bytes the signature covers
    prompt_digest: bytes = b""  # v2 with FLAG_PROMPT_DIGEST: the 8-byte digest of the prompt ids
    dict_id: int = 0            # v2: zstd dictionary of the payload (0: none; ``wiredict``)
    eos_id: int | None = None   # v2 with FLAG_EOS_ID: the generator's EOS token id

    @property
    def has_texts(self) -> bool:
        return bool(self.flags & FLAG_TEXTS)


def _bad(reason: str, message: str) -> BatchValidationError:
    return BatchValidationError(reason, message)


# ----------------------------------------------------------------------------------------- encode

def id_width_for(max_id: int) -> int:
    """Narrowest width in bytes (1, 2 or 4) that holds ids in [0, max_id]."""
    if max_id < 0 or max_id >= 1 << 32:
        raise _bad("id_out_of_range", f"token id {max_id}: must be in [0, 2**32)")
    return 1 if max_id < 1 << 8 else 2 if max_id < 1 << 16 else 4


def quantize_logprobs(lp: np.ndarray, frac_bits: int) -> tuple[np.ndarray, np.ndarray]:
    """(N,) float log-probs -> ((N,) uint16 codes, (E,) float32 escaped values, in order).

    code = round(-lp * 2**frac_bits); values it cannot represent within half a step
    (NaN, inf, > 0, < -(0xFFFE / 2**frac_bits)) get ``LOGP_ESCAPE`` and travel exactly.
    """
    lp = np.asarray(lp, dtype=np.float32)
    scaled = -lp.astype(np.float64) * float(1 << frac_bits)               # (N,) exact
    with np.errstate(invalid="ignore"):
        ok = np.isfinite(scaled) & (scaled >= 0) & (scaled <= LOGP_ESCAPE - 0.5)
    codes = np.full(lp.shape, LOGP_ESCAPE, dtype=np.uint16)
    codes[ok] = np.rint(scaled[ok]).astype(np.uint16)
    return codes, lp[~ok].astype(np.float32)


def dequantize_logprobs(codes: np.ndarray, escapes: np.ndarray, frac_bits: int) -> np.ndarray:
    """Inverse of :func:`quantize_logprobs`: (N,) uint16 + (E,) float32 -> (N,) float32."""
    out = np.float32(0.0) - codes.astype(np.float32) * np.float32(2.0 ** -frac_bits)
    esc = codes == LOGP_ESCAPE
    if int(esc.sum()) != escapes.size:
        raise _bad("undecodable", f"logprobs: {int(esc.sum())} escape codes but {escapes.size} escaped values")
    out[esc] = escapes
    return out


def _planes(codes: np.ndarray) -> bytes:
    """(N,) uint16 -> low bytes then high bytes (2N bytes): zstd sees a near-zero high plane."""
    b = codes.astype("<u2").view(np.uint8).reshape(-1, 2)                 # (N, 2)
    return b.T.tobytes()


def _str(s: str) -> bytes:
    raw = s.encode("utf-8")
    return struct.pack("<I", len(raw)) + raw


def _uvarint(v: int) -> bytes:
    """LEB128 (7 bits per byte, least significant first), v >= 0."""
    v = int(v)
    if v < 0:
        raise _bad("bad_header", f"varint {v}: must be >= 0")
    out = bytearray()
    while v >= 0x80:
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    out.append(v)
    return bytes(out)


def _uvarints(values) -> bytes:
    """(N,) integers in [0, 2**32) -> their LEB128 codes, concatenated (vectorised)."""
    a = np.asarray(values, dtype=np.int64).reshape(-1)
    if a.size and (int(a.min()) < 0 or int(a.max()) >= 1 << 32):
        raise _bad("bad_header", "varint array: values must be in [0, 2**32)")
    a = a.astype(np.uint64)
    nbytes = 1 + sum((a >= np.uint64(1 << (7 * k))).astype(np.int64) for k in range(1, 5))   # (N,) 1..5
    starts = np.concatenate([[0], np.cumsum(nbytes)[:-1]]).astype(np.int64)
    out = np.zeros(int(nbytes.sum()), dtype=np.uint8)
    for k in range(5):
        m = nbytes > k
        byte = (a[m] >> np.uint64(7 * k)) & np.uint64(0x7F)
        out[starts[m] + k] = (byte | (np.uint64(0x80) * (nbytes[m] > k + 1))).astype(np.uint8)
    return out.tobytes()


def _vstr(s: str) -> bytes:
    raw = s.encode("utf-8")
    return _uvarint(len(raw)) + raw


_MAX_DECIMAL_SCALE = 30


def _real(x: float) -> bytes:
    """A float exactly, compactly: u8 scale d <= 30 + varint m for x == m / 10**d (the shortest
    decimal that reads back as x, e.g. 0.7 -> d=1, m=7: 2 bytes), else 0xFF + float64."""
    x = float(x)
    if np.isfinite(x) and x >= 0:
        from decimal import Decimal

        _, digits, exp = Decimal(repr(x)).as_tuple()
        m, d = int("".join(map(str, digits))), -int(exp)
        if d < 0:
            m, d = m * 10 ** -d, 0
        while d > 0 and m % 10 == 0:
            m, d = m // 10, d - 1
        if d <= _MAX_DECIMAL_SCALE and m < 1 << 53 and m / 10 ** d == x:
            return bytes([d]) + _uvarint(m)
    return b"\xff" + struct.pack("<d", x)


def _payload(batch: CompletionBatch, width: int, opts: WireOptions) -> bytes:
    """The raw (uncompressed) payload sections, in the order of the module docstring."""
    if opts.version == 2:
        return _payload_v2(batch, width, opts)
    gs = batch.groups
    dt = _ID_DTYPES[width]
    lengths = [len(c) for g in gs for c in g.completion_ids]
    parts = [
        np.array([(len(g.prompt_ids), g.size) for g in gs], dtype="<u4").tobytes(),
        np.array(lengths, dtype="<u4").tobytes(),
        _concat([np.asarray(g.rewards, dtype="<f4").reshape(-1) for g in gs], np.float32).tobytes(),
        _concat([g.prompt_ids for g in gs], np.int64).astype(dt).tobytes(),
        _concat([c for g in gs for c in g.completion_ids], np.int64).astype(dt).tobytes(),
    ]
    lp = _concat([x for g in gs for x in g.logprobs], np.float32)
    if opts.logp == "f32":
        parts.append(lp.astype("<f4").tobytes())
    else:
        codes, escapes = quantize_logprobs(lp, opts.logp_frac_bits)
        parts += [_planes(codes), escapes.astype("<f4").tobytes()]
    parts += [_str(g.task_id) + _str(g.reference) for g in gs]
    if opts.texts:
        for g in gs:
            parts.append(_str(g.prompt_text) + struct.pack("<I", len(g.completion_texts)))
            parts += [_str(t) for t in g.completion_texts]
    return b"".join(parts)


def _payload_v2(batch: CompletionBatch, width: int, opts: WireOptions) -> bytes:
    """v2 raw payload: like v1 with varint sizes and strings, and no prompt section without prompt ids."""
    gs = batch.groups
    dt = _ID_DTYPES[width]
    parts = [_uvarints([g.size for g in gs])]
    if opts.prompt_ids:
        parts.append(_uvarints([len(g.prompt_ids) for g in gs]))
    parts += [_uvarints([len(c) for g in gs for c in g.completion_ids]),
              _concat([np.asarray(g.rewards, dtype="<f4").reshape(-1) for g in gs], np.float32).tobytes()]
    if opts.prompt_ids:
        parts.append(_concat([g.prompt_ids for g in gs], np.int64).astype(dt).tobytes())
    parts.append(_concat([c for g in gs for c in g.completion_ids], np.int64).astype(dt).tobytes())
    lp = _concat([x for g in gs for x in g.logprobs], np.float32)
    if opts.logp == "f32":
        parts.append(lp.astype("<f4").tobytes())
    else:
        codes, escapes = quantize_logprobs(lp, opts.logp_frac_bits)
        parts += [_uvarints(codes), escapes.astype("<f4").tobytes()]          # v2: LEB128 codes
    parts += [_vstr(g.task_id) + _vstr(g.reference) for g in gs]
    if opts.texts:
        for g in gs:
            parts.append(_vstr(g.prompt_text) + _uvarint(len(g.completion_texts)))
            parts += [_vstr(t) for t in g.completion_texts]
    return b"".join(parts)


def _concat(arrays: list, dtype) -> np.ndarray:
    return np.concatenate(arrays) if arrays else np.zeros(0, dtype=dtype)


def _check_shapes(batch: CompletionBatch) -> None:
    """The structure the layout relies on: per completion, as many log-probs as ids; G rewards."""
    for gi, g in enumerate(batch.groups):
        if np.ndim(g.prompt_ids) != 1:
            raise _bad("bad_ids", f"groups[{gi}].prompt_ids: shape {np.shape(g.prompt_ids)}, expected (P,)")
        if len(g.logprobs) != g.size or np.asarray(g.rewards).reshape(-1).shape != (g.size,):
            raise _bad("length_mismatch", f"groups[{gi}]: {g.size} completions, {len(g.logprobs)} log-prob "
                                          f"arrays, {np.asarray(g.rewards).size} rewards")
        for i, (c, lp) in enumerate(zip(g.completion_ids, g.logprobs)):
            if np.shape(c) != np.shape(lp) or np.ndim(c) != 1:
                raise _bad("length_mismatch", f"groups[{gi}].logprobs[{i}]: shape {np.shape(lp)} "
                                              f"for completion_ids shape {np.shape(c)}")


def encode_body(batch: CompletionBatch, options: WireOptions = WireOptions()) -> bytes:
    """Lay a batch out as ``header || payload`` (the bytes a signature covers).

    Does not validate the batch (``signing.sign_batch`` does): it encodes whatever it is given
    as long as it fits the format, so tests can build hostile frames. Raises BatchValidationError
    for what cannot be encoded (negative ids, ids >= 2**32, oversized strings or counts).
    """
    gs = batch.groups
    _check_shapes(batch)
    all_ids = [g.prompt_ids for g in gs] + [c for g in gs for c in g.completion_ids]
    lo = min((int(a.min()) for a in all_ids if a.size), default=0)
    hi = max((int(a.max()) for a in all_ids if a.size), default=0)
    if lo < 0:
        raise _bad("id_out_of_range", f"token id {lo}: ids must be >= 0")
    width = options.id_width or id_width_for(max(hi, min(int(batch.vocab_size), 1 << 32) - 1, 0))
    if hi >= 1 << (8 * width):
        raise _bad("id_out_of_range", f"token id {hi} does not fit id_width={width} bytes")
    if batch.prompt_digest and options.prompt_ids:
        raise _bad("missing_field", "prompt_ids: this batch carries only their digest; encode it with "
                                    "WireOptions(prompt_ids=False)")
    raw = _payload(batch, width, options)
    flags = (FLAG_TEXTS if options.texts else 0) | (FLAG_LOGP_F32 if options.logp == "f32" else 0)
    payload, dict_id = raw, 0
    if options.compress:
        packed = zstd.ZstdCompressor(level=options.zstd_level, write_content_size=True,
                                     write_checksum=False).compress(raw)
        if options.version == 2 and options.dictionary and len(raw) <= DICTIONARY_MAX_RAW:
            from ftis_fed.wire import dictionary as wiredict

            with_dict = zstd.ZstdCompressor(level=options.zstd_level, dict_data=wiredict.dictionary(wiredict.DEFAULT),
                                            write_content_size=True, write_checksum=False,
                                            write_dict_id=False).compress(raw)
            if len(with_dict) < len(packed):
                packed, dict_id = with_dict, wiredict.DEFAULT
        if len(packed) < len(raw):
            payload, flags = packed, flags | FLAG_ZSTD
        else:
            dict_id = 0
    if options.version == 2:
        return _header_v2(batch, options, width, flags, dict_id, len(raw), len(payload)) + payload
    names = [batch.sender, batch.run_id, batch.model_id, batch.tokenizer_fp]
    enc = [str(s).encode("utf-8") for s in names]
    s = batch.sampling
    try:
        head = _HEADER.pack(
            MAGIC, 1, flags, width, 0 if options.logp == "f32" else options.logp_frac_bits,
            int(batch.round), int(batch.seq), int(batch.vocab_size),
            float(s.temperature), float(s.top_p), int(s.top_k), int(s.max_new_tokens),
            len(gs), sum(g.size for g in gs), sum(len(g.prompt_ids) for g in gs),
            batch.num_completion_tokens, len(raw), len(payload), *[len(e) for e in enc])
    except struct.error as e:
        raise _bad("bad_header", f"a header field does not fit its wire width ({e})") from e
    return head + b"".join(enc) + payload


_FP_HEX = re.compile(r"^tok-[0-9a-f]{16}$")


def _header_v2(batch: CompletionBatch, opts: WireOptions, width: int, flags: int, dict_id: int,
               raw_len: int, payload_len: int) -> bytes:
    """The v2 header (module docstring, "v2"): fixed 9 bytes, then varints, reals and strings."""
    gs = batch.groups
    s = batch.sampling
    fp = str(batch.tokenizer_fp)
    if _FP_HEX.match(fp):
        flags |= FLAG_FP_HEX
        fp_bytes = bytes.fromhex(fp[4:])
    else:
        fp_bytes = _vstr(fp)
    digest = b""
    if not opts.prompt_ids:
        flags |= FLAG_PROMPT_DIGEST
        digest = batch.prompt_digest or prompt_ids_digest([g.prompt_ids for g in gs])
    eos = b""
    if batch.eos_id is not None:
        if not 0 <= int(batch.eos_id) < int(batch.vocab_size):
            raise _bad("bad_header", f"eos_id={batch.eos_id}: must be in [0, vocab_size={batch.vocab_size})")
        flags |= FLAG_EOS_ID
        eos = _uvarint(int(batch.eos_id))
    for name in ("sender", "run_id", "model_id", "tokenizer_fp"):
        if len(str(getattr(batch, name)).encode("utf-8")) > 0xFFFF:
            raise _bad("bad_header", f"{name}: longer than 65535 bytes")
    for name, value, bits in (("round", batch.round, 64), ("seq", batch.seq, 64), ("vocab_size", batch.vocab_size, 64),
                              ("top_k", s.top_k, 32), ("max_new_tokens", s.max_new_tokens, 32)):
        if not 0 <= int(value) < 1 << bits:
            raise _bad("bad_header", f"{name}={value}: does not fit its wire range [0, 2**{bits})")
    bits = 0 if opts.logp == "f32" else opts.logp_frac_bits
    head = [MAGIC, bytes([2, flags, width, bits, dict_id]),
            _uvarint(batch.round), _uvarint(batch.seq), _uvarint(batch.vocab_size),
            _real(s.temperature), _real(s.top_p), _uvarint(s.top_k), _uvarint(s.max_new_tokens),
            _uvarint(len(gs)), _uvarint(sum(g.size for g in gs)),
            _uvarint(sum(len(g.prompt_ids) for g in gs) if opts.prompt_ids else 0),
            _uvarint(batch.num_completion_tokens), _uvarint(raw_len), _uvarint(payload_len),
            _vstr(str(batch.sender)), _vstr(str(batch.run_id)), _vstr(str(batch.model_id)), fp_bytes, digest, eos]
    return b"".join(head)


# ----------------------------------------------------------------------------------------- decode

def parse_header(frame: bytes, limits: WireLimits = WireLimits(),
                 signature_len: int = SIGNATURE_LEN) -> WireHeader:
    """Read and bound-check the header of a signed frame; touches no payload byte.

    Checks magic, version, flags, widths, every count against ``limits`` and that the frame is
    exactly ``header + payload_len + signature_len`` bytes long (0 parses an unsigned body).
    """
    if not isinstance(frame, (bytes, bytearray, memoryview)):
        raise _bad("undecodable", f"frame: expected bytes, got {type(frame).__name__}")
    n = len(frame)
    if n > limits.max_frame_bytes:
        raise _bad("too_large", f"frame has {n} bytes: limit max_frame_bytes={limits.max_frame_bytes}")
    if n < 5 + signature_len:
        raise _bad("undecodable", f"frame has {n} bytes: shorter than magic + version + signature")
    if bytes(frame[:4]) != MAGIC:
        raise _bad("undecodable", f"magic {bytes(frame[:4])!r}: expected {MAGIC!r}")
    if frame[4] not in VERSIONS:
        raise _bad("unsupported_version", f"version {frame[4]}: this reader understands {VERSIONS}")
    if frame[4] == 2:
        return _parse_header_v2(frame, limits, signature_len)
    if n < _FIXED + signature_len:
        raise _bad("undecodable", f"frame has {n} bytes: shorter than header + signature ({_FIXED + signature_len})")
    f = _HEADER.unpack_from(frame, 0)
    (magic, version, flags, width, bits, rnd, seq, vocab, temp, top_p, top_k, max_new,
     n_groups, n_compl, n_ptok, n_ctok, raw_len, payload_len, *slen) = f
    if flags & ~_KNOWN_FLAGS:
        raise _bad("undecodable", f"flags 0x{flags:02x}: unknown bits (known 0x{_KNOWN_FLAGS:02x})")
    _check_widths(flags, width, bits)
    _check_counts(n_groups, n_compl, n_ptok, n_ctok, raw_len, limits)
    for name, ln in zip(("sender", "run_id", "model_id", "tokenizer_fp"), slen):
        _limit(f"len({name})", ln, limits.max_string_bytes)
    if not flags & FLAG_ZSTD and payload_len != raw_len:
        raise _bad("undecodable", f"payload_len={payload_len} != raw_len={raw_len} for an uncompressed payload")
    lp_width = 4 if flags & FLAG_LOGP_F32 else 2
    min_raw = 8 * n_groups + 8 * n_compl + width * (n_ptok + n_ctok) + lp_width * n_ctok + 8 * n_groups
    if raw_len < min_raw:
        raise _bad("undecodable", f"raw_len={raw_len}: the declared counts need at least {min_raw} bytes")
    head_len = _FIXED + sum(slen)
    body_len = head_len + payload_len
    if n != body_len + signature_len:
        raise _bad("undecodable", f"frame has {n} bytes: header declares {body_len} + {signature_len}-byte signature")
    strings, pos = [], _FIXED
    for name, ln in zip(("sender", "run_id", "model_id", "tokenizer_fp"), slen):
        strings.append(_utf8(bytes(frame[pos:pos + ln]), f"header.{name}"))
        pos += ln
    return WireHeader(version, flags, width, bits, rnd, seq, vocab, temp, top_p, top_k, max_new,
                      n_groups, n_compl, n_ptok, n_ctok, raw_len, payload_len, *strings, body_len)


def _varint_at(buf, pos: int, end: int, max_bytes: int, bits: int, where: str, ended) -> tuple[int, int]:
    """One canonical unsigned LEB128 value from ``buf[pos:end]`` -> (value, next pos): at most
    ``max_bytes`` bytes, no trailing zero byte, below ``2**bits``; ``ended(left)``: the error when the
    data ends inside the value. The header's values use (10, 64), the payload's (5, 32)."""
    v = 0
    for i in range(max_bytes):
        if pos >= end:
            raise ended(end - pos)
        b = buf[pos]
        pos += 1
        v |= (b & 0x7F) << (7 * i)
        if not b & 0x80:
            if b == 0 and i > 0:
                raise _bad("undecodable", f"{where}: varint not minimal")
            if v >= 1 << bits:
                raise _bad("undecodable", f"{where}: varint above 2**{bits}")
            return v, pos
    raise _bad("undecodable", f"{where}: varint too long (more than {max_bytes} bytes)")


def _varint_run(buf, pos: int, end: int, count: int, max_bytes: int, bits: int) -> tuple[list[int], int] | None:
    """``count`` values as :func:`_varint_at` reads them from ``buf[pos:end]``, in one pass over the bytes
    -> (values, next pos); None wherever it would refuse one (read them one by one then: it says why)."""
    out = []
    append = out.append
    v = shift = 0
    left, top = count, 7 * max_bytes
    for i, b in enumerate(buf[pos:min(end, pos + count * max_bytes)]):
        if b < 0x80:
            if shift:
                if not b:                                    # not minimal
                    return None
                v |= b << shift
                if v >> bits:                                # too large
                    return None
                append(v)
                v = shift = 0
            else:
                append(b)
            left -= 1
            if not left:
                return out, pos + i + 1
        else:
            v |= (b & 0x7F) << shift
            shift += 7
            if shift == top:                                 # one byte more than max_bytes
                return None
    return None


#: up to this many values, :meth:`_Reader.varints` decodes in a Python loop (a few us per value, where
#: the vectorised decoder's ~20 numpy calls cost ~50 us whatever the count: a small frame has 2-64)
SMALL_VARINTS = 128


def _small_varints(buf, pos: int, count: int) -> tuple[list[int], int] | None:
    """``count`` canonical LEB128 values < 2**32 of at most 5 bytes each, all within ``5 * count`` bytes
    of ``pos`` -> (values, next pos); None when any is not (the vectorised decoder then names the error)."""
    head = buf[pos:pos + count]
    if len(head) == count and max(head, default=0) < 0x80:  # every value one byte (sizes, lengths): as is
        return list(head), pos + count
    return _varint_run(buf, pos, len(buf), count, 5, 32)


class _HeadCursor:
    """Bounded reads from a frame's header: varints (canonical, <= 10 bytes, < 2**64), reals, strings."""

    def __init__(self, frame, end: int):
        self.frame, self.pos, self.end = frame, 0, end

    def take(self, n: int, what: str) -> bytes:
        if self.pos + n > self.end:
            raise _bad("undecodable", f"header.{what}: needs {n} bytes, {self.end - self.pos} left before "
                                      "the signature")
        out = bytes(self.frame[self.pos:self.pos + n])
        self.pos += n
        return out

    def varint(self, what: str) -> int:
        def ended(left: int) -> BatchValidationError:
            return _bad("undecodable", f"header.{what}: needs 1 bytes, {left} left before the signature")

        v, self.pos = _varint_at(self.frame, self.pos, self.end, 10, 64, f"header.{what}", ended)
        return v

    def varints(self, *what: str) -> list[int]:
        """One varint per name in ``what``, in one pass (where that declines, one by one: the first
        that fails is named)."""
        got = _varint_run(self.frame, self.pos, self.end, len(what), 10, 64)
        if got is None:
            return [self.varint(w) for w in what]
        values, self.pos = got
        return values

    def real(self, what: str) -> float:
        d = self.take(1, what)[0]
        if d == 0xFF:
            return struct.unpack("<d", self.take(8, what))[0]
        if d > _MAX_DECIMAL_SCALE:
            raise _bad("undecodable", f"header.{what}: decimal scale {d}: must be <= {_MAX_DECIMAL_SCALE} or 0xFF")
        return self.varint(what) / 10 ** d

    def string(self, what: str, limit: int) -> str:
        pos = self.pos
        if pos < self.end and self.frame[pos] < 0x80:         # a length below 128: one byte
            ln, self.pos = self.frame[pos], pos + 1
        else:
            ln = self.varint(f"len({what})")
        if ln > limit:
            _limit(f"len({what})", ln, limit)
        return _utf8(self.take(ln, what), f"header.{what}")


def _parse_header_v2(frame, limits: WireLimits, signature_len: int) -> WireHeader:
    """The v2 header (module docstring): every size checked against ``limits`` before use."""
    n = len(frame)
    c = _HeadCursor(frame, n - signature_len)
    c.take(5, "magic")
    flags, width, bits, dict_id = c.take(4, "flags")
    if flags & ~_KNOWN_FLAGS_V2:
        raise _bad("undecodable", f"flags 0x{flags:02x}: unknown bits (known 0x{_KNOWN_FLAGS_V2:02x})")
    _check_widths(flags, width, bits)
    if dict_id:
        from ftis_fed.wire import dictionary as wiredict

        if dict_id not in wiredict.DICTIONARIES:
            raise _bad("unsupported_version", f"dict_id={dict_id}: this reader knows the zstd dictionaries "
                                              f"{sorted(wiredict.DICTIONARIES)}")
        if not flags & FLAG_ZSTD:
            raise _bad("undecodable", f"dict_id={dict_id} without a zstd payload")
    rnd, seq, vocab = c.varints("round", "seq", "vocab_size")
    temp, top_p = c.real("temperature"), c.real("top_p")
    top_k, max_new, n_groups, n_compl, n_ptok, n_ctok, raw_len, payload_len = c.varints(
        "top_k", "max_new_tokens", "n_groups", "n_completions", "n_prompt_tokens", "n_completion_tokens", "raw_len",
        "payload_len")
    _check_counts(n_groups, n_compl, n_ptok, n_ctok, raw_len, limits)
    digest_mode = bool(flags & FLAG_PROMPT_DIGEST)
    if digest_mode and n_ptok:
        raise _bad("undecodable", f"n_prompt_tokens={n_ptok} in a frame that carries only the prompt digest")
    if not flags & FLAG_ZSTD and payload_len != raw_len:
        raise _bad("undecodable", f"payload_len={payload_len} != raw_len={raw_len} for an uncompressed payload")
    lp_width = 4 if flags & FLAG_LOGP_F32 else 1                          # v2 codes: 1..3-byte varints
    min_raw = (n_groups * (3 + (0 if digest_mode else 1)) + 5 * n_compl + width * (n_ptok + n_ctok)
               + lp_width * n_ctok)
    if raw_len < min_raw:
        raise _bad("undecodable", f"raw_len={raw_len}: the declared counts need at least {min_raw} bytes")
    lim = limits.max_string_bytes
    sender, run_id, model_id = (c.string(f, lim) for f in ("sender", "run_id", "model_id"))
    if flags & FLAG_FP_HEX:
        fp = "tok-" + c.take(8, "tokenizer_fp").hex()
    else:
        fp = c.string("tokenizer_fp", lim)
    digest = c.take(PROMPT_DIGEST_LEN, "prompt_digest") if digest_mode else b""
    eos = c.varint("eos_id") if flags & FLAG_EOS_ID else None
    if eos is not None and eos >= vocab:
        raise _bad("undecodable", f"eos_id={eos}: must be below vocab_size={vocab}")
    body_len = c.pos + payload_len
    if n != body_len + signature_len:
        raise _bad("undecodable", f"frame has {n} bytes: header declares {body_len} + {signature_len}-byte signature")
    return WireHeader(2, flags, width, bits, rnd, seq, vocab, temp, top_p, top_k, max_new, n_groups, n_compl, n_ptok,
                      n_ctok, raw_len, payload_len, sender, run_id, model_id, fp, body_len, digest, dict_id, eos)


def _check_widths(flags: int, width: int, bits: int) -> None:
    if width not in _ID_DTYPES:
        raise _bad("undecodable", f"id_width={width}: must be 1, 2 or 4")
    if flags & FLAG_LOGP_F32:
        if bits != 0:
            raise _bad("undecodable", f"logp_frac_bits={bits}: must be 0 with float32 log-probs")
    elif not MIN_LOGP_FRAC_BITS <= bits <= MAX_LOGP_FRAC_BITS:
        raise _bad("undecodable", f"logp_frac_bits={bits}: must be in [{MIN_LOGP_FRAC_BITS}, {MAX_LOGP_FRAC_BITS}]")


def check_header_limits(h: WireHeader, limits: WireLimits) -> None:
    """Check a parsed header's declared sizes against (stricter) ``limits``: ``too_large`` otherwise.

    For a receiver that parsed the header with loose limits to verify the signature first, then
    holds the now-authenticated header to its own run's bounds before decompressing anything.
    """
    if h.body_len + SIGNATURE_LEN > limits.max_frame_bytes:
        raise _bad("too_large", f"frame has {h.body_len + SIGNATURE_LEN} bytes: limit max_frame_bytes="
                                f"{limits.max_frame_bytes}")
    _check_counts(h.n_groups, h.n_completions, h.n_prompt_tokens, h.n_completion_tokens, h.raw_len, limits)


def _check_counts(n_groups: int, n_compl: int, n_ptok: int, n_ctok: int, raw_len: int, limits: WireLimits) -> None:
    _limit("n_groups", n_groups, limits.max_groups)
    _limit("n_completions", n_compl, limits.max_completions)
    _limit("n_prompt_tokens", n_ptok, limits.max_prompt_tokens)
    _limit("n_completion_tokens", n_ctok, limits.max_tokens)
    _limit("raw_len", raw_len, limits.max_raw_bytes)


def _limit(name: str, value: int, limit: int) -> None:
    if value > limit:
        raise _bad("too_large", f"{name}={value}: limit {limit}")


def _utf8(raw: bytes, where: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _bad("undecodable", f"{where}: invalid UTF-8 ({e.reason} at byte {e.start})") from e


def split_frame(frame: bytes, limits: WireLimits = WireLimits()) -> tuple[WireHeader, bytes, bytes]:
    """frame -> (header, body, signature); body = header + payload bytes (what is signed)."""
    h = parse_header(frame, limits)
    frame = bytes(frame)
    return h, frame[:h.body_len], frame[h.body_len:]


def _decompress(payload: bytes, raw_len: int, dict_id: int = 0) -> bytes:
    """One zstd frame -> exactly raw_len bytes; never allocates more than raw_len (checked).
    dict_id: the packaged zstd dictionary it was compressed with (0: none)."""
    if payload[:4] != _ZSTD_MAGIC:
        raise _bad("undecodable", "payload: not a zstd frame")
    try:
        declared = zstd.frame_content_size(payload)
        if declared != raw_len:
            raise _bad("undecodable", f"payload: zstd frame declares {declared} bytes, header raw_len={raw_len}")
        if _zstd_frame_len(payload) != len(payload):
            raise _bad("undecodable", "payload: bytes after the zstd frame")
        if dict_id:
            from ftis_fed.wire import dictionary as wiredict

            dec = zstd.ZstdDecompressor(dict_data=wiredict.dictionary(dict_id))
        else:
            dec = zstd.ZstdDecompressor()
        raw = dec.decompress(payload, max_output_size=raw_len)
    except zstd.ZstdError as e:
        raise _bad("undecodable", f"payload: zstd: {e}") from e
    if len(raw) != raw_len:
        raise _bad("undecodable", f"payload: decompressed to {len(raw)} bytes, header raw_len={raw_len}")
    return raw


def _zstd_frame_len(data: bytes) -> int:
    """Length in bytes of the zstd frame at the start of ``data`` (walks the block headers)."""
    pos = zstd.frame_header_size(data)
    while True:
        if pos + 3 > len(data):
            raise _bad("undecodable", "payload: truncated zstd block header")
        bh = int.from_bytes(data[pos:pos + 3], "little")
        last, btype, bsize = bh & 1, (bh >> 1) & 3, bh >> 3
        if btype == 3:
            raise _bad("undecodable", "payload: reserved zstd block type")
        pos += 3 + (1 if btype == 1 else bsize)
        if last:
            break
    return pos + (4 if zstd.get_frame_parameters(data).has_checksum else 0)


class _Reader:
    """Bounded cursor over the raw payload: every read checks the bytes left first."""

    def __init__(self, buf: bytes):
        self.buf, self.pos = buf, 0

    def take(self, n: int, what: str) -> bytes:
        if n < 0 or self.pos + n > len(self.buf):
            raise _bad("undecodable", f"payload.{what}: needs {n} bytes, {len(self.buf) - self.pos} left")
        out = self.buf[self.pos:self.pos + n]
        self.pos += n
        return out

    def array(self, dtype, count: int, what: str) -> np.ndarray:
        dt = np.dtype(dtype)
        return np.frombuffer(self.take(count * dt.itemsize, what), dtype=dt)

    def u32(self, what: str) -> int:
        return struct.unpack("<I", self.take(4, what))[0]

    def str(self, what: str) -> str:
        return _utf8(self.take(self.u32(what), what), f"payload.{what}")

    def varint_list(self, count: int, what: str) -> list[int]:
        """``count`` canonical LEB128 values < 2**32 (<= 5 bytes each) -> Python ints (sizes, lengths:
        what the groups are cut by); reads at most 5 * count bytes."""
        if 0 < count <= SMALL_VARINTS:
            got = _small_varints(self.buf, self.pos, count)
            if got is not None:
                self.pos = got[1]
                return got[0]
        return self.varints(count, what).tolist()

    def varints(self, count: int, what: str) -> np.ndarray:
        """``count`` canonical LEB128 values < 2**32 (<= 5 bytes each) -> (count,) int64, vectorised;
        reads at most 5 * count bytes."""
        if count == 0:
            return np.zeros(0, dtype=np.int64)
        if count <= SMALL_VARINTS:
            got = _small_varints(self.buf, self.pos, count)
            if got is not None:
                self.pos = got[1]
                return np.array(got[0], dtype=np.int64)
        window = np.frombuffer(self.buf, dtype=np.uint8, count=min(len(self.buf) - self.pos, 5 * count),
                               offset=self.pos)
        ends = np.flatnonzero(window < 0x80)[:count]                     # last byte of each value
        if ends.size < count:
            raise _bad("undecodable", f"payload.{what}: {ends.size} of {count} varints end within the "
                                      f"{window.size} bytes left to read (at most 5 bytes each)")
        starts = np.concatenate([[0], ends[:-1] + 1])
        lens = ends - starts + 1
        if int(lens.max()) > 5 or bool(((window[ends] == 0) & (lens > 1)).any()):
            raise _bad("undecodable", f"payload.{what}: varint too long or not minimal")
        used = int(ends[-1]) + 1
        seg = np.repeat(np.arange(count), lens)                              # (used,) value of each byte
        shift = 7 * (np.arange(used) - starts[seg])
        vals = np.bincount(seg, weights=(window[:used] & 0x7F).astype(np.float64) * 2.0 ** shift,
                           minlength=count)                                  # exact: < 2**35
        if float(vals.max()) >= 2.0 ** 32:
            raise _bad("undecodable", f"payload.{what}: varint above 2**32")
        self.pos += used
        return vals.astype(np.int64)

    def varint(self, what: str) -> int:
        """One canonical LEB128 value < 2**32 (<= 5 bytes)."""
        def ended(left: int) -> BatchValidationError:
            return _bad("undecodable", f"payload.{what}: the data ends inside a varint")

        v, self.pos = _varint_at(self.buf, self.pos, len(self.buf), 5, 32, f"payload.{what}", ended)
        return v

    def vstr(self, what: str) -> str:
        return _utf8(self.take(self.varint(what), what), f"payload.{what}")


def decode_payload(h: WireHeader, body: bytes) -> CompletionBatch:
    """Header + body (from :func:`split_frame`) -> CompletionBatch (not validated: call validate).

    Hostile input raises only BatchValidationError; memory stays within the header's checked sizes.
    """
    return decode_payload_flat(h, body)[0]


def decode_payload_flat(h: WireHeader, body: bytes) -> tuple[CompletionBatch, FlatGroups]:
    """:func:`decode_payload` and the flat arrays the batch's groups are views of
    (``CompletionBatch.validate(flat=...)`` checks them all at once instead of group by group)."""
    try:
        return _decode_payload(h, body)
    except BatchValidationError:
        raise
    except (ValueError, OverflowError, struct.error, IndexError) as e:   # defence in depth
        raise _bad("undecodable", f"payload: {type(e).__name__}: {e}") from e


def _decode_payload(h: WireHeader, body: bytes) -> tuple[CompletionBatch, FlatGroups]:
    """The payload's sections in order; v1 and v2 differ only in how sizes, counts and string
    lengths are written (u32 vs varint), in v2's optional prompt ids (prompt digest) and in the
    log-prob codes (``_read_logprobs``). Sizes are read as Python ints (the groups are cut by them)."""
    payload = body[h.body_len - h.payload_len:]
    raw = _decompress(payload, h.raw_len, h.dict_id) if h.flags & FLAG_ZSTD else payload
    r = _Reader(raw)
    v2 = h.version == 2
    if v2:
        g_sizes = r.varint_list(h.n_groups, "group_sizes")
        p_lens = ([0] * h.n_groups if h.flags & FLAG_PROMPT_DIGEST
                  else r.varint_list(h.n_groups, "prompt_lengths"))
    else:
        table = r.array("<u4", 2 * h.n_groups, "groups").reshape(-1, 2)      # (n_groups, 2)
        p_lens, g_sizes = table[:, 0].tolist(), table[:, 1].tolist()
    if sum(g_sizes) != h.n_completions or sum(p_lens) != h.n_prompt_tokens:
        raise _bad("undecodable", f"payload.groups: sizes sum to {sum(g_sizes)} completions / "
                                  f"{sum(p_lens)} prompt tokens, header says {h.n_completions} / "
                                  f"{h.n_prompt_tokens}")
    lengths = (r.varint_list(h.n_completions, "lengths") if v2
               else r.array("<u4", h.n_completions, "lengths").tolist())   # (n_completions,)
    if sum(lengths) != h.n_completion_tokens:
        raise _bad("undecodable", f"payload.lengths: sum {sum(lengths)}, "
                                  f"header n_completion_tokens={h.n_completion_tokens}")
    rewards = r.array("<f4", h.n_completions, "rewards").astype(np.float32)
    dt = _ID_DTYPES[h.id_width]
    prompt_ids = r.array(dt, h.n_prompt_tokens, "prompt_ids").astype(np.int64)
    comp_ids = r.array(dt, h.n_completion_tokens, "completion_ids").astype(np.int64)
    logprobs, free = _read_logprobs(h, r)
    names, texts = _read_strings(h, g_sizes, r, v2)
    if r.pos != len(raw):
        raise _bad("undecodable", f"payload: {len(raw) - r.pos} unread bytes at the end")
    flat = FlatGroups(g_sizes, p_lens, lengths, prompt_ids, comp_ids, rewards, logprobs, free, names, texts)
    return _assemble(h, flat), flat


def _read_strings(h: WireHeader, g_sizes: list[int], r: _Reader, v2: bool) -> tuple[list, list]:
    """The payload's string sections, the same in both versions up to how a string and a count are
    written (v1: u32 length / u32; v2: varint length / varint): per group the task id and reference,
    then with the texts flag the prompt text and 0 or the group's size completion texts. Read in one
    pass without naming each field (``_strings_fast``); where that declines, read again field by
    field, naming the first that fails."""
    got = _strings_fast(r.buf, r.pos, g_sizes, h.has_texts, v2)
    if got is not None:
        names, texts, r.pos = got
        return names, texts
    read_str, read_int = (r.vstr, r.varint) if v2 else (r.str, r.u32)
    names = [(read_str(f"groups[{i}].task_id"), read_str(f"groups[{i}].reference")) for i in range(h.n_groups)]
    texts = [("", ())] * h.n_groups
    if h.has_texts:
        texts = []
        for i in range(h.n_groups):
            pt = read_str(f"groups[{i}].prompt_text")
            k = read_int(f"groups[{i}].n_texts")
            if k not in (0, int(g_sizes[i])):
                raise _bad("undecodable", f"payload.groups[{i}].n_texts={k}: must be 0 or the group's "
                                          f"{int(g_sizes[i])} completions")
            texts.append((pt, tuple(read_str(f"groups[{i}].completion_texts[{j}]") for j in range(k))))
    return names, texts


def _count_at(buf, pos: int, v2: bool) -> tuple[int, int] | None:
    """A string length or count at ``pos`` (v2: canonical varint < 2**32; v1: u32) -> (value, next pos);
    None when it is not there or not canonical."""
    if v2:
        if pos < len(buf) and buf[pos] < 0x80:
            return buf[pos], pos + 1
        got = _small_varints(buf, pos, 1)
        return None if got is None else (got[0][0], got[1])
    if pos + 4 > len(buf):
        return None
    return int.from_bytes(buf[pos:pos + 4], "little"), pos + 4


def _str_at(buf, pos: int, v2: bool) -> tuple[str, int] | None:
    """A length-prefixed UTF-8 string at ``pos`` -> (text, next pos); None when it is not all there or not UTF-8."""
    got = _count_at(buf, pos, v2)
    if got is None:
        return None
    n, pos = got
    end = pos + n
    if end > len(buf):
        return None
    try:
        return buf[pos:end].decode("utf-8"), end
    except UnicodeDecodeError:
        return None


def _strings_fast(buf, pos: int, g_sizes: list[int], has_texts: bool, v2: bool) -> tuple[list, list, int] | None:
    """What :func:`_read_strings` reads, -> (names, texts, next pos); None wherever it would refuse."""
    names = []
    for _ in g_sizes:
        task = _str_at(buf, pos, v2)
        ref = task and _str_at(buf, task[1], v2)
        if ref is None:
            return None
        names.append((task[0], ref[0]))
        pos = ref[1]
    if not has_texts:
        return names, [("", ())] * len(g_sizes), pos
    texts = []
    for size in g_sizes:
        prompt = _str_at(buf, pos, v2)
        k = prompt and _count_at(buf, prompt[1], v2)
        if k is None or k[0] not in (0, size):
            return None
        pos, comps = k[1], []
        for _ in range(k[0]):
            got = _str_at(buf, pos, v2)
            if got is None:
                return None
            comps.append(got[0])
            pos = got[1]
        texts.append((prompt[0], tuple(comps)))
    return names, texts, pos


def _read_logprobs(h: WireHeader, r: _Reader) -> tuple[np.ndarray, np.ndarray]:
    """-> (log-probs, the ones not read from fixed-point codes): the escaped values, or all of them
    in a float32 frame (a code gives a finite value <= 0 by construction; only these need checking)."""
    n = h.n_completion_tokens
    if h.flags & FLAG_LOGP_F32:
        lp = r.array("<f4", n, "logprobs").astype(np.float32)
        return lp, lp
    if h.version == 2:                                                       # LEB128 codes <= 0xFFFF
        if n <= SMALL_VARINTS:                                               # a Python list, no array of codes
            got = _small_varints(r.buf, r.pos, n) if n else ([], r.pos)
            if got is not None and max(got[0], default=0) <= LOGP_ESCAPE:
                codes, r.pos = got
                escapes = r.array("<f4", codes.count(LOGP_ESCAPE), "logprob_escapes").astype(np.float32)
                return dequantize_logprobs(np.array(codes, dtype=np.uint16), escapes, h.logp_frac_bits), escapes
        codes = r.varints(n, "logprob_codes")
        if n and int(codes.max()) > LOGP_ESCAPE:
            raise _bad("undecodable", f"payload.logprob_codes: code {int(codes.max())} above {LOGP_ESCAPE}")
        codes = codes.astype(np.uint16)
    else:
        planes = r.array(np.uint8, 2 * n, "logprobs").reshape(2, n)        # (2, N)
        codes = planes[0].astype(np.uint16) | (planes[1].astype(np.uint16) << 8)
    n_esc = int((codes == LOGP_ESCAPE).sum())
    escapes = r.array("<f4", n_esc, "logprob_escapes").astype(np.float32)
    return dequantize_logprobs(codes, escapes, h.logp_frac_bits), escapes


def _assemble(h: WireHeader, flat: FlatGroups) -> CompletionBatch:
    """Cut the flat arrays back into groups (views sliced from the flat arrays, by Python int offsets)."""
    p_off = [0, *accumulate(flat.prompt_lengths)]
    g_off = [0, *accumulate(flat.group_sizes)]
    t_off = [0, *accumulate(flat.lengths)]
    prompt_ids, comp_ids, logprobs, rewards = flat.prompt_ids, flat.completion_ids, flat.logprobs, flat.rewards
    groups = []
    for i, ((task_id, reference), (prompt_text, completion_texts)) in enumerate(zip(flat.names, flat.texts)):
        a, b = g_off[i], g_off[i + 1]
        spans = list(zip(t_off[a:b], t_off[a + 1:b + 1]))
        groups.append(PromptGroup(
            prompt_ids=prompt_ids[p_off[i]:p_off[i + 1]],
            completion_ids=tuple([comp_ids[s:e] for s, e in spans]),
            logprobs=tuple([logprobs[s:e] for s, e in spans]),
            rewards=rewards[a:b], task_id=task_id, reference=reference,
            prompt_text=prompt_text, completion_texts=completion_texts))
    sampling = SamplingParams(temperature=h.temperature, top_p=h.top_p, top_k=h.top_k,
                              max_new_tokens=h.max_new_tokens)
    return CompletionBatch(sender=h.sender, run_id=h.run_id, round=h.round, seq=h.seq,
                           model_id=h.model_id, tokenizer_fp=h.tokenizer_fp, vocab_size=h.vocab_size,
                           sampling=sampling, groups=tuple(groups), prompt_digest=h.prompt_digest, eos_id=h.eos_id)


def decode_frame(frame: bytes, limits: WireLimits = WireLimits()) -> CompletionBatch:
    """Signed frame -> CompletionBatch *without checking the signature* (see signing.verify_frame).

    Hostile input raises only BatchValidationError; memory stays within ``limits``.
    """
    h, body, _ = split_frame(frame, limits)
    return decode_payload(h, body)
