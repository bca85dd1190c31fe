"""A real deployment on loopback with Flower's node authentication: a SuperLink over TLS (a CA and a
server certificate for 127.0.0.1 made here with ``cryptography``) started with
``--enable-supernode-auth``; two organisations' SuperNodes whose keys come from ``ftis-fed keys
generate`` and are registered with ``flwr supernode register``; tiny models; two rounds. A SuperNode
with an unregistered key, one with no key, and clients without TLS are refused.

Only the product's external behaviour is asserted: exit statuses, the run's final status, the
``_federation`` rows of ``metrics.jsonl`` (round, ``fed/replies``) and Flower's own log lines.
Every process the test starts carries a marker in its environment and is killed at the end
(SuperNode children and the participants' detached worker processes included).
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
MARK = "FTIS_DEPLOY_AUTH_TEST"
PEOPLE = {"alice": "tiny-llama", "bob": "tiny-llama-b"}
RUN_CONFIG = {"num-rounds": 2, "min-participants": 2, "eval-every": 0, "group-size": 4, "prompts-per-round": 3,
              "max-new-tokens": 8, "task-families": "add1", "lr": 0.001, "round-timeout-s": 240.0}


# ------------------------------------------------------------------------------------- helpers

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_tls(d: Path) -> None:
    """ca.crt (a self-signed CA) and server.crt / server.key for 127.0.0.1, signed by it."""
    now = datetime.datetime.now(datetime.timezone.utc)
    valid = dict(not_valid_before=now - datetime.timedelta(minutes=5), not_valid_after=now + datetime.timedelta(days=1))
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "ftis-fed test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number())
          .not_valid_before(valid["not_valid_before"]).not_valid_after(valid["not_valid_after"])
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                       data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                       crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(valid["not_valid_before"]).not_valid_after(valid["not_valid_after"])
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                                                        x509.DNSName("localhost")]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    d.mkdir(parents=True, exist_ok=True)
    (d / "ca.crt").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    (d / "server.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (d / "server.key").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                     serialization.NoEncryption()))


class Deployment:
    """The processes of one loopback deployment, all started with ``MARK`` in their environment."""

    def __init__(self, base: Path):
        self.base = base
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.ca = base / "tls" / "ca.crt"
        self.env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", MARK: str(base),
                    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1", "FLWR_DISABLE_UPDATE_CHECK": "1",
                    "FTIS_FED_RUNTIME": str(base / "rt"), "PYTHONUNBUFFERED": "1"}
        self.procs: list[subprocess.Popen] = []
        self.cli_home = base / "cli"
        self.cli_home.mkdir(parents=True, exist_ok=True)
        (self.cli_home / "config.toml").write_text(
            '[superlink]\ndefault = "tls"\n\n'
            f'[superlink.tls]\naddress = "{self.address}"\nroot-certificates = "{self.ca}"\n\n'
            f'[superlink.plain]\naddress = "{self.address}"\ninsecure = true\n')

    def start(self, name: str, cmd: list[str], home: Path) -> subprocess.Popen:
        home.mkdir(parents=True, exist_ok=True)
        log = open(home / f"{name}.log", "w")
        p = subprocess.Popen(cmd, cwd=home, env={**self.env, "FLWR_HOME": str(home)}, stdout=log,
                             stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        self.procs.append(p)
        return p

    def log(self, name: str, home: Path) -> str:
        return (home / f"{name}.log").read_text(errors="replace")

    def flwr(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        env = {**self.env, "FLWR_HOME": str(self.cli_home)}
        return subprocess.run([str(BIN / "flwr"), *args], cwd=self.base, env=env, capture_output=True, text=True,
                              timeout=timeout)

    def supernode(self, name: str, *extra: str, node_config: str | None = None) -> subprocess.Popen:
        cmd = [str(BIN / "flower-supernode"), "--superlink", self.address, "--port", str(free_port()), *extra]
        if node_config:
            cmd += ["--node-config", node_config]
        return self.start("supernode", cmd, self.base / name)

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
        kill_marked(str(self.base))


def kill_marked(value: str) -> None:
    """Every process left with ``MARK=value`` in its environment (workers, app processes)."""
    needle = f"{MARK}={value}\0".encode()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            if needle in (d / "environ").read_bytes():
                os.kill(int(d.name), signal.SIGKILL)
        except (OSError, ProcessLookupError):
            continue


def wait_for(pred, timeout: float, what: str, step: float = 0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = pred()
        if out:
            return out
        time.sleep(step)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def generate_keys(keys_dir: Path, name: str, connection: str = "tls") -> str:
    r = subprocess.run([sys.executable, "-m", "ftis_fed.commands.cli", "keys", "generate", name, "--dir", str(keys_dir),
                        "--connection", connection], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


# ---------------------------------------------------------------------------------------- test

@pytest.mark.slow
def test_tls_and_supernode_auth_deployment(tmp_path):
    """Registered SuperNodes complete two rounds; unregistered, keyless and non-TLS clients are refused."""
    dep = Deployment(tmp_path)
    try:
        _run(dep)
    finally:
        dep.stop()


def _run(dep: Deployment) -> None:
    base = dep.base
    make_tls(base / "tls")

    # each organisation makes its two key pairs; the public signing keys are shared with everyone
    printed = {n: generate_keys(base / n / "keys", n) for n in (*PEOPLE, "mallory")}
    (base / "server-keys" / "public").mkdir(parents=True)
    for n in PEOPLE:
        pub = (base / n / "keys" / "public" / f"{n}.pub").read_bytes()
        for holder in (*PEOPLE, "server"):
            folder = base / ("server-keys" if holder == "server" else f"{holder}/keys") / "public"
            (folder / f"{n}.pub").write_bytes(pub)

    link_home = base / "link"
    dep.start("superlink", [str(BIN / "flower-superlink"), "--ssl-ca-certfile", str(dep.ca),
                            "--ssl-certfile", str(base / "tls" / "server.crt"),
                            "--ssl-keyfile", str(base / "tls" / "server.key"),
                            "--enable-supernode-auth", "--host", "127.0.0.1", "--port", str(dep.port)], link_home)
    wait_for(lambda: "Uvicorn running on https://" in dep.log("superlink", link_home), 90, "the SuperLink")

    # the SuperLink operator registers the two organisations' SuperNode keys, with the exact
    # command `ftis-fed keys generate` printed
    for n in PEOPLE:
        line = next(s for s in printed[n].splitlines() if "flwr supernode register" in s)
        cmd = line.split("#", 1)[1].split()
        assert cmd[:3] == ["flwr", "supernode", "register"] and cmd[4] == "tls"
        r = dep.flwr(*cmd[1:])
        assert r.returncode == 0 and "registered successfully" in r.stdout, r.stdout + r.stderr

    # a client without TLS is refused (the CLI, and a SuperNode)
    plain_cli = dep.flwr("supernode", "ls", "plain")
    assert plain_cli.returncode != 0, plain_cli.stdout
    plain = dep.supernode("plain", "--insecure", "--max-retries", "1")
    # a SuperNode whose key nobody registered, and one with no key at all
    mallory = dep.supernode("mallory", "--root-certificates", str(dep.ca), "--max-retries", "1",
                            "--auth-supernode-private-key", str(base / "mallory/keys/supernode/mallory.key"))
    keyless = dep.supernode("keyless", "--root-certificates", str(dep.ca), "--max-retries", "1")

    # the two registered organisations
    for i, (n, model) in enumerate(PEOPLE.items()):
        keys = base / n / "keys"
        dep.supernode(n, "--root-certificates", str(dep.ca), "--auth-supernode-private-key",
                      str(keys / "supernode" / f"{n}.key"),
                      node_config=f'participant="{n}" model="{model}" keys-dir="{keys}" state-dir="{base / n / "state"}" '
                                  f'partition-id={i} num-partitions={len(PEOPLE)}')

    for p in (plain, mallory, keyless):
        p.wait(timeout=180)
        assert p.returncode != 0
    refused = {n: dep.log("supernode", base / n) for n in ("plain", "mallory", "keyless")}
    for n, text in refused.items():
        assert "Failed to initialize the connection to the SuperLink" in text, (n, text[-2000:])
        assert "SuperNode ID:" not in text, n
    assert "Failed to activate SuperNode" in refused["mallory"]
    assert "must be registered via the CLI" in refused["keyless"]
    link_log = dep.log("superlink", link_home)
    assert "No SuperNode found with the given public key" in link_log            # mallory, at the SuperLink

    for n in PEOPLE:
        wait_for(lambda n=n: "SuperNode ID:" in dep.log("supernode", base / n), 120, f"{n}'s SuperNode to connect")

    # the coordinator starts the run over TLS
    out = base / "out"
    items = [f"{k}={json.dumps(v)}" for k, v in {**RUN_CONFIG, "keys-dir": str(base / "server-keys"),
                                                  "output-dir": str(out)}.items()]
    started = dep.flwr("run", str(ROOT), "tls", "--format", "json", "--run-config", " ".join(items), timeout=300)
    assert started.returncode == 0, started.stdout + started.stderr
    run_id = str(json.loads(started.stdout)["run-id"])

    def finished():
        r = dep.flwr("ls", "tls", "--run-id", run_id, "--format", "json")
        status = json.loads(r.stdout)["runs"][0]["status"] if r.returncode == 0 else ""
        return status if status.startswith("finished") else None

    status = wait_for(finished, 900, f"run {run_id} to finish", step=3)
    logs = dep.flwr("log", run_id, "tls", "--show")
    assert status == "finished:completed", logs.stdout[-4000:] + logs.stderr[-2000:]

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    fed = {r["round"]: r for r in rows if r.get("participant") == "_federation"}
    assert sorted(fed) == [1, 2]
    assert all(fed[k]["fed/replies"] == 2 for k in (1, 2)), fed
    # every SuperNode the SuperLink ever admitted is one of the two registered keys
    assert link_log.count("[ControlServicer.RegisterNode] Created node_id=") == 2
    nodes = dep.flwr("supernode", "ls", "tls", "--format", "json")
    assert nodes.returncode == 0, nodes.stdout + nodes.stderr
    assert len(json.loads(nodes.stdout)["nodes"]) == 2
