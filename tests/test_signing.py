"""Ed25519 keys, key directory, sign/verify with real cryptography, replay guard, revocation,
SuperNode keys (read back with Flower's own loaders), keys CLI."""

from __future__ import annotations

import argparse
import os
import stat

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ftis_fed.wire.batch import BatchValidationError, CompletionBatch, SamplingParams, make_group
from ftis_fed.trust.inbox import Inbox, InboxConfig
from ftis_fed.trust.deploy_keys import (add_cli, generate_supernode_keypair, generate_tls, load_supernode_public_key,
                                        supernode_fingerprint)
from ftis_fed.trust.signing import (
    KeyDirectory,
    ReplayGuard,
    RevocationList,
    fingerprint,
    generate_keypair,
    load_key_directory,
    load_private_key,
    load_public_key,
    parse_revocations,
    raw_public,
    read_revocations,
    sign_batch,
    sign_body,
    verify_frame,
)
from ftis_fed.wire.codec import (HEADER_FIELDS, WireOptions, decode_payload, encode_body, header_offset, parse_header,
                           send_options)


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


def test_an_expected_sender_is_checked_before_any_key(keydir):
    """The server knows who sent a reply (the node's hello): a frame naming anyone else is
    sender_mismatch, even one validly signed by that other participant."""
    keys = load_key_directory(keydir)
    frame = sign_batch(batch(), load_private_key(keydir / "private" / "alice.key"))
    assert verify_frame(frame, keys, expected_sender="alice")[0].sender == "alice"
    with pytest.raises(BatchValidationError) as e:
        verify_frame(frame, keys, expected_sender="bob")
    assert e.value.reason == "sender_mismatch"


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


@pytest.mark.parametrize("options", [WireOptions(version=1), WireOptions(), send_options(False), send_options(True)])
def test_every_flipped_byte_is_rejected(keydir, options):
    """Header fields, payload, signature: a single bit flipped anywhere never verifies (v1, v2 with
    prompt ids, v2 as participants send it: prompt digest, dictionary)."""
    keys = load_key_directory(keydir)
    frame = sign_batch(batch(), load_private_key(keydir / "private" / "alice.key"), options)
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
    frame = sign_batch(batch(), load_private_key(keydir / "private" / "alice.key"), WireOptions(version=1))
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
    assert _reject(g, "r", "alice", 2, 2**64 - 1) == "bad_header"          # would end alice's seq space
    assert _reject(g, "r", "alice", 2, 2**63) == "bad_header"
    g.check("r", "alice", 2, 2**63 - 1)


def test_replay_guard_state_survives_a_restart(tmp_path):
    g = ReplayGuard()
    g.commit("r", "alice", 3, 30)
    g.commit("r", "bob", 3, 7)
    g2 = ReplayGuard.from_json(g.to_json())          # what the server and participants persist
    assert g2.last("r", "alice") == (3, 30) and g2.last("r", "bob") == (3, 7)
    assert _reject(g2, "r", "alice", 3, 30) == "replay"
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


# ------------------------------------------------------------------------------------ revocation

def _revoke_file(keydir, *lines):
    (keydir / "revoked.txt").write_text("".join(line + "\n" for line in lines))


def test_revocation_file_format(tmp_path):
    fp = "ed25519:0123456789abcdef"
    assert parse_revocations(f"# revoked keys\n\n{fp.upper().replace('ED25519', 'ed25519')}  # alice, lost laptop\n") \
        == {fp}
    with pytest.raises(ValueError, match=r"line 2: 'alice' is not a key fingerprint"):
        parse_revocations(f"{fp}\nalice\n", "revoked.txt")
    with pytest.raises(ValueError, match="line 1"):
        parse_revocations("ed25519:0123\n")                                    # too short
    assert read_revocations(tmp_path / "missing.txt") == frozenset()


def test_key_directory_reads_revoked_txt_next_to_public(keydir):
    keys = load_key_directory(keydir / "public")                              # as the server and workers call it
    assert keys.revocations.path == keydir / "revoked.txt"
    assert keys.revoked() == frozenset() and not keys.is_revoked("alice")
    alice_fp = keys.fingerprints()["alice"]
    _revoke_file(keydir, f"{alice_fp}  # alice")
    assert keys.is_revoked("alice") and keys.is_revoked(alice_fp)             # picked up without reloading
    assert not keys.is_revoked("bob") and not keys.is_revoked("nobody")
    assert keys.revoked_participants() == ["alice"]
    assert load_key_directory(keydir, revocations=keydir / "other.txt").revoked() == frozenset()


