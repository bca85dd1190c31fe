"""``ftis-fed deploy check`` and ``ftis-fed deploy cert``: a deployment's TLS and SuperNode key
checked the way the SuperNode uses them, before anyone starts a run, with the real reason.

``deploy check --superlink HOST:PORT --root-certificates ca.crt [--auth-supernode-private-key
supernode/alice.key]`` (an organisation, from its SuperNode host):

1. **TLS**, as the SuperNode's HTTPS client does it: the SuperLink's certificate chain verified
   against ``--root-certificates`` and its name against HOST (Python's ``ssl``, OpenSSL). A failure
   is one line naming the cause: ``expired`` (with its end date), ``not yet valid``, ``wrong host``
   (the names the certificate holds), ``unknown CA`` (its issuer, and that the CA file did not sign
   it), or that nothing listens / it is not TLS. The ``flwr`` CLI says only "check your network
   connection and 'address'" for all of these.
2. **The SuperNode key**, as ``flower-supernode --auth-supernode-private-key`` presents it: Flower's
   own Fleet HTTP client (``FleetHttpClient`` with its ``NodeAuthHttpInterceptor``) asks the
   SuperLink to activate the node. Registered: its node id (the node is deactivated again at once).
   Refused: the key's fingerprint (``SHA256:…``, as ``ssh-keygen -lf`` and ``ftis-fed keys show``
   print it) and the command that registers it (Flower refuses a node already online with the same
   answer, "Failed to activate SuperNode"; the line says so, and such a node is not touched).

``deploy cert --ssl-certfile server.crt [--ssl-ca-certfile ca.crt] HOST ...`` (the coordinator,
before ``flower-superlink`` starts): the certificate's validity now, that it names every HOST the
SuperNodes will use, and that the CA file signed it. A SuperLink starts with an expired or
wrong-host certificate without a word.

``deploy end-worker --state-dir DIR`` (an organisation, after ``flwr stop`` of a run that will not
resume): ends the participant worker recorded in ``DIR/worker.json`` with its process group, so its
model and memory are freed now instead of after ``worker-idle-timeout-s``.

Exit status 0 when everything checked is right, 1 otherwise (each problem one line on stderr).
"""

from __future__ import annotations

import datetime
import ipaddress
import socket
import ssl
import sys
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec


class CheckFailed(Exception):
    """A check found a problem; the message is the one line for the operator."""


