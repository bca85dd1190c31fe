"""Signed frames, requests and replies <-> Flower records: the only module of ``ftis_fed`` that
imports ``flwr``.

Requests and replies of the round engine are plain dicts (see ``ftis_fed.engine.transport``);
here they become a message's ``RecordDict`` and back:

    request {round, texts, run, node, challenge, ...}  -> ConfigRecord "config"
    request/reply "frames"                             -> ConfigRecord "ftis-batches" {"frames": [...]}
    reply "metrics"                                    -> MetricRecord "metrics"
    reply "info"                                       -> ConfigRecord "info"

The Flower message type of each action is in the action table (``ftis_fed.actions``). Unpacking a
reply checks nothing (the engine's boundary does): it only maps records to fields.

A message carries its batches as one ``ConfigRecord`` under ``BATCHES_RECORD`` in the message's
``RecordDict``, holding a list of signed frames (``bytes``) under ``FRAMES_KEY``::

    RecordDict {"ftis-batches": ConfigRecord {"frames": [frame, frame, ...]}}

A client puts its own frame(s) there; the server relays the frames of all other participants the
same way, byte for byte (it cannot alter them unnoticed: see ``ftis_fed.trust.signing``). Nothing here
verifies anything: pass the frames to ``ftis_fed.trust.inbox.Inbox.accept_many``.
"""

from __future__ import annotations

from collections.abc import Sequence

from typing import Any, Mapping

from flwr.app import ConfigRecord, MetricRecord, RecordDict

from ftis_fed.wire.batch import BatchValidationError

BATCHES_RECORD = "ftis-batches"
FRAMES_KEY = "frames"
DEFAULT_MAX_FRAMES = 4096


def frames_to_record(frames: Sequence[bytes]) -> ConfigRecord:
    """(n,) signed frames -> ConfigRecord {FRAMES_KEY: [bytes, ...]} (an empty list is allowed)."""
    frames = [bytes(f) for f in frames]
    return ConfigRecord({FRAMES_KEY: frames})


def frames_from_record(record: ConfigRecord, max_frames: int = DEFAULT_MAX_FRAMES) -> list[bytes]:
    """ConfigRecord -> the list of frames; BatchValidationError if missing, mistyped or too many."""
    if not isinstance(record, ConfigRecord):
        raise BatchValidationError("missing_field", f"record: expected a ConfigRecord, got {type(record).__name__}")
    if FRAMES_KEY not in record:
        raise BatchValidationError("missing_field", f"record has no {FRAMES_KEY!r} entry (keys: {sorted(record)})")
    frames = record[FRAMES_KEY]
    if not isinstance(frames, list) or not all(isinstance(f, bytes) for f in frames):
        raise BatchValidationError("missing_field", f"record[{FRAMES_KEY!r}]: must be a list of bytes")
    if len(frames) > max_frames:
        raise BatchValidationError("too_large", f"record[{FRAMES_KEY!r}] has {len(frames)} frames: limit {max_frames}")
    return list(frames)


def put_frames(content: RecordDict, frames: Sequence[bytes], name: str = BATCHES_RECORD) -> RecordDict:
    """Store frames in ``content[name]`` (replacing what was there); returns ``content``."""
    content[name] = frames_to_record(frames)
    return content


def get_frames(content: RecordDict, name: str = BATCHES_RECORD,
               max_frames: int = DEFAULT_MAX_FRAMES) -> list[bytes]:
    """The frames in ``content[name]``; BatchValidationError ``missing_field`` if there are none."""
    if name not in content:
        raise BatchValidationError("missing_field", f"message has no {name!r} record (records: {sorted(content)})")
    return frames_from_record(content[name], max_frames)


def record_nbytes(record: ConfigRecord | RecordDict) -> int:
    """Bytes Flower serialises for a record (its deflated form, without transport framing)."""
    return len(record.deflate())


# ------------------------------------------------------------------ requests and replies

CONFIG_RECORD, METRICS_RECORD, INFO_RECORD = "config", "metrics", "info"


def request_to_content(request: Mapping[str, Any]) -> RecordDict:
    """Engine request -> RecordDict ("frames" in "ftis-batches", the rest in "config")."""
    content = RecordDict({CONFIG_RECORD: ConfigRecord({k: v for k, v in request.items() if k != FRAMES_KEY})})
    if FRAMES_KEY in request:
        content[BATCHES_RECORD] = frames_to_record(request[FRAMES_KEY])
    return content


def content_to_request(content: RecordDict) -> dict[str, Any]:
    """RecordDict -> engine request (participant side; frames checked by ``get_frames``)."""
    request = dict(content[CONFIG_RECORD]) if CONFIG_RECORD in content else {}
    if BATCHES_RECORD in content:
        request[FRAMES_KEY] = get_frames(content)
    return request


def reply_to_content(reply: Mapping[str, Any]) -> RecordDict:
    """Participant reply {info, frames, metrics} -> RecordDict; ValueError for any other field."""
    content = RecordDict()
    for k, v in reply.items():
        if k == FRAMES_KEY:
            content[BATCHES_RECORD] = frames_to_record(v)
        elif k == METRICS_RECORD:
            content[METRICS_RECORD] = MetricRecord({m: float(x) for m, x in v.items()})
        elif k == INFO_RECORD:
            content[INFO_RECORD] = ConfigRecord(dict(v))
        else:
            raise ValueError(f"reply field {k!r}: expected info, frames or metrics")
    return content


def content_to_reply(content: RecordDict) -> dict[str, Any]:
    """RecordDict -> raw reply fields, unchecked (server side; the engine's boundary validates).
    A "ftis-batches" record becomes "frames" only when it holds exactly the frames list;
    otherwise its whole content is passed on (and rejected as the wrong type)."""
    out: dict[str, Any] = {}
    for name in list(content.keys()):
        record = content[name]
        if name == BATCHES_RECORD:
            items = dict(record) if isinstance(record, Mapping) else record
            out[FRAMES_KEY] = items[FRAMES_KEY] if isinstance(items, dict) and set(items) == {FRAMES_KEY} else items
        else:
            out[name] = dict(record) if isinstance(record, Mapping) else record
    return out