def test_revocation_list_reloads_on_change_and_keeps_the_last_good_list(tmp_path):
    path = tmp_path / "revoked.txt"
    a, b = "ed25519:" + "a" * 16, "ed25519:" + "b" * 16
    rl = RevocationList(path)
    assert rl.revoked() == frozenset()
    path.write_text(a + "\n")
    assert rl.is_revoked(a) and not rl.is_revoked(b)
    path.write_text(f"{a}\n{b}\n")
    assert rl.revoked() == {a, b}
    path.write_text(f"{a}\nnot a fingerprint\n")                              # a broken edit mid-run
    with pytest.warns(RuntimeWarning, match="line 2"):
        assert rl.revoked() == {a, b}                                         # nothing un-revoked by accident
    assert "line 2" in rl.error
    path.write_text(b + "\n")
    assert rl.revoked() == {b} and rl.error is None
    path.unlink()                                                             # deleting the file lifts them
    assert rl.revoked() == frozenset()
    path.write_text("junk\n")
    with pytest.raises(ValueError, match="line 1"):
        RevocationList(path)                                                  # at start: a configuration error


def test_a_batch_signed_by_a_revoked_key_is_rejected_mid_run(keydir):
    """Through the real receive path: the revocation takes effect at the next frame, without a
    restart; a rejected frame does not use up the sender's sequence number; others are unaffected."""
    keys = load_key_directory(keydir / "public")
    alice = load_private_key(keydir / "private" / "alice.key")
    bob = load_private_key(keydir / "private" / "bob.key")
    inbox = Inbox(keys, InboxConfig(run_id="run-1"))
    assert inbox.accept(sign_batch(batch(round=1, seq=1), alice), expected_round=1).sender == "alice"
    _revoke_file(keydir, "# compromised", f"{fingerprint(alice)}  # alice")
    frame = sign_batch(batch(round=2, seq=2), alice)
    with pytest.raises(BatchValidationError) as e:
        inbox.accept(frame, expected_round=2)
    assert e.value.reason == "revoked_key" and "revoked" in str(e.value)
    assert inbox.counts["rejected/revoked_key"] == 1
    assert inbox.guard.last("run-1", "alice") == (1, 1)
    # a revoked sender's frame with a broken signature is still a bad signature (checked first)
    assert _reason(frame[:-1] + bytes([frame[-1] ^ 1]), keys) == "bad_signature"
    assert inbox.accept(sign_batch(batch("bob", round=2, seq=1), bob), expected_round=2).sender == "bob"
    # un-revoked: alice's same frame is accepted again
    _revoke_file(keydir, "# nothing revoked")
    assert inbox.accept(frame, expected_round=2).sender == "alice"
    # a plain mapping of keys (no revocation file) verifies as before
    assert verify_frame(frame, dict(keys))[0].sender == "alice"


# ------------------------------------------------------------------------------ SuperNode keys

def test_supernode_keys_load_with_flowers_own_loaders(tmp_path):
    """The key files are read by the same Flower 1.42 functions `flwr supernode register` and
    `flower-supernode --auth-supernode-private-key` use."""
    from flwr.cli.supernode.register import try_load_public_key
    from flwr.supercore.primitives.asymmetric import public_key_to_bytes
    from flwr.supernode.cli.flower_supernode import _try_setup_client_authentication

    paths = generate_supernode_keypair("alice", tmp_path)
    assert stat.S_IMODE(paths.private.stat().st_mode) == 0o600
    assert stat.S_IMODE(paths.private.parent.stat().st_mode) == 0o700
    assert paths.public.read_text().startswith("ecdsa-sha2-nistp384 ")
    private, public = _try_setup_client_authentication(
        argparse.Namespace(auth_supernode_private_key=str(paths.private), auth_supernode_public_key=None))
    assert try_load_public_key(paths.public) == public_key_to_bytes(public)   # the registered key is this node's
    with pytest.raises(FileExistsError):
        generate_supernode_keypair("alice", tmp_path)
    again = generate_supernode_keypair("alice", tmp_path, overwrite=True)
    assert try_load_public_key(again.public) != public_key_to_bytes(public)


def test_supernode_fingerprint_is_ssh_keygens(tmp_path):
    import shutil
    import subprocess

    if shutil.which("ssh-keygen") is None:
        pytest.skip("ssh-keygen not installed")
    paths = generate_supernode_keypair("alice", tmp_path)
    out = subprocess.run(["ssh-keygen", "-lf", str(paths.public)], capture_output=True, text=True).stdout
    assert supernode_fingerprint(load_supernode_public_key(paths.public)) == out.split()[1]


