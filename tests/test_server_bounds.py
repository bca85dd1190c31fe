"""Issue 20: one sender's bad frame costs only that sender, at the SERVER.

The real engine (in-process transport), real Ed25519 keys, real wire encoding: mallory, an admitted
participant signing validly, sends crafted frames; the server must refuse each by the run's own
bounds before it decompresses or relays it, charge mallory (quarantine), and relay the honest
participants' frames as usual. Also: run identity (frames of another run, a resumed run), admission
(no unauthenticated say), hello and metric-name bounds, horizontal partitions.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from pathlib import Path

import pytest
import zstandard as zstd
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ftis_fed.config.federation import FederationConfig
from ftis_fed.engine.core import AdmissionError, Engine
from ftis_fed.engine.inprocess import InProcessTransport
from ftis_fed.metrics.writer import FEDERATION
from ftis_fed.tasks.suite import task_at
from ftis_fed.trust.reverify import ReverifyConfig
from ftis_fed.trust.signing import KeyDirectory, fingerprint, run_name_of, sign_body, sign_challenge
from ftis_fed.wire import codec as wire
from ftis_fed.wire.batch import CompletionBatch, SamplingParams, make_group
from ftis_fed.wire.codec import WireOptions, encode_body, parse_header

RUN = "bounds-test"
NAMES = ("alice", "bob", "mallory")
KEYS = {n: Ed25519PrivateKey.generate() for n in NAMES}
DIRECTORY = KeyDirectory({n: k.public_key() for n, k in KEYS.items()})
SAMPLING = SamplingParams(0.7, max_new_tokens=8)


def group(size: int = 4, tokens: int = 2, task: str = "add30/train/0/0", texts=None):
    ids = [[4 + i] * tokens for i in range(size)]
    return make_group([1, 2, 3], ids, [[-0.5] * tokens] * size, [1.0, 0.0] * (size // 2) + [0.0] * (size % 2),
                      task, "33", task_at("add30", "train", 0, 0).text, texts if texts is not None else [" ".join(map(str, c)) for c in ids])


def batch(name: str, run: str, rnd: int, seq: int, **kw) -> CompletionBatch:
    fields = dict(sender=name, run_id=run, round=rnd, seq=seq, model_id="stub", tokenizer_fp="tok", vocab_size=100,
                  sampling=SAMPLING, groups=(group(),))
    fields.update(kw)
    return CompletionBatch(**fields)


def signed(b: CompletionBatch, texts: bool = False) -> bytes:
    """Encoded and signed WITHOUT validating, as a hostile sender does: only the signature is real."""
    return sign_body(encode_body(b, WireOptions(texts=texts)), KEYS[b.sender])


class Stub:
    """A participant as the engine sees it; ``craft(stub, rnd) -> frame`` replaces its honest frame."""

    def __init__(self, name: str, craft=None, extra_info=None, key=None, claim=None):
        self.name, self.craft, self.key, self.claim = name, craft, key or KEYS[name], claim or name
        self.extra_info = dict(extra_info or {})
        self.seq, self.run = 0, ""
        self.received: dict[int, list[str]] = {}
        self.sent: dict[int, bytes] = {}
        self.metrics: dict[str, float] = {"train/loss": 0.1}

    def next_seq(self, rnd: int) -> int:
        self.seq = max(self.seq + 1, rnd << 16)
        return self.seq

    def handle(self, action: str, request: dict) -> dict:
        rnd = int(request.get("round", -1))
        if action == "hello":
            self.run = request["run"]
            return {"info": {"participant": self.claim, "model_id": "stub", "tokenizer_fp": "tok", "vocab_size": 100,
                             "key_fp": fingerprint(DIRECTORY[self.claim]) if self.claim in DIRECTORY else "none",
                             "proof": sign_challenge(self.key, request["run"], request["node"], self.claim,
                                                     request["challenge"]), **self.extra_info}}
        if action == "generate":
            frame = self.craft(self, rnd) if self.craft else signed(batch(self.name, self.run, rnd, self.next_seq(rnd)))
            self.sent[rnd] = frame
            return {"frames": [frame], "metrics": {"reward/mean": 0.5}}
        if action == "learn":
            self.received[rnd] = [parse_header(f).sender for f in request["frames"]]
            return {"metrics": dict(self.metrics)}
        if action == "evaluate":
            return {"metrics": {}}
        return {"info": {"stopped": True}}


def fed(tmp: Path, **kw) -> FederationConfig:
    args = dict(num_rounds=1, min_participants=2, wait_for_participants_s=60.0, round_timeout_s=60.0, eval_every=0,
                run_name=RUN, output_dir=str(tmp), max_batch_tokens=4096, max_new_tokens=8)
    args.update(kw)
    return FederationConfig(**args)


def run(tmp: Path, stubs: dict, transport=None, **kw) -> Engine:
    eng = Engine(fed(tmp, **kw), DIRECTORY, tmp, transport or InProcessTransport(stubs), sleep=lambda s: None,
                 plots=False)
    eng.run()
    return eng


def fed_rows(tmp: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (tmp / "metrics.jsonl").read_text().splitlines()]
    return {r["round"]: r for r in rows if r["participant"] == FEDERATION}


def trio(craft) -> dict:
    return {"alice": Stub("alice"), "bob": Stub("bob"), "mallory": Stub("mallory", craft)}


def refused_and_not_relayed(tmp: Path, stubs: dict, reason: str, rnd: int = 1) -> bool:
    row = fed_rows(tmp)[rnd]
    relayed = [s for n in ("alice", "bob") for s in stubs[n].received[rnd]]
    return (row.get(f"fed/rejected/{reason}") == 1 and row["fed/frames_verified"] == 2
            and "mallory" not in relayed and sorted(relayed) == ["alice", "bob"])


# ----------------------------------------------------------------------------- bounds before relaying

def zip_bomb(s: Stub, rnd: int) -> bytes:
    """A ~4 KB signed frame whose payload would decompress to 120 MiB (v1: fixed header offsets)."""
    body = bytearray(encode_body(batch(s.name, s.run, rnd, s.next_seq(rnd)), WireOptions(texts=False, version=1)))
    raw_len = 120 << 20
    bomb = zstd.ZstdCompressor(level=3).compress(bytes(raw_len))
    head_len = len(body) - struct.unpack_from("<I", body, wire.header_offset("payload_len")[0])[0]
    struct.pack_into("<I", body, wire.header_offset("raw_len")[0], raw_len)
    struct.pack_into("<I", body, wire.header_offset("payload_len")[0], len(bomb))
    frame = sign_body(bytes(body[:head_len]) + bomb, KEYS[s.name])
    assert len(frame) < 8 << 10
    return frame


def test_a_zip_bomb_is_refused_at_the_server_before_decompressing(tmp_path, decompressions):
    stubs = trio(zip_bomb)
    run(tmp_path, stubs)
    assert refused_and_not_relayed(tmp_path, stubs, "too_large")
    assert max(decompressions, default=0) < 1 << 20                    # only honest frames were inflated


def test_65536_one_token_groups_are_refused_from_the_header(tmp_path, decompressions):
    def many(s, rnd):
        g = make_group([1], [[2]], [[-0.5]], [1.0], "add30/train/0/0", "33")
        return signed(batch(s.name, s.run, rnd, s.next_seq(rnd), groups=(g,) * 65_536))
    stubs = trio(many)
    run(tmp_path, stubs)
    assert refused_and_not_relayed(tmp_path, stubs, "too_large")
    assert len(stubs["mallory"].sent[1]) < 192 << 10 and len(decompressions) <= 2


@pytest.mark.parametrize("craft, reason", [
    (lambda s, r: signed(batch(s.name, s.run, r, s.next_seq(r), groups=(group(size=8),))), "too_large"),     # G=8 > 4
    (lambda s, r: signed(batch(s.name, s.run, r, s.next_seq(r), groups=(group(),) * 5)), "too_large"),       # 5 > 4 groups
    (lambda s, r: signed(batch(s.name, s.run, r, s.next_seq(r), sampling=SamplingParams(1.0, max_new_tokens=8))),
     "wrong_sampling"),
    (lambda s, r: signed(batch(s.name, s.run, r, s.next_seq(r), sampling=SamplingParams(0.7, max_new_tokens=64),
                               groups=(group(tokens=64),))), "too_large"),          # longer than the run's 8 tokens
    (lambda s, r: signed(batch(s.name, s.run, r, s.next_seq(r), groups=(group(texts=["7" * 300] * 4),)), texts=True),
     "text_too_long"),                                                              # 300 > 8 x 32 characters
    (lambda s, r: signed(batch(s.name, s.run, r, s.next_seq(r), groups=(group(texts=["\U0001F600" * 65] * 4),)),
                         texts=True), "text_too_long"),                             # 65 > 2 ids x 32 characters
    (lambda s, r: signed(batch(s.name, s.run, r, s.next_seq(r), tokenizer_fp="tok-other")), "wrong_tokenizer"),
    (lambda s, r: signed(batch(s.name, s.run, r, s.next_seq(r), vocab_size=1 << 32)), "wrong_tokenizer"),
    (lambda s, r: signed(batch(s.name, s.run, r, 2**64 - 1)), "bad_header"),
    (lambda s, r: signed(batch(s.name, s.run, r, s.next_seq(r), groups=(group(task="add30/eval/0/0"),))), "eval_task"),
    (lambda s, r: signed(batch(s.name, s.run, r, s.next_seq(r), groups=(group(task="mul7/train/0/0"),))),
     "unknown_task"),
    (lambda s, r: signed(batch(s.name, s.run, r, s.next_seq(r), groups=(group(),) * 2)), "duplicate_task"),
    (lambda s, r: signed(batch(s.name, s.run, r, s.next_seq(r), groups=(dataclasses.replace(
        group(), prompt_text="What is 1 + 1? Reply with just the number."),)), texts=True), "prompt_mismatch"),
])
def test_frames_every_receiver_would_refuse_are_refused_by_the_server(tmp_path, craft, reason):
    stubs = trio(craft)
    run(tmp_path, stubs)
    assert refused_and_not_relayed(tmp_path, stubs, reason)


def test_refusals_a_sender_controls_quarantine_it_at_the_server(tmp_path):
    """mallory's frames are out of bounds in rounds 1 and 2 (reverify-quarantine-after = 2): from
    round 3 on even its in-bounds frames are refused unread and never relayed."""
    def craft(s, rnd):
        return signed(batch(s.name, s.run, rnd, s.next_seq(rnd), groups=(group(size=8 if rnd <= 2 else 4),)))
    stubs = trio(craft)
    eng = run(tmp_path, stubs, num_rounds=3, reverify=ReverifyConfig(quarantine_after=2))
    rows = fed_rows(tmp_path)
    assert rows[1]["fed/rejected/too_large"] == 1 and rows[2]["fed/rejected/too_large"] == 1
    assert rows[1]["fed/quarantined"] == 0 and rows[2]["fed/quarantined"] == 1
    assert rows[3]["fed/rejected/quarantined"] == 1 and eng.inbox.quarantined == {"mallory"}
    assert all("mallory" not in stubs[n].received[r] for n in ("alice", "bob") for r in (1, 2, 3))
    assert stubs["alice"].received[3] == ["bob"]


# ----------------------------------------------------------------------------- run identity

def test_a_frame_recorded_in_one_run_is_refused_in_the_next_and_a_resumed_run_keeps_its_id(tmp_path):
    first = trio(None)
    a = run(tmp_path / "a", first)
    recorded = first["mallory"].sent[1]
    assert run_name_of(a.run_id) == RUN and a.run_id != RUN
    # run B, same run name, same keys, fresh state: mallory replays its round-1 frame of run A
    stubs = trio(lambda s, rnd: recorded)
    b = run(tmp_path / "b", stubs)
    assert b.run_id != a.run_id and refused_and_not_relayed(tmp_path / "b", stubs, "wrong_run")
    # run A resumed: same id, its participants' frames of the new round are accepted
    again = trio(None)
    for n, s in again.items():
        s.seq = first[n].seq
    resumed = run(tmp_path / "a", again, num_rounds=2, resume=True)
    assert resumed.run_id == a.run_id and again["alice"].run == a.run_id
    assert fed_rows(tmp_path / "a")[2]["fed/frames_verified"] == 3
    assert json.loads((tmp_path / "a" / "server_state.json").read_text())["run_id"] == a.run_id


# ----------------------------------------------------------------------------- admission

class Arrivals(InProcessTransport):
    """Nodes that connect over time: ``later`` appear after the first ``after`` listings."""

    def __init__(self, participants, later, after=3):
        super().__init__(participants)
        self.later, self.after, self.calls = set(later), after, 0

    def addresses(self):
        self.calls += 1
        return [a for a in self.participants if a not in self.later or self.calls > self.after]


def test_an_unauthenticated_node_has_no_say_in_admission(tmp_path):
    """A keyless rogue that says ``supernodes: 1`` connects first: it neither stops the run as 'too
    few SuperNodes' nor counts toward min-participants; the engine waits for bob and runs."""
    rogue = Stub("bob", key=Ed25519PrivateKey.generate(), extra_info={"supernodes": 1})
    stubs = {"alice": Stub("alice", extra_info={"supernodes": 3}), "rogue": rogue,
             "bob": Stub("bob", extra_info={"supernodes": 3})}
    transport = Arrivals(stubs, later={"bob"})
    eng = Engine(fed(tmp_path), DIRECTORY, tmp_path, transport, declared=["alice", "bob", "mallory"],
                 sleep=lambda s: None, plots=False)
    assert eng.run() == 1
    assert eng.refused == {"rogue": "bad_proof"}
    assert sorted(i["participant"] for i in eng.nodes.values()) == ["alice", "bob"]
    assert fed_rows(tmp_path)[1]["fed/replies"] == 2


