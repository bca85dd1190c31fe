"""Signed frames <-> Flower records: the only module of ``ftis_fed`` that imports ``flwr``.

A message carries its batches as one ``ConfigRecord`` under ``BATCHES_RECORD`` in the message's
``RecordDict``, holding a list of signed frames (``bytes``) under ``FRAMES_KEY``::

    RecordDict {"ftis-batches": ConfigRecord {"frames": [frame, frame, ...]}}

A client puts its own frame(s) there; the server relays the frames of all other participants the
same way, byte for byte (it cannot alter them unnoticed: see ``ftis_fed.signing``). Nothing here
verifies anything: pass the frames to ``ftis_fed.inbox.Inbox.accept_many``.
"""

from __future__ import annotations

from collections.abc import Sequence

from flwr.app import ConfigRecord, RecordDict

from .batch import BatchValidationError

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
