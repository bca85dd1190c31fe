"""``ftis-fed keys``: an organisation's two key pairs, the SuperLink's TLS files, revocation, and
the commands that use them.

Each participant (organisation) holds two key pairs with different jobs:

* its **Ed25519 signing key** (``<dir>/private/<p>.key``, ``<dir>/public/<p>.pub``, see
  :mod:`ftis_fed.trust.signing`): signs every completion batch end to end. The server and every receiver
  verify the batch with this public key, so the relaying server can neither forge nor alter it.
* its **SuperNode authentication key** (``<dir>/supernode/<p>.key`` / ``.pub``): Flower's own node
  authentication. The SuperNode signs a timestamp with it on every Fleet API request; a SuperLink
  started with ``--enable-supernode-auth`` admits only SuperNodes whose public key its operator
  registered with ``flwr supernode register``. It authenticates the *node* to the *SuperLink*
  (transport), and proves nothing to the other participants.

The SuperNode key is in the format Flower 1.42 reads: an EC key on NIST P-384 (the curve Flower
generates itself; ``flwr supernode register`` accepts any NIST curve), private half in OpenSSH
format (``flower-supernode --auth-supernode-private-key`` loads it with ``load_ssh_private_key``),
public half as one OpenSSH line ``ecdsa-sha2-nistp384 AAAA... <comment>`` (what ``flwr supernode
register`` loads with ``load_ssh_public_key``). ``ssh-keygen -t ecdsa -b 384 -N "" -f <p>.key``
makes an equivalent pair (its public half in ``<p>.key.pub``).
"""

from __future__ import annotations

import argparse
import base64
import datetime
import hashlib
import ipaddress
import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from ftis_fed.atomic import atomic_write
from ftis_fed.trust.signing import (
    KeyPaths,
    check_participant,
    fingerprint,
    generate_keypair,
    key_paths,
    load_key_directory,
    load_public_key,
    revocation_path,
)

SUPERNODE_CURVE = ec.SECP384R1()


# --------------------------------------------------------------------------------- SuperNode key

def supernode_key_paths(participant: str, key_dir: str | os.PathLike) -> KeyPaths:
    """``<dir>/supernode/<p>.key`` (OpenSSH private, 0600) and ``<dir>/supernode/<p>.pub``."""
    check_participant(participant)
    d = Path(key_dir) / "supernode"
    return KeyPaths(d / f"{participant}.key", d / f"{participant}.pub")


def generate_supernode_keypair(participant: str, out_dir: str | os.PathLike,
                               overwrite: bool = False) -> KeyPaths:
    """A P-384 key pair for Flower's SuperNode authentication (OpenSSH formats, see module doc).

    Refuses to replace an existing key unless ``overwrite``; the private file is created 0600
    in a 0700 folder.
    """
    paths = supernode_key_paths(participant, out_dir)
    if not overwrite and (paths.private.exists() or paths.public.exists()):
        raise FileExistsError(f"{paths.private} or {paths.public} exists: pass overwrite=True (--force) to replace it")
    paths.private.parent.mkdir(parents=True, exist_ok=True)
    os.chmod(paths.private.parent, 0o700)
    key = ec.generate_private_key(SUPERNODE_CURVE)
    private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                serialization.NoEncryption())
    atomic_write(paths.private, private, mode=0o600)
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    paths.public.write_bytes(public + f" ftis-fed-supernode-{participant}\n".encode())
    return paths


def load_supernode_public_key(path: str | os.PathLike) -> ec.EllipticCurvePublicKey:
    """An OpenSSH ``ecdsa-sha2-nistp*`` public key line, as ``flwr supernode register`` reads it."""
    p = Path(path)
    key = serialization.load_ssh_public_key(p.read_bytes())
    if not isinstance(key, ec.EllipticCurvePublicKey):
        raise ValueError(f"{p}: not an EC public key ({type(key).__name__}); Flower's SuperNode "
                         "authentication needs an ECDSA key on a NIST curve")
    return key


def supernode_fingerprint(key: ec.EllipticCurvePublicKey) -> str:
    """``SHA256:<base64>``, the fingerprint ``ssh-keygen -lf <p>.pub`` prints for the same key."""
    blob = key.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH).split()[1]
    digest = hashlib.sha256(base64.b64decode(blob)).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


# ------------------------------------------------------------------------------ TLS (SuperLink)

@dataclass(frozen=True)
class TlsFiles:
    ca_cert: Path          # give to every SuperNode and `flwr` user (--root-certificates / root-certificates)
    ca_key: Path           # keep offline: it can issue certificates the SuperNodes would trust
    server_cert: Path      # flower-superlink --ssl-certfile
    server_key: Path       # flower-superlink --ssl-keyfile


def _write_private(path: Path, data: bytes) -> None:
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)


