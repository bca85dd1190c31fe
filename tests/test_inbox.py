"""The receiver / server pipeline: every rejection reason, counters, and bad batches beside good ones."""

from __future__ import annotations

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from flwr.app import ConfigRecord, RecordDict

from ftis_fed.wire.batch import BatchValidationError, CompletionBatch, SamplingParams, make_group
from ftis_fed.flower_io import frames_from_record, get_frames, put_frames, record_nbytes
from ftis_fed.trust.inbox import Inbox, InboxConfig
from ftis_fed.trust.signing import KeyDirectory, ReplayGuard, sign_batch, sign_body
from ftis_fed.wire.codec import WireOptions, encode_body

KEYS = {p: Ed25519PrivateKey.generate() for p in ("alice", "bob")}
DIRECTORY = KeyDirectory({p: k.public_key() for p, k in KEYS.items()})


def group(ids=((4, 5), (6,)), lps=((-0.1, -2.0), (-0.5,)), texts=True, **kw):
    args = dict(prompt_ids=[1, 2, 3], completion_ids=ids, logprobs=lps, rewards=[1.0, 0.0][:len(ids)],
                task_id="add/id/0", reference="7", prompt_text="What is 3 + 4?" if texts else "",
                completion_texts=["7", "six"][:len(ids)] if texts else ())
    args.update(kw)
    return make_group(**args)


def batch(sender="alice", round=1, seq=1, groups=None, **kw) -> CompletionBatch:
    fields = dict(sender=sender, run_id="run-1", round=round, seq=seq, model_id="smollm2", tokenizer_fp="tok-a",
                  vocab_size=49152, sampling=SamplingParams(0.7, max_new_tokens=8),
                  groups=(group(),) if groups is None else groups)
    fields.update(kw)
    return CompletionBatch(**fields)


def signed(b: CompletionBatch, key=None, options=WireOptions()) -> bytes:
    """Encode and sign WITHOUT validating, as a hostile or buggy sender could."""
    return sign_body(encode_body(b, options), key or KEYS[b.sender])


def inbox(**kw) -> Inbox:
    return Inbox(DIRECTORY, InboxConfig(run_id="run-1", **kw))


def reason(ib: Inbox, frame, **kw) -> str:
    with pytest.raises(BatchValidationError) as e:
        ib.accept(frame, **kw)
    return e.value.reason


def test_accepts_a_good_batch_and_keeps_the_exact_frame():
    ib = inbox(tokenizer_fp="tok-a")
    frame = sign_batch(batch(), KEYS["alice"])
    a = ib.accept(frame, expected_round=1)
    assert a.frame == frame and a.token_level and a.sender == "alice"
    assert np.array_equal(a.batch.groups[0].completion_ids[1], [6])
    assert ib.metrics() == {"offpolicy/accepted": 1}


F32 = WireOptions(logp="f32")          # carries NaN / inf / positive values exactly to the receiver


