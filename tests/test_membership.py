"""Late joiners, rejoiners and retirement through the in-process transport, with light participants
that sign and verify real frames (ftis_fed/bench/swarm.py): a node connecting after the start is
admitted at the next round boundary with the same proof of possession; a participant restarted at a
new address with its state dir continues (no round trained twice, no sequence number reused); an
absent one is retired; everything counted in the federation row."""

from __future__ import annotations

import dataclasses
import json

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ftis_fed.bench.swarm import LightParticipant, light_federation
from ftis_fed.config.federation import FederationConfig
from ftis_fed.engine.core import AdmissionError, Engine
from ftis_fed.engine.inprocess import InProcessTransport
from ftis_fed.trust.signing import fingerprint, key_paths, load_key_directory, load_private_key

RUN = "swarm"


class Scripted:
    """A participant with ``before[(action, round)]`` / ``after[(action, round)]`` callbacks; an
    ``after`` callback that raises loses the reply (a crash after the work was done)."""

    def __init__(self, inner, before=None, after=None):
        self.inner, self.before, self.after = inner, dict(before or {}), dict(after or {})
        self.calls: list[tuple[str, int]] = []

    def handle(self, action: str, request: dict) -> dict:
        rnd = int(request.get("round", -1))
        self.calls.append((action, rnd))
        if (action, rnd) in self.before:
            self.before[(action, rnd)]()
        reply = self.inner.handle(action, request)
        if (action, rnd) in self.after:
            self.after[(action, rnd)]()
        return reply


class Imposter(LightParticipant):
    """Claims a participant and its key fingerprint without holding its private key."""

    def handle(self, action, request):
        reply = super().handle(action, request)
        if action == "hello":
            reply["info"]["key_fp"] = fingerprint(self.inbox.keys[self.name])
        return reply


def _fed(tmp_path, rounds, **kw):
    return FederationConfig(num_rounds=rounds, min_participants=2, run_name=RUN, output_dir=str(tmp_path),
                            eval_every=0, progress_every_s=0, join_timeout_s=30, **kw)


def _fed_rows(tmp_path):
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    return {r["round"]: r for r in rows if r["participant"] == "_federation"}


def test_a_late_joiner_is_admitted_at_the_next_round_boundary_with_its_proof(tmp_path):
    parts, keys = light_federation(tmp_path, 3)                     # p0000, p0001, p0002 (all keys known)
    a, b, c = (parts[n] for n in sorted(parts))
    transport = InProcessTransport({})
    late = Scripted(c)
    imposter = Scripted(Imposter(c.name, Ed25519PrivateKey.generate(), keys, RUN))   # c's name and fingerprint

    def connect():
        transport.connect("late", late)
        transport.connect("imposter", imposter)

    transport.connect("a", Scripted(a, after={("learn", 1): connect}))
    transport.connect("b", Scripted(b))
    eng = Engine(_fed(tmp_path, 3), keys, tmp_path, transport, plots=False)
    assert eng.run() == 3
    assert late.calls[0] == ("hello", -1) and [r for act, r in late.calls if act == "generate"] == [2, 3]
    assert c.trained == [2, 3] and a.trained == [1, 2, 3]
    assert imposter.calls == [("hello", -1)]                        # refused for its proof, never asked again
    assert eng.refused["imposter"] == "bad_proof"
    rows = _fed_rows(tmp_path)
    assert [rows[r]["fed/joined"] for r in (1, 2, 3)] == [0, 1, 0]
    assert [rows[r]["fed/participants"] for r in (1, 2, 3)] == [2, 3, 3]
    assert rows[2]["fed/refused_at_boundary"] == 1 and rows[3]["fed/refused_at_boundary"] == 0
    assert {s for got in a.accepted.values() for s in got} == {b.name, c.name}    # the joiner's frames relayed


