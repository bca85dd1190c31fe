"""``ftis-fed deploy check`` / ``deploy cert`` on loopback, with real TLS (certificates made with
``cryptography``, a TLS listener from Python's ``ssl``) and, in the slow tier, a real SuperLink with
SuperNode authentication: an expired certificate, a wrong CA, a wrong host and an unregistered
SuperNode key are each named, with the details the operator needs."""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
import ssl
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from ftis_fed.commands.deploy import CheckFailed, check_certificate, check_tls

ROOT = Path(__file__).resolve().parent.parent
NOW = datetime.datetime.now(datetime.timezone.utc)
DAY = datetime.timedelta(days=1)


def make_ca(d: Path, name: str = "test CA") -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(NOW - 10 * DAY)
            .not_valid_after(NOW + 10 * DAY)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                         crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    d.mkdir(parents=True, exist_ok=True)
    (d / "ca.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return key, cert


def make_server_cert(d: Path, ca: tuple, hosts: list[str], not_before, not_after) -> tuple[Path, Path]:
    ca_key, ca_cert = ca
    key = ec.generate_private_key(ec.SECP256R1())
    names = []
    for h in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            names.append(x509.DNSName(h))
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
            .issuer_name(ca_cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(not_before).not_valid_after(not_after)
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    d.mkdir(parents=True, exist_ok=True)
    (d / "server.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (d / "server.key").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                     serialization.NoEncryption()))
    return d / "server.crt", d / "server.key"


class TlsListener:
    """A TLS server on 127.0.0.1 that completes handshakes with the given certificate (and nothing else)."""

    def __init__(self, cert: Path, key: Path):
        self.ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.ctx.load_cert_chain(cert, key)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            try:
                with self.ctx.wrap_socket(conn, server_side=True):
                    pass
            except (OSError, ssl.SSLError):
                pass

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def pki(tmp_path):
    ca = make_ca(tmp_path / "ca")
    listeners = []

    def serve(hosts, not_before=NOW - DAY, not_after=NOW + DAY, name="srv"):
        listener = TlsListener(*make_server_cert(tmp_path / name, ca, hosts, not_before, not_after))
        listeners.append(listener)
        return listener

    yield tmp_path, serve
    for listener in listeners:
        listener.close()


def deploy_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ftis_fed.commands.cli", "deploy", *args], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_a_good_certificate_passes_and_says_what_it_checked(pki):
    tmp, serve = pki
    srv = serve(["127.0.0.1", "localhost"])
    line = check_tls(srv.address, tmp / "ca" / "ca.crt")
    assert line.startswith(f"TLS ok: {srv.address} presents a certificate for localhost, 127.0.0.1") and "valid until" in line


def test_an_expired_certificate_is_named_with_its_end_date(pki):
    tmp, serve = pki
    srv = serve(["127.0.0.1"], NOW - 10 * DAY, NOW - 2 * DAY)
    with pytest.raises(CheckFailed, match=rf"^{srv.address}: the SuperLink's certificate expired on "
                                          rf"{(NOW - 2 * DAY):%Y-%m-%d}"):
        check_tls(srv.address, tmp / "ca" / "ca.crt")
    r = deploy_cli("check", "--superlink", srv.address, "--root-certificates", str(tmp / "ca" / "ca.crt"))
    assert r.returncode == 1 and "certificate expired on" in r.stderr and "Traceback" not in r.stderr


def test_a_wrong_ca_is_named_with_the_certificates_issuer(pki):
    tmp, serve = pki
    srv = serve(["127.0.0.1"])
    make_ca(tmp / "other", "another CA")
    with pytest.raises(CheckFailed, match=rf"^{srv.address}: unknown CA: the SuperLink's certificate \(issued by "
                                          r"CN=test CA\) is not signed by a CA in .*other/ca.crt"):
        check_tls(srv.address, tmp / "other" / "ca.crt")


def test_a_wrong_host_is_named_with_the_names_the_certificate_holds(pki):
    tmp, serve = pki
    srv = serve(["superlink.example.org"])
    with pytest.raises(CheckFailed, match=rf"^{srv.address}: wrong host: the SuperLink's certificate is for "
                                          r"superlink.example.org, not 127.0.0.1"):
        check_tls(srv.address, tmp / "ca" / "ca.crt")


def test_nothing_listening_and_a_plain_port_are_told_apart(tmp_path):
    make_ca(tmp_path / "ca")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(CheckFailed, match="connection refused: nothing listens there"):
        check_tls(f"127.0.0.1:{port}", tmp_path / "ca" / "ca.crt")
    with socket.socket() as s:                                   # accepts, then closes: not TLS
        s.bind(("127.0.0.1", 0))
        s.listen()

        def drop():
            c, _ = s.accept()
            c.close()

        threading.Thread(target=drop, daemon=True).start()
        with pytest.raises(CheckFailed, match=r"127.0.0.1:\d+: (the TLS handshake failed|cannot connect)"):
            check_tls(f"127.0.0.1:{s.getsockname()[1]}", tmp_path / "ca" / "ca.crt")


def test_the_certificate_is_checked_before_the_superlink_starts(tmp_path):
    ca = make_ca(tmp_path / "ca")
    good, _ = make_server_cert(tmp_path / "good", ca, ["127.0.0.1", "superlink.example.org"], NOW - DAY, NOW + DAY)
    assert check_certificate(good, ["127.0.0.1", "superlink.example.org"], tmp_path / "ca" / "ca.crt").startswith(
        "certificate ok")
    old, _ = make_server_cert(tmp_path / "old", ca, ["127.0.0.1"], NOW - 5 * DAY, NOW - DAY)
    make_ca(tmp_path / "other", "another CA")
    with pytest.raises(CheckFailed) as e:
        check_certificate(old, ["127.0.0.1", "203.0.113.7"], tmp_path / "other" / "ca.crt")
    msg = str(e.value)
    assert f"it expired on {(NOW - DAY):%Y-%m-%d}" in msg and "it does not name 203.0.113.7 (it names 127.0.0.1)" in msg
    assert "it is not signed by the CA in" in msg
    r = deploy_cli("cert", "127.0.0.1", "--ssl-certfile", str(old))
    assert r.returncode == 1 and r.stderr.startswith("ftis-fed deploy cert: --ssl-certfile") and "expired" in r.stderr


def test_keys_tls_refuses_a_negative_validity_in_one_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "ftis_fed.commands.cli", "keys", "tls", "127.0.0.1", "--dir",
                        str(tmp_path / "c"), "--days", "-1"], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip() == ("ftis-fed keys tls: error: --days -1: must be in [1, 3650] (the certificates are "
                                "valid from now for that many days; an expired certificate makes every SuperNode's "
                                "TLS handshake fail)")
    assert not (tmp_path / "c").exists()


@pytest.mark.slow                       # a real SuperLink over TLS with SuperNode authentication: ~30 s
def test_an_unregistered_supernode_key_is_named_by_its_fingerprint(tmp_path):
    """A real flower-superlink (TLS, --enable-supernode-auth): alice's SuperNode key is refused with
    its fingerprint before registration, and reported with its node id after it; the check leaves
    the node offline (flwr supernode ls)."""
    from deploy_helpers import Deployment, make_tls

    from ftis_fed.trust.deploy_keys import load_supernode_public_key, supernode_fingerprint

    with Deployment(tmp_path) as dep:
        make_tls(tmp_path / "tls")
        printed = dep.exchange_keys(["alice"])
        dep.superlink()
        key = tmp_path / "alice" / "keys" / "supernode" / "alice.key"
        fp = supernode_fingerprint(load_supernode_public_key(key.with_suffix(".pub")))
        args = ["check", "--superlink", dep.address, "--root-certificates", str(dep.ca),
                "--auth-supernode-private-key", str(key)]
        r = deploy_cli(*args)
        assert r.returncode == 1, r.stdout + r.stderr
        assert r.stdout.startswith(f"TLS ok: {dep.address}")
        assert f"SuperNode key {fp} ({key}) is not registered at this SuperLink" in r.stderr
        node_id = dep.register(printed["alice"])
        r = deploy_cli(*args)
        assert r.returncode == 0, r.stdout + r.stderr
        assert f"SuperNode key ok: {fp} is registered as node {node_id}" in r.stdout
        assert dep.nodes().get(node_id) != "online"