def test_a_rogue_node_alone_never_completes_admission(tmp_path):
    stubs = {"alice": Stub("alice"), "rogue": Stub("bob", key=Ed25519PrivateKey.generate())}
    with pytest.raises(AdmissionError, match="min-participants=2: only 1 admitted.*rogue: bad_proof"):
        run(tmp_path, stubs, wait_for_participants_s=0.5)


def test_a_huge_model_id_in_hello_is_refused(tmp_path):
    stubs = {"alice": Stub("alice"), "bob": Stub("bob", extra_info={"model_id": "x" * 10_000_000}),
             "mallory": Stub("mallory")}
    eng = run(tmp_path, stubs)
    assert eng.refused == {"bob": "bad_hello"}
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert max(len(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()) < 10_000
    assert {r["participant"] for r in rows} == {"alice", "mallory", FEDERATION}


def test_participants_with_different_num_partitions_stop_admission_with_the_fix(tmp_path):
    stubs = {"alice": Stub("alice", extra_info={"num_partitions": 2}), "bob": Stub("bob", extra_info={"num_partitions": 3})}
    with pytest.raises(AdmissionError, match="different num-partitions.*alice: 2, bob: 3"):
        run(tmp_path, stubs)


# ----------------------------------------------------------------------------- metric names

def test_new_metric_names_are_bounded_per_reply_and_in_length(tmp_path):
    """mallory invents 3,000 new metric names per round (and one of 1,000 characters): at most 512
    new ones per reply are kept; names it sent before stay; honest rows are untouched."""
    stubs = trio(None)
    mallory = stubs["mallory"]
    real_handle = mallory.handle

    def handle(action, request):
        if action == "learn":
            rnd = int(request["round"])
            mallory.metrics = {"train/loss": 0.2, **{f"junk/{rnd}/{i}": 1.0 for i in range(3000)}, "x" * 1000: 1.0}
        return real_handle(action, request)
    mallory.handle = handle
    run(tmp_path, stubs, num_rounds=3)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    m = {r["round"]: r for r in rows if r["participant"] == "mallory"}
    for rnd, r in m.items():
        assert r["train/loss"] == 0.2 and 0 < sum(k.startswith("junk/") for k in r) <= 512
        assert all(len(k) <= 128 for k in r)
        assert fed_rows(tmp_path)[rnd]["fed/metrics_dropped"] >= 3000 - 512
    alice = [r for r in rows if r["participant"] == "alice"]
    assert len(alice) == 3 and all(r["train/loss"] == 0.1 and not any(k.startswith("junk/") for k in r) for r in alice)


def test_horizontal_groups_are_held_to_the_share_and_the_shared_prompts_at_the_server(tmp_path):
    """advantage-groups = horizontal, G = 4, participants reporting num-partitions 2: a group must be
    one of the round's shared prompts with at most ceil(4/2) = 2 completions, as every receiver
    checks; mallory's 4-completion group (round 1) and its group of another prompt (round 2) are
    refused at the server and never relayed."""
    from ftis_fed.learn.objective import ObjectiveConfig

    cfg = fed(tmp_path, objective=ObjectiveConfig(advantage_groups="horizontal"))

    def shared(rnd: int):
        return cfg.task.prompts_for_round(0, 2, rnd)[0]

    def honest(s, rnd):
        t = shared(rnd)
        return signed(batch(s.name, s.run, rnd, s.next_seq(rnd), groups=(group(size=2, task=t.task_id),)))

    def mallory(s, rnd):
        t = shared(rnd) if rnd == 1 else task_at("add30", "train", 0, 999)
        return signed(batch(s.name, s.run, rnd, s.next_seq(rnd), groups=(group(size=4 if rnd == 1 else 2,
                                                                                task=t.task_id),)))
    info = {"num_partitions": 2}
    stubs = {"alice": Stub("alice", honest, info), "bob": Stub("bob", honest, info),
             "mallory": Stub("mallory", mallory, info)}
    eng = Engine(dataclasses.replace(cfg, num_rounds=2), DIRECTORY, tmp_path, InProcessTransport(stubs),
                 sleep=lambda s: None, plots=False)
    assert eng.run() == 2
    assert refused_and_not_relayed(tmp_path, stubs, "too_large", rnd=1)
    assert refused_and_not_relayed(tmp_path, stubs, "unshared_task", rnd=2)


def test_a_participant_may_ask_for_fewer_peers_samples_never_more(tmp_path):
    stubs = {"alice": Stub("alice", extra_info={"peer_budget": 0}), "bob": Stub("bob", extra_info={"peer_budget": 10**9}),
             "mallory": Stub("mallory", extra_info={"peer_budget": 4})}
    eng = run(tmp_path, stubs, peer_budget=4)
    assert eng.budgets == {"alice": 4, "bob": 4, "mallory": 4}
    assert all(len(s.received[1]) == 1 for s in stubs.values())       # 4 completions: one peer's frame