@pytest.mark.parametrize("make,expected", [
    (lambda: signed(batch(groups=(group(lps=((-0.1, float("nan")), (-0.5,))),)), options=F32), "nonfinite_logprob"),
    (lambda: signed(batch(groups=(group(lps=((-0.1, -np.inf), (-0.5,))),)), options=F32), "nonfinite_logprob"),
    (lambda: signed(batch(groups=(group(lps=((-0.1, 0.25), (-0.5,))),)), options=F32), "positive_logprob"),
    (lambda: signed(batch(groups=(group(lps=((-0.1, float("nan")), (-0.5,))),))), "nonfinite_logprob"),
    (lambda: signed(batch(groups=(group(lps=((-0.1, 3.0), (-0.5,))),))), "positive_logprob"),
    (lambda: signed(batch(vocab_size=6)), "id_out_of_range"),
    (lambda: signed(batch(groups=(group(completion_texts=["only one"]),))), "undecodable"),  # 1 text, 2 completions
    (lambda: signed(batch(sampling=SamplingParams(0.7, max_new_tokens=1))), "length_mismatch"),
    (lambda: signed(batch(groups=(group(task_id=""),))), "missing_field"),
    (lambda: signed(batch(model_id="")), "missing_field"),
    (lambda: signed(batch(groups=(group(rewards=[np.inf, 0.0]),))), "bad_reward"),
    (lambda: signed(batch(groups=())), "missing_field"),
    (lambda: None, "missing_field"),
    (lambda: b"not a frame", "undecodable"),
    (lambda: signed(batch(sender="bob"), key=KEYS["alice"]), "bad_signature"),
    (lambda: signed(batch(sender="eve"), key=KEYS["alice"]), "unknown_sender"),
    (lambda: signed(batch(run_id="run-0")), "wrong_run"),
    (lambda: signed(batch(round=0)), "replay"),
    (lambda: signed(batch(round=2)), "wrong_round"),
    (lambda: signed(batch(groups=(group(),) * 6)), "too_large"),
    (lambda: signed(batch(tokenizer_fp="tok-b", groups=(group(texts=False),))), "wrong_tokenizer"),
])
def test_rejection_reasons(make, expected):
    ib = inbox(tokenizer_fp="tok-a", max_tokens=12)
    assert reason(ib, make(), expected_round=1) == expected
    assert ib.metrics() == {f"offpolicy/rejected/{expected}": 1}


def test_other_tokenizer_with_texts_is_accepted_at_sequence_level():
    ib = inbox(tokenizer_fp="tok-a")
    a = ib.accept(sign_batch(batch(tokenizer_fp="tok-b"), KEYS["alice"]))
    assert not a.token_level
    assert ib.counts["accepted_sequence_level"] == 1
    # the server (no tokenizer of its own) does not classify
    assert Inbox(DIRECTORY).accept(sign_batch(batch(tokenizer_fp="tok-b", seq=2), KEYS["alice"])).token_level


def test_replays_are_rejected_and_state_resumes(tmp_path):
    ib = inbox()
    frame = sign_batch(batch(round=1, seq=5), KEYS["alice"])
    ib.accept(frame, expected_round=1)
    assert reason(ib, frame, expected_round=1) == "replay"                              # same batch twice
    assert reason(ib, sign_batch(batch(round=1, seq=4), KEYS["alice"])) == "replay"     # older seq
    assert reason(ib, frame, expected_round=2) == "replay"                              # an old round's batch
    (tmp_path / "guard.json").write_text(ib.guard.to_json())          # as participant.json / server_state.json
    resumed = Inbox(DIRECTORY, InboxConfig(run_id="run-1"), ReplayGuard.from_json((tmp_path / "guard.json").read_text()))
    assert reason(resumed, frame) == "replay"
    assert resumed.accept(sign_batch(batch(round=2, seq=6), KEYS["alice"]), expected_round=2)


def test_a_rejected_signed_frame_uses_up_its_sequence_number():
    """Once its signature holds, a frame's seq is spent whatever happens next: resending it (or any
    frame with that seq) is a replay, so a costly rejection cannot be replayed at the receiver."""
    ib = inbox(tokenizer_fp="tok-a")
    bad = signed(batch(seq=3, groups=(group(lps=((-0.1, 3.0), (-0.5,))),)))
    assert reason(ib, bad) == "positive_logprob"
    assert reason(ib, bad) == "replay"
    assert reason(ib, sign_batch(batch(seq=3), KEYS["alice"])) == "replay"
    assert ib.accept(sign_batch(batch(seq=4), KEYS["alice"])).batch.seq == 4
    # a frame refused before its signature holds spends nothing (anyone can send those)
    forged = signed(batch(seq=5), key=KEYS["bob"])
    assert reason(ib, forged) == "bad_signature"
    assert ib.accept(sign_batch(batch(seq=5), KEYS["alice"])).batch.seq == 5