def test_keys_cli_generate_prints_registration_and_revokes(tmp_path, capsys):
    ap = argparse.ArgumentParser()
    add_cli(ap.add_subparsers(dest="command"))
    d = tmp_path / "keys"

    def run(*argv):
        args = ap.parse_args(["keys", *argv])
        assert args.func(args) == 0
        return capsys.readouterr().out

    out = run("generate", "alice", "--dir", str(d), "--connection", "lab", "--superlink", "link.example:9093")
    sn = d / "supernode" / "alice.pub"
    assert f"flwr supernode register {sn} lab --name alice" in out
    assert f"--auth-supernode-private-key {d / 'supernode' / 'alice.key'}" in out
    assert "--superlink link.example:9093" in out and "participant='alice'" in out
    assert (d / "private" / "alice.key").exists() and sn.exists()
    run("generate", "bob", "--dir", str(d), "--no-supernode")
    assert not (d / "supernode" / "bob.pub").exists()
    assert "register" in run("show", "alice", "--dir", str(d))
    fp = fingerprint(load_key_directory(d)["alice"])
    assert fp in run("revoke", "alice", "--dir", str(d), "--note", "laptop lost")
    assert "laptop lost" in (d / "revoked.txt").read_text()
    listing = run("list", "--dir", str(d))
    assert f"alice\t{fp}\tREVOKED" in listing and "bob\ted25519:" in listing and listing.count("REVOKED") == 1
    assert load_key_directory(d / "public").revoked_participants() == ["alice"]
    args = ap.parse_args(["keys", "revoke", "carol", "--dir", str(d)])   # one line and exit 2, no traceback
    assert args.func(args) == 2
    assert capsys.readouterr().err.startswith("ftis-fed keys revoke: error: participant 'carol': no public key in")


def test_tls_files_make_a_real_handshake_for_the_named_hosts(tmp_path):
    """`ftis-fed keys tls 127.0.0.1 localhost`: a client trusting only ca.crt completes a TLS
    handshake with a server using server.crt/server.key, for 127.0.0.1 and not for another name."""
    import socket
    import ssl
    import threading

    f = generate_tls(tmp_path / "certs", ["127.0.0.1", "localhost"], days=2)
    assert stat.S_IMODE(f.server_key.stat().st_mode) == 0o600 and stat.S_IMODE(f.ca_key.stat().st_mode) == 0o600
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(f.server_cert, f.server_key)
    client_ctx = ssl.create_default_context(cafile=str(f.ca_cert))
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(2)
        port = listener.getsockname()[1]

        def serve():
            for _ in range(2):
                conn, _ = listener.accept()
                try:
                    with server_ctx.wrap_socket(conn, server_side=True) as tls:
                        tls.sendall(b"ok")
                except (ssl.SSLError, OSError):
                    pass

        t = threading.Thread(target=serve, daemon=True)
        t.start()
        with socket.create_connection(("127.0.0.1", port)) as raw, \
                client_ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
            assert tls.recv(2) == b"ok"
        with socket.create_connection(("127.0.0.1", port)) as raw, pytest.raises(ssl.SSLCertVerificationError):
            client_ctx.wrap_socket(raw, server_hostname="superlink.example.org")
        t.join(timeout=10)
    with pytest.raises(FileExistsError):
        generate_tls(tmp_path / "certs", ["127.0.0.1"])


def test_a_shared_key_directory_is_parsed_once_until_a_key_file_changes(tmp_path, monkeypatch):
    """#31: the 32 participants a worker hosts each parsed all N public keys at their hello (N^2
    parses a run). ``shared_key_directory`` parses the folder once per process and reads it anew
    when a key file is added, removed or rewritten."""
    from pathlib import Path

    from ftis_fed.trust import signing

    for name in ("alice", "bob"):
        generate_keypair(name, tmp_path / "keys")
    parsed = []
    real = signing.load_public_key
    monkeypatch.setattr(signing, "load_public_key", lambda p: parsed.append(Path(p).stem) or real(p))
    signing._SHARED_DIRS.clear()
    first = signing.shared_key_directory(tmp_path / "keys" / "public")
    assert signing.shared_key_directory(tmp_path / "keys" / "public") is first
    assert sorted(parsed) == ["alice", "bob"] and sorted(first) == ["alice", "bob"]
    generate_keypair("carol", tmp_path / "keys")                     # a key added: read anew
    again = signing.shared_key_directory(tmp_path / "keys" / "public")
    assert again is not first and sorted(again) == ["alice", "bob", "carol"]
    old_bob = again["bob"]
    generate_keypair("bob", tmp_path / "keys", overwrite=True)      # a key rewritten: read anew
    fresh = signing.shared_key_directory(tmp_path / "keys" / "public")
    assert fingerprint(fresh["bob"]) != fingerprint(old_bob)        # bob's new key, not the cached one
    signing._SHARED_DIRS.clear()
