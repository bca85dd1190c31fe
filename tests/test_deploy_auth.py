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

import json

import pytest

from tests.deploy_helpers import Deployment, make_tls, metrics_rows, wait_for

PEOPLE = {"alice": "tiny-llama", "bob": "tiny-llama-b"}
RUN_CONFIG = {"num-rounds": 2, "min-participants": 2, "eval-every": 0, "group-size": 4, "prompts-per-round": 3,
              "max-new-tokens": 8, "task-families": "add1", "lr": 0.001, "round-timeout-s": 240.0}


# ---------------------------------------------------------------------------------------- test

@pytest.mark.slow
def test_tls_and_supernode_auth_deployment(tmp_path):
    """Registered SuperNodes complete two rounds; unregistered, keyless and non-TLS clients are refused."""
    with Deployment(tmp_path) as dep:                # every process it started is killed at the end
        _run(dep)


def _run(dep: Deployment) -> None:
    base = dep.base
    make_tls(base / "tls")

    # each organisation makes its two key pairs; the public signing keys are shared with everyone
    printed = dep.exchange_keys(PEOPLE, extra=("mallory",))
    link_home = base / "link"
    dep.superlink()

    # the SuperLink operator registers the two organisations' SuperNode keys, with the exact
    # command `ftis-fed keys generate` printed
    for n in PEOPLE:
        dep.register(printed[n])

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
        dep.participant_node(n, model, i, len(PEOPLE))

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
    run_id = dep.submit({**RUN_CONFIG, "keys-dir": str(base / "server-keys"), "output-dir": str(out)})
    status = dep.wait_finished(run_id)
    logs = dep.flwr("log", run_id, "tls", "--show")
    assert status == "finished:completed", logs.stdout[-4000:] + logs.stderr[-2000:]

    rows = metrics_rows(out)
    fed = {r["round"]: r for r in rows if r.get("participant") == "_federation"}
    assert sorted(fed) == [1, 2]
    assert all(fed[k]["fed/replies"] == 2 for k in (1, 2)), fed
    # every SuperNode the SuperLink ever admitted is one of the two registered keys
    assert link_log.count("[ControlServicer.RegisterNode] Created node_id=") == 2
    nodes = dep.flwr("supernode", "ls", "tls", "--format", "json")
    assert nodes.returncode == 0, nodes.stdout + nodes.stderr
    assert len(json.loads(nodes.stdout)["nodes"]) == 2
