"""Completion texts only to receivers with another tokenizer (issue 12): the engine asks a sender
for both variants of its batch (without / with texts) only when some receiver needs texts, relays
to each receiver the variant it needs, and refuses at the boundary a pair that is not exactly the
requested variants of one batch. Stub participants (as in tests/test_engine.py), real keys, real
signed frames, the in-process transport."""

from __future__ import annotations

import dataclasses
import json

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ftis_fed.wire.batch import CompletionBatch, SamplingParams, make_group
from ftis_fed.config.federation import FederationConfig
from ftis_fed.tasks.suite import task_at
from ftis_fed.engine.core import Engine
from ftis_fed.engine.inprocess import InProcessTransport
from ftis_fed.engine.validation import check_reply
from ftis_fed.engine.core import wire_metrics
from ftis_fed.engine.relay import text_variants, texts_differ
from ftis_fed.actions import requested_variants
from ftis_fed.engine.validation import BadReply
from ftis_fed.metrics.writer import FEDERATION
from ftis_fed.trust.signing import KeyDirectory, fingerprint, sign_batch, sign_challenge
from ftis_fed.wire.codec import WireOptions, parse_header

RUN = "variants-test"
TASK = task_at("add30", "train", 0, 0)                                # a train task of the run's default families
NAMES = ("alice", "bob", "carol")
KEYS = {n: Ed25519PrivateKey.generate() for n in NAMES}
DIRECTORY = KeyDirectory({n: k.public_key() for n, k in KEYS.items()})
TOKENIZER = {"alice": "tok-a", "bob": "tok-a", "carol": "tok-c"}     # carol has another tokenizer


def batch(name: str, rnd: int, seq: int, reward: float = 1.0, text: str = "4 5", run: str = RUN) -> CompletionBatch:
    group = make_group([1, 2, 3], [[4, 5], [6], [7, 8], [9]], [[-0.5, -0.5], [-1.0], [-0.2, -0.3], [-0.9]],
                       [reward, 0.0, 1.0, 0.0], TASK.task_id, TASK.reference, TASK.text, [text, "6", "7 8", "9"])
    return CompletionBatch(sender=name, run_id=run, round=rnd, seq=seq, model_id="stub", tokenizer_fp=TOKENIZER[name],
                           vocab_size=100, sampling=SamplingParams(0.7, max_new_tokens=8), groups=(group,))


class Stub:
    """Signs one frame per requested variant; ``lie`` = fn(batch) -> the batch its texts variant is
    made of (a mismatched pair); records which variant it received from whom."""

    def __init__(self, name: str, lie=None, texts_key=None):
        self.name, self.lie, self.seq, self.texts_key = name, lie, 0, texts_key
        self.run = RUN                                          # the run id hello names
        self.asked: dict[int, object] = {}
        self.received: dict[int, dict[str, bool]] = {}       # round -> {sender: has texts}

    def handle(self, action: str, request: dict) -> dict:
        rnd = int(request.get("round", -1))
        if action == "hello":
            self.run = request["run"]
            return {"info": {"participant": self.name, "model_id": "stub", "tokenizer_fp": TOKENIZER[self.name],
                             "key_fp": fingerprint(DIRECTORY[self.name]), "load_seconds": 1.5,
                             "proof": sign_challenge(KEYS[self.name], request["run"], request["node"], self.name,
                                                     request["challenge"])}}
        if action == "generate":
            self.asked[rnd] = request["texts"]
            self.seq = max(self.seq + 1, rnd << 16)
            b = batch(self.name, rnd, self.seq, run=self.run)
            variants = requested_variants(request)
            frames = [sign_batch(self.lie(b) if (t and self.lie) else b,
                                 (self.texts_key if t and self.texts_key else KEYS[self.name]), WireOptions(texts=t))
                      for t in variants]
            return {"frames": frames, "metrics": {"reward/mean": 0.5}}
        if action == "learn":
            self.received[rnd] = {h.sender: h.has_texts for h in map(parse_header, request["frames"])}
            return {"metrics": {"train/loss": 0.1}}
        if action == "evaluate":
            return {"metrics": {}}
        return {"info": {"stopped": True}}


def run(tmp, stubs, **kw) -> list[dict]:
    args = dict(num_rounds=2, min_participants=2, wait_for_participants_s=5.0, round_timeout_s=5.0, eval_every=0,
                run_name=RUN, output_dir=str(tmp), max_batch_tokens=4096, max_new_tokens=8)
    args.update(kw)
    logs = []
    Engine(FederationConfig(**args), DIRECTORY, tmp, InProcessTransport(stubs), sleep=lambda s: None, plots=False,
           log=lambda lvl, msg, *a: logs.append(msg % a)).run()
    run.logs = logs
    return [json.loads(line) for line in (tmp / "metrics.jsonl").read_text().splitlines()]


