"""A real Flower deployment on loopback for the slow deployment tests (``test_deploy_auth``,
``test_deploy_faults``): a CA and a server certificate for 127.0.0.1 made with ``cryptography``, a
SuperLink over TLS with ``--enable-supernode-auth``, SuperNodes whose keys come from ``ftis-fed
keys generate`` and are registered with ``flwr supernode register``, and the ``flwr`` CLI.

Every process started here carries ``MARK`` in its environment and is killed at the end
(``Deployment.stop``: SuperNode children and the participants' detached worker processes included).
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
MARK = "FTIS_DEPLOY_AUTH_TEST"


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

    def start(self, name: str, cmd: list[str], home: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
        """Start ``cmd`` in its own session (so ``kill`` takes its children), logging to ``home/<name>.log``."""
        home.mkdir(parents=True, exist_ok=True)
        log = open(home / f"{name}.log", "w")
        p = subprocess.Popen(cmd, cwd=home, env={**self.env, "FLWR_HOME": str(home), **(env or {})}, stdout=log,
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

    # ------------------------------------------------------------------ the parts of a deployment
    def exchange_keys(self, people, extra: tuple[str, ...] = ()) -> dict[str, str]:
        """Each organisation (``people`` and ``extra``) makes its two key pairs; the public signing keys
        of ``people`` are shared with each other and the server (``server-keys``). Returns what
        ``ftis-fed keys generate`` printed, per organisation."""
        printed = {n: generate_keys(self.base / n / "keys", n) for n in (*people, *extra)}
        (self.base / "server-keys" / "public").mkdir(parents=True)
        for n in people:
            pub = (self.base / n / "keys" / "public" / f"{n}.pub").read_bytes()
            for holder in (*people, "server"):
                folder = self.base / ("server-keys" if holder == "server" else f"{holder}/keys") / "public"
                (folder / f"{n}.pub").write_bytes(pub)
        return printed

    def superlink(self, name: str = "superlink", database: Path | None = None) -> subprocess.Popen:
        """The SuperLink over TLS with SuperNode authentication (``database``: Flower's state file,
        kept across a restart; default in memory), once it serves."""
        home = self.base / "link"
        cmd = [str(BIN / "flower-superlink"), "--ssl-ca-certfile", str(self.ca),
               "--ssl-certfile", str(self.base / "tls" / "server.crt"),
               "--ssl-keyfile", str(self.base / "tls" / "server.key"),
               "--enable-supernode-auth", "--host", "127.0.0.1", "--port", str(self.port)]
        if database is not None:
            cmd += ["--database", str(database)]
        p = self.start(name, cmd, home)
        wait_for(lambda: "Uvicorn running on https://" in self.log(name, home), 90, "the SuperLink")
        return p

    def register(self, printed: str) -> int:
        """Register a SuperNode key with the exact command ``ftis-fed keys generate`` printed; its node id."""
        line = next(s for s in printed.splitlines() if "flwr supernode register" in s)
        cmd = line.split("#", 1)[1].split()
        assert cmd[:3] == ["flwr", "supernode", "register"] and cmd[4] == "tls"
        r = self.flwr(*cmd[1:])
        assert r.returncode == 0 and "registered successfully" in r.stdout, r.stdout + r.stderr
        return int(re.search(r"SuperNode (\d+) registered successfully", r.stdout).group(1))

    def supernode(self, name: str, *extra: str, node_config: str | None = None, log_name: str = "supernode",
                  env: dict[str, str] | None = None) -> subprocess.Popen:
        cmd = [str(BIN / "flower-supernode"), "--superlink", self.address, "--port", str(free_port()), *extra]
        if node_config:
            cmd += ["--node-config", node_config]
        return self.start(log_name, cmd, self.base / name, env=env)

    def participant_node(self, name: str, model: str, index: int, count: int, log_name: str = "supernode",
                         env: dict[str, str] | None = None) -> subprocess.Popen:
        """The SuperNode of organisation ``name`` (its registered key, its keys and state dir)."""
        keys = self.base / name / "keys"
        return self.supernode(name, "--root-certificates", str(self.ca), "--auth-supernode-private-key",
                              str(keys / "supernode" / f"{name}.key"), log_name=log_name, env=env,
                              node_config=f'participant="{name}" model="{model}" keys-dir="{keys}" '
                                          f'state-dir="{self.base / name / "state"}" partition-id={index} '
                                          f'num-partitions={count}')

    def submit(self, run_config: dict) -> str:
        """``flwr run`` of this project over TLS; the run id."""
        items = [f"{k}={json.dumps(v)}" for k, v in run_config.items()]
        started = self.flwr("run", str(ROOT), "tls", "--format", "json", "--run-config", " ".join(items), timeout=300)
        assert started.returncode == 0, started.stdout + started.stderr
        return str(json.loads(started.stdout)["run-id"])

    def run_status(self, run_id: str) -> str:
        r = self.flwr("ls", "tls", "--run-id", run_id, "--format", "json")
        return json.loads(r.stdout)["runs"][0]["status"] if r.returncode == 0 else ""

    def wait_finished(self, run_id: str, timeout: float = 900) -> str:
        def finished():
            status = self.run_status(run_id)
            return status if status.startswith("finished") else None
        return wait_for(finished, timeout, f"run {run_id} to finish", step=3)

    def nodes(self) -> dict[int, str]:
        """node id -> status, as ``flwr supernode ls`` reports it."""
        r = self.flwr("supernode", "ls", "tls", "--format", "json")
        assert r.returncode == 0, r.stdout + r.stderr
        return {int(n["node-id"]): n["status"] for n in json.loads(r.stdout)["nodes"]}

    def kill(self, p: subprocess.Popen) -> None:
        """SIGKILL ``p`` and its session (a crash: nothing is shut down cleanly)."""
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.wait(timeout=30)

    def __enter__(self) -> "Deployment":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

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


def marked(value: str) -> dict[int, str]:
    """pid -> command line of every process with ``MARK=value`` in its environment."""
    needle = f"{MARK}={value}\0".encode()
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            if needle in (d / "environ").read_bytes():
                out[int(d.name)] = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
    return out


def kill_marked(value: str, contains: str = "") -> list[int]:
    """SIGKILL every process left with ``MARK=value`` in its environment (workers, app processes),
    or only those whose command line contains ``contains``; the pids signalled."""
    killed = []
    for pid, cmdline in marked(value).items():
        if contains in cmdline:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except (OSError, ProcessLookupError):
                continue
    return killed


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


def metrics_rows(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
