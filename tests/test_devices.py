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
from ftis_fed.policies.devices import VISIBLE_ENV, start_environment, worker_env

ray.init(num_cpus=1, num_gpus=2, include_dashboard=False, log_to_driver=False)

@ray.remote(num_cpus=1, num_gpus=0)
class ClientAppActor:                      # like Flower's simulation actors: no GPU requested
    def probe(self):
        child = [sys.executable, "-c", "import os; print(os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>'))"]
        out = lambda env: subprocess.run(child, env=env, capture_output=True, text=True).stdout.strip()
        return {"actor": os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>"),
                "plain_child": out(dict(os.environ)), "worker": out(worker_env(os.environ)),
                "plain_flwr_run": out(worker_env({k: v for k, v in os.environ.items() if k != VISIBLE_ENV},
                                                 start_environment()))}

print(json.dumps(ray.get(ClientAppActor.remote().probe.remote())))
ray.shutdown()
"""


@pytest.mark.slow                                                      # ~20-25 s: starts a Ray cluster
def test_through_a_real_ray_actor_the_worker_sees_the_launchers_gpus():
    """A real Ray actor without GPUs (Flower's simulation backend): Ray masks CUDA_VISIBLE_DEVICES
    for it and any process it starts the plain way; the worker environment built from the
    launcher's variable restores the launcher's devices, and so does, without the launcher (a
    plain `flwr run`), the actor's start environment (Ray masks os.environ at run time)."""
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
    assert got["plain_flwr_run"] == "0,1"                            # no launcher: the actor's start environment


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


def test_run_memory_share_splits_a_card_between_the_run_s_participants(monkeypatch):
    """Three participants on one card, one with an explicit share: the others share what is left;
    a CPU participant gets none; explicit shares that oversubscribe the card are an error. It reads
    the keys it needs: no run config parsed, no spec built (the worker has its parse)."""
    import tomllib
    from pathlib import Path

    from ftis_fed.config.federation import FederationConfig, ParticipantSpec
    from ftis_fed.config.gpu_shares import run_memory_share
    from ftis_fed.policies.devices import DeviceError

    made = []
    for cls in (FederationConfig, ParticipantSpec):
        monkeypatch.setattr(cls, "__post_init__", lambda self, real=cls.__post_init__: made.append(1) or real(self))

    cfg = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())
    rc = dict(cfg["tool"]["flwr"]["app"]["config"])
    rc.update({"p0-device": "cuda:0", "p1-device": "cuda:0", "p2-device": "cuda:0", "p3-device": "cpu",
               "p0-gpu-memory-share": 0.3})
    assert run_memory_share(rc, "smol-full", 1) == 0.3
    assert abs(run_memory_share(rc, "smol-lora", 1) - 0.3) < 1e-9          # (0.9 - 0.3) / 2
    assert run_memory_share(rc, "smol-bpe8k", 1) == 0.0
    assert made == []
    rc.update({"p1-gpu-memory-share": 0.5, "p2-gpu-memory-share": 0.2})
    with pytest.raises(DeviceError, match="oversubscribes cuda:0"):
        run_memory_share(rc, "smol-full", 1)


# ----------------------------------------------------------------------------- spreading over the cards

def test_auto_spreads_participants_over_the_visible_cards_by_index():
    assert [select_device("auto", 4, index=i) for i in range(6)] == [
        "cuda:0", "cuda:1", "cuda:2", "cuda:3", "cuda:0", "cuda:1"]
    assert select_device("auto", 0, index=5) == "cpu"
    assert select_device("cuda:1", 2, index=0) == "cuda:1"                  # an explicit card is kept
    # pinned in the launcher's numbering: participant 1 of 2 on CUDA_VISIBLE_DEVICES=4,7 gets card 7
    assert worker_device("auto", {CUDA_ENV: "4,7"}, count=2, index=1) == ({CUDA_ENV: "7"}, "cuda:0", "cuda:1")
    with pytest.raises(DeviceError, match="index -1: must be >= 0"):
        select_device("auto", 2, index=-1)