def generate_tls(out_dir: str | os.PathLike, hosts: list[str], days: int = 365, overwrite: bool = False) -> TlsFiles:
    """A private CA and a SuperLink server certificate for ``hosts`` (IP addresses or DNS names,
    all in its subjectAltName), EC P-256, valid ``days``. For a SuperLink without a certificate
    from an organisation-wide CA; every participant then trusts exactly this CA."""
    if not hosts:
        raise ValueError("hosts: give at least one address or DNS name the SuperNodes will connect to")
    if not 1 <= days <= 3650:
        raise ValueError(f"--days {days}: must be in [1, 3650] (the certificates are valid from now for that "
                         "many days; an expired certificate makes every SuperNode's TLS handshake fail)")
    d = Path(out_dir)
    files = TlsFiles(d / "ca.crt", d / "ca.key", d / "server.crt", d / "server.key")
    if not overwrite and any(p.exists() for p in (files.ca_cert, files.server_cert)):
        raise FileExistsError(f"{files.ca_cert} or {files.server_cert} exists: pass overwrite=True (--force)")
    d.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "ftis-fed SuperLink CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(start).not_valid_after(end)
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                       data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                       crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    names: list[x509.GeneralName] = []
    for h in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            names.append(x509.DNSName(h))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(end)
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    pkcs8 = (serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    _write_private(files.ca_key, ca_key.private_bytes(*pkcs8))
    _write_private(files.server_key, key.private_bytes(*pkcs8))
    files.ca_cert.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    files.server_cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return files


# ------------------------------------------------------------------------- commands to print

def register_command(public_key: str | os.PathLike, connection: str = "lab", name: str | None = None) -> str:
    """What the SuperLink operator runs to admit a SuperNode (``flwr`` reads the connection
    from ``$FLWR_HOME/config.toml``; the address and CA of ``flower.toml``'s entry)."""
    cmd = ["flwr", "supernode", "register", str(public_key), connection]
    if name:
        cmd += ["--name", name]
    return shlex.join(cmd)


def supernode_command(participant: str, key_dir: str | os.PathLike, superlink: str = "superlink.example.org:9093",
                      root_certificates: str = "ca.crt") -> str:
    """The ``flower-supernode`` line for this participant: TLS, its SuperNode key, its node-config."""
    d = Path(key_dir)
    node_config = f"participant='{participant}' keys-dir='{d}' state-dir='{d.parent / 'state'}'"
    quoted = f'"{node_config}"' if not set(node_config) & set('"$`\\') else shlex.quote(node_config)
    return shlex.join(["flower-supernode", "--root-certificates", root_certificates, "--superlink", superlink,
                       "--auth-supernode-private-key", str(supernode_key_paths(participant, d).private),
                       "--node-config"]) + " " + quoted


# ----------------------------------------------------------------------------------- revocation

def revoke(key_dir: str | os.PathLike, who: str, note: str = "") -> str:
    """Append a participant's key fingerprint (or a given ``ed25519:`` fingerprint) to
    ``<dir>/revoked.txt``; returns the fingerprint. The server and receivers that read this
    file reject that key's batches and hellos from their next check on."""
    if who.startswith("ed25519:"):
        fp = who.lower()
        label = who
    else:
        directory = load_key_directory(key_dir)
        if who not in directory:
            raise KeyError(f"participant {who!r}: no public key in {key_dir}/public (give its fingerprint instead)")
        fp = fingerprint(directory[who])
        label = who
    path = revocation_path(key_dir)
    existing = path.read_text() if path.exists() else ""
    line = f"{fp}  # {label}" + (f": {note}" if note else "") + "\n"
    with path.open("a") as fh:
        if existing and not existing.endswith("\n"):
            fh.write("\n")
        fh.write(line)
    load_key_directory(key_dir).revoked()                # the file still parses
    return fp


# ------------------------------------------------------------------------------------------- CLI

def add_cli(subparsers) -> argparse.ArgumentParser:
    """Add ``keys generate|list|show|tls|revoke`` to an argparse subparsers object; handler in ``func``."""
    keys = subparsers.add_parser("keys", help="participants' Ed25519 signing keys and SuperNode keys")
    sub = keys.add_subparsers(dest="keys_command", required=True)
    gen = sub.add_parser("generate", help="create the Ed25519 signing key pair (private/<p>.key 0600, "
                                          "public/<p>.pub) and the SuperNode key pair (supernode/<p>.key, .pub)")
    gen.add_argument("participants", nargs="+", help="participant ids")
    gen.add_argument("--dir", default="keys", help="key directory (default: keys)")
    gen.add_argument("--force", action="store_true", help="replace existing keys")
    gen.add_argument("--no-supernode", action="store_true", help="only the Ed25519 signing key")
    gen.add_argument("--connection", default="lab", help="SuperLink connection name for the printed "
                                                         "`flwr supernode register` command (default: lab)")
    gen.add_argument("--superlink", default="superlink.example.org:9093",
                     help="SuperLink address for the printed flower-supernode command")
    gen.add_argument("--root-certificates", default="ca.crt", help="CA file for the printed flower-supernode command")
    ls = sub.add_parser("list", help="registered public keys, fingerprints, revoked or not")
    ls.add_argument("--dir", default="keys")
    show = sub.add_parser("show", help="one participant's public keys (PEM / OpenSSH), fingerprints and "
                                       "the SuperNode registration command")
    show.add_argument("participant")
    show.add_argument("--dir", default="keys")
    show.add_argument("--connection", default="lab")
    tls = sub.add_parser("tls", help="a private CA and the SuperLink's server certificate (ca.crt, ca.key, "
                                     "server.crt, server.key)")
    tls.add_argument("hosts", nargs="+", help="IP addresses / DNS names SuperNodes connect to")
    tls.add_argument("--dir", default="certs", help="output folder (default: certs)")
    tls.add_argument("--days", type=int, default=365)
    tls.add_argument("--force", action="store_true", help="replace existing files")
    rev = sub.add_parser("revoke", help="add a participant's key (or an ed25519: fingerprint) to <dir>/revoked.txt")
    rev.add_argument("who", help="participant id or ed25519:<16 hex> fingerprint")
    rev.add_argument("--dir", default="keys")
    rev.add_argument("--note", default="", help="why (kept as a comment)")
    keys.set_defaults(func=run_keys_cli)
    return keys


def run_keys_cli(args: argparse.Namespace) -> int:
    """Handler for ``ftis-fed keys ...``; returns the exit code (2 with one line for a bad argument,
    an existing file or a missing key)."""
    try:
        return _run_keys(args)
    except (ValueError, FileExistsError, FileNotFoundError, KeyError) as e:
        text = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"ftis-fed keys {args.keys_command}: error: {text}", file=sys.stderr)
        return 2


