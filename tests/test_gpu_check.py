"""sims/gpu_check.sh / gpu_check.py. --dry (what CI runs): the GPU check's code paths on the CPU
(tiny models), saying it is dry; what needs CUDA is reported as skipped, never as passed. Without
--dry it fails unless it really ran CUDA (here: no GPU, or a pretend one torch cannot use)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import os

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_dry(*extra: str, timeout: int = 900) -> dict:
    r = subprocess.run([sys.executable, str(ROOT / "sims" / "gpu_check.py"), "--dry", *extra], cwd=ROOT,
                       capture_output=True, text=True, timeout=timeout)
    lines = [line for line in r.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, r.stdout[-2000:] + r.stderr[-3000:]                # exactly one JSON line
    res = json.loads(lines[0])
    assert r.returncode == (0 if res["ok"] else 1)
    return res


def dry_in_process(capfd, *extra: str) -> dict:
    """``gpu_check.main(["--dry", ...])`` in this process (torch, transformers, peft and bitsandbytes
    already imported: ~10 s of a fresh interpreter's start saved), held to what ``run_dry`` holds the
    script to: exactly one JSON line on stdout (the file descriptor, so a library's C-level print
    counts too), the exit status by ``ok``. The script's own start (``python sims/gpu_check.py``) is
    run by the slow tier's tests below."""
    from sims import gpu_check

    rc = gpu_check.main(["--dry", *extra])
    out = capfd.readouterr().out
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1, out[-2000:]                                        # exactly one JSON line
    res = json.loads(lines[0])
    assert rc == (0 if res["ok"] else 1)
    return res


def test_dry_run_exercises_the_cpu_paths_and_skips_cuda(capfd):
    res = dry_in_process(capfd, "--skip", "participants")
    assert res["ok"], res
    assert res["dry"] and res["device"] == "cpu" and res["cuda_verified"] is False
    assert res["dry_note"].startswith("DRY RUN") and "nothing ran on a GPU" in res["dry_note"]
    assert res["cuda"]["skipped"] == "dry run" and "sees no CUDA device" in res["cuda"]["why_no_cuda"]
    bf16 = res["bf16_weights"]
    assert bf16["ok"] and bf16["param_dtypes"] == ["torch.bfloat16"]
    assert bf16["weight_bytes_bf16"] * 2 == bf16["weight_bytes_fp32"]
    q = res["qlora"]
    assert q["ok"] and q["lora_B"] == q["lora_B_nonzero"] == q["linear4bit_layers"] > 0
    assert res["vllm"]["skipped"] == "no CUDA"
    assert res["throughput"]["hf_tokens"] > 0 and res["throughput"]["vllm"]["skipped"] == "no CUDA"
    assert "skipped" in res["federation"] and res["participants"]["skipped"] == "--skip"
    assert res["failed"] == []


def test_dry_federation_through_the_inprocess_transport(capfd):
    """``--transport inprocess``: the federation check on a machine without Ray (how it ran on the H200,
    docs/gpu.md): the same engine and participants, seconds per round from the run's own metrics."""
    res = dry_in_process(capfd, "--skip", "participants,qlora,bf16_weights,throughput,vllm", "--federation",
                         "--transport", "inprocess", "--rounds", "2")
    f = res["federation"]
    assert res["ok"] and f["ok"] and f["exit_status"] == 0, f
    assert f["preset"] == "quick" and f["transport"] == "inprocess" and len(f["round_seconds"]) == 2


@pytest.mark.slow                      # Ray start-up and a 2-round CPU federation: minutes
def test_dry_run_with_participants_and_federation():
    res = run_dry("--skip", "qlora,bf16_weights,throughput", "--federation", "--rounds", "2")
    p = res["participants"]
    assert p["ok"] and p["passthrough_ok"] and p["actor_cvd"] == [""]          # Ray masked the actors
    assert all(c == p["launcher_visible"] for c in p["worker_cvd"])            # workers got the launcher's
    assert p["cuda_in_every_participant"] == {"skipped": "no CUDA"}
    f = res["federation"]
    assert f["ok"] and f["preset"] == "quick" and len(f["round_seconds"]) == 2


def run_script(*args: str, path: str | None = None) -> tuple[int, dict, str]:
    env = {**os.environ, "PYTHON": sys.executable}
    if path:
        env["PATH"] = path
    r = subprocess.run(["bash", str(ROOT / "sims" / "gpu_check.sh"), *args], cwd=ROOT, capture_output=True, text=True,
                       timeout=600, env=env)
    lines = [line for line in r.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, r.stdout[-2000:] + r.stderr[-3000:]
    return r.returncode, json.loads(lines[0]), r.stderr


@pytest.mark.slow
def test_without_dry_it_fails_unless_cuda_really_ran():
    """No GPU here: the real check exits non-zero, the cuda check says why, and nothing else counts
    as passed or skipped-and-fine."""
    rc, res, err = run_script()
    assert rc == 1 and res["ok"] is False and res["cuda_verified"] is False and not res["dry"]
    assert res["cuda"]["ok"] is False and "sees no CUDA device" in res["cuda"]["error"]
    assert set(res["failed"]) == {"cuda", "participants", "bf16_weights", "qlora", "vllm", "throughput", "federation"}
    assert "[gpu_check] FAILED" in err and "DRY RUN" not in err


@pytest.mark.slow
def test_a_gpu_torch_cannot_use_is_a_failure_with_the_reason(tmp_path):
    """A pretend machine with two H200s (a fake nvidia-smi) and this CPU build of torch: a GPU box
    whose CUDA checks would all have been 'skipped' before now fails with the reason."""
    from tests.test_devices import fake_smi

    fake_smi(tmp_path)
    rc, res, _ = run_script("--skip", "participants,qlora", path=f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert rc == 1 and res["cuda"]["driver_gpus"] == ["NVIDIA H200", "NVIDIA H200"]
    assert res["cuda"]["error"].startswith("this machine has 2 NVIDIA GPUs (NVIDIA H200; driver 550.54.14, CUDA 12.4) "
                                           "but torch ") and "CPU-only build" in res["cuda"]["error"]
    assert res["participants"] == {"skipped": "--skip"} and "participants" not in res["failed"]


def test_checks_that_did_not_run_fail_outside_a_dry_run():
    sys.path.insert(0, str(ROOT))
    from sims.gpu_check import fail_unrun

    c = {"ok": True, "hf_tokens": 8, "vllm": {"skipped": "no CUDA"}}
    assert fail_unrun(c) and c["ok"] is False and c["vllm"]["ok"] is False and "no CUDA" in c["vllm"]["error"]
    left_out = {"skipped": "--skip"}
    assert not fail_unrun(left_out) and "ok" not in left_out
    ran = {"ok": True, "figures": {"a": 1}}
    assert not fail_unrun(ran) and ran["ok"] is True


def test_peak_gpu_memory_keeps_the_highest_reading_per_card(tmp_path):
    from sims.verify_vllm import PeakGpuMemory

    readings = tmp_path / "readings"
    readings.write_text("0, 100, 81559\n1, 5, 81559\n|0, 900, 81559\n1, 7, 81559\n|0, 300, 81559\n1, 6, 81559\n")
    smi = tmp_path / "nvidia-smi"
    smi.write_text(f"""#!/usr/bin/env python3
import sys
from pathlib import Path
p, n = Path({str(readings)!r}), Path({str(tmp_path / 'n')!r})
i = int(n.read_text()) if n.exists() else 0
n.write_text(str(i + 1))
parts = p.read_text().split("|")
assert sys.argv[1:] == ["--query-gpu=index,memory.used,memory.total", "--format=csv,noheader,nounits"]
print(parts[min(i, len(parts) - 1)], end="")
""")
    smi.chmod(0o755)
    peak = PeakGpuMemory(smi=str(smi))
    for _ in range(3):
        peak.sample()
    assert peak.peak == {"0": 900, "1": 7} and peak.total == {"0": 81559, "1": 81559} and peak.samples == 3
    with PeakGpuMemory(smi=str(smi), every_s=3600) as p2:       # entry and exit readings at least
        pass
    assert p2.result["nvidia_smi_samples"] >= 2 and p2.result["nvidia_smi_peak_used_mib"]["0"] == 300
    assert p2.result["torch_max_allocated_mib"] is None                  # no CUDA here
