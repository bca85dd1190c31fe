"""Completion batches <-> compact, versioned, strictly bounded bytes (wire format v1).

A *frame* is what travels: ``body || signature`` where ``body = header || payload`` and the
64-byte Ed25519 signature is made and checked by :mod:`ftis_fed.signing`. This module only lays
the bytes out and reads them back; it never trusts a length it has not checked against
:class:`WireLimits` first, and every failure is a :class:`BatchValidationError` (reason
``undecodable``, ``unsupported_version`` or ``too_large``).

Header (little-endian, ``_FIXED`` = 88 bytes, then 4 UTF-8 strings of the declared lengths):

    magic "FTIS" | version u8 | flags u8 | id_width u8 | logp_frac_bits u8 |
    round u64 | seq u64 | vocab_size u64 | temperature f64 | top_p f64 | top_k u32 |
    max_new_tokens u32 | n_groups u32 | n_completions u32 | n_prompt_tokens u32 |
    n_completion_tokens u32 | raw_len u32 | payload_len u32 |
    len(sender) u16 | len(run_id) u16 | len(model_id) u16 | len(tokenizer_fp) u16 |
    sender | run_id | model_id | tokenizer_fp

Payload (``raw_len`` bytes; zstd-compressed to ``payload_len`` bytes when ``FLAG_ZSTD``):

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

The fixed-point code has step 2**-bits nats, so the log-prob error is <= 2**-(bits+1): 1.95e-3 at
the default (and minimum accepted) 8 bits.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import zstandard as zstd

from .batch import (
    DEFAULT_MAX_TOKENS,
    BatchValidationError,
    CompletionBatch,
    PromptGroup,
    SamplingParams,
)

MAGIC = b"FTIS"
VERSION = 1
SIGNATURE_LEN = 64

FLAG_ZSTD = 0x01       # payload is one zstd frame (content size declared, no trailing bytes)
FLAG_TEXTS = 0x02      # payload carries prompt_text and completion_texts
FLAG_LOGP_F32 = 0x04   # log-probs stored as raw float32 instead of fixed-point codes
_KNOWN_FLAGS = FLAG_ZSTD | FLAG_TEXTS | FLAG_LOGP_F32

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
    """

    texts: bool = True
    compress: bool = True
    zstd_level: int = 19
    logp: str = "fixed"
    logp_frac_bits: int = 8
    id_width: int = 0

    def __post_init__(self) -> None:
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
PAPER_OPTIONS = WireOptions(texts=False, compress=False, logp="f32", id_width=4)


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


