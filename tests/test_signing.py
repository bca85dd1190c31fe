"""Ed25519 keys, key directory, sign/verify with real cryptography, replay guard, keys CLI."""

from __future__ import annotations

import argparse
import os
import stat

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ftis_fed.batch import BatchValidationError, CompletionBatch, SamplingParams, make_group
from ftis_fed.signing import (
    KeyDirectory,
    ReplayGuard,
    add_cli,
    fingerprint,
    generate_keypair,
    load_key_directory,
    load_private_key,
    load_public_key,
    raw_public,
    sign_batch,
    sign_body,
    verify_frame,
)
from ftis_fed.wire import HEADER_FIELDS, decode_payload, encode_body, header_offset, parse_header


def batch(sender: str = "alice", round: int = 1, seq: int = 1) -> CompletionBatch:
    g = make_group([1, 2, 3], [[4, 5], [6]], [[-0.1, -2.0], [-0.5]], [1.0, 0.0], "add/id/0", "7",
                   "What is 3 + 4?", ["7", "six"])
    return CompletionBatch(sender, "run-1", round, seq, "smollm2", "tok-a", 49152, SamplingParams(0.7), (g,))


@pytest.fixture
def keydir(tmp_path):
    for p in ("alice", "bob"):
        generate_keypair(p, tmp_path)
    return tmp_path


def test_generate_keypair_layout_and_permissions(keydir):
    priv, pub = keydir / "private" / "alice.key", keydir / "public" / "alice.pub"
    assert stat.S_IMODE(priv.stat().st_mode) == 0o600
    assert stat.S_IMODE((keydir / "private").stat().st_mode) == 0o700
    assert pub.read_bytes().startswith(b"-----BEGIN PUBLIC KEY-----")
    key = load_private_key(priv)
    assert raw_public(key.public_key()) == raw_public(load_public_key(pub))
    with pytest.raises(FileExistsError):
        generate_keypair("alice", keydir)
    generate_keypair("alice", keydir, overwrite=True)
    assert raw_public(load_private_key(priv).public_key()) != raw_public(key.public_key())


def test_private_key_readable_by_others_is_refused(keydir):
    priv = keydir / "private" / "alice.key"
    os.chmod(priv, 0o644)
    with pytest.raises(PermissionError, match="chmod 600"):
        load_private_key(priv)
    assert load_private_key(priv, check_permissions=False)


@pytest.mark.parametrize("name", ["", ".hidden", "../x", "a/b", "x" * 65, "-rf"])
def test_participant_names_are_file_safe(tmp_path, name):
    with pytest.raises(ValueError):
        generate_keypair(name, tmp_path)


def test_key_directory_loading(keydir):
    keys = load_key_directory(keydir)
    assert list(keys) == ["alice", "bob"] and len(keys) == 2
    assert list(load_key_directory(keydir / "public")) == ["alice", "bob"]
    # a raw hex public key file is accepted too
    extra = Ed25519PrivateKey.generate()
    (keydir / "public" / "carol.pub").write_text(raw_public(extra.public_key()).hex() + "\n")
    assert fingerprint(load_key_directory(keydir)["carol"]) == fingerprint(extra)


def test_one_key_cannot_be_registered_for_two_participants(keydir):
    (keydir / "public" / "mallory.pub").write_bytes((keydir / "public" / "alice.pub").read_bytes())
    with pytest.raises(ValueError, match="also registered"):
        load_key_directory(keydir)


def test_sign_verify_round_trip(keydir):
    keys = load_key_directory(keydir)
    frame = sign_batch(batch(), load_private_key(keydir / "private" / "alice.key"))
    h, body = verify_frame(frame, keys)
    assert (h.sender, h.run_id, h.round, h.seq) == ("alice", "run-1", 1, 1)
    assert np.array_equal(decode_payload(h, body).groups[0].completion_ids[0], [4, 5])


def test_sign_batch_validates_first(keydir):
    b = batch()
    g = b.groups[0]
    nan_group = make_group(g.prompt_ids, [[1]], [[float("nan")]], [0.0], "t", "r")
    bad = CompletionBatch(**{**b.__dict__, "groups": (nan_group,)})
    with pytest.raises(BatchValidationError) as e:
        sign_batch(bad, Ed25519PrivateKey.generate())
    assert e.value.reason == "nonfinite_logprob"


def _reason(frame, keys) -> str:
    with pytest.raises(BatchValidationError) as e:
        h, body = verify_frame(frame, keys)
        decode_payload(h, body).validate()
    return e.value.reason


def test_every_flipped_byte_is_rejected(keydir):
    """Header fields, payload, signature: a single bit flipped anywhere never verifies."""
    keys = load_key_directory(keydir)
    frame = sign_batch(batch(), load_private_key(keydir / "private" / "alice.key"))
    reasons = set()
    for i in range(len(frame)):
        for bit in (0x01, 0x80):
            bad = bytearray(frame)
            bad[i] ^= bit
            reasons.add(_reason(bytes(bad), keys))
    assert reasons <= {"bad_signature", "undecodable", "unsupported_version", "unknown_sender", "too_large"}
    assert "bad_signature" in reasons