def test_same_tokenizer_receivers_get_the_frame_without_texts_the_other_one_with(tmp_path):
    stubs = {n: Stub(n) for n in NAMES}
    rows = run(tmp_path, stubs)
    # alice and bob share a tokenizer: each signs both variants (carol needs texts); carol only texts
    assert stubs["alice"].asked[1] == [False, True] and stubs["bob"].asked[1] == [False, True]
    assert stubs["carol"].asked[1] is True
    for rnd in (1, 2):
        assert stubs["alice"].received[rnd] == {"bob": False, "carol": True}
        assert stubs["bob"].received[rnd] == {"alice": False, "carol": True}
        assert stubs["carol"].received[rnd] == {"alice": True, "bob": True}
    fed = [r for r in rows if r["participant"] == FEDERATION]
    assert len(fed) == 2
    for r in fed:
        assert r["fed/rejected"] == 0 and r["fed/replies"] == 3 and r["fed/frames_relayed"] == 6
        assert 0 < r["wire/bytes_per_token"] < r["wire/bytes_per_token_texts"]
    assert any("model loaded in 1.5 s" in line for line in run.logs)


def test_one_tokenizer_means_one_variant_without_texts(tmp_path):
    stubs = {n: Stub(n) for n in ("alice", "bob")}
    rows = run(tmp_path, stubs)
    assert stubs["alice"].asked[1] is False and stubs["bob"].asked[2] is False
    assert stubs["alice"].received[2] == {"bob": False}
    fed = [r for r in rows if r["participant"] == FEDERATION]
    assert all("wire/bytes_per_token" in r and "wire/bytes_per_token_texts" not in r for r in fed)


def test_wire_texts_always_and_never_keep_one_variant(tmp_path):
    for mode, want in (("always", True), ("never", False)):
        stubs = {n: Stub(n) for n in NAMES}
        run(tmp_path / mode, stubs, wire_texts=mode)
        assert all(s.asked[1] is want for s in stubs.values())
        assert set(stubs["alice"].received[1].values()) == {want}


def test_a_texts_variant_of_another_batch_is_refused_and_the_plain_one_still_relayed(tmp_path):
    # the headers agree (same seq, counts), the content does not: the server decodes and compares
    stubs = {n: Stub(n) for n in NAMES}
    stubs["alice"].lie = lambda b: dataclasses.replace(
        b, groups=(dataclasses.replace(b.groups[0], rewards=b.groups[0].rewards[::-1].copy()),))
    rows = run(tmp_path, stubs)
    fed = {r["round"]: r for r in rows if r["participant"] == FEDERATION}
    assert fed[1]["fed/rejected/variant_mismatch"] == 1
    assert stubs["bob"].received[1] == {"alice": False, "carol": True}     # the valid variant still goes
    assert stubs["carol"].received[1] == {"alice": False, "bob": True}     # (carol rejects it: no texts)


def test_a_texts_variant_whose_texts_cannot_be_its_ids_is_refused_and_charged(tmp_path):
    """Issue 20: alice's texts variant carries 300-character texts for 1-2 ids (more characters
    than any decoding of them: 32 per id) and, in round 2, a variant with other ids: neither is relayed
    to carol, who gets the plain one; alice is charged (quarantined after 2 with quarantine-after 2)."""
    from ftis_fed.trust.reverify import ReverifyConfig

    stubs = {n: Stub(n) for n in NAMES}

    def lie(b):
        g = b.groups[0]
        if b.round == 1:
            return dataclasses.replace(b, groups=(dataclasses.replace(g, completion_texts=("9" * 300,) * 4),))
        return dataclasses.replace(b, groups=(dataclasses.replace(g, completion_ids=tuple(c[::-1].copy() for c in
                                                                                          g.completion_ids)),))
    stubs["alice"].lie = lie
    rows = run(tmp_path, stubs, reverify=ReverifyConfig(quarantine_after=2))
    fed = {r["round"]: r for r in rows if r["participant"] == FEDERATION}
    assert fed[1]["fed/rejected/text_too_long"] == 1 and fed[2]["fed/rejected/variant_mismatch"] == 1
    assert stubs["carol"].received[1] == {"alice": False, "bob": True}
    assert stubs["carol"].received[2] == {"alice": False, "bob": True}
    assert fed[2]["fed/quarantined"] == 1


def test_a_texts_variant_signed_with_another_key_is_refused(tmp_path):
    stubs = {n: Stub(n) for n in NAMES}
    stubs["bob"].texts_key = KEYS["alice"]                  # headers agree; the signature does not
    rows = run(tmp_path, stubs, num_rounds=1)
    fed = {r["round"]: r for r in rows if r["participant"] == FEDERATION}
    assert fed[1]["fed/rejected/bad_signature"] == 1
    assert stubs["carol"].received[1] == {"alice": True, "bob": False}


def _pair(**texts_kw) -> list[bytes]:
    b = batch("alice", 1, 70000)
    return [sign_batch(b, KEYS["alice"], WireOptions(texts=False)),
            sign_batch(dataclasses.replace(b, **texts_kw), KEYS["alice"], WireOptions(texts=True))]


