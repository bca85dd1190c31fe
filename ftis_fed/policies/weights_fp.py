"""A model folder's weights fingerprint: which bytes a participant started from.

Two builds of "the same" model can differ (the micro warm-ups built with AVX-512 kernels instead of
the pinned AVX2 ones were a materially weaker sampler: docs/models.md), and a run's metrics named
only the model. Each participant now reports ``weights_fingerprint`` of the folder it loaded with its
hello; the engine writes it into every train row beside ``model_id`` (``model_weights``), and
``ftis-fed grid`` refuses to compare cells whose participants started from different bytes.

The fingerprint is ``w-`` and 16 hex digits of the SHA-256 over the folder's weight files (name and
bytes, in name order). Hashing SmolLM2's 540 MB costs ~0.6 s, so in the project's model cache the
result is kept beside the weights (``ftis_fed_weights.json``, keyed by each file's name, size and
modification time); a folder elsewhere (the user's own, the hub's cache) is not written to, and is
hashed once per process. Above ``FULL_HASH_BYTES`` of weights (a 7B model's 14 GB would take ~15 s)
the hash reads each file's size and ``SAMPLES`` evenly spaced 1 MiB pieces instead of every byte.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
from pathlib import Path

#: the files whose bytes are the model's weights (transformers' names and the GGUF a folder may hold)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
RECORD = "ftis_fed_weights.json"
#: what a fingerprint looks like ("" = unknown: a backend without a weights folder)
FINGERPRINT_RE = re.compile(r"(w-[0-9a-f]{16})?")

FULL_HASH_BYTES = 2 << 30
SAMPLES = 64
_CHUNK = 1 << 20

_MEMO: dict[tuple, str] = {}


def _weight_files(folder: Path) -> list[Path]:
    return sorted((p for p in folder.iterdir() if p.is_file() and p.suffix in WEIGHT_SUFFIXES), key=lambda p: p.name)


def weights_fingerprint(folder: str | Path) -> str:
    """``w-`` + 16 hex digits over ``folder``'s weight files, or "" when it has none (not a folder)."""
    folder = Path(folder)
    if not folder.is_dir():
        return ""
    files = _weight_files(folder)
    if not files:
        return ""
    key = [[p.name, st.st_size, st.st_mtime_ns] for p, st in ((p, p.stat()) for p in files)]
    memo_key = (str(folder.resolve()), json.dumps(key))
    if memo_key in _MEMO:
        return _MEMO[memo_key]
    record = folder / RECORD
    try:
        saved = json.loads(record.read_text())
        if saved.get("files") == key and FINGERPRINT_RE.fullmatch(saved.get("fingerprint", "")):
            _MEMO[memo_key] = saved["fingerprint"]
            return saved["fingerprint"]
    except (OSError, ValueError, AttributeError):
        pass
    fp = _hash(files, sampled=sum(size for _, size, _ in key) > FULL_HASH_BYTES)
    _MEMO[memo_key] = fp
    if not _in_model_cache(folder):
        return fp
    tmp = record.with_name(f"{record.name}.{os.getpid()}.tmp")              # participants may race here
    try:
        tmp.write_text(json.dumps({"files": key, "fingerprint": fp}))
        tmp.replace(record)
    except OSError:                                              # a read-only folder: this process only
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
    return fp


def _hash(files: list[Path], sampled: bool) -> str:
    h = hashlib.sha256(b"sampled\0" if sampled else b"")
    for p in files:
        h.update(p.name.encode() + b"\0")
        with p.open("rb") as fh:
            if not sampled:
                for chunk in iter(lambda: fh.read(_CHUNK), b""):
                    h.update(chunk)
                continue
            size = p.stat().st_size
            h.update(str(size).encode() + b"\0")
            for k in range(SAMPLES):
                fh.seek(max(0, (size - _CHUNK) * k // max(1, SAMPLES - 1)))
                h.update(fh.read(_CHUNK))
    return "w-" + h.hexdigest()[:16]


def _in_model_cache(folder: Path) -> bool:
    from ftis_fed.policies.store import cache_root

    return folder.resolve().is_relative_to(cache_root().resolve())