def _run_keys(args: argparse.Namespace) -> int:
    if args.keys_command == "generate":
        for p in args.participants:
            paths = generate_keypair(p, args.dir, overwrite=args.force)
            print(f"{p}\t{fingerprint(load_public_key(paths.public))}\t{paths.private}\t{paths.public}")
            if args.no_supernode:
                continue
            sn = generate_supernode_keypair(p, args.dir, overwrite=args.force)
            print(f"{p}\tsupernode {supernode_fingerprint(load_supernode_public_key(sn.public))}\t"
                  f"{sn.private}\t{sn.public}")
            print(f"# send {paths.public} (batch signing) and {sn.public} (SuperNode) to the coordinator;\n"
                  f"# the SuperLink operator admits this SuperNode with:\n"
                  f"#   {register_command(sn.public, args.connection, p)}\n"
                  f"# then start it with:\n"
                  f"#   {supernode_command(p, args.dir, args.superlink, args.root_certificates)}")
    elif args.keys_command == "list":
        directory = load_key_directory(args.dir)
        gone = directory.revoked()
        for name, fp in directory.fingerprints().items():
            print(f"{name}\t{fp}" + ("\tREVOKED" if fp in gone else ""))
    elif args.keys_command == "show":
        path = key_paths(args.participant, args.dir).public
        key = load_public_key(path)
        revoked = load_key_directory(args.dir).is_revoked(fingerprint(key))
        print(f"# {args.participant} {fingerprint(key)} ({path})" + (" REVOKED" if revoked else ""))
        print(key.public_bytes(serialization.Encoding.PEM,
                               serialization.PublicFormat.SubjectPublicKeyInfo).decode(), end="")
        sn = supernode_key_paths(args.participant, args.dir).public
        if sn.exists():
            print(f"# SuperNode key {supernode_fingerprint(load_supernode_public_key(sn))} ({sn})")
            print(sn.read_text(), end="")
            print(f"# {register_command(sn, args.connection, args.participant)}")
    elif args.keys_command == "tls":
        f = generate_tls(args.dir, args.hosts, args.days, overwrite=args.force)
        print(f"# flower-superlink --ssl-ca-certfile {f.ca_cert} --ssl-certfile {f.server_cert} "
              f"--ssl-keyfile {f.server_key} --enable-supernode-auth ...\n"
              f"# give {f.ca_cert} to every organisation (flower-supernode --root-certificates, flwr's "
              f"root-certificates); keep {f.ca_key} offline")
    elif args.keys_command == "revoke":
        fp = revoke(args.dir, args.who, args.note)
        print(f"{args.who}\t{fp}\trevoked in {revocation_path(args.dir)}")
    return 0