def test_a_restarted_participant_continues_without_training_twice_or_reusing_a_seq(tmp_path):
    parts, keys = light_federation(tmp_path, 3, run_key="run-7", state=True)
    a, b, c = (parts[n] for n in sorted(parts))
    transport = InProcessTransport({})
    restarted: list[LightParticipant] = []

    def crash():                                                    # c trained round 2, then its node died
        transport.disconnect("c@1")
        raise RuntimeError("node lost")

    def restart():                                                  # a new process, a new node id, same key
        again = LightParticipant(c.name, load_private_key(key_paths(c.name, tmp_path / "keys").private),
                                 load_key_directory(tmp_path / "keys" / "public"), RUN, c.state_dir, "run-7")
        restarted.append(again)
        transport.connect("c@2", again)

    transport.connect("a", Scripted(a, after={("learn", 3): restart}))
    transport.connect("b", Scripted(b))
    transport.connect("c@1", Scripted(c, after={("learn", 2): crash}))
    eng = Engine(_fed(tmp_path, 5), keys, tmp_path, transport, plots=False)
    assert eng.run() == 5
    again = restarted[0]
    assert again.trained_round == 5 and c.trained == [1, 2] and again.trained == [4, 5]
    assert not set(c.trained) & set(again.trained)                  # no round trained twice
    assert min(again.signed) > max(c.signed)                        # no sequence number reused
    assert again.handle("learn", {"round": 4, "frames": []}) == {"metrics": {"train/already_trained": 1.0}}
    rows = _fed_rows(tmp_path)
    assert [rows[r]["fed/rejoined"] for r in range(1, 6)] == [0, 0, 0, 1, 0]
    assert [rows[r]["fed/participants"] for r in range(1, 6)] == [3, 3, 3, 3, 3]
    assert rows[2]["fed/dropped/error"] == 1 and rows[3]["fed/sampled"] == 2     # its lost node is not asked
    assert all(rows[r]["fed/rejected"] == 0 for r in range(1, 6))   # the server's replay guard saw no reuse
    assert eng.nodes["c@2"]["completed_round"] == 2                 # it said where it was at its hello
    assert "c@1" not in eng.nodes


@pytest.mark.parametrize("lost", ["phase", "boundary"])
def test_a_node_back_at_the_same_address_is_said_hello_again_before_it_is_asked(tmp_path, lost):
    """With SuperNode authentication Flower binds the node id to the SuperNode's key: a SuperNode
    killed and restarted comes back at the same address, as a new process. Lost during a phase
    (the transport reports the node gone: ``NODE_GONE``) or found gone at a boundary, it is said
    hello again (proof of possession; it learns the run id again) before it is asked anything,
    counted as a rejoin, and continues from its state dir: no round trained twice, no seq reused,
    no frame refused (without the hello its first frame would name the wrong run)."""
    parts, keys = light_federation(tmp_path, 3, run_key="run-7", state=True)
    a, b, c = (parts[n] for n in sorted(parts))
    transport = InProcessTransport({})
    restarted: list[Scripted] = []

    def restart():                                                  # a new process at the old address
        again = Scripted(LightParticipant(c.name, load_private_key(key_paths(c.name, tmp_path / "keys").private),
                                          load_key_directory(tmp_path / "keys" / "public"), RUN, c.state_dir,
                                          "run-7"))
        restarted.append(again)
        transport.connect("c", again)

    # "phase": c's node is lost after its round-2 batch, before round 2's learn reaches it (unknown_node);
    # "boundary": lost after round 1, so round 2's boundary finds it gone
    when = ("generate", 2) if lost == "phase" else ("learn", 1)
    transport.connect("a", Scripted(a, after={("learn", 2): restart}))
    transport.connect("b", Scripted(b))
    transport.connect("c", Scripted(c, after={when: lambda: transport.disconnect("c")}))
    eng = Engine(_fed(tmp_path, 4), keys, tmp_path, transport, plots=False)
    assert eng.run() == 4
    again = restarted[0]
    assert again.calls[0] == ("hello", -1)                          # admitted anew before anything else
    assert [r for act, r in again.calls if act == "generate"] == [3, 4]
    assert c.trained == [1] and again.inner.trained == [3, 4]      # round 2 lost for c, none trained twice
    assert min(again.inner.signed) > max(c.signed)                  # no sequence number reused
    rows = _fed_rows(tmp_path)
    assert [rows[r]["fed/rejoined"] for r in (1, 2, 3, 4)] == [0, 0, 1, 0]
    assert all(rows[r]["fed/rejected"] == 0 for r in (1, 2, 3, 4))  # its frames name this run's id
    assert rows[2].get("fed/dropped/unknown_node", 0) == (1 if lost == "phase" else 0)
    assert rows[3]["fed/replies"] == 3 and rows[4]["fed/replies"] == 3
    assert eng.nodes["c"]["completed_round"] == 1                   # it said where it was at its hello


