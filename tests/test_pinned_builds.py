"""Builds that train (warm-ups, SFT, distillation) run with AVX2-pinned kernels on any x86-64 CPU with
AVX2, are stamped with how they were built, and a cached copy built otherwise is rebuilt on its next use
(``ftis_fed.policies.store``, TRAINED_BUILDS); ``ftis-fed sim`` / ``grid`` started from the command line
run with the same kernels (``store.run_pin_env``), so a committed cell's run reproduces on either CPU."""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import pytest

from ftis_fed.commands import cli
from ftis_fed.policies import store
from ftis_fed.policies.models import resolve_model
from tests.grid_cells import rewrite_metrics


@pytest.fixture
def fake_trained(tmp_path, monkeypatch):
    """A registered trained build that writes a config and counts its builds, in a tmp cache, in a
    process that is already pinned (so it builds here, where the test can see it)."""
    monkeypatch.setenv("FTIS_FED_CACHE", str(tmp_path / "cache"))
    for k, v in store.PINNED_KERNELS.items():
        monkeypatch.setenv(k, v)
    calls = []

    def build(out):
        out.mkdir(parents=True)
        calls.append(out)
        (out / "config.json").write_text(json.dumps({"build": len(calls)}))
    monkeypatch.setitem(store.OFFLINE_MODELS, "fake-trained", build)
    monkeypatch.setattr(store, "TRAINED_BUILDS", store.TRAINED_BUILDS | {"fake-trained"})
    return calls


def test_a_trained_build_is_stamped_and_a_copy_built_otherwise_is_rebuilt(fake_trained):
    out = store.cache_root() / "models" / "fake-trained"
    assert resolve_model("fake-trained") == str(out) and len(fake_trained) == 1
    stamp = json.loads((out / store.BUILD_STAMP).read_text())
    assert stamp["model"] == "fake-trained" and stamp["kernels"] == store.build_kernels()
    assert store.is_built("fake-trained")
    resolve_model("fake-trained")
    assert len(fake_trained) == 1                                     # cached: not built again
    for other in ({"kernels": "unpinned"}, None):                     # another machine's build; an old cache
        if other is None:
            (out / store.BUILD_STAMP).unlink()
        else:
            (out / store.BUILD_STAMP).write_text(json.dumps(other))
        assert not store.is_built("fake-trained")
        resolve_model("fake-trained")
        assert json.loads((out / "config.json").read_text())["build"] == len(fake_trained)   # replaced
        assert json.loads((out / store.BUILD_STAMP).read_text())["kernels"] == store.build_kernels()
    assert len(fake_trained) == 3


def test_a_build_of_another_recipe_is_rebuilt(fake_trained, monkeypatch):
    """A registry spec changed since the cache was built (a micro model's warm-up steps, say): the
    stamp's recipe differs, so the next use rebuilds instead of loading the old weights."""
    monkeypatch.setitem(store.RECIPES, "fake-trained", "MicroSpec(steps=340)")
    out = store.cache_root() / "models" / "fake-trained"
    resolve_model("fake-trained")
    assert json.loads((out / store.BUILD_STAMP).read_text())["recipe"] == "MicroSpec(steps=340)"
    resolve_model("fake-trained")
    assert len(fake_trained) == 1
    monkeypatch.setitem(store.RECIPES, "fake-trained", "MicroSpec(steps=350)")
    assert not store.is_built("fake-trained")
    resolve_model("fake-trained")
    assert len(fake_trained) == 2 and json.loads((out / "config.json").read_text())["build"] == 2
    stamp = json.loads((out / store.BUILD_STAMP).read_text())
    assert stamp["recipe"] == "MicroSpec(steps=350)"
    del stamp["recipe"]                                              # a stamp from before recipes: kept
    (out / store.BUILD_STAMP).write_text(json.dumps(stamp))
    assert store.is_built("fake-trained")


def test_every_micro_model_has_its_spec_as_recipe():
    from ftis_fed.policies import micro

    assert {n: store.RECIPES[n] for n in micro.MICRO_MODELS} == {n: repr(s) for n, s in micro.MICRO_MODELS.items()}


