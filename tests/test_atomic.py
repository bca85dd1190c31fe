"""Atomic writes: the old file or the new one, never half; private files never world-readable."""

from __future__ import annotations

import stat

import pytest

from ftis_fed.atomic import atomic_path, atomic_write


def test_replaces_whole_and_keeps_mode(tmp_path):
    p = tmp_path / "sub" / "key.pem"
    atomic_write(p, b"one", mode=0o600)
    assert p.read_bytes() == b"one" and stat.S_IMODE(p.stat().st_mode) == 0o600
    atomic_write(p, "two")
    assert p.read_text() == "two"


def test_an_error_leaves_the_old_file_and_no_temporary(tmp_path):
    p = tmp_path / "state.json"
    atomic_write(p, "old")
    with pytest.raises(RuntimeError):
        with atomic_path(p) as tmp:
            tmp.write_text("half")
            raise RuntimeError("crash mid-write")
    assert p.read_text() == "old"
    assert [f.name for f in tmp_path.iterdir()] == ["state.json"]