def test_a_node_claiming_a_connected_participant_is_refused_and_asked_again(tmp_path):
    parts, keys = light_federation(tmp_path, 2)
    a, b = (parts[n] for n in sorted(parts))
    transport = InProcessTransport({})
    twin = Scripted(LightParticipant(b.name, load_private_key(key_paths(b.name, tmp_path / "keys").private), keys, RUN))
    transport.connect("a", Scripted(a, after={("learn", 1): lambda: transport.connect("twin", twin)}))
    transport.connect("b", Scripted(b))
    eng = Engine(_fed(tmp_path, 3), keys, tmp_path, transport, plots=False)
    eng.run()
    assert twin.calls == [("hello", -1), ("hello", -1)]             # boundaries 2 and 3, refused both times
    assert eng.refused["twin"] == "duplicate_participant" and "twin" not in eng.nodes


def test_an_absent_participant_is_retired_and_may_come_back(tmp_path):
    parts, keys = light_federation(tmp_path, 3)
    a, b, c = (parts[n] for n in sorted(parts))
    transport = InProcessTransport({})
    flaky = Scripted(c, before={(act, r): _fail for act in ("generate",) for r in (2, 3)})
    transport.connect("a", Scripted(a, after={("learn", 4): lambda: transport.disconnect("c")}))
    transport.connect("b", Scripted(b))
    transport.connect("c", flaky)
    eng = Engine(_fed(tmp_path, 6, retire_after_rounds=2), keys, tmp_path, transport, plots=False)
    assert eng.run() == 6
    rows = _fed_rows(tmp_path)
    assert [rows[r]["fed/retired"] for r in range(1, 7)] == [0, 0, 0, 1, 0, 0]
    assert [rows[r]["fed/participants"] for r in range(1, 7)] == [3, 3, 3, 2, 2, 2]
    assert [r for act, r in flaky.calls if act == "generate"] == [1, 2, 3]     # not asked once retired
    assert c.name not in {s for rnd, got in a.accepted.items() if rnd >= 4 for s in got}


def _fail():
    raise RuntimeError("flaky")


def test_a_retired_participant_that_reconnects_rejoins(tmp_path):
    parts, keys = light_federation(tmp_path, 3)
    a, b, c = (parts[n] for n in sorted(parts))
    transport = InProcessTransport({})
    transport.connect("a", Scripted(a, after={("learn", 4): lambda: transport.connect("c2", Scripted(c))}))
    transport.connect("b", Scripted(b))
    transport.connect("c", Scripted(c, after={("learn", 1): lambda: transport.disconnect("c")}))
    eng = Engine(_fed(tmp_path, 6, retire_after_rounds=2), keys, tmp_path, transport, plots=False)
    eng.run()
    rows = _fed_rows(tmp_path)
    # gone after round 1: absent in rounds 2 and 3 (not asked) -> retired at the boundary of round 4
    assert [rows[r]["fed/sampled"] for r in range(1, 7)] == [3, 2, 2, 2, 3, 3]
    assert [rows[r]["fed/retired"] for r in range(1, 7)] == [0, 0, 0, 1, 0, 0]
    assert [rows[r]["fed/rejoined"] for r in range(1, 7)] == [0, 0, 0, 0, 1, 0]
    assert [rows[r]["fed/participants"] for r in range(1, 7)] == [3, 3, 3, 2, 3, 3]
    assert c.trained == [1, 5, 6]


def test_console_lines_do_not_grow_with_the_participants(tmp_path):
    """Above 8 participants the console prints aggregates and the extremes: apart from the admission
    list (16 lines at most), a 20-participant run logs as many lines as a 10-participant one, none
    naming more than 8 participants (then '(+N more)'); the plots are drawn."""
    counts = {}
    for n in (10, 20):
        out = tmp_path / f"n{n}"
        parts, keys = light_federation(out, n)
        lines: list[str] = []
        fed = FederationConfig(num_rounds=2, min_participants=2, run_name=RUN, output_dir=str(out), eval_every=0,
                               progress_every_s=0, peers_per_round=3)
        Engine(fed, keys, out, InProcessTransport(parts), plots=n > 10,
               log=lambda level, msg, *args: lines.append(msg % args if args else msg)).run()
        admission = [line for line in lines if line.startswith(("participant ", "... and "))]
        assert len(admission) == min(n, 16) + (n > 16)              # 16 listed at most, then one line
        counts[n] = len(lines) - len(admission)
        for line in lines:
            assert sum(p in line for p in parts) <= 8, line
        assert any("(+" in line and "more)" in line for line in lines)
        assert any(line.strip().startswith("reward") and "over" in line and "[min" in line for line in lines)
        assert n == 10 or ((out / "fed.png").exists() and (out / "training.png").exists())
    assert counts[10] == counts[20], counts


