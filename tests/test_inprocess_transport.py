"""InProcessTransport: a send's requests are taken in turn by one thread, more only when none ended
for ``STALL_S`` (fewer threads than requests), and still each participant's failure costs only
itself: hung participants taken first, or a slow one holding the GIL, do not delay the others'
replies, every request is handled exactly once, a participant handles one request at a time, errors
and time-outs are per address."""

from __future__ import annotations

import threading
import time

import pytest

from ftis_fed.engine import inprocess
from ftis_fed.engine.inprocess import InProcessTransport
from ftis_fed.engine.transport import Delivered, Failure

RELEASE = threading.Event()


@pytest.fixture(autouse=True)
def _release_hung():
    RELEASE.clear()
    yield
    RELEASE.set()                                   # lets the hung stubs' threads end


class Stub:
    def __init__(self, hang: bool = False, fail: bool = False, work_s: float = 0.0):
        self.hang, self.fail, self.work_s = hang, fail, work_s
        self.calls: list[tuple[str, dict]] = []
        self.busy = 0
        self.overlapped = False

    def handle(self, action: str, request: dict) -> dict:
        self.busy += 1
        self.overlapped |= self.busy > 1
        try:
            self.calls.append((action, request))
            if self.hang:
                RELEASE.wait(30)
            if self.fail:
                raise RuntimeError("boom")
            if self.work_s:
                time.sleep(self.work_s)
            return {"metrics": {"n": float(len(self.calls))}}
        finally:
            self.busy -= 1


def test_hung_participants_taken_first_cost_only_themselves():
    hung = {f"h{i:02d}": Stub(hang=True) for i in range(40)}
    good = {f"g{i:02d}": Stub(work_s=0.001) for i in range(40)}
    t = InProcessTransport({**hung, **good})
    replied = []
    t0 = time.monotonic()
    out = t.send("learn", {a: {"round": 1} for a in [*hung, *good]}, 1.5, on_reply=replied.append)
    took = time.monotonic() - t0
    assert all(isinstance(out[a], Delivered) and out[a].content == {"metrics": {"n": 1.0}} for a in good)
    assert all(out[a] == Failure("timeout", "no reply within 1.5 s") for a in hung)
    assert sorted(replied) == sorted(good)          # progress: once per reply that came
    assert took < 1.5 + 1.0
    assert all(len(s.calls) == 1 for s in {**hung, **good}.values())   # each request handled once


def test_every_request_is_handled_once_by_fewer_threads_than_requests(monkeypatch):
    stubs = {f"p{i:03d}": Stub() for i in range(300)}
    t = InProcessTransport(stubs)
    before = threading.active_count()
    starts = []
    real = inprocess._thread.start_new_thread
    monkeypatch.setattr(inprocess._thread, "start_new_thread", lambda *a: starts.append(1) or real(*a))
    out = t.send("generate", {a: {"round": 2, "who": a} for a in stubs}, 10.0)
    monkeypatch.undo()
    assert 1 <= len(starts) <= 16                   # one, doubled only after a STALL_S without a reply
    assert all(isinstance(r, Delivered) for r in out.values()) and list(out) == list(stubs)
    assert all(s.calls == [("generate", {"round": 2, "who": a})] for a, s in stubs.items())
    time.sleep(0.05)
    assert threading.active_count() <= before + 1   # the send's threads are gone


def test_a_busy_participant_handles_one_request_at_a_time_and_errors_are_per_address():
    slow, boom, ok = Stub(hang=True), Stub(fail=True), Stub()
    t = InProcessTransport({"slow": slow, "boom": boom, "ok": ok})
    first = t.send("learn", {"slow": {}, "ok": {}}, 0.3)
    assert first["slow"].reason == "timeout" and isinstance(first["ok"], Delivered)
    second = t.send("learn", {"slow": {}, "boom": {}, "ok": {}, "gone": {}}, 0.3)
    assert second["slow"].reason == "timeout"       # still busy with the first: waits, within the deadline
    assert second["boom"].reason == "error" and "RuntimeError: boom" in second["boom"].detail
    assert isinstance(second["ok"], Delivered) and second["gone"].reason == "unknown_node"
    RELEASE.set()
    deadline = time.monotonic() + 5
    while len(slow.calls) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(slow.calls) == 2 and not slow.overlapped   # then the second request, after the first


def test_an_empty_send_and_only_unknown_addresses():
    t = InProcessTransport({"a": Stub()})
    assert t.send("learn", {}, 1.0) == {}
    assert t.send("learn", {"x": {}}, 1.0)["x"].reason == "unknown_node"


def test_many_hung_participants_taken_first_and_a_slow_one_holding_the_gil():
    hung = {f"h{i:03d}": Stub(hang=True) for i in range(200)}

    class Spin(Stub):
        def handle(self, action, request):
            end = time.monotonic() + 0.6                # holds the GIL but for the switch interval
            while time.monotonic() < end:
                pass
            return super().handle(action, request)

    slow = {"slow": Spin()}
    good = {f"g{i:02d}": Stub() for i in range(20)}
    t = InProcessTransport({**slow, **hung, **good})
    ended = {}
    t0 = time.monotonic()
    out = t.send("learn", {a: {} for a in [*slow, *hung, *good]}, 3.0,
                 on_reply=lambda a: ended.setdefault(a, time.monotonic() - t0))
    assert all(isinstance(out[a], Delivered) for a in [*slow, *good])
    assert all(out[a].reason == "timeout" for a in hung)
    assert max(ended[a] for a in good) < 2.0        # taken within ~STALL_S x log2(201), not at the deadline