def test_run_memory_share_follows_the_spreading():
    """Four participants on two cards: two per card, so each gets half of the budget."""
    import tomllib
    from pathlib import Path

    from ftis_fed.config.participants import participant_names
    from ftis_fed.config.gpu_shares import run_memory_share

    cfg = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())
    rc = dict(cfg["tool"]["flwr"]["app"]["config"])
    names = participant_names(rc)
    assert len(names) >= 3
    one = run_memory_share(rc, names[0], 1)
    two = run_memory_share(rc, names[0], 2)
    on_card0 = len(range(0, len(names), 2))
    assert one == pytest.approx(0.9 / len(names)) and two == pytest.approx(0.9 / on_card0)


# ----------------------------------------------------------------------------- plain `flwr run`: Ray's mask

def test_without_a_launcher_the_worker_takes_the_actors_start_environment():
    """Ray writes CUDA_VISIBLE_DEVICES='' into an actor's os.environ after the actor started; the
    value it started with (its /proc environment) is what the machine's user gave the run."""
    from ftis_fed.policies.devices import FROM_ENV

    env = worker_env({CUDA_ENV: "", "PATH": "/bin"}, start_env={CUDA_ENV: "2,3"})
    assert env[CUDA_ENV] == "2,3" and FROM_ENV in env
    env = worker_env({CUDA_ENV: ""}, start_env={"PATH": "/bin"})             # unset at start: every GPU
    assert CUDA_ENV not in env
    assert worker_env({CUDA_ENV: ""}, start_env={CUDA_ENV: ""})[CUDA_ENV] == ""     # hidden on purpose
    assert worker_env({CUDA_ENV: "1"}, start_env={CUDA_ENV: "0,1"})[CUDA_ENV] == "1"  # not masked: kept
    assert worker_env({CUDA_ENV: ""})[CUDA_ENV] == ""                          # nothing to go by


