"""Every participant's reply is checked here, once, before the engine uses it.

``check_reply(action, content, limits) -> Reply`` or :class:`BadReply` with a named reason:

    missing_record / extra_record   the reply's fields differ from what the action returns
    wrong_type                      a field of the wrong type (frames not a list, metrics not a mapping, ...)
    too_many_frames                 more frames than ``frames_per_reply`` (one frame per sender per round;
                                    times the variants asked for: see below)
    wrong_variants                  the request asked for two variants (``texts: [False, True]``) and the
                                    reply has neither none nor exactly one frame per variant, in order
    variant_mismatch                the two variants' headers disagree on anything but the texts (flags,
                                    payload sizes): sender, run, round, seq, model, tokenizer, vocabulary,
                                    sampling, counts; or a header that cannot be read
    frame_not_bytes                 a frame that is not ``bytes``
    frame_too_large                 a frame above ``max_frame_bytes`` (from the run's max-batch-tokens)
    nonscalar_metric                a metric that is not a plain int/float (list, string, ...)
    nonfinite_metric                NaN or +-inf
    reserved_metric                 a metric named like a row's identity (round, participant, phase, model_id)
    too_many_metrics                more than ``max_metrics`` entries
    bad_hello                       hello info without its required fields, or with mistyped ones

Pure functions: no I/O, no Flower. The boundary (``boundary.py``) adds the reasons that need the
engine's state (``unknown_node``, ``wrong_node``) and wraps anything unexpected as ``internal_error``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from ftis_fed.actions import ACTIONS
from ftis_fed.policies.weights_fp import FINGERPRINT_RE
from ftis_fed.wire.batch import DEFAULT_MAX_TOKENS, BatchValidationError
from ftis_fed.wire.codec import FLAG_TEXTS, WireHeader, WireLimits, parse_header

#: hello info fields the server needs, with their types
HELLO_FIELDS: dict[str, type | tuple[type, ...]] = {
    "participant": str, "key_fp": str, "model_id": str, "tokenizer_fp": str, "proof": bytes,
}

#: a metrics row's identity: set by the engine, never by a participant
IDENTITY_FIELDS = frozenset({"round", "participant", "phase", "model_id", "model_weights"})


def max_frame_bytes_for(max_batch_tokens: int) -> int:
    """The largest signed frame a run can legitimately produce: a 64 KiB allowance for headers,
    prompts and signature plus 32 bytes per completion token (8-byte id + 4-byte log-prob at the
    widest encoding, and room for its text). Anything above cannot be an honest batch."""
    return (64 << 10) + 32 * max_batch_tokens


@dataclass(frozen=True)
class ReplyLimits:
    """What a reply may hold.

    frames_per_reply: frames one sender may return in one reply (= per round: one generate or
        exchange reply per round), >= 0. The issue-10 rule: one frame per sender per round.
    max_frame_bytes: a frame's size limit (``max_frame_bytes_for(max-batch-tokens)``).
    max_metrics: entries in one metrics record.
    """

    frames_per_reply: int = 1
    max_frame_bytes: int = field(default_factory=lambda: max_frame_bytes_for(DEFAULT_MAX_TOKENS))
    max_metrics: int = 4096

    def __post_init__(self) -> None:
        if self.frames_per_reply < 0 or self.max_frame_bytes < 1 or self.max_metrics < 1:
            raise ValueError(f"ReplyLimits: frames_per_reply={self.frames_per_reply} must be >= 0, "
                             f"max_frame_bytes={self.max_frame_bytes} and max_metrics={self.max_metrics} >= 1")


class BadReply(ValueError):
    """A reply that cannot be used; ``reason`` names the rule it broke (see the module docstring)."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class Reply:
    """A checked reply: ``frames`` (bytes each, within the limits), ``metrics`` (finite floats,
    no identity keys), ``info`` (hello / finish: plain values)."""

    frames: tuple[bytes, ...] = ()
    metrics: dict[str, float] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)


def check_reply(action: str, content: Any, limits: ReplyLimits = ReplyLimits(),
                variants: tuple[bool, ...] = ()) -> Reply:
    """The raw reply of ``action`` -> :class:`Reply`, or :class:`BadReply`. ``variants``: the frame
    variants the request asked for (``ftis_fed.actions.requested_variants``); two or more allow one
    frame each. The fields an action's reply carries are its row of ``ftis_fed.actions.ACTIONS``."""
    if action not in ACTIONS:
        raise BadReply("internal_error", f"no reply rules for action {action!r}")
    if not isinstance(content, Mapping):
        raise BadReply("wrong_type", f"{action} reply: expected a mapping of fields, got {type(content).__name__}")
    want, got = set(ACTIONS[action].reply), set(content)
    if want - got:
        raise BadReply("missing_record", f"{action} reply lacks {sorted(want - got)} (has {sorted(got)})")
    if got - want:
        raise BadReply("extra_record", f"{action} reply has unexpected {sorted(got - want, key=str)[:8]}")
    if len(variants) > 1:
        limits = ReplyLimits(limits.frames_per_reply * len(variants), limits.max_frame_bytes, limits.max_metrics)
    frames = check_frames(content["frames"], limits) if "frames" in want else ()
    if len(variants) > 1 and frames:
        check_variants(frames, variants, limits)
    metrics = check_metrics(content["metrics"], limits) if "metrics" in want else {}
    info = check_info(content["info"], hello=action == "hello") if "info" in want else {}
    return Reply(frames=frames, metrics=metrics, info=info)


