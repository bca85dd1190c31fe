"""Fixtures shared by the test files."""

from __future__ import annotations

import pytest

from ftis_fed.wire import codec as wire


@pytest.fixture
def decompressions(monkeypatch):
    """Counts zstd decompressions on the real decoding path (to show a frame was refused before):
    the list of the ``raw_len`` each decompression was asked for."""
    calls = []
    real = wire._decompress

    def counting(payload, raw_len, dict_id=0):
        calls.append(raw_len)
        return real(payload, raw_len, dict_id)
    monkeypatch.setattr(wire, "_decompress", counting)
    return calls
