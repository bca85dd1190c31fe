"""The round engine through the in-process transport: stub participants implementing the one
entry point ``handle(action, request)`` (the engine is the subject here), with real Ed25519 keys
and real signed frames, so the server's checks (proof of possession, signatures, replay guard)
are the real ones. Schedules, budgets, dropouts, a hung participant, every malformed reply,
admission and resume."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from flwr.app import ConfigRecord, MetricRecord, RecordDict

from ftis_fed.wire.batch import CompletionBatch, SamplingParams, make_group
from ftis_fed.config.federation import FederationConfig
from ftis_fed.engine.core import AdmissionError, Engine, TooFewSupernodes
from ftis_fed.engine.inprocess import InProcessTransport
from ftis_fed.engine.schedules import SCHEDULES, register_schedule
from ftis_fed.engine.transport import Delivered
from ftis_fed.engine.validation import check_reply
from ftis_fed.engine.boundary import Boundary
from ftis_fed.flower_io import content_to_reply, reply_to_content
from ftis_fed.metrics.writer import FEDERATION
from ftis_fed.trust.signing import KeyDirectory, fingerprint, sign_batch, sign_challenge
from ftis_fed.wire.codec import parse_header

RUN = "engine-test"
NAMES = ("alice", "bob", "carol")
KEYS = {n: Ed25519PrivateKey.generate() for n in NAMES}
DIRECTORY = KeyDirectory({n: k.public_key() for n, k in KEYS.items()})
RELEASE = threading.Event()                     # set at the end: lets a hung stub's thread finish


@pytest.fixture(autouse=True, scope="module")
def _release_hung_threads():
    yield
    RELEASE.set()


class Stub:
    """A participant as the engine sees it. ``tamper[(action, round)] = fn(reply) -> reply``
    turns one reply into a malformed one; ``hang_at`` / ``raise_at`` = (action, round)."""

    def __init__(self, name: str, key=None, claim: str | None = None, tamper=None, hang_at=None, raise_at=None,
                 extra_info=None):
        self.name, self.key, self.claim = name, key or KEYS[name], claim or name
        self.tamper, self.hang_at, self.raise_at = dict(tamper or {}), hang_at, raise_at
        self.extra_info = dict(extra_info or {})
        self.seq = 0
        self.run = RUN                                                  # the run id hello names
        self.received: dict[int, list[tuple[str, int]]] = {}          # round -> [(sender, frame round)]
        self.calls: list[tuple[str, int]] = []

    def frame(self, rnd: int, sender: str | None = None, key=None) -> bytes:
        self.seq = max(self.seq + 1, rnd << 16)
        group = make_group([1, 2, 3], [[4, 5], [6], [7, 8], [9]], [[-0.5, -0.5], [-1.0], [-0.2, -0.3], [-0.9]],
                           [1.0, 0.0, 1.0, 0.0], "add30/train/0/0", "33")
        batch = CompletionBatch(sender=sender or self.name, run_id=self.run, round=rnd, seq=self.seq, model_id="stub",
                                tokenizer_fp="tok", vocab_size=100, sampling=SamplingParams(0.7, max_new_tokens=8),
                                groups=(group,))
        return sign_batch(batch, key or self.key)

    def handle(self, action: str, request: dict) -> dict:
        rnd = int(request.get("round", -1))
        self.calls.append((action, rnd))
        if self.hang_at == (action, rnd):
            RELEASE.wait(60)
        if self.raise_at == (action, rnd):
            raise RuntimeError(f"{self.name}: injected failure at {action} {rnd}")
        if action == "hello":
            self.run = request["run"]
            reply = {"info": {"participant": self.claim, "model_id": "stub", "tokenizer_fp": "tok",
                              "key_fp": fingerprint(DIRECTORY[self.claim]) if self.claim in DIRECTORY else "none",
                              "proof": sign_challenge(self.key, request["run"], request["node"],
                                                                        self.claim, request["challenge"]),
                              **self.extra_info}}
        elif action == "generate":
            reply = {"frames": [self.frame(rnd)], "metrics": {"reward/mean": 0.5, "gen/tokens": 6}}
        elif action in ("learn", "exchange"):
            self.received[rnd] = [(h.sender, h.round) for h in map(parse_header, request["frames"])]
            reply = {"metrics": {"train/loss": 0.1, "train/peer_samples": 4.0 * len(request["frames"])}}
            if action == "exchange":
                reply["frames"] = [self.frame(rnd)]
        elif action == "evaluate":
            reply = {"metrics": {"eval/id/accuracy": 0.25}}
        else:
            reply = {"info": {"stopped": True}}
        fn = self.tamper.get((action, rnd))
        return fn(self, reply) if fn else reply


def fed(tmp: Path, **kw) -> FederationConfig:
    args = dict(num_rounds=2, min_participants=2, wait_for_participants_s=5.0, round_timeout_s=5.0, eval_every=0,
                run_name=RUN, output_dir=str(tmp), max_batch_tokens=4096, max_new_tokens=8)
    args.update(kw)
    return FederationConfig(**args)


def engine(tmp: Path, stubs: dict, **kw) -> Engine:
    declared, plots = kw.pop("declared", None), kw.pop("plots", False)
    return Engine(fed(tmp, **kw), DIRECTORY, tmp, InProcessTransport(stubs), declared=declared, sleep=lambda s: None,
                  plots=plots)


def rows(tmp: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp / "metrics.jsonl").read_text().splitlines()]


def fed_rows(tmp: Path) -> dict[int, dict]:
    return {r["round"]: r for r in rows(tmp) if r["participant"] == FEDERATION}


def trio(**per) -> dict:
    return {n: Stub(n, **per.get(n, {})) for n in NAMES}


# ------------------------------------------------------------------ schedules

def test_sync_rounds_relay_every_peer_frame_of_the_same_round(tmp_path):
    stubs = trio()
    assert engine(tmp_path, stubs, plots=True).run() == 2
    assert (tmp_path / "fed.png").stat().st_size > 0 and (tmp_path / "reward.png").stat().st_size > 0
    for rnd, row in fed_rows(tmp_path).items():
        assert row["fed/replies"] == 3 and row["fed/frames_verified"] == 3 and row["fed/frames_relayed"] == 6
        assert row["fed/rejected"] == 0 and row["fed/complete"] == 1.0 and row["fed/generate_failures"] == 0
    for name, s in stubs.items():
        assert [a for a, _ in s.calls] == ["hello", "generate", "learn", "generate", "learn", "finish"]
        assert sorted(s.received[2]) == [(p, 2) for p in NAMES if p != name]
    people = [r for r in rows(tmp_path) if r["participant"] != FEDERATION]
    assert {(r["participant"], r["round"]) for r in people} == {(n, r) for n in NAMES for r in (1, 2)}
    assert all(r["reward/mean"] == 0.5 and r["train/loss"] == 0.1 and r["model_id"] == "stub" for r in people)
    assert json.loads((tmp_path / "server_state.json").read_text())["completed_round"] == 2


def test_pipelined_rounds_relay_the_previous_rounds_frames(tmp_path):
    stubs = trio()
    engine(tmp_path, stubs, scheme="pipelined", num_rounds=3).run()
    for name, s in stubs.items():
        assert [a for a, _ in s.calls] == ["hello", "exchange", "exchange", "exchange", "finish"]
        assert s.received[1] == []
        assert sorted(s.received[3]) == [(p, 2) for p in NAMES if p != name]
    f = fed_rows(tmp_path)
    assert f[1]["fed/frames_verified"] == 0 and f[2]["fed/frames_verified"] == 3 and f[3]["fed/replies"] == 3


def test_a_new_schedule_is_one_registered_function(tmp_path):
    @register_schedule("generate-only-test")
    def generate_only(eng, rnd, stats):
        stats.fed["fed/frames_verified"] = float(len(eng.generate(rnd, stats)))
        stats.fed["fed/replies"] = stats.fed["fed/frames_verified"]

    try:
        stubs = trio()
        eng = engine(tmp_path, stubs)
        eng.schedule = SCHEDULES["generate-only-test"]
        eng.run()
        assert all("learn" not in [a for a, _ in s.calls] for s in stubs.values())
        assert fed_rows(tmp_path)[2]["fed/frames_verified"] == 3
    finally:
        SCHEDULES.pop("generate-only-test")


def test_evaluation_rows_on_the_eval_rounds(tmp_path):
    engine(tmp_path, trio(), eval_every=2, eval_size=4, num_rounds=2).run()
    evals = [r for r in rows(tmp_path) if r["phase"] == "eval"]
    assert sorted({r["round"] for r in evals}) == [0, 2] and len(evals) == 6


# ------------------------------------------------------------------ budgets, dropouts, deadlines

def test_peer_budget_relays_whole_frames_and_rotates(tmp_path):
    stubs = trio()
    engine(tmp_path, stubs, peer_budget=4).run()                 # 4 completions = one peer frame
    for s in stubs.values():
        assert all(len(s.received[r]) == 1 for r in (1, 2))
        assert s.received[1][0][0] != s.received[2][0][0]        # a different peer next round
    assert fed_rows(tmp_path)[1]["fed/frames_relayed"] == 3


def test_a_participant_that_errors_is_dropped_for_that_phase_only(tmp_path):
    stubs = trio(carol={"raise_at": ("learn", 1)})
    engine(tmp_path, stubs).run()
    f = fed_rows(tmp_path)
    assert f[1]["fed/replies"] == 2 and f[1]["fed/train_failures"] == 1 and f[1]["fed/dropped/error"] == 1
    assert f[1]["fed/complete"] == 1.0 and f[1]["fed/frames_verified"] == 3
    assert f[2]["fed/replies"] == 3 and "fed/dropped/error" not in f[2]
    assert sorted(stubs["alice"].received[2]) == [("bob", 2), ("carol", 2)]


def test_a_hung_participant_is_dropped_at_the_deadline(tmp_path):
    stubs = trio(bob={"hang_at": ("generate", 1)})
    engine(tmp_path, stubs, round_timeout_s=0.5, num_rounds=1).run()
    f = fed_rows(tmp_path)[1]
    assert f["fed/generate_failures"] == 1 and f["fed/dropped/timeout"] >= 1 and f["fed/frames_verified"] == 2
    assert sorted(stubs["alice"].received[1]) == [("carol", 1)]


# ------------------------------------------------------------------ malformed replies

def _drop(field):
    return lambda s, r: {k: v for k, v in r.items() if k != field}


def _set(field, value):
    return lambda s, r: {**r, field: value}


def _metric(key, value):
    return lambda s, r: {**r, "metrics": {**r["metrics"], key: value}}


MALFORMED = {                                     # (action, tamper) -> the reason the server counts
    "generate without frames": (("generate", _drop("frames")), "missing_record"),
    "generate with 4097 frames": (("generate", lambda s, r: {**r, "frames": r["frames"] * 4097}), "too_many_frames"),
    "generate with two frames": (("generate", lambda s, r: {**r, "frames": r["frames"] + [s.frame(1)]}),
                                 "too_many_frames"),
    "non-bytes frames": (("generate", _set("frames", ["not bytes"])), "frame_not_bytes"),
    "frames not a list": (("generate", _set("frames", b"raw")), "wrong_type"),
    "oversized frame": (("generate", _set("frames", [b"\0" * 300_000])), "frame_too_large"),
    "extra record": (("generate", _set("surprise", {"x": 1})), "extra_record"),
    "list-valued metric": (("learn", _metric("train/loss", [1.0, 2.0])), "nonscalar_metric"),
    "string metric": (("learn", _metric("train/loss", "low")), "nonscalar_metric"),
    "NaN metric": (("learn", _metric("train/loss", float("nan"))), "nonfinite_metric"),
    "infinite metric": (("generate", _metric("reward/mean", float("inf"))), "nonfinite_metric"),
    "metric overwriting the row's participant": (("learn", _metric("participant", 1.0)), "reserved_metric"),
    "metric overwriting the round": (("generate", _metric("round", 7.0)), "reserved_metric"),
    "metrics not a mapping": (("learn", _set("metrics", [1.0])), "wrong_type"),
    "learn without metrics": (("learn", _drop("metrics")), "missing_record"),
    "reply that is not a mapping": (("learn", lambda s, r: None), "wrong_type"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_reply_drops_its_sender_for_that_phase_and_is_counted(tmp_path, case):
    (action, tamper), reason = MALFORMED[case]
    stubs = trio(bob={"tamper": {(action, 1): tamper}})
    engine(tmp_path, stubs, num_rounds=2).run()
    f = fed_rows(tmp_path)
    assert f[1][f"fed/dropped/{reason}"] == 1
    failures = "fed/generate_failures" if action == "generate" else "fed/train_failures"
    assert f[1][failures] == 1
    assert f[1]["fed/replies"] == (3 if action == "generate" else 2)
    assert f[2]["fed/replies"] == 3 and f[2]["fed/frames_verified"] == 3          # the run went on
    if action == "generate":                                                  # the others still learn
        assert sorted(stubs["alice"].received[1]) == [("carol", 1)]


def test_evaluate_without_metrics_is_dropped_and_the_others_are_written(tmp_path):
    stubs = trio(carol={"tamper": {("evaluate", 0): _drop("metrics")}})
    engine(tmp_path, stubs, eval_every=1, eval_size=4, num_rounds=1).run()
    evals = [r for r in rows(tmp_path) if r["phase"] == "eval"]
    assert sorted((r["round"], r["participant"]) for r in evals) == [(0, "alice"), (0, "bob"), (1, "alice"),
                                                                    (1, "bob"), (1, "carol")]


def test_a_frame_signed_as_someone_else_is_rejected_before_the_replay_guard_commits(tmp_path):
    """alice returns a frame validly signed by bob (seq far ahead): rejected as sender_mismatch
    without committing bob's seq, so bob's own frame of the round (a lower seq) still verifies."""
    stubs = trio(alice={"tamper": {("generate", 1): lambda s, r: {**r, "frames": [_bob_ahead()]}}})
    engine(tmp_path, stubs, num_rounds=1).run()
    f = fed_rows(tmp_path)[1]
    assert f["fed/rejected/sender_mismatch"] == 1 and f["fed/frames_verified"] == 2
    assert sorted(stubs["carol"].received[1]) == [("bob", 1)]


def _bob_ahead() -> bytes:
    s = Stub("bob")
    s.seq = (1 << 16) + 1000
    return s.frame(1)


def test_boundary_counts_wrong_node_unknown_replies_and_transport_bugs():
    class Odd:
        def addresses(self):
            return [1, 2, 3]

        def send(self, action, requests, timeout):
            return {1: Delivered(2, {"metrics": {}}), 2: "junk", 9: Delivered(9, {"metrics": {}})}

    replies, dropped = Boundary(Odd()).send("learn", {1: {}, 2: {}, 3: {}}, 1.0)
    assert replies == {} and {a: f.reason for a, f in dropped.items()} == {1: "wrong_node", 2: "internal_error",
                                                                          3: "no_reply"}

    class Broken(Odd):
        def send(self, action, requests, timeout):
            raise OSError("link down")

    _, dropped = Boundary(Broken()).send("learn", {1: {}}, 1.0)
    assert dropped[1].reason == "internal_error"


def test_flower_records_map_to_the_same_checks():
    good = reply_to_content({"frames": [b"x"], "metrics": {"a": 1.0}})
    assert check_reply("generate", content_to_reply(good)).frames == (b"x",)
    bad = RecordDict({"ftis-batches": ConfigRecord({"frames": [b"x"], "more": 1}), "metrics": MetricRecord({})})
    with pytest.raises(ValueError, match="wrong_type"):
        check_reply("generate", content_to_reply(bad))
    listy = RecordDict({"metrics": MetricRecord({"a": [1.0, 2.0]})})
    with pytest.raises(ValueError, match="nonscalar_metric"):
        check_reply("learn", content_to_reply(listy))


# ------------------------------------------------------------------ admission

def test_hello_without_info_or_key_fields_is_refused_and_the_run_goes_on(tmp_path):
    stubs = trio(bob={"tamper": {("hello", -1): _drop("info")}},
                 carol={"tamper": {("hello", -1): lambda s, r: {"info": {k: v for k, v in r["info"].items()
                                                                          if k != "key_fp"}}}})
    eng = engine(tmp_path, {**stubs, "dave": Stub("alice", key=KEYS["alice"])}, min_participants=1, num_rounds=1)
    eng.run()
    assert eng.refused["bob"] == "missing_record" and eng.refused["carol"] == "bad_hello"
    assert eng.refused["dave"] == "duplicate_participant"             # a second node claiming alice
    assert [i["participant"] for i in eng.nodes.values()] == ["alice"]


def test_hello_with_someone_elses_public_fingerprint_but_not_their_key_is_refused(tmp_path):
    """mallory says she is bob and shows bob's public fingerprint, but signs the challenge with
    her own key: refused (bad_proof); the real bob, asked after her, is admitted."""
    mallory = Stub("bob", key=Ed25519PrivateKey.generate(), claim="bob")
    stubs = {1: Stub("alice"), 2: mallory, 3: Stub("bob")}
    eng = engine(tmp_path, stubs, num_rounds=1)
    eng.run()
    assert eng.refused == {2: "bad_proof"}
    assert {a: i["participant"] for a, i in eng.nodes.items()} == {1: "alice", 3: "bob"}
    assert fed_rows(tmp_path)[1]["fed/replies"] == 2
    assert [a for a, _ in mallory.calls] == ["hello"]                  # never asked anything else


def test_a_revoked_participant_is_refused_at_hello(tmp_path):
    """A key listed in revoked.txt cannot join, even with a valid proof of possession."""
    from ftis_fed.trust.signing import RevocationList

    (tmp_path / "revoked.txt").write_text(f"{fingerprint(DIRECTORY['carol'])}  # carol: key leaked\n")
    keys = KeyDirectory(dict(DIRECTORY.items()), revocations=RevocationList(tmp_path / "revoked.txt"))
    eng = Engine(fed(tmp_path, num_rounds=1), keys, tmp_path, InProcessTransport(trio()), sleep=lambda s: None,
                 plots=False)
    eng.run()
    assert eng.refused == {"carol": "revoked_key"}
    assert sorted(i["participant"] for i in eng.nodes.values()) == ["alice", "bob"]


def test_a_participant_may_lower_its_own_peer_budget_but_a_bad_value_is_ignored(tmp_path):
    stubs = trio(alice={"extra_info": {"peer_budget": 4}}, bob={"extra_info": {"peer_budget": "lots"}},
                 carol={"extra_info": {"peer_budget": -3}})
    engine(tmp_path, stubs, num_rounds=1).run()
    assert len(stubs["alice"].received[1]) == 1
    assert len(stubs["bob"].received[1]) == 2 and len(stubs["carol"].received[1]) == 2


def test_a_proof_for_another_node_or_run_does_not_count(tmp_path):
    replay = Stub("bob", tamper={("hello", -1): lambda s, r: {"info": {**r["info"], "proof": sign_challenge(
        KEYS["bob"], RUN, "another-node", "bob", b"\0" * 32)}}})
    eng = engine(tmp_path, {"alice": Stub("alice"), "carol": Stub("carol"), "bob": replay}, num_rounds=1)
    eng.run()
    assert eng.refused == {"bob": "bad_proof"}


def test_too_few_admitted_participants_stop_the_run(tmp_path):
    stubs = {"alice": Stub("alice"), "bob": Stub("bob", key=Ed25519PrivateKey.generate())}
    with pytest.raises(AdmissionError, match="min-participants=2: only 1 admitted"):
        engine(tmp_path, stubs, wait_for_participants_s=0.5).run()   # waits for another node until then


def test_a_simulation_with_fewer_supernodes_than_declared_participants_stops_with_the_fix(tmp_path):
    stubs = {n: Stub(n, extra_info={"supernodes": 2}) for n in ("alice", "bob")}
    with pytest.raises(TooFewSupernodes) as e:
        engine(tmp_path, stubs, declared=["alice", "bob", "carol", "dave"]).run()
    msg = str(e.value)
    assert "declares 4 participants" in msg and "2 SuperNodes" in msg and "\n" not in msg
    assert 'num-supernodes=4' in msg and "ftis-fed sim" in msg
    assert all([a for a, _ in s.calls] == ["hello", "finish"] for s in stubs.values())
    enough = {n: Stub(n, extra_info={"supernodes": 3}) for n in NAMES}
    assert engine(tmp_path / "ok", enough, declared=list(NAMES), num_rounds=1).run() == 1


# ------------------------------------------------------------------ metrics files and resume

def test_resume_after_a_stop_continues_with_the_saved_frames(tmp_path):
    first = trio()
    engine(tmp_path, first, scheme="pipelined", num_rounds=1).run()
    state = json.loads((tmp_path / "server_state.json").read_text())
    assert state["completed_round"] == 1 and len(state["pending"]) == 3
    second = trio()
    for n, s in second.items():
        s.seq = first[n].seq                                             # participants resume their seq
    assert engine(tmp_path, second, scheme="pipelined", num_rounds=2, resume=True).run() == 2
    assert [a for a, _ in second["alice"].calls] == ["hello", "exchange", "finish"]
    assert sorted(second["alice"].received[2]) == [("bob", 1), ("carol", 1)]
    assert sorted(fed_rows(tmp_path)) == [1, 2]                         # appended to the same file
    assert fed_rows(tmp_path)[2]["fed/frames_verified"] == 3 and fed_rows(tmp_path)[2]["fed/rejected"] == 0


def test_resume_refuses_another_runs_state(tmp_path):
    engine(tmp_path, trio(), num_rounds=1).run()
    with pytest.raises(ValueError, match="belongs to run"):
        engine(tmp_path, trio(), run_name="other", resume=True).run()


def test_a_fresh_run_moves_old_metrics_aside(tmp_path):
    engine(tmp_path, trio(), num_rounds=1).run()
    engine(tmp_path, trio(), num_rounds=2).run()
    assert sorted(fed_rows(tmp_path)) == [1, 2]                         # not 1, 1, 2
    old = sorted(tmp_path.glob("metrics.*.jsonl"))
    assert len(old) == 1 and len(old[0].read_text().splitlines()) == 4
    assert len(list(tmp_path.glob("metrics.*.csv"))) == 1