@pytest.mark.parametrize("field", [n for n, _ in HEADER_FIELDS] + ["sender", "run_id", "model_id",
                                                                   "tokenizer_fp", "payload", "signature"])
def test_each_field_tampered_is_rejected(keydir, field):
    keys = load_key_directory(keydir)
    frame = sign_batch(batch(), load_private_key(keydir / "private" / "alice.key"))
    h = parse_header(frame)
    fixed = header_offset("len_tokenizer_fp")[0] + 2                      # strings follow: alice, run-1, smollm2, ...
    strings = {"sender": fixed, "run_id": fixed + 5, "model_id": fixed + 10, "tokenizer_fp": fixed + 17}
    pos = (header_offset(field)[0] if field not in strings and field not in ("payload", "signature")
           else strings.get(field, h.body_len - h.payload_len if field == "payload" else h.body_len))
    for i in (pos, pos + 1):
        bad = bytearray(frame)
        bad[i] ^= 0x04
        assert _reason(bytes(bad), keys) in {"bad_signature", "undecodable", "unsupported_version",
                                             "unknown_sender", "too_large"}


def test_relay_cannot_forge_or_alter(keydir):
    """The server (no participant key) re-encodes a changed batch and signs it with its own key."""
    keys = load_key_directory(keydir)
    server_key = Ed25519PrivateKey.generate()
    alice = load_private_key(keydir / "private" / "alice.key")
    honest = sign_batch(batch(), alice)
    altered = batch()
    altered = CompletionBatch(**{**altered.__dict__, "round": 2})
    assert _reason(sign_batch(altered, server_key), keys) == "bad_signature"          # forged
    assert _reason(encode_body(altered) + honest[-64:], keys) == "bad_signature"      # old signature
    # alice cannot sign in bob's name
    assert _reason(sign_batch(batch(sender="bob"), alice), keys) == "bad_signature"
    # a key nobody registered
    assert _reason(sign_batch(batch(sender="eve"), server_key), keys) == "unknown_sender"
    # a signature from another, valid frame of the same sender
    other = sign_batch(batch(seq=2), alice)
    assert _reason(honest[:-64] + other[-64:], keys) == "bad_signature"


def test_sign_body_equals_sign_batch(keydir):
    alice = load_private_key(keydir / "private" / "alice.key")
    b = batch()
    assert sign_body(encode_body(b), alice) == sign_batch(b, alice)                    # Ed25519 is deterministic


# ---------------------------------------------------------------------------------- replay guard

def _reject(guard, *args, **kw) -> str:
    with pytest.raises(BatchValidationError) as e:
        guard.check(*args, **kw)
    return e.value.reason


def test_replay_guard_rules():
    g = ReplayGuard()
    g.check("r", "alice", 1, 10, expected_round=1)
    g.commit("r", "alice", 1, 10)
    assert _reject(g, "r", "alice", 1, 10) == "replay"                     # same batch twice
    assert _reject(g, "r", "alice", 2, 9) == "replay"                      # old seq
    assert _reject(g, "r", "alice", 0, 11) == "replay"                     # older round than accepted
    assert _reject(g, "r", "alice", 1, 11, expected_round=2) == "replay"   # an old round's batch
    assert _reject(g, "r", "alice", 3, 11, expected_round=2) == "wrong_round"
    g.check("r", "alice", 2, 11, expected_round=2)
    g.check("r", "bob", 1, 10)                                             # other sender: own counter
    g.check("r2", "alice", 1, 1)                                           # other run: own counter
    assert g.last("r", "alice") == (1, 10)


def test_replay_guard_state_survives_a_restart(tmp_path):
    g = ReplayGuard()
    g.commit("r", "alice", 3, 30)
    g.commit("r", "bob", 3, 7)
    path = tmp_path / "state" / "replay.json"
    g.save(path)
    g2 = ReplayGuard.load(path)
    assert g2.last("r", "alice") == (3, 30) and g2.last("r", "bob") == (3, 7)
    assert _reject(g2, "r", "alice", 3, 30) == "replay"
    assert ReplayGuard.load(tmp_path / "missing.json").last("r", "alice") is None
    with pytest.raises(ValueError):
        ReplayGuard.from_json('{"format": "other"}')


# ------------------------------------------------------------------------------------------ CLI

def test_keys_cli(tmp_path, capsys):
    ap = argparse.ArgumentParser()
    add_cli(ap.add_subparsers(dest="command"))
    d = str(tmp_path / "keys")
    for argv in (["keys", "generate", "alice", "bob", "--dir", d], ["keys", "list", "--dir", d],
                 ["keys", "show", "alice", "--dir", d]):
        args = ap.parse_args(argv)
        assert args.func(args) == 0
    out = capsys.readouterr().out
    fp = fingerprint(load_key_directory(d)["alice"])
    assert out.count(fp) == 3 and "BEGIN PUBLIC KEY" in out
    assert isinstance(load_key_directory(d), KeyDirectory)