def _split(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise CheckFailed(f"--superlink {address!r}: expected HOST:PORT")
    return host.strip("[]"), int(port)


def _names(cert: x509.Certificate) -> list[str]:
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return [a.value for a in cert.subject.get_attributes_for_oid(x509.oid.NameOID.COMMON_NAME)]
    return [str(n) for n in san.get_values_for_type(x509.DNSName)] + \
           [str(n) for n in san.get_values_for_type(x509.IPAddress)]


def _when(t: datetime.datetime) -> str:
    return t.strftime("%Y-%m-%d %H:%M UTC")


def peer_certificate(host: str, port: int, timeout: float = 10.0) -> x509.Certificate | None:
    """The certificate the server at host:port presents, not verified (to explain a failure)."""
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    try:
        with socket.create_connection((host, port), timeout=timeout) as raw, \
                ctx.wrap_socket(raw, server_hostname=host) as tls:
            der = tls.getpeercert(binary_form=True)
    except (OSError, ssl.SSLError):
        return None
    return x509.load_der_x509_certificate(der) if der else None


def check_tls(address: str, root_certificates: str | Path, timeout: float = 10.0) -> str:
    """Connect to ``address`` over TLS as the SuperNode does (chain against the CA file, name
    against the host); a one-line summary, or CheckFailed with the reason."""
    host, port = _split(address)
    ca = Path(root_certificates)
    try:
        ctx = ssl.create_default_context(cafile=str(ca))
    except (OSError, ssl.SSLError) as e:
        raise CheckFailed(f"--root-certificates {ca}: cannot be read as PEM certificates ({e})") from None
    try:
        with socket.create_connection((host, port), timeout=timeout) as raw, \
                ctx.wrap_socket(raw, server_hostname=host) as tls:
            der = tls.getpeercert(binary_form=True)
            version = tls.version()
    except ssl.SSLCertVerificationError as e:
        raise CheckFailed(_verify_reason(e, address, host, port, ca)) from None
    except ssl.SSLError as e:
        raise CheckFailed(f"{address}: the TLS handshake failed ({e.reason or e}): is it a TLS SuperLink "
                          "(not one started with --insecure)?") from None
    except ConnectionRefusedError:
        raise CheckFailed(f"{address}: connection refused: nothing listens there (is the SuperLink running, "
                          "on this port?)") from None
    except socket.timeout:
        raise CheckFailed(f"{address}: no answer within {timeout:.0f} s (a firewall, or the wrong address)") from None
    except OSError as e:
        raise CheckFailed(f"{address}: cannot connect ({e.strerror or e})") from None
    cert = x509.load_der_x509_certificate(der)
    return (f"TLS ok: {address} presents a certificate for {', '.join(_names(cert))}, signed by a CA in {ca}, "
            f"valid until {_when(cert.not_valid_after_utc)} ({version})")


def _verify_reason(e: ssl.SSLCertVerificationError, address: str, host: str, port: int, ca: Path) -> str:
    cert = peer_certificate(host, port)
    code = getattr(e, "verify_code", None)
    said = getattr(e, "verify_message", "") or str(e)
    if code == 10 and cert is not None:                         # X509_V_ERR_CERT_HAS_EXPIRED
        return (f"{address}: the SuperLink's certificate expired on {_when(cert.not_valid_after_utc)} "
                f"(certificate for {', '.join(_names(cert))}): make a new one (ftis-fed keys tls ... --days N) "
                "and restart the SuperLink with it")
    if code == 10:
        return f"{address}: a certificate in the SuperLink's chain has expired ({said})"
    if code == 9:                                               # X509_V_ERR_CERT_NOT_YET_VALID
        start = f" (valid from {_when(cert.not_valid_before_utc)})" if cert is not None else ""
        return f"{address}: the SuperLink's certificate is not valid yet{start}: check both machines' clocks"
    if code in (62, 64):                                        # hostname / IP address mismatch
        names = ", ".join(_names(cert)) if cert is not None else "?"
        return (f"{address}: wrong host: the SuperLink's certificate is for {names}, not {host}: connect with "
                "one of those names, or make a certificate that names this one (ftis-fed keys tls HOST ...)")
    if code in (2, 18, 19, 20, 21):                             # issuer unknown / self-signed / chain incomplete
        issuer = cert.issuer.rfc4514_string() if cert is not None else "?"
        return (f"{address}: unknown CA: the SuperLink's certificate (issued by {issuer}) is not signed by a CA "
                f"in {ca} ({said}): use the coordinator's ca.crt as --root-certificates")
    return f"{address}: the SuperLink's certificate was refused: {said}"


def _load_supernode_key(path: str | Path) -> ec.EllipticCurvePrivateKey:
    from cryptography.hazmat.primitives import serialization

    p = Path(path)
    try:
        key = serialization.load_ssh_private_key(p.read_bytes(), password=None)
    except (OSError, ValueError) as e:
        raise CheckFailed(f"--auth-supernode-private-key {p}: not an unencrypted OpenSSH private key ({e})") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise CheckFailed(f"--auth-supernode-private-key {p}: not an ECDSA key (Flower's SuperNode "
                          "authentication needs one on a NIST curve)")
    return key


def check_registration(address: str, root_certificates: str | Path, private_key: str | Path) -> str:
    """Present the SuperNode key as ``flower-supernode`` does (Flower's Fleet HTTP client and its
    authentication interceptor) and ask the SuperLink to activate the node: registered -> its node
    id (deactivated again); else CheckFailed naming the key's fingerprint."""
    import httpx
    from flwr.common.constant import HEARTBEAT_DEFAULT_INTERVAL
    from flwr.proto.fleet_pb2 import ActivateNodeRequest, DeactivateNodeRequest  # pylint: disable=E0611
    from flwr.supercore.interceptors.http.runtime_version import RuntimeVersionHttpInterceptor
    from flwr.supercore.primitives.asymmetric import public_key_to_bytes
    from flwr.supernode.fleet_http_client import FleetHttpClient
    from flwr.supernode.node_auth_http_interceptor import NodeAuthHttpInterceptor

    from ftis_fed.trust.deploy_keys import supernode_fingerprint

    key = _load_supernode_key(private_key)
    public = key.public_key()
    fp = supernode_fingerprint(public)
    interceptors = [RuntimeVersionHttpInterceptor(component_name="SuperNode"), NodeAuthHttpInterceptor(key, public)]
    with FleetHttpClient.from_server_address(address, False, Path(root_certificates).read_bytes(),
                                             interceptors=interceptors) as client:
        try:
            node_id = client.ActivateNode(ActivateNodeRequest(public_key=public_key_to_bytes(public),
                                                              heartbeat_interval=HEARTBEAT_DEFAULT_INTERVAL)).node_id
        except httpx.HTTPStatusError as e:
            text = e.response.text
            if '"code":2004' in text.replace(" ", "") or "Failed to activate SuperNode" in text:
                raise CheckFailed(f"{address}: SuperNode key {fp} ({private_key}) is not registered at this "
                                  "SuperLink (Flower: 'Failed to activate SuperNode'): send its .pub to the "
                                  "coordinator, who registers it with `flwr supernode register <name>.pub "
                                  "<connection> --name <name>`; if it is registered, its node is online already "
                                  "(a SuperNode with this key runs, or a killed one whose heartbeat has not "
                                  "lapsed yet: up to a minute)") from None
            raise CheckFailed(f"{address}: the SuperLink refused SuperNode key {fp}: HTTP "
                              f"{e.response.status_code} {text[:300]}") from None
        except httpx.TransportError as e:
            raise CheckFailed(f"{address}: {type(e).__name__}: {e}") from None
        try:                                                     # as flower-supernode does when it stops
            client.DeactivateNode(DeactivateNodeRequest(node_id=node_id))
        except (httpx.HTTPError, RuntimeError) as e:
            return (f"SuperNode key ok: {fp} is registered as node {node_id} (deactivating it again failed: "
                    f"{e}; it shows online until its heartbeat lapses)")
    return f"SuperNode key ok: {fp} is registered as node {node_id}"


def check_certificate(cert_file: str | Path, hosts: list[str], ca_file: str | Path | None = None,
                      now: datetime.datetime | None = None) -> str:
    """The SuperLink's certificate, before it starts: valid now, names every host, signed by the CA
    file (when given); a one-line summary, or CheckFailed listing every problem."""
    p = Path(cert_file)
    try:
        cert = x509.load_pem_x509_certificate(p.read_bytes())
    except (OSError, ValueError) as e:
        raise CheckFailed(f"--ssl-certfile {p}: not a PEM certificate ({e})") from None
    now = now or datetime.datetime.now(datetime.timezone.utc)
    problems = []
    if cert.not_valid_after_utc <= now:
        problems.append(f"it expired on {_when(cert.not_valid_after_utc)}")
    if cert.not_valid_before_utc > now:
        problems.append(f"it is not valid before {_when(cert.not_valid_before_utc)}")
    names = _names(cert)
    for h in hosts:
        if not _covers(names, h):
            problems.append(f"it does not name {h} (it names {', '.join(names)})")
    if ca_file is not None:
        try:
            ca = x509.load_pem_x509_certificate(Path(ca_file).read_bytes())
            cert.verify_directly_issued_by(ca)
        except (OSError, ValueError, TypeError) as e:
            problems.append(f"it is not signed by the CA in {ca_file} ({e or type(e).__name__})")
        except Exception as e:                                   # noqa: BLE001 - InvalidSignature and kin
            problems.append(f"it is not signed by the CA in {ca_file} ({type(e).__name__})")
    if problems:
        raise CheckFailed(f"--ssl-certfile {p}: " + "; ".join(problems))
    return (f"certificate ok: {p} names {', '.join(names)}, valid until {_when(cert.not_valid_after_utc)}"
            + (f", signed by {ca_file}" if ca_file else ""))


def _covers(names: list[str], host: str) -> bool:
    try:
        ip = ipaddress.ip_address(host)
        return any(n == str(ip) for n in names)
    except ValueError:
        pass
    host = host.lower().rstrip(".")
    for n in (n.lower().rstrip(".") for n in names):
        if n == host or (n.startswith("*.") and host.split(".", 1)[-1] == n[2:] and host.count(".") == n.count(".")):
            return True
    return False


def add_cli(sub) -> None:
    p = sub.add_parser("deploy", help="check a deployment's TLS and SuperNode key before a run")
    d = p.add_subparsers(dest="deploy", required=True)
    c = d.add_parser("check", help="try the TLS connection and the SuperNode key registration the way the "
                                   "SuperNode will; print the real reason of a failure")
    c.add_argument("--superlink", required=True, help="HOST:PORT, as given to flower-supernode --superlink")
    c.add_argument("--root-certificates", required=True, help="the CA file, as given to flower-supernode")
    c.add_argument("--auth-supernode-private-key", default=None,
                   help="the SuperNode key, as given to flower-supernode (omit: TLS only)")
    c.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the connection")
    k = d.add_parser("cert", help="the SuperLink's certificate before it starts: valid now, names every host, "
                                  "signed by the CA")
    k.add_argument("hosts", nargs="+", help="every name or address the SuperNodes connect to")
    k.add_argument("--ssl-certfile", required=True, help="as given to flower-superlink")
    k.add_argument("--ssl-ca-certfile", default=None, help="as given to flower-superlink")

    w = d.add_parser("end-worker", help="end the participant worker recorded in a state dir (a run stopped "
                                        "with flwr stop that will not resume: its model and memory are freed now)")
    w.add_argument("--state-dir", required=True, help="the participant's state-dir (node config)")

    def run_end_worker(a) -> int:
        from clients.worker import end_other_run_worker

        ended = end_other_run_worker(a.state_dir, None)
        print(f"ended worker pid {ended[0]} of run {ended[1]}" if ended else
              f"no worker running for {a.state_dir}")
        return 0

    w.set_defaults(func=run_end_worker)

    def run_check(a) -> int:
        try:
            print(check_tls(a.superlink, a.root_certificates, a.timeout))
            if a.auth_supernode_private_key:
                print(check_registration(a.superlink, a.root_certificates, a.auth_supernode_private_key))
        except CheckFailed as e:
            print(f"ftis-fed deploy check: {e}", file=sys.stderr)
            return 1
        return 0

    def run_cert(a) -> int:
        try:
            print(check_certificate(a.ssl_certfile, a.hosts, a.ssl_ca_certfile))
        except CheckFailed as e:
            print(f"ftis-fed deploy cert: {e}", file=sys.stderr)
            return 1
        return 0

    c.set_defaults(func=run_check)
    k.set_defaults(func=run_cert)
