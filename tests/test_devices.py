"""Device selection, GPU pass-through past Ray's masking, and memory-share arithmetic (ftis_fed/policies/devices.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from ftis_fed.policies.devices import (ALL, CUDA_ENV, VISIBLE_ENV, DeviceError, count_visible, launcher_env, memory_shares,
                              parse_device, pin_env, select_device, worker_device, worker_env)


# ----------------------------------------------------------------------------- selection

def test_auto_is_the_first_visible_cuda_device_else_cpu():
    assert select_device("auto", cuda_count=2) == "cuda:0"
    assert select_device("auto", cuda_count=0) == "cpu"
    assert select_device("cpu", cuda_count=4) == "cpu"
    assert select_device("CUDA", cuda_count=1) == "cuda:0"
    assert select_device("cuda:1", cuda_count=2) == "cuda:1"


def test_an_invisible_device_is_an_error_naming_the_key_and_what_is_visible():
    with pytest.raises(DeviceError, match=r"p2-device='cuda:2': not visible; visible CUDA devices: cuda:0, cuda:1"):
        select_device("cuda:2", cuda_count=2, key="p2-device", env={CUDA_ENV: "4,7"})
    with pytest.raises(DeviceError, match=r"device='cuda:0'.*none.*Ray hides GPUs"):
        select_device("cuda:0", cuda_count=0, env={CUDA_ENV: ""})
    for bad in ("gpu", "cuda:-1", "cuda:x", "", "mps"):
        with pytest.raises(DeviceError, match=r"p0-device=.*must be 'auto', 'cpu', 'cuda' or 'cuda:N'"):
            parse_device(bad, key="p0-device")


# ----------------------------------------------------------------------------- pass-through

def test_the_launchers_gpus_reach_the_worker_not_rays_mask():
    launcher = launcher_env({CUDA_ENV: "2,3", "PATH": "/bin"})
    assert launcher[VISIBLE_ENV] == "2,3"
    actor = {**launcher, CUDA_ENV: ""}                          # what Ray gives an actor without GPUs
    env = worker_env(actor)
    assert env[CUDA_ENV] == "2,3" and env["PATH"] == "/bin"
    # the launcher saw every GPU (unset): the worker gets it unset too, not Ray's ""
    env = worker_env({**launcher_env({}), CUDA_ENV: ""})
    assert CUDA_ENV not in env and launcher_env({})[VISIBLE_ENV] == ALL
    # the launcher hid every GPU on purpose: that stays
    assert worker_env({**launcher_env({CUDA_ENV: ""}), CUDA_ENV: "0"})[CUDA_ENV] == ""
    # a deployed SuperNode without a launcher: what the user set is kept
    assert worker_env({CUDA_ENV: "1"})[CUDA_ENV] == "1"
    # an outer launcher's value is not overwritten by an inner one (e.g. ftis-fed grid -> sim)
    assert launcher_env({VISIBLE_ENV: "5", CUDA_ENV: ""})[VISIBLE_ENV] == "5"


def test_pin_narrows_the_worker_to_its_device():
    assert pin_env({CUDA_ENV: "4,7"}, "cuda:1") == ({CUDA_ENV: "7"}, "cuda:0")
    assert pin_env({}, "cuda:3")[0][CUDA_ENV] == "3"
    assert pin_env({CUDA_ENV: "4,7"}, "cpu") == ({CUDA_ENV: ""}, "cpu")
    with pytest.raises(DeviceError, match=r"device='cuda:2': not visible; visible CUDA devices: cuda:0, cuda:1"):
        pin_env({CUDA_ENV: "4,7"}, "cuda:2")
    with pytest.raises(DeviceError, match="resolve 'auto'"):
        pin_env({}, "auto")


def test_worker_device_selects_then_pins_before_cuda_starts():
    assert worker_device("cuda:1", {CUDA_ENV: "4,7"}, count=2) == ({CUDA_ENV: "7"}, "cuda:0", "cuda:1")
    assert worker_device("auto", {CUDA_ENV: "4,7"}, count=2)[1:] == ("cuda:0", "cuda:0")
    with pytest.raises(DeviceError, match=r"p1-device='cuda:1': not visible"):
        worker_device("cuda:1", {CUDA_ENV: "4"}, key="p1-device", count=1)


def test_count_visible_asks_a_child_process():
    """A hidden view counts 0 devices (no child needed), so 'auto' means the CPU and the worker is
    pinned to no GPU at all; asked in a child process (a torch import), the count is this machine's.
    The caller never initialises CUDA."""
    import torch

    env, local, chosen = worker_device("auto", {**os.environ, CUDA_ENV: ""})
    assert (local, chosen, env[CUDA_ENV]) == ("cpu", "cpu", "")
    here = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert count_visible({k: v for k, v in os.environ.items() if k != CUDA_ENV}, ask_child=True) == here
    assert not torch.cuda.is_initialized()


_ACTOR_PROBE = r"""
import json, os, subprocess, sys
import ray
from ftis_fed.policies.devices import worker_env

ray.init(num_cpus=1, num_gpus=2, include_dashboard=False, log_to_driver=False)

