"""Atomic writes: the old file or the new one, never half; private files never world-readable."""

from __future__ import annotations

import stat

import pytest

from ftis_fed.atomic import atomic_dir, atomic_path, atomic_write


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


def test_a_folder_is_replaced_whole_or_not_at_all(tmp_path):
    out = tmp_path / "export"
    with atomic_dir(out) as tmp:
        tmp.mkdir()
        (tmp / "model.bin").write_text("v1")
    assert (out / "model.bin").read_text() == "v1"
    with pytest.raises(RuntimeError):
        with atomic_dir(out) as tmp:
            tmp.mkdir()
            (tmp / "model.bin").write_text("half")
            raise RuntimeError("crash mid-save")
    assert (out / "model.bin").read_text() == "v1"
    with atomic_dir(out) as tmp:
        tmp.mkdir()
        (tmp / "adapter.bin").write_text("v2")
    assert [f.name for f in out.iterdir()] == ["adapter.bin"]           # the old folder's files are gone
    assert [f.name for f in tmp_path.iterdir()] == ["export"]            # no .tmp / .old left behind