@pytest.mark.slow
def test_256_light_participants_through_the_engine(tmp_path):
    """The N = 256 scale run (docs/scale.md): every participant admitted with its proof, k = 4 peers'
    frames per receiver (N * k frames relayed per round, every sender reaching exactly k), sampling
    off, server state and rows linear in N, plots drawn as aggregates."""
    from ftis_fed.bench.swarm import measure

    n, k = 256, 4
    r = measure(n, rounds=3, peers=k, fraction=1.0, out=tmp_path, plots=True)
    rows = _fed_rows(tmp_path)
    assert all(rows[i]["fed/participants"] == n and rows[i]["fed/replies"] == n for i in (1, 2, 3))
    assert all(rows[i]["fed/frames_relayed"] == n * k and rows[i]["fed/rejected"] == 0 for i in (1, 2, 3))
    assert all(rows[i]["fed/sender_reach_min"] == rows[i]["fed/sender_reach_max"] == k for i in (1, 2, 3))
    assert r["frames_relayed_per_round"] == n * k and r["bytes_relayed_per_round"] > 0
    state = json.loads((tmp_path / "server_state.json").read_text())
    assert len(json.loads(state["guard"])["entries"]) == n          # one replay-guard entry per sender
    assert (tmp_path / "reward.png").exists()


class Silent:
    """A connected node that never answers hello (it holds the call until the test ends)."""

    def __init__(self):
        import threading

        self.calls: list[str] = []
        self.release = threading.Event()

    def handle(self, action, request):
        self.calls.append(action)
        self.release.wait(30)
        raise RuntimeError("never answered")


def test_a_never_answering_node_costs_its_own_admission_only(tmp_path):
    """Connected from round 2's boundary on, it never answers hello: refused (counted) once, then not
    said hello again while it stays connected, so no later boundary waits join-timeout-s for it (before:
    one hello, one time-out per boundary). Gone and back, it is asked again after its back-off."""
    parts, keys = light_federation(tmp_path, 2)
    a, b = (parts[n] for n in sorted(parts))
    transport = InProcessTransport({})
    silent = Silent()

    transport.connect("a", Scripted(a, after={("learn", 1): lambda: transport.connect("silent", silent),
                                              ("learn", 4): lambda: transport.disconnect("silent"),
                                              ("learn", 5): lambda: transport.connect("silent", silent)}))
    transport.connect("b", Scripted(b))
    fed = dataclasses.replace(_fed(tmp_path, 8), join_timeout_s=0.3)
    eng = Engine(fed, keys, tmp_path, transport, plots=False)
    try:
        assert eng.run() == 8
    finally:
        silent.release.set()
    rows = _fed_rows(tmp_path)
    asked = [rows[r]["fed/refused_at_boundary"] for r in range(1, 9)]
    # boundary 2: its hello times out (refused); never asked again while connected; gone at boundary 5,
    # back at 6 (a new process): asked once more (back-off 2^0 = 1 round), refused again
    assert asked == [0, 1, 0, 0, 0, 1, 0, 0], asked
    assert silent.calls.count("hello") <= 2 and eng.members.silent["silent"] == 2   # (the 2nd may queue behind the 1st)
    assert eng.refused["silent"] == "timeout" and "silent" not in eng.nodes
    assert [r for r in range(1, 9) if rows[r]["fed/replies"] == 2] == list(range(1, 9))


