"""Fixtures shared by the test files."""

from __future__ import annotations

import sys

import pytest

from ftis_fed.wire import codec as wire


@pytest.fixture(autouse=True)
def one_torch_thread(request):
    """Every default-tier test runs with one torch thread in the test process. The tests' models are
    tiny (or SmolLM2 on a few rows), where a second intra-op thread saves little even on an idle machine
    (the tier used 91 % of one core there), and on a shared one its spin-waits cost more than they save
    (test_prefix + test_policies + test_micro: 116-149 -> 50-55 s of CPU, 182-255 -> 78-91 s of wall at
    load 3-4). An in-process run sets the process to cores / participants (1 here) and left it so for
    every later test: now each default-tier test starts the same whatever ran before it. The slow
    tier's tests (minutes of SmolLM2 training on CI's idle cores) are left as they were. Subprocesses
    (``flwr run`` workers, CLI runs) choose their own threads."""
    torch = sys.modules.get("torch")
    if torch is not None and request.node.get_closest_marker("slow") is None and torch.get_num_threads() != 1:
        torch.set_num_threads(1)
    yield


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