def check_frames(frames: Any, limits: ReplyLimits) -> tuple[bytes, ...]:
    if not isinstance(frames, (list, tuple)):
        raise BadReply("wrong_type", f"frames: expected a list of bytes, got {type(frames).__name__}")
    if len(frames) > limits.frames_per_reply:
        raise BadReply("too_many_frames", f"{len(frames)} frames in one reply: limit {limits.frames_per_reply} "
                                          "(one frame per sender per round)")
    for i, f in enumerate(frames):
        if not isinstance(f, bytes):
            raise BadReply("frame_not_bytes", f"frames[{i}] is {type(f).__name__}, not bytes")
        if len(f) > limits.max_frame_bytes:
            raise BadReply("frame_too_large", f"frames[{i}] has {len(f)} bytes: limit {limits.max_frame_bytes} "
                                              "(from max-batch-tokens)")
    return tuple(frames)


#: header fields that may differ between the variants of one batch (the texts flag, sizes, and
#: whether zstd's packaged dictionary paid: wire v2 keeps the smaller payload per variant)
VARIANT_FREE_FIELDS = frozenset({"flags", "raw_len", "payload_len", "body_len", "dict_id"})


def check_variants(frames: tuple[bytes, ...], variants: tuple[bool, ...], limits: ReplyLimits) -> None:
    """Exactly one frame per requested variant, in order, each with (or without) texts as asked,
    and headers that agree on everything but the texts (``VARIANT_FREE_FIELDS``)."""
    if len(frames) != len(variants):
        raise BadReply("wrong_variants", f"{len(frames)} frames for the {len(variants)} variants asked for "
                                         f"(texts={list(variants)}): one frame per variant, or none")
    heads: list[WireHeader] = []
    for i, f in enumerate(frames):
        try:
            h = parse_header(f, WireLimits(max_frame_bytes=limits.max_frame_bytes))
        except BatchValidationError as e:
            raise BadReply("variant_mismatch", f"frames[{i}]: header unreadable ({e})") from None
        if bool(h.flags & FLAG_TEXTS) != variants[i]:
            raise BadReply("wrong_variants", f"frames[{i}] {'has' if h.has_texts else 'lacks'} texts: "
                                             f"asked for texts={list(variants)}")
        heads.append(h)
    first = {k: v for k, v in vars(heads[0]).items() if k not in VARIANT_FREE_FIELDS}
    for i, h in enumerate(heads[1:], 1):
        other = {k: v for k, v in vars(h).items() if k not in VARIANT_FREE_FIELDS}
        diff = sorted(k for k in first if first[k] != other[k])
        if diff:
            raise BadReply("variant_mismatch", f"frames[{i}] differs from frames[0] in {', '.join(diff)} "
                                               "(variants of one batch differ only in their texts)")


def check_metrics(metrics: Any, limits: ReplyLimits) -> dict[str, float]:
    if not isinstance(metrics, Mapping):
        raise BadReply("wrong_type", f"metrics: expected a mapping, got {type(metrics).__name__}")
    if len(metrics) > limits.max_metrics:
        raise BadReply("too_many_metrics", f"{len(metrics)} metrics: limit {limits.max_metrics}")
    out = {}
    for k, v in metrics.items():
        if not isinstance(k, str) or not k:
            raise BadReply("wrong_type", f"metric name {k!r}: must be a non-empty string")
        if k in IDENTITY_FIELDS:
            raise BadReply("reserved_metric", f"metric {k!r} would overwrite the row's identity "
                                              f"({', '.join(sorted(IDENTITY_FIELDS))})")
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise BadReply("nonscalar_metric", f"metric {k!r} is {type(v).__name__}: must be a number")
        if not math.isfinite(v):
            raise BadReply("nonfinite_metric", f"metric {k!r} = {v!r}: must be finite")
        out[k] = float(v)
    return out


def check_info(info: Any, hello: bool) -> dict[str, Any]:
    if not isinstance(info, Mapping):
        raise BadReply("wrong_type", f"info: expected a mapping, got {type(info).__name__}")
    for k, v in info.items():
        if not isinstance(k, str) or not isinstance(v, (str, int, float, bool, bytes)):
            raise BadReply("wrong_type", f"info[{k!r}]: must be a plain str/int/float/bool/bytes value")
    if hello:
        for k, typ in HELLO_FIELDS.items():
            if k not in info:
                raise BadReply("bad_hello", f"hello info lacks {k!r} (required: {', '.join(HELLO_FIELDS)})")
            if not isinstance(info[k], typ):
                raise BadReply("bad_hello", f"hello info[{k!r}] is {type(info[k]).__name__}, "
                                            f"not {getattr(typ, '__name__', typ)}")
        fp = info.get("weights_fp", "")                          # optional: recorded in every train row
        if not isinstance(fp, str) or not FINGERPRINT_RE.fullmatch(fp):
            raise BadReply("bad_hello", f"hello info['weights_fp'] = {str(fp)[:40]!r}: 'w-' and 16 hex digits, "
                                        "or '' (not known)")
    return dict(info)