def test_every_node_refused_with_an_error_stops_the_run_at_once_with_each_whole_reason(tmp_path):
    """#29: every connected node's hello raises (a model that cannot load on this device): the run
    stops at the first hello, not after wait-for-participants-s, naming each node and its whole reason."""
    parts, keys = light_federation(tmp_path, 2)
    reason = "CUDA requested (device = 'cuda') but this machine has none: " + "x" * 900 + " END-OF-REASON"

    class Broken:
        def handle(self, action, request):
            if action == "hello":
                raise RuntimeError(reason)
            return {}

    slept: list[float] = []                                         # a fake clock: sleeping moves it on
    now = [0.0]

    def sleep(s):
        slept.append(s)
        now[0] += s

    transport = InProcessTransport({"n1": Broken(), "n2": Broken()})
    fed = dataclasses.replace(_fed(tmp_path, 2), wait_for_participants_s=600)
    eng = Engine(fed, keys, tmp_path, transport, plots=False, sleep=sleep, clock=lambda: now[0])
    with pytest.raises(AdmissionError) as err:
        eng.run()
    msg = str(err.value)
    assert "join: n1: error: RuntimeError: CUDA requested" in msg and "; n2: error: RuntimeError: CUDA requested" in msg
    assert msg.count("x" * 900 + " END-OF-REASON") >= 2
    assert "nobody else can join" in msg and slept == []             # no wait at all


def test_a_timed_out_node_at_the_start_does_not_stop_the_run_and_is_not_asked_again(tmp_path):
    parts, keys = light_federation(tmp_path, 2)
    a, b = (parts[n] for n in sorted(parts))
    silent = Silent()
    transport = InProcessTransport({"a": Scripted(a), "b": Scripted(b), "silent": silent})
    fed = dataclasses.replace(_fed(tmp_path, 3), min_participants=2, wait_for_participants_s=0.5)
    eng = Engine(fed, keys, tmp_path, transport, plots=False, sleep=lambda s: None)
    try:
        assert eng.run() == 3
    finally:
        silent.release.set()
    assert silent.calls.count("hello") == 1 and eng.refused["silent"] == "timeout"


def test_admission_looks_participants_up_in_an_index_not_a_scan(tmp_path):
    """#31: admitting N nodes visits O(N) hello infos in all (an index by name), not O(N^2): the
    number visited grows by the same factor as N (60 -> 240), where a scan per hello grows 16-fold."""
    from ftis_fed.engine.membership import Roster

    class Counting(Roster):
        visited = 0

        def values(self):
            for v in super().values():
                Counting.visited += 1
                yield v

        def items(self):
            for kv in super().items():
                Counting.visited += 1
                yield kv

        def __iter__(self):
            for k in super().__iter__():
                Counting.visited += 1
                yield k

    visited = {}
    for n in (60, 240):
        out = tmp_path / str(n)
        parts, keys = light_federation(out, n)
        eng = Engine(dataclasses.replace(_fed(out, 1), min_participants=n), keys, out, InProcessTransport(parts),
                     plots=False)
        eng.nodes = Counting()
        Counting.visited = 0
        eng.admit()
        assert len(eng.nodes) == n
        visited[n] = Counting.visited
    assert visited[240] / visited[60] < 6, visited                  # linear: ~4 (a scan per hello: ~16)


class HelloWith:
    """A participant whose hello info gets ``extra`` fields (or ``drop``s some)."""

    def __init__(self, inner, drop=(), **extra):
        self.inner, self.extra, self.drop = inner, extra, set(drop)
        self.calls: list[str] = []

    def handle(self, action, request):
        self.calls.append(action)
        reply = self.inner.handle(action, request)
        if action == "hello":
            info = {k: v for k, v in reply["info"].items() if k not in self.drop}
            reply = {**reply, "info": {**info, **self.extra}}
        return reply


def test_a_late_joiner_is_checked_for_num_partitions_like_the_first(tmp_path):
    parts, keys = light_federation(tmp_path, 3)
    a, b, c = (parts[n] for n in sorted(parts))
    transport = InProcessTransport({})
    late = HelloWith(c, num_partitions=5)
    transport.connect("a", Scripted(HelloWith(a, num_partitions=3), after={("learn", 1): lambda: transport.connect("late", late)}))
    transport.connect("b", HelloWith(b, num_partitions=3))
    eng = Engine(_fed(tmp_path, 2), keys, tmp_path, transport, plots=False)
    assert eng.run() == 2
    assert eng.refused["late"] == "num_partitions_mismatch" and "late" not in eng.nodes
    assert "num-partitions=5, this run's participants with 3" in eng.refusals["late"]