def test_the_boundary_allows_exactly_the_requested_variants():
    ok = _pair()
    reply = check_reply("generate", {"frames": ok, "metrics": {}}, variants=(False, True))
    assert reply.frames == tuple(ok)
    assert check_reply("generate", {"frames": [], "metrics": {}}, variants=(False, True)).frames == ()
    cases = {
        "wrong_variants": [ok[0]],                          # one frame for two variants
        "too_many_frames": ok + ok[:1],
        "variant_mismatch": _pair(seq=70001),                # two batches, not two variants of one
    }
    for reason, frames in cases.items():
        with pytest.raises(BadReply) as e:
            check_reply("generate", {"frames": frames, "metrics": {}}, variants=(False, True))
        assert e.value.reason == reason, (reason, e.value)
    with pytest.raises(BadReply) as e:                      # in the wrong order
        check_reply("generate", {"frames": ok[::-1], "metrics": {}}, variants=(False, True))
    assert e.value.reason == "wrong_variants"
    with pytest.raises(BadReply) as e:                      # two frames where one variant was asked for
        check_reply("generate", {"frames": ok, "metrics": {}}, variants=(False,))
    assert e.value.reason == "too_many_frames"


def test_a_mismatched_pair_drops_its_sender_at_the_boundary(tmp_path):
    stubs = {n: Stub(n) for n in NAMES}
    stubs["bob"].lie = lambda b: dataclasses.replace(b, round=b.round + 1)
    rows = run(tmp_path, stubs)
    fed = {r["round"]: r for r in rows if r["participant"] == FEDERATION}
    assert fed[1]["fed/dropped/variant_mismatch"] == 1 and fed[1]["fed/generate_failures"] == 1
    assert "bob" not in stubs["alice"].received[1] and "bob" not in stubs["carol"].received[1]


def test_pure_helpers():
    assert text_variants("auto", "a", ["a", "a"]) == (False,)
    assert text_variants("auto", "a", ["a", "b"]) == (False, True)
    assert text_variants("auto", "b", ["a", "a"]) == (True,)
    assert text_variants("always", "a", ["a"]) == (True,) and text_variants("never", "a", ["b"]) == (False,)
    assert text_variants("auto", "a", []) == (False,)
    b = batch("alice", 1, 1)
    assert texts_differ(b, dataclasses.replace(b, groups=(dataclasses.replace(b.groups[0], completion_texts=()),))) == ""
    assert texts_differ(b, batch("alice", 1, 1, reward=0.0)) == "groups[0].rewards"
    assert texts_differ(b, batch("alice", 1, 2)) == "seq"
    # averaged per receiver: (100/10 + 300/100) / 2
    assert wire_metrics({False: [(100, 10), (300, 100)], True: []}) == {"wire/bytes_per_token": 6.5}


# ------------------------------------------------------------------ live progress (issue 12, part 2)

def test_progress_lines_name_who_replied_and_who_is_still_awaited(tmp_path):
    import threading

    release = threading.Event()

    class Slow(Stub):
        def handle(self, action, request):
            if action == "generate" and int(request["round"]) == 1:
                release.wait(10)
            return super().handle(action, request)

    stubs = {"alice": Stub("alice"), "bob": Stub("bob"), "carol": Slow("carol")}
    logs: list[str] = []

    def log(lvl, msg, *a):
        logs.append(msg % a)
        if "waiting for carol" in logs[-1]:
            release.set()                                   # seen the line: let carol go on

    args = dict(num_rounds=1, min_participants=2, wait_for_participants_s=5.0, round_timeout_s=20.0, eval_every=0,
                run_name=RUN, output_dir=str(tmp_path), max_batch_tokens=4096, progress_every_s=0.05,
                max_new_tokens=8)
    Engine(FederationConfig(**args), DIRECTORY, tmp_path, InProcessTransport(stubs), sleep=lambda s: None,
           plots=False, log=log).run()
    waiting = [line for line in logs if line.startswith("round 1 generate: 2/3 replied")]
    assert waiting and "waiting for carol" in waiting[0] and "alice" in waiting[0] and "bob" in waiting[0]
    assert all("\r" not in line for line in logs)
    done = [line for line in logs if line.startswith("round 1 generate done:")]
    assert done and "carol" in done[0]


def test_phase_summary_and_progress_line():
    from ftis_fed.metrics.writer import phase_summary
    from ftis_fed.engine.progress import PhaseProgress

    assert phase_summary("alice", {"gen/seconds": 2.0, "gen/tokens": 50.0, "train/seconds": 3.0}) == \
        "alice generate 2.0 s 50 tokens 25.0 tok/s, train 3.0 s"
    t = [0.0]
    p = PhaseProgress("round 3 learn", {1: "alice", 2: "bob"}, lambda *a: None, 0, clock=lambda: t[0])
    t[0] = 4.0
    p.replied(2)
    t[0] = 30.0
    assert p.line() == "round 3 learn: 1/2 replied (bob 4 s); waiting for alice (30 s)"
    q = PhaseProgress("hello", {1: "n1"}, lambda *a: None, 0, clock=lambda: t[0], tracked=False)
    assert q.line() == "hello: 0 s, waiting for replies from n1"