@ray.remote(num_cpus=1, num_gpus=0)
class ClientAppActor:                      # like Flower's simulation actors: no GPU requested
    def probe(self):
        child = [sys.executable, "-c", "import os; print(os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>'))"]
        out = lambda env: subprocess.run(child, env=env, capture_output=True, text=True).stdout.strip()
        return {"actor": os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>"),
                "plain_child": out(dict(os.environ)), "worker": out(worker_env(os.environ))}

print(json.dumps(ray.get(ClientAppActor.remote().probe.remote())))
ray.shutdown()
"""


@pytest.mark.slow                                                      # ~20-25 s: starts a Ray cluster
def test_through_a_real_ray_actor_the_worker_sees_the_launchers_gpus():
    """A real Ray actor without GPUs (Flower's simulation backend): Ray masks CUDA_VISIBLE_DEVICES
    for it and any process it starts the plain way; the worker environment built from the
    launcher's variable restores the launcher's devices."""
    pytest.importorskip("ray")
    env = launcher_env({**os.environ, CUDA_ENV: "0,1"})
    env["PYTHONPATH"] = os.pathsep.join([os.getcwd(), env.get("PYTHONPATH", "")])
    short = tempfile.mkdtemp(prefix="ray", dir="/tmp")                 # Ray's socket paths must be short
    env["RAY_TMPDIR"] = short
    try:
        r = subprocess.run([sys.executable, "-c", _ACTOR_PROBE], env=env, capture_output=True, text=True, timeout=180,
                           cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    finally:
        shutil.rmtree(short, ignore_errors=True)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["actor"] == "" and got["plain_child"] == ""           # Ray's mask (the bug being fixed)
    assert got["worker"] == "0,1"                                    # the launcher's devices


# ----------------------------------------------------------------------------- memory shares

def test_derived_shares_split_the_budget_per_card():
    devs = {"a": "cuda:0", "b": "cuda:0", "c": "cuda:0", "d": "cuda:1", "e": "cpu"}
    s = memory_shares(devs, engines={"a", "d"}, budget=0.9, engine_fraction=0.4)
    assert set(s) == {"a", "b", "c", "d"}                             # cpu participants get none
    assert s["a"].share == pytest.approx(0.3) and s["b"].share == pytest.approx(0.3)
    assert s["a"].engine == pytest.approx(0.12) and s["b"].engine == 0.0
    assert s["d"].share == pytest.approx(0.9) and s["d"].engine == pytest.approx(0.36)
    for card in ("cuda:0", "cuda:1"):
        assert sum(v.share for v in s.values() if v.device == card) == pytest.approx(0.9)


def test_explicit_shares_are_kept_and_the_rest_is_split():
    s = memory_shares({"a": "cuda:0", "b": "cuda:0", "c": "cuda:0"}, explicit={"a": 0.5, "b": 0.0})
    assert s["a"] == memory_shares({"a": "cuda:0"}, explicit={"a": 0.5})["a"] and s["a"].explicit
    assert s["b"].share == pytest.approx(0.2) and s["c"].share == pytest.approx(0.2) and not s["b"].explicit
    assert sum(v.share for v in s.values()) <= 0.9 + 1e-12


def test_oversubscribed_cards_are_clear_errors():
    with pytest.raises(DeviceError, match=r"gpu-memory-share oversubscribes cuda:0: a 0.6 \+ b 0.5 = 1.1 > 0.9"):
        memory_shares({"a": "cuda:0", "b": "cuda:0", "c": "cuda:1"}, explicit={"a": 0.6, "b": 0.5, "c": 0.8})
    with pytest.raises(DeviceError, match=r"cuda:0: b would get 0.02 of the card each.*explicit gpu-memory-share of a"):
        memory_shares({"a": "cuda:0", "b": "cuda:0"}, explicit={"a": 0.88})
    with pytest.raises(DeviceError, match=r"a: gpu-memory-share=1.2: must be in \(0, 1\)"):
        memory_shares({"a": "cuda:0"}, explicit={"a": 1.2})
    with pytest.raises(DeviceError, match="must be resolved"):
        memory_shares({"a": "auto"})
    # the same explicit shares on two different cards are fine
    s = memory_shares({"a": "cuda:0", "b": "cuda:1"}, explicit={"a": 0.6, "b": 0.6})
    assert s["a"].share == s["b"].share == 0.6


def test_run_memory_share_splits_a_card_between_the_run_s_participants():
    """Three participants on one card, one with an explicit share: the others share what is left;
    a CPU participant gets none; explicit shares that oversubscribe the card are an error."""
    import tomllib
    from pathlib import Path

    from ftis_fed.config.federation import run_memory_share
    from ftis_fed.policies.devices import DeviceError

    cfg = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())
    rc = dict(cfg["tool"]["flwr"]["app"]["config"])
    rc.update({"p0-device": "cuda:0", "p1-device": "cuda:0", "p2-device": "cuda:0", "p3-device": "cpu",
               "p0-gpu-memory-share": 0.3})
    assert run_memory_share(rc, "smol-full", 1) == 0.3
    assert abs(run_memory_share(rc, "smol-lora", 1) - 0.3) < 1e-9          # (0.9 - 0.3) / 2
    assert run_memory_share(rc, "smol-bpe8k", 1) == 0.0
    rc.update({"p1-gpu-memory-share": 0.5, "p2-gpu-memory-share": 0.2})
    with pytest.raises(DeviceError, match="oversubscribes cuda:0"):
        run_memory_share(rc, "smol-full", 1)
