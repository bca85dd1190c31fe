"""Atomic file and folder writes: a reader (or a resume after a crash) sees the old file or the new
one, never half of one. Write to ``<name>.tmp`` in the same folder, then rename over the target."""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Iterator


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, mode: int | None = None) -> Iterator[Path]:
    """Yields a temporary path next to ``path``; when the block ends without an error it replaces
    ``path`` (created with permissions ``mode`` when given, e.g. 0o600 for private keys, so the
    secret is never readable by others, not even briefly); on an error the temporary file is removed."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    tmp.unlink(missing_ok=True)
    if mode is not None:
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode))
    try:
        yield tmp
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write(path: str | os.PathLike, data: bytes | str, mode: int | None = None) -> Path:
    """Write ``data`` (bytes, or text as UTF-8) to ``path`` atomically; returns the path."""
    with atomic_path(path, mode) as tmp:
        with open(tmp, "wb" if isinstance(data, bytes) else "w", encoding=None if isinstance(data, bytes) else "utf-8") as f:
            f.write(data)
    return Path(path)


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """Yields a path next to ``path`` for a folder to be written there (not created: the writer, e.g.
    ``save_pretrained``, makes it); when the block ends without an error it takes ``path``'s place
    (a folder already there is moved aside, then removed); on an error it is removed."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp, old = target.with_name(target.name + ".tmp"), target.with_name(target.name + ".old")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        yield tmp
        shutil.rmtree(old, ignore_errors=True)
        if target.exists():
            target.replace(old)
        tmp.replace(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