def test_an_untrained_build_needs_no_stamp(tmp_path, monkeypatch):
    monkeypatch.setenv("FTIS_FED_CACHE", str(tmp_path))
    calls = []
    monkeypatch.setitem(store.OFFLINE_MODELS, "fake-init",
                        lambda out: (out.mkdir(parents=True), calls.append(1), (out / "config.json").write_text("{}")))
    resolve_model("fake-init")
    resolve_model("fake-init")
    assert calls == [1] and not (tmp_path / "models" / "fake-init" / store.BUILD_STAMP).exists()


def test_the_trained_builds_are_registered():
    assert {"micro-llama-w250", "micro-llama-w-sub", "tiny-arith", "smollm2-sub30", "smollm2-l20",
            "smollm2-l20-sft"} <= store.TRAINED_BUILDS <= set(store.OFFLINE_MODELS)
    assert not {"smollm2", "tiny-llama", "tiny-llama-b", "smollm2-bpe8k"} & store.TRAINED_BUILDS


@pytest.mark.slow
def test_the_learning_tier_model_is_the_committed_one_on_any_avx2_cpu():
    """``micro-llama-w250`` (the learning tier's model) resolved from the cache, built through the pinned
    child if it is not there: stamped with ATen's AVX2 capability and byte for byte the weights that built
    every committed learning-tier cell (an AVX-512 build without the pin gave other weights: greedy ID
    0.672 instead of 0.617 in ``tests/test_research.py``'s calibrated cell). ~80 s of CPU when it builds."""
    if store.build_kernels() != "avx2":
        pytest.skip("this CPU has no AVX2: its builds are its own")
    from pathlib import Path

    folder = Path(resolve_model("micro-llama-w250"))
    stamp = json.loads((folder / store.BUILD_STAMP).read_text())
    assert stamp["kernels"] == "avx2" and stamp["aten_capability"] == "AVX2"
    digest = hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()
    assert digest == "d1504431e22c0e5da3c8a6c5d2f32fa941dc679baeec1004e1ac145d50420451"


def test_a_run_from_the_command_line_restarts_itself_pinned_once(monkeypatch, tmp_path):
    """``ftis-fed grid`` / ``sim`` started from the command line (``main()`` without argv) exec the same
    interpreter and arguments with ``PINNED_KERNELS`` on a CPU with AVX2; not when either variable is set
    (pinned already, or the user's own choice), not on a CPU without AVX2, not for other commands, not
    when called with argv (a library call: the caller's process is not replaced)."""
    for k in store.PINNED_KERNELS:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(store, "build_kernels", lambda: "avx2")
    execs = []

    class Exec(Exception):
        pass

    def fake_exec(path, args, env):
        execs.append((path, args, env))
        raise Exec
    monkeypatch.setattr(os, "execve", fake_exec)
    argv = ["grid", "--summary-only", "--out", str(tmp_path / "none")]
    monkeypatch.setattr(sys, "argv", ["ftis-fed", *argv])
    monkeypatch.setattr(sys, "orig_argv", [sys.executable, "/venv/bin/ftis-fed", *argv])
    with pytest.raises(Exec):
        cli.main()
    (path, args, env), = execs
    assert path == sys.executable and args == [sys.executable, "/venv/bin/ftis-fed", *argv]
    assert {k: env[k] for k in store.PINNED_KERNELS} == store.PINNED_KERNELS
    assert store.run_pin_env() is not None
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx512")              # the user's choice: kept
    assert store.run_pin_env() is None
    monkeypatch.delenv("ATEN_CPU_CAPABILITY")
    monkeypatch.setattr(store, "build_kernels", lambda: "native")     # no AVX2: runs as it is
    assert store.run_pin_env() is None
    monkeypatch.setattr(store, "build_kernels", lambda: "avx2")
    # a participant's worker (clients/worker.py) starts with the same rule, on the environment it is given
    assert store.with_pinned_kernels({"PATH": "/bin"}) == {"PATH": "/bin", **store.PINNED_KERNELS}
    assert store.with_pinned_kernels({"MKL_ENABLE_INSTRUCTIONS": "AVX512"}) == {"MKL_ENABLE_INSTRUCTIONS": "AVX512"}
    assert cli.main(argv) != 0                    # a library call: no exec; the command ran (and found no cell)
    assert len(execs) == 1
    assert store.run_kernels() == "native"
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx512")
    assert store.run_kernels() == "ATEN_CPU_CAPABILITY=avx512"                 # the user's choice, recorded
    for k, v in store.PINNED_KERNELS.items():
        monkeypatch.setenv(k, v)
    assert store.run_kernels() == "avx2-pinned"