@pytest.mark.parametrize("extra,why", [
    ({"model_id": "light\n round 9: everyone rejected"}, "must be printable"),
    ({"model_id": "\x1b[31mred"}, "must be printable"),
    ({"model_id": "m" * 257}, "257 characters: limit 256"),
    ({f"field{i}": i for i in range(70)}, "fields: limit 64"),
    ({"f" * 65: 1}, "65 characters: limit 64"),
])
def test_hello_fields_are_bounded_and_printable(tmp_path, extra, why):
    parts, keys = light_federation(tmp_path, 3)
    a, b, c = (parts[n] for n in sorted(parts))
    transport = InProcessTransport({"a": a, "b": b, "c": HelloWith(c, **extra)})
    eng = Engine(_fed(tmp_path, 1), keys, tmp_path, transport, plots=False)
    assert eng.run() == 1
    assert eng.refused["c"] == "bad_hello" and why in eng.refusals["c"]


def test_a_hello_without_vocab_size_is_held_to_its_first_frames_vocabulary(tmp_path):
    """Before, a hello without vocab_size switched the server's vocabulary check off for that sender."""
    from ftis_fed.bench import swarm

    parts, keys = light_federation(tmp_path, 3)
    a, b, c = (parts[n] for n in sorted(parts))

    class Drifting(LightParticipant):
        def _frame(self, rnd):
            if rnd != 2:
                return super()._frame(rnd)
            self.seq = max(self.seq + 1, rnd << 16)
            task = swarm.task_at(swarm.FAMILY, "train", 0, rnd * self.prompts)
            group = swarm.make_group([1, 2, 3, 4], [[5, 6]] * 4, [[-0.5, -0.5]] * 4, [1.0, 0.0, 1.0, 0.0],
                                     task.task_id, task.reference)
            batch = swarm.CompletionBatch(sender=self.name, run_id=self.run, round=rnd, seq=self.seq, model_id="light",
                                          tokenizer_fp="light-tok", vocab_size=5000, sampling=swarm.SAMPLING,
                                          groups=(group,))
            return swarm.sign_batch(batch, self.key)

    d = Drifting(c.name, c.key, keys, RUN)
    transport = InProcessTransport({"a": a, "b": b, "c": HelloWith(d, drop={"vocab_size"})})
    eng = Engine(_fed(tmp_path, 3), keys, tmp_path, transport, plots=False)
    assert eng.run() == 3
    rows = _fed_rows(tmp_path)
    assert eng.vocab_pinned == {c.name: 1000}
    assert [rows[r]["fed/rejected"] for r in (1, 2, 3)] == [0, 1, 0], {k: v for k, v in rows[2].items() if "reject" in k}
    assert rows[2]["fed/rejected/wrong_tokenizer"] == 1


def test_a_participant_restarted_while_due_for_retirement_is_a_rejoiner_not_retired(tmp_path):
    """c's node is gone after round 1 (absent rounds 2 and 3: due for retirement at boundary 4); its
    restart on a new node connects during round 3. Boundary 4 admits it as a rejoiner and retires
    nobody (before: counted retired and rejoined in the same round)."""
    parts, keys = light_federation(tmp_path, 3, run_key="run-7", state=True)
    a, b, c = (parts[n] for n in sorted(parts))
    transport = InProcessTransport({})

    def restart():
        transport.connect("c@2", LightParticipant(c.name, load_private_key(key_paths(c.name, tmp_path / "keys").private),
                                                  load_key_directory(tmp_path / "keys" / "public"), RUN, c.state_dir,
                                                  "run-7"))

    transport.connect("a", Scripted(a, after={("learn", 3): restart}))
    transport.connect("b", Scripted(b))
    transport.connect("c@1", Scripted(c, after={("learn", 1): lambda: transport.disconnect("c@1")}))
    eng = Engine(_fed(tmp_path, 5, retire_after_rounds=2), keys, tmp_path, transport, plots=False)
    assert eng.run() == 5
    rows = _fed_rows(tmp_path)
    assert [rows[r]["fed/retired"] for r in range(1, 6)] == [0, 0, 0, 0, 0]
    assert [rows[r]["fed/rejoined"] for r in range(1, 6)] == [0, 0, 0, 1, 0]
    assert c.name not in eng.members.retired and eng.nodes.address_of(c.name) == "c@2"
