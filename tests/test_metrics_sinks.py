"""report-to: the server's metrics rows also to TensorBoard (real ``tensorboard`` package, read back
with its own EventAccumulator) and W&B (a fake ``wandb`` module: the real one is not installed here,
and must never be needed offline); a missing package or an unknown target is a clear error at start."""

from __future__ import annotations

import sys
import types

import pytest

from ftis_fed.config.federation import FederationConfig
from ftis_fed.metrics.writer import FEDERATION, MetricsWriter
from ftis_fed.metrics.sinks import open_sinks, parse_report_to, scalars


def test_parse_report_to_like_trl():
    assert parse_report_to("none") == () and parse_report_to("") == ()
    assert parse_report_to("tensorboard") == ("tensorboard",)
    assert parse_report_to(" wandb , tensorboard,wandb") == ("wandb", "tensorboard")
    with pytest.raises(ValueError, match=r"report-to='mlflow'.*tensorboard, wandb"):
        parse_report_to("mlflow")
    with pytest.raises(ValueError, match="report-to"):
        FederationConfig(report_to="tensorboard,comet")


def test_scalars_skip_identity_and_non_numbers():
    row = {"round": 2, "participant": "alice", "phase": "train", "model_id": "m", "train/loss": 0.5,
           "flag": True, "nan": float("nan"), "n": 3}
    assert scalars(row) == {"alice/train/loss": 0.5, "alice/n": 3.0}


def test_tensorboard_gets_every_written_row(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    w = MetricsWriter(tmp_path, sinks=open_sinks(("tensorboard",), tmp_path, "run"))
    for rnd in (1, 2):
        w.write([{"round": rnd, "participant": "alice", "phase": "train", "train/loss": 1.0 / rnd},
                 {"round": rnd, "participant": FEDERATION, "phase": "train", "wire/bytes_per_token": 2.5 + rnd}])
    w.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    loss = [(e.step, e.value) for e in acc.Scalars("alice/train/loss")]
    assert loss == [(1, 1.0), (2, 0.5)]
    assert [e.value for e in acc.Scalars(f"{FEDERATION}/wire/bytes_per_token")] == [3.5, 4.5]


def test_wandb_sink_with_a_fake_module_runs_offline(tmp_path, monkeypatch):
    calls = {"log": [], "finish": 0}

    class Run:
        def log(self, data):
            calls["log"].append(data)

        def finish(self):
            calls["finish"] += 1

    def init(**kw):
        calls["init"] = kw
        return Run()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    w = MetricsWriter(tmp_path, sinks=open_sinks(("wandb",), tmp_path, "my-run", {"lr": 1e-5}))
    w.write([{"round": 3, "participant": "bob", "phase": "eval", "eval/id/accuracy": 0.25}])
    w.close()
    assert calls["init"]["mode"] == "offline" and calls["init"]["name"] == "my-run"
    assert calls["init"]["config"] == {"lr": 1e-5}
    assert calls["log"] == [{"bob/eval/id/accuracy": 0.25, "round": 3}] and calls["finish"] == 1


def test_a_missing_package_is_a_clear_error_at_start(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)         # import fails as if not installed
    with pytest.raises(RuntimeError, match=r"report-to=wandb: the 'wandb' package is not installed.*ftis-fed\[wandb\]"):
        open_sinks(("wandb",), tmp_path, "run")


def test_the_engine_refuses_to_start_without_the_package(tmp_path, monkeypatch):
    from tests.test_engine import engine, trio

    monkeypatch.setitem(sys.modules, "wandb", None)
    stubs = trio()
    with pytest.raises(RuntimeError, match="report-to=wandb"):
        engine(tmp_path, stubs, report_to="wandb").run()
    assert all(s.calls == [] for s in stubs.values())       # nobody was even asked hello
