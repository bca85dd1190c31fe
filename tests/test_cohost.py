"""Several participants in one worker process (``participants-per-worker``): each is built on its
first request with its own spec, keys, state dir and counters; an error in one is its own error
reply, the others keep working; the process is shared (one torch for all)."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

from clients.client_app import worker_host
from clients.worker import FAULT_ENV, WorkerError, call, ensure_worker, existing_worker
from ftis_fed.config.federation import to_jsonable
from ftis_fed.config.keys import federation_from_run_config
from ftis_fed.config.participants import absolute_paths, participant_spec
from ftis_fed.trust.signing import generate_keypair, load_key_directory, verify_challenge

ROOT = Path(__file__).resolve().parents[1]
RUN_CONFIG = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]


@pytest.mark.slow
def test_three_participants_share_one_worker_and_fail_alone(tmp_path, monkeypatch):
    monkeypatch.setenv("FTIS_FED_RUNTIME", str(tmp_path / "rt"))
    monkeypatch.setenv(FAULT_ENV, "t-1=raise:generate:1")            # the worker inherits it
    table = {"participants": [{"name": "t", "count": 3, "model": "tiny-llama", "adapter": "full"}]}
    rc, _ = absolute_paths({**RUN_CONFIG, "population": json.dumps(table), "output-dir": str(tmp_path / "out"),
                            "participants-per-worker": 3, "task-families": "add1", "max-new-tokens": 4,
                            "prompts-per-round": 1, "eval-every": 0, "run-name": "cohost"}, {})
    fed = federation_from_run_config(rc)
    for n in ("t-0", "t-1", "t-2"):
        generate_keypair(n, tmp_path / "out" / "keys")
    keys = load_key_directory(tmp_path / "out" / "keys" / "public")
    nodes = [{"partition-id": i, "num-partitions": 3} for i in range(3)]
    specs = [participant_spec(rc, nc, fed) for nc in nodes]
    hosts = {worker_host(fed, s, nc)[0] for s, nc in zip(specs, nodes)}
    assert hosts == {"host0-of-3"}
    payload = {"run_config": rc, "node_config": nodes[0], "participant": to_jsonable(specs[0]), "concurrent": 1,
               "run_key": "r1"}
    conn = ensure_worker("r1", "host0-of-3", payload, tmp_path / "worker.log", start_timeout=600)
    infos = []
    for s, nc in zip(specs, nodes):
        conn = conn or existing_worker("r1", "host0-of-3")
        info = call(conn, "hello", {"run": "cohost", "node": f"n{s.name}", "challenge": b"c" * 32}, timeout=600,
                    participant=s.name, node_config=nc)["info"]
        conn = None
        assert info["participant"] == s.name
        assert verify_challenge(keys[s.name], "cohost", f"n{s.name}", s.name, b"c" * 32, info["proof"])
        infos.append(info)
    assert len({i["pid"] for i in infos}) == 1                       # one process for the three
    assert len({i["key_fp"] for i in infos}) == 3
    with pytest.raises(WorkerError, match="injected fault"):
        call(existing_worker("r1", "host0-of-3"), "generate", {"round": 1, "texts": False}, timeout=600,
             participant="t-1", node_config=nodes[1])
    for i in (0, 2):                                                 # its process-mates go on
        got = call(existing_worker("r1", "host0-of-3"), "generate", {"round": 1, "texts": False}, timeout=600,
                   participant=specs[i].name, node_config=nodes[i])
        assert len(got["frames"]) == 1 and got["metrics"]["gen/tokens"] > 0
    assert (tmp_path / "out" / "participants" / "t-2" / "model_loads.jsonl").exists()   # its own state dir
    assert call(existing_worker("r1", "host0-of-3"), "finish", {}, timeout=60)["info"]["stopped"]