def test_start_environment_reads_the_environment_a_process_started_with(tmp_path):
    from ftis_fed.policies.devices import start_environment

    f = tmp_path / "environ"
    f.write_bytes(b"A=1\0CUDA_VISIBLE_DEVICES=0,1\0EMPTY=\0")
    assert start_environment(f) == {"A": "1", CUDA_ENV: "0,1", "EMPTY": ""}
    assert start_environment(tmp_path / "missing") is None
    r = subprocess.run([sys.executable, "-c", _LOAD_DEVICES + "import os, json; os.environ['CUDA_VISIBLE_DEVICES'] = ''; "
                        "print(json.dumps(devices.start_environment().get('CUDA_VISIBLE_DEVICES', '<unset>')))",
                        DEVICES_PY],
                       env={**os.environ, CUDA_ENV: "5"}, capture_output=True, text=True,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == "5"                                  # not the value set at run time


# ----------------------------------------------------------------------------- what the driver shows

_SMI_Q = """
==============NVSMI LOG==============

Timestamp                                 : Tue Dec  1 07:00:00 2026
Driver Version                            : {driver}
CUDA Version                              : {cuda}

Attached GPUs                             : 2
GPU 00000000:17:00.0
    Product Name                          : NVIDIA H200
    Product Brand                         : NVIDIA
GPU 00000000:2A:00.0
    Product Name                          : NVIDIA H200
"""


def fake_smi(tmp_path, driver="550.54.14", cuda="12.4", code=0):
    exe = tmp_path / "nvidia-smi"
    (tmp_path / "smi.txt").write_text(_SMI_Q.format(driver=driver, cuda=cuda))
    exe.write_text(f"#!/bin/sh\ncat {tmp_path / 'smi.txt'}\nexit {code}\n")
    exe.chmod(0o755)
    return str(exe)


def test_nvidia_driver_reads_nvidia_smi_else_proc(tmp_path):
    from ftis_fed.policies.devices import Driver, nvidia_driver

    assert nvidia_driver(fake_smi(tmp_path)) == Driver(("NVIDIA H200", "NVIDIA H200"), "550.54.14", "12.4")
    proc = tmp_path / "proc"
    (proc / "gpus" / "0000:17:00.0").mkdir(parents=True)
    (proc / "gpus" / "0000:17:00.0" / "information").write_text("Model: \t\t NVIDIA A10\nIRQ:   1\n")
    (proc / "version").write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 UTC 2023\n")
    broken = fake_smi(tmp_path / "x" if (tmp_path / "x").mkdir() is None else tmp_path, code=9)
    assert nvidia_driver(broken, proc) == Driver(("NVIDIA A10",), "535.104.05", "")
    assert nvidia_driver(str(tmp_path / "none"), tmp_path / "no-proc") == Driver()


def test_cuda_problem_names_the_cause_in_one_line():
    from ftis_fed.policies.devices import Driver, cuda_problem

    h200 = Driver(("NVIDIA H200", "NVIDIA H200"), "550.54.14", "12.4")
    cu13 = {"count": 0, "torch": "2.11.0+cu130", "cuda": "13.0", "warning": ""}
    msg = cuda_problem(h200, cu13, {})
    assert msg == ("this machine has 2 NVIDIA GPUs (NVIDIA H200; driver 550.54.14, CUDA 12.4) but torch 2.11.0+cu130 "
                   "is built for CUDA 13.0, which needs a driver for CUDA 13 (>= 580.65.06): update the NVIDIA "
                   "driver or install a torch built for CUDA 12.4")
    assert "\n" not in msg
    # no CUDA version from nvidia-smi: the driver version against NVIDIA's minimum
    assert "needs a driver for CUDA 13" in cuda_problem(Driver(("A10",), "535.104.05", ""), cu13)
    assert cuda_problem(Driver(("A10",), "580.95.05", ""), cu13).endswith("(torch.cuda.is_available() is False)")
    assert "CPU-only build" in cuda_problem(h200, {"count": 0, "torch": "2.11.0+cpu", "cuda": None})
    assert "CUDA_VISIBLE_DEVICES='' hides them" in cuda_problem(h200, cu13, {CUDA_ENV: ""})
    said = {**cu13, "cuda": "12.1", "warning": "CUDA initialization: Unexpected error from cudaGetDeviceCount()"}
    assert cuda_problem(h200, said).endswith("sees none: CUDA initialization: Unexpected error from cudaGetDeviceCount()")
    assert cuda_problem(h200, {**cu13, "count": 2}) is None                   # torch sees them: nothing to say
    assert cuda_problem(Driver(), cu13) is None                              # no GPU on this machine


def test_a_gpu_machine_never_runs_an_auto_participant_on_the_cpu_silently():
    from ftis_fed.policies.devices import Driver

    h200 = Driver(("NVIDIA H200",), "550.54.14", "12.4")
    probe = {"count": 0, "torch": "2.11.0+cu130", "cuda": "13.0", "warning": ""}
    with pytest.raises(DeviceError, match=r"^p1: device='auto': this machine has 1 NVIDIA GPU .* needs a driver "
                                          r"for CUDA 13 .*; set device='cpu' to run on the CPU$"):
        worker_device("auto", {}, key="p1: device", count=0, driver=h200, probe=probe)
    with pytest.raises(DeviceError, match="CUDA_VISIBLE_DEVICES='' hides it"):
        worker_device("cuda:0", {CUDA_ENV: ""}, count=0, driver=h200)
    assert worker_device("cpu", {}, driver=h200)[1:] == ("cpu", "cpu")      # asked for the CPU: fine
    assert worker_device("auto", {}, count=0, driver=Driver())[1:] == ("cpu", "cpu")   # no GPU at all


def test_launcher_cuda_problem_costs_nothing_without_a_driver(tmp_path, monkeypatch):
    from ftis_fed.policies import devices

    assert devices.launcher_cuda_problem({}, devices.Driver()) is None
    h200 = devices.Driver(("NVIDIA H200",), "550.54.14", "12.4")
    monkeypatch.setattr(devices, "cuda_probe", lambda env, python=None: {"count": 0, "torch": "2.9+cpu", "cuda": None})
    assert "CPU-only build" in devices.launcher_cuda_problem({}, h200)


# ----------------------------------------------------------------------------- one start-up per card

#: devices.py alone (standard library only), without the package (torch): fast child processes
_LOAD_DEVICES = ("import importlib.util as u, sys; s = u.spec_from_file_location('devices', sys.argv[-1]); "
                 "devices = sys.modules['devices'] = u.module_from_spec(s); s.loader.exec_module(devices)\n")
DEVICES_PY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "ftis_fed", "policies",
                          "devices.py")

_LOCKER = _LOAD_DEVICES + r"""
import time
from pathlib import Path
card_lock = devices.card_lock
name, events, go = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
def log(line):
    with open(events, "a") as fh:
        fh.write(f"{name} {line}\n")
with card_lock(f"participant {name}", log=lambda m: log("waiting " + m)) as card:
    log(f"enter {card}")
    while not go.exists():
        time.sleep(0.05)
    log("exit")
"""