def test_bad_batches_never_discard_the_good_ones_beside_them():
    ib = inbox(tokenizer_fp="tok-a")
    good_a = sign_batch(batch("alice", seq=1), KEYS["alice"])
    good_b = sign_batch(batch("bob", seq=1), KEYS["bob"])
    nan = signed(batch("bob", seq=2, groups=(group(lps=((-0.1, float("nan")), (-0.5,))),)))
    tampered = bytearray(sign_batch(batch("alice", seq=2), KEYS["alice"]))
    tampered[-100] ^= 1
    items = [good_a, b"\x00" * 10, bytes(tampered), None, good_b, nan, good_a]
    accepted, rejected = ib.accept_many(items, expected_round=1)
    assert [a.frame for a in accepted] == [good_a, good_b]
    assert rejected == {"nonfinite_logprob": 1, "undecodable": 1, "bad_signature": 1, "missing_field": 1,
                        "replay": 1}
    m = ib.metrics()
    assert m["offpolicy/accepted"] == 2 and sum(v for k, v in m.items() if "rejected" in k) == 5


def test_frames_travel_through_flower_records_unchanged():
    frames = [sign_batch(batch("alice"), KEYS["alice"]), sign_batch(batch("bob"), KEYS["bob"])]
    content = put_frames(RecordDict(), frames)
    children = {oid: ConfigRecord.inflate(ch.deflate()) for oid, ch in content.children.items()}
    wire = RecordDict.inflate(content.deflate(), children=children)              # as Flower ships it
    got = get_frames(wire)
    assert got == frames
    assert record_nbytes(content["ftis-batches"]) < sum(map(len, frames)) + 64
    accepted, rejected = inbox().accept_many(got, expected_round=1)
    assert len(accepted) == 2 and rejected == {}
    assert get_frames(put_frames(RecordDict(), [])) == []


def test_flower_records_missing_or_mistyped_are_named():
    with pytest.raises(BatchValidationError) as e:
        get_frames(RecordDict())
    assert e.value.reason == "missing_field"
    with pytest.raises(BatchValidationError) as e:
        frames_from_record(ConfigRecord({"frames": ["text, not bytes"]}))
    assert e.value.reason == "missing_field"
    with pytest.raises(BatchValidationError) as e:
        frames_from_record(ConfigRecord({"frames": [b"x"] * 3}), max_frames=2)
    assert e.value.reason == "too_large"


def test_frame_counts_keep_two_rounds_and_scan_once_per_round():
    """``Inbox._count_frame`` keeps exactly the entries the per-frame scan kept (this round's and the
    previous one's, and late ones until a later frame drops them), scanning its table once per new
    round, not once per frame (4,096 senders: ~8,000 entries scanned for each of 4,096 frames)."""
    import random
    from collections import Counter

    from ftis_fed.trust.inbox import Inbox

    class Scans(Counter):
        scans = 0

        def __iter__(self):
            Scans.scans += 1
            return super().__iter__()

    def reference(seen: Counter, sender: str, rnd: int) -> None:          # the per-frame scan
        seen[(sender, rnd)] += 1
        for k in [k for k in seen if k[1] < rnd - 1]:
            del seen[k]

    rng = random.Random(3)
    box, ref = Inbox({}), Counter()
    for step in range(3000):
        rnd = 1 + step // 500 - (rng.random() < 0.05) * rng.randint(1, 3)   # mostly in order, some late
        sender = f"p{rng.randrange(400)}"
        box._count_frame(sender, rnd)
        reference(ref, sender, rnd)
        assert box.frames_seen == ref, step
    box = Inbox({})
    box.frames_seen = Scans()
    for rnd in (1, 2, 3):
        for i in range(1000):
            box._count_frame(f"p{i}", rnd)
    assert Scans.scans <= 3 and len(box.frames_seen) == 2000