@pytest.mark.slow
def test_a_committed_learning_tier_cell_reproduces_from_the_command_line_on_any_avx2_cpu(tmp_path, capsys,
                                                                                          monkeypatch):
    """The committed ``research-w`` F-TIS seed-0 cell (run on an AVX2 machine) rerun by ``ftis-fed grid``
    for two rounds (``sims.rerun_cell``) gives its train rows value for value: rewards, lengths, losses
    and every off-policy figure of the own and the peer's samples. Unpinned on an AVX-512 CPU
    (``ATEN_CPU_CAPABILITY=avx512``) the own samples' log-ratio statistics differed from round 1
    (``log_ratio_mean`` −4.7e-8 against −1.8e-7) and the runs sampled other tokens by round ~10. ~30 s of
    CPU with the model cached."""
    if store.build_kernels() != "avx2":
        pytest.skip("this CPU has no AVX2: its runs are its own")
    from sims import rerun_cell

    cell = Path(__file__).resolve().parents[1] / "docs" / "results" / "research-w" / "cells" / "F-TIS__vertical__s0"
    for k in store.PINNED_KERNELS:
        monkeypatch.delenv(k, raising=False)         # the command pins itself (this process is not pinned)
    assert rerun_cell.main([str(cell), "--rounds", "2", "--keep", str(tmp_path / "out")]) == 0
    assert "244 figures compared" in capsys.readouterr().out
    assert json.loads((tmp_path / "out" / "cells" / cell.name / "done.json").read_text())["kernels"] == "avx2-pinned"
    committed = rerun_cell.train_rows(cell, 2)
    key = ("lora", 2, "train", 0)
    changed = {k: {**r, "reward/mean": r["reward/mean"] + 1e-9} if k == key else r for k, r in committed.items()}
    assert rerun_cell.differences(committed, changed)[1] == [
        f"lora round 2 reward/mean: {committed[key]['reward/mean'] + 1e-9!r} in the rerun, "
        f"{committed[key]['reward/mean']!r} committed"]
    del changed[("full", 1, "train", 0)]
    assert rerun_cell.differences(committed, changed)[1][0] == "full round 1: no train row in the rerun"


def test_several_cells_rerun_in_turn_and_the_tally_names_those_that_differ_or_failed(tmp_path, monkeypatch,
                                                                                    capsys):
    """``sims.rerun_cell`` with several cells (its grid command faked: it puts a copy of the committed
    cell in place, one with a round-1 figure changed): each is said as it ends, then a tally; a folder
    that is no finished cell is one failure, not the end of the others. Exit status the worst of them."""
    import shutil
    import subprocess

    from sims import rerun_cell

    committed = Path(__file__).resolve().parents[1] / "docs" / "results" / "research-w" / "cells"
    ran = []

    def nudge_first_loss(rows):
        next(r for r in rows if r.get("phase") == "train" and r.get("round") == 1
             and "train/loss" in r)["train/loss"] += 1e-9
        return rows

    def fake_run(cmd, **kw):
        out = Path(cmd[cmd.index("--out") + 1])
        name = next(c for c in ("VIS__vertical__s5", "noIS__vertical__s6") if c.split("__")[0] in cmd)
        ran.append((name, out))
        shutil.copytree(committed / name, out / "cells" / name)
        if name.startswith("noIS"):
            rewrite_metrics(out / "cells" / name, nudge_first_loss)
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(rerun_cell.subprocess, "run", fake_run)
    cells = [committed / "VIS__vertical__s5", committed / "noIS__vertical__s6", tmp_path / "no-cell"]
    assert rerun_cell.main([*map(str, cells), "--rounds", "1", "--keep", str(tmp_path / "out")]) == 2
    assert [n for n, _ in ran] == ["VIS__vertical__s5", "noIS__vertical__s6"]
    assert ran[0][1] == tmp_path / "out" / "0-VIS__vertical__s5"           # a folder each under --keep
    out, err = capsys.readouterr()
    assert "VIS__vertical__s5, rounds 1-1:" in out and "every figure equal" in out
    assert "1 differ, the first:" in out and "train/loss" in out
    assert "no-cell" in err
    assert out.rstrip().endswith(f"3 cells, rounds 1-1: 1 equal, 1 differ, 1 failed\n  differ: {cells[1]}\n"
                                 f"  failed: {cells[2]}")