def _payload(batch: CompletionBatch, width: int, opts: WireOptions) -> bytes:
    """The raw (uncompressed) payload sections, in the order of the module docstring."""
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
    raw = _payload(batch, width, options)
    flags = (FLAG_TEXTS if options.texts else 0) | (FLAG_LOGP_F32 if options.logp == "f32" else 0)
    payload = raw
    if options.compress:
        packed = zstd.ZstdCompressor(level=options.zstd_level, write_content_size=True,
                                     write_checksum=False).compress(raw)
        if len(packed) < len(raw):
            payload, flags = packed, flags | FLAG_ZSTD
    names = [batch.sender, batch.run_id, batch.model_id, batch.tokenizer_fp]
    enc = [str(s).encode("utf-8") for s in names]
    s = batch.sampling
    try:
        head = _HEADER.pack(
            MAGIC, VERSION, flags, width, 0 if options.logp == "f32" else options.logp_frac_bits,
            int(batch.round), int(batch.seq), int(batch.vocab_size),
            float(s.temperature), float(s.top_p), int(s.top_k), int(s.max_new_tokens),
            len(gs), sum(g.size for g in gs), sum(len(g.prompt_ids) for g in gs),
            batch.num_completion_tokens, len(raw), len(payload), *[len(e) for e in enc])
    except struct.error as e:
        raise _bad("bad_header", f"a header field does not fit its wire width ({e})") from e
    return head + b"".join(enc) + payload


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
    if n < _FIXED + signature_len:
        raise _bad("undecodable", f"frame has {n} bytes: shorter than header + signature ({_FIXED + signature_len})")
    f = _HEADER.unpack_from(frame, 0)
    (magic, version, flags, width, bits, rnd, seq, vocab, temp, top_p, top_k, max_new,
     n_groups, n_compl, n_ptok, n_ctok, raw_len, payload_len, *slen) = f
    if magic != MAGIC:
        raise _bad("undecodable", f"magic {bytes(magic)!r}: expected {MAGIC!r}")
    if version != VERSION:
        raise _bad("unsupported_version", f"version {version}: this reader understands {VERSION}")
    if flags & ~_KNOWN_FLAGS:
        raise _bad("undecodable", f"flags 0x{flags:02x}: unknown bits (known 0x{_KNOWN_FLAGS:02x})")
    if width not in _ID_DTYPES:
        raise _bad("undecodable", f"id_width={width}: must be 1, 2 or 4")
    if flags & FLAG_LOGP_F32:
        if bits != 0:
            raise _bad("undecodable", f"logp_frac_bits={bits}: must be 0 with float32 log-probs")
    elif not MIN_LOGP_FRAC_BITS <= bits <= MAX_LOGP_FRAC_BITS:
        raise _bad("undecodable", f"logp_frac_bits={bits}: must be in [{MIN_LOGP_FRAC_BITS}, {MAX_LOGP_FRAC_BITS}]")
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


def _decompress(payload: bytes, raw_len: int) -> bytes:
    """One zstd frame -> exactly raw_len bytes; never allocates more than raw_len (checked)."""
    if payload[:4] != _ZSTD_MAGIC:
        raise _bad("undecodable", "payload: not a zstd frame")
    try:
        declared = zstd.frame_content_size(payload)
        if declared != raw_len:
            raise _bad("undecodable", f"payload: zstd frame declares {declared} bytes, header raw_len={raw_len}")
        if _zstd_frame_len(payload) != len(payload):
            raise _bad("undecodable", "payload: bytes after the zstd frame")
        raw = zstd.ZstdDecompressor().decompress(payload, max_output_size=raw_len)
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


def decode_payload(h: WireHeader, body: bytes) -> CompletionBatch:
    """Header + body (from :func:`split_frame`) -> CompletionBatch (not validated: call validate).

    Hostile input raises only BatchValidationError; memory stays within the header's checked sizes.
    """
    try:
        return _decode_payload(h, body)
    except BatchValidationError:
        raise
    except (ValueError, OverflowError, struct.error, IndexError) as e:   # defence in depth
        raise _bad("undecodable", f"payload: {type(e).__name__}: {e}") from e