def test_engine_start_ups_on_one_card_run_one_after_another(tmp_path):
    """Two processes pinned to the same card: the second finds the lock held (it says by whom) and
    enters only after the first has left; a process on another card does not wait."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    events = tmp_path / "events"
    env = {**os.environ, "FTIS_FED_RUNTIME": str(tmp_path / "rt"), CUDA_ENV: "3", "PYTHONPATH": root}

    def start(name, go, **extra):
        return subprocess.Popen([sys.executable, "-c", _LOCKER, name, str(events), str(go), DEVICES_PY], env={**env, **extra},
                                cwd=root)

    def wait_for(pred, procs):
        for _ in range(2400):                          # an event, not a speed: fails only if it never comes
            if pred(events.read_text() if events.exists() else ""):
                return
            assert all(p.poll() is None for p in procs), events.read_text() if events.exists() else ""
            subprocess.run(["sleep", "0.05"])
        for p in procs:
            p.kill()
        raise AssertionError(f"never happened; events: {events.read_text() if events.exists() else ''}")

    a = start("a", tmp_path / "go-a")
    wait_for(lambda t: "a enter 3" in t, [a])
    b = start("b", tmp_path / "go-b")
    c = start("c", tmp_path / "go-c", CUDA_VISIBLE_DEVICES="4")           # another card
    wait_for(lambda t: "b waiting" in t and "c enter 4" in t, [a, b, c])
    text = events.read_text()
    assert "b enter" not in text and f"pid {a.pid} (participant a)" in text   # b waits, naming the holder
    (tmp_path / "go-a").touch()
    (tmp_path / "go-b").touch()
    (tmp_path / "go-c").touch()
    for p in (a, b, c):
        assert p.wait(timeout=60) == 0
    lines = [line for line in events.read_text().splitlines() if line.startswith(("a ", "b "))]
    assert [line.split()[:2] for line in lines] == [["a", "enter"], ["b", "waiting"], ["a", "exit"],
                                                     ["b", "enter"], ["b", "exit"]]


def test_card_lock_is_nothing_without_a_gpu(tmp_path):
    from ftis_fed.policies.devices import card_lock, card_of

    assert card_of({CUDA_ENV: ""}) is None and card_of({}) == "0" and card_of({CUDA_ENV: "GPU-ab,1"}) == "GPU-ab"
    with card_lock("x", env={CUDA_ENV: "", "FTIS_FED_RUNTIME": str(tmp_path)}) as card:
        assert card is None
    assert not list(tmp_path.glob("gpu-*.lock"))


# ----------------------------------------------------------------------------- the launcher, at start

def test_the_launcher_says_in_one_line_that_torch_cannot_use_the_gpus(tmp_path, monkeypatch, capsys):
    """`ftis-fed sim` on a pretend GPU machine (a fake nvidia-smi) with this CPU build of torch: one
    line at start, and no run, since its participants (device auto) would stop at once."""
    from pathlib import Path

    from ftis_fed.commands.sim import gpu_check_at_start, simulate

    fake_smi(tmp_path)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FLWR_HOME", str(tmp_path / "flwr-home"))
    root = Path(__file__).resolve().parent.parent
    with pytest.raises(ValueError, match=r"^device='auto' \(participant smol-full\): this machine has 2 NVIDIA GPUs "
                                         r"\(NVIDIA H200; driver 550.54.14, CUDA 12.4\) but torch .* CPU-only build"):
        simulate(root, run_config=[f'output-dir="{tmp_path / "out"}"'])
    out = capsys.readouterr().out
    assert [line for line in out.splitlines() if line.startswith("[ftis-fed] CUDA: this machine has 2 NVIDIA GPUs")]
    assert not (tmp_path / "out").exists()                                 # nothing started
    # every participant on the CPU on purpose: reported, not refused; nothing to report: silent
    gpu_check_at_start({"device": "cpu", "p1-device": ""}, 2, "the problem")
    with pytest.raises(ValueError, match=r"^p1-device='cuda:1' \(participant p1\): the problem; set p1-device='cpu'"):
        gpu_check_at_start({"device": "cpu", "p1-device": "cuda:1"}, 2, "the problem")
    gpu_check_at_start({"device": "auto"}, 2, None)


# ----------------------------------------------------------------------------- a run that needs a GPU, without one

def test_a_run_that_needs_a_gpu_refuses_without_one_unless_told_cpu():
    """requires-gpu = true: `auto` with no visible CUDA device is refused, naming the key and the way
    out; `cpu` is never refused; `cuda:N` with none visible is refused whatever requires-gpu says."""
    from ftis_fed.commands.sim import gpu_check_at_start
    from ftis_fed.policies.devices import no_gpu_refusal, worker_device

    assert no_gpu_refusal("auto", 0, requires_gpu=False) is None         # the default: auto may be the CPU
    assert no_gpu_refusal("auto", 1, requires_gpu=True) is None
    assert no_gpu_refusal("cpu", 0, requires_gpu=True) is None
    assert "names a CUDA device" in no_gpu_refusal("cuda:0", 0, key="p1-device")
    line = no_gpu_refusal("auto", 0, requires_gpu=True, key="p2-device")
    assert line.startswith("p2-device='auto': requires-gpu = true") and line.endswith("set p2-device='cpu' to run on the CPU")
    # the worker (plain `flwr run`) refuses with the same line, before anything initialises CUDA
    with pytest.raises(DeviceError, match=r"^p0-device='auto': requires-gpu = true"):
        worker_device("auto", {CUDA_ENV: ""}, key="p0-device", requires_gpu=True)
    assert worker_device("auto", {CUDA_ENV: ""}, key="p0-device")[2] == "cpu"
    assert worker_device("cpu", {CUDA_ENV: ""}, key="p0-device", requires_gpu=True)[2] == "cpu"
    # the launcher: one participant left on auto stops it; all on the CPU on purpose do not
    cfg = {"requires-gpu": True, "device": "cpu", "p1-device": "auto", "p1-participant": "b"}
    with pytest.raises(ValueError, match=r"^p1-device='auto' \(participant b\): requires-gpu = true"):
        gpu_check_at_start(cfg, 2, None, 0)
    gpu_check_at_start({**cfg, "p1-device": "cpu"}, 2, None, 0)
    gpu_check_at_start(cfg, 2, None, 1)
    with pytest.raises(ValueError, match=r"^device='cuda:0' \(participant p0\): names a CUDA device"):
        gpu_check_at_start({"device": "cuda:0"}, 1, None, 0)


@pytest.mark.skipif(os.path.exists("/dev/nvidiactl") or bool(shutil.which("nvidia-smi")),
                    reason="needs a machine without an NVIDIA driver")
def test_a_gpu_preset_on_this_cpu_machine_stops_at_once_with_the_reason(tmp_path):
    """`ftis-fed sim --preset gpu-offline` here: exit status 2 and the reason, before Flower starts
    (no SuperLink, no output folder, no Flower configuration written); with device='cpu' the
    check passes (the run itself does not start: the SuperLink's port is taken)."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "FLWR_HOME": str(tmp_path / "flwr-home")}
    env.pop(CUDA_ENV, None)
    exe = [sys.executable, "-m", "ftis_fed.commands.cli", "sim", "--app", str(root), "--preset", "gpu-offline"]
    import resource
    import time

    cpu0, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.monotonic()
    r = subprocess.run(exe + ["--run-config", f'output-dir="{tmp_path / "out"}"'], env=env, capture_output=True,
                       text=True, timeout=300)
    cpu1, wall = resource.getrusage(resource.RUSAGE_CHILDREN), time.monotonic() - t0
    assert r.returncode == 2, r.stdout + r.stderr
    # in seconds: the CPU time of the whole launch (imports, config check, device check; no model,
    # no Flower), which load on the machine does not inflate; the wall time only loosely bounded
    cpu = cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime
    assert cpu < 30 and wall < 120, (cpu, wall)
    assert ("ftis-fed sim: error: device='auto' (participant smol-full): requires-gpu = true (this run needs a GPU), "
            "but no CUDA device is visible on this machine") in r.stderr
    assert "set device='cpu' to run on the CPU" in r.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / "flwr-home").exists()   # nothing started
    # device='cpu' said on purpose: past the device check, up to the SuperLink (its port is taken here)
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = subprocess.run(exe + ["--run-config", f"output-dir=\"{tmp_path / 'out'}\" device='cpu'",
                                  "--address", f"127.0.0.1:{port}"], env=env, capture_output=True, text=True,
                           timeout=300)
    assert r.returncode == 2 and "the port is in use by another program" in r.stderr, r.stdout + r.stderr
    assert "requires-gpu" not in r.stderr