def _decode_payload(h: WireHeader, body: bytes) -> CompletionBatch:
    payload = body[h.body_len - h.payload_len:]
    raw = _decompress(payload, h.raw_len) if h.flags & FLAG_ZSTD else payload
    r = _Reader(raw)
    table = r.array("<u4", 2 * h.n_groups, "groups").reshape(-1, 2)      # (n_groups, 2)
    p_lens, g_sizes = table[:, 0].astype(np.int64), table[:, 1].astype(np.int64)
    if int(g_sizes.sum()) != h.n_completions or int(p_lens.sum()) != h.n_prompt_tokens:
        raise _bad("undecodable", f"payload.groups: sizes sum to {int(g_sizes.sum())} completions / "
                                  f"{int(p_lens.sum())} prompt tokens, header says {h.n_completions} / "
                                  f"{h.n_prompt_tokens}")
    lengths = r.array("<u4", h.n_completions, "lengths").astype(np.int64)   # (n_completions,)
    if int(lengths.sum()) != h.n_completion_tokens:
        raise _bad("undecodable", f"payload.lengths: sum {int(lengths.sum())}, "
                                  f"header n_completion_tokens={h.n_completion_tokens}")
    rewards = r.array("<f4", h.n_completions, "rewards").astype(np.float32)
    dt = _ID_DTYPES[h.id_width]
    prompt_ids = r.array(dt, h.n_prompt_tokens, "prompt_ids").astype(np.int64)
    comp_ids = r.array(dt, h.n_completion_tokens, "completion_ids").astype(np.int64)
    n = h.n_completion_tokens
    if h.flags & FLAG_LOGP_F32:
        logprobs = r.array("<f4", n, "logprobs").astype(np.float32)
    else:
        planes = r.array(np.uint8, 2 * n, "logprobs").reshape(2, n)        # (2, N)
        codes = planes[0].astype(np.uint16) | (planes[1].astype(np.uint16) << 8)
        n_esc = int((codes == LOGP_ESCAPE).sum())
        escapes = r.array("<f4", n_esc, "logprob_escapes").astype(np.float32)
        logprobs = dequantize_logprobs(codes, escapes, h.logp_frac_bits)
    names = [(r.str(f"groups[{i}].task_id"), r.str(f"groups[{i}].reference")) for i in range(h.n_groups)]
    texts = [("", ())] * h.n_groups
    if h.has_texts:
        texts = []
        for i in range(h.n_groups):
            pt = r.str(f"groups[{i}].prompt_text")
            k = r.u32(f"groups[{i}].n_texts")
            if k not in (0, int(g_sizes[i])):
                raise _bad("undecodable", f"payload.groups[{i}].n_texts={k}: must be 0 or the group's "
                                          f"{int(g_sizes[i])} completions")
            texts.append((pt, tuple(r.str(f"groups[{i}].completion_texts[{j}]") for j in range(k))))
    if r.pos != len(raw):
        raise _bad("undecodable", f"payload: {len(raw) - r.pos} unread bytes at the end")
    return _assemble(h, p_lens, g_sizes, lengths, rewards, prompt_ids, comp_ids, logprobs, names, texts)


def _assemble(h, p_lens, g_sizes, lengths, rewards, prompt_ids, comp_ids, logprobs, names, texts) -> CompletionBatch:
    """Cut the flat arrays back into groups (views sliced from the flat arrays)."""
    p_off = np.concatenate([[0], np.cumsum(p_lens)])
    g_off = np.concatenate([[0], np.cumsum(g_sizes)])
    t_off = np.concatenate([[0], np.cumsum(lengths)])
    groups = []
    for i in range(h.n_groups):
        ci = range(int(g_off[i]), int(g_off[i + 1]))
        groups.append(PromptGroup(
            prompt_ids=prompt_ids[p_off[i]:p_off[i + 1]],
            completion_ids=tuple(comp_ids[t_off[j]:t_off[j + 1]] for j in ci),
            logprobs=tuple(logprobs[t_off[j]:t_off[j + 1]] for j in ci),
            rewards=rewards[g_off[i]:g_off[i + 1]],
            task_id=names[i][0], reference=names[i][1],
            prompt_text=texts[i][0], completion_texts=texts[i][1]))
    sampling = SamplingParams(temperature=h.temperature, top_p=h.top_p, top_k=h.top_k,
                              max_new_tokens=h.max_new_tokens)
    return CompletionBatch(sender=h.sender, run_id=h.run_id, round=h.round, seq=h.seq,
                           model_id=h.model_id, tokenizer_fp=h.tokenizer_fp, vocab_size=h.vocab_size,
                           sampling=sampling, groups=tuple(groups))


def decode_frame(frame: bytes, limits: WireLimits = WireLimits()) -> CompletionBatch:
    """Signed frame -> CompletionBatch *without checking the signature* (see signing.verify_frame).

    Hostile input raises only BatchValidationError; memory stays within ``limits``.
    """
    h, body, _ = split_frame(frame, limits)
    return decode_payload(h, body)
