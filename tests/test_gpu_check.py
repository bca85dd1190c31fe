"""sims/gpu_check.py in --dry mode: the GPU check's code paths on the CPU (tiny models); what needs
CUDA is reported as skipped, never as passed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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


def test_dry_run_exercises_the_cpu_paths_and_skips_cuda():
    res = run_dry("--skip", "participants")
    assert res["ok"], res
    assert res["dry"] and res["device"] == "cpu" and res["cuda"]["available"] is False
    bf16 = res["bf16_weights"]
    assert bf16["ok"] and bf16["param_dtypes"] == ["torch.bfloat16"]
    assert bf16["weight_bytes_bf16"] * 2 == bf16["weight_bytes_fp32"]
    q = res["qlora"]
    assert q["ok"] and q["lora_B"] == q["lora_B_nonzero"] == q["linear4bit_layers"] > 0
    assert res["vllm"]["skipped"] == "no CUDA"
    assert res["throughput"]["hf_tokens"] > 0 and res["throughput"]["vllm"]["skipped"] == "no CUDA"
    assert "skipped" in res["federation"] and res["participants"]["skipped"] == "--skip"
    assert res["failed"] == []


@pytest.mark.slow                      # Ray start-up and a 2-round CPU federation: minutes
def test_dry_run_with_participants_and_federation():
    res = run_dry("--skip", "qlora,bf16_weights,throughput", "--federation", "--rounds", "2")
    p = res["participants"]
    assert p["ok"] and p["passthrough_ok"] and p["actor_cvd"] == [""]          # Ray masked the actors
    assert all(c == p["launcher_visible"] for c in p["worker_cvd"])            # workers got the launcher's
    assert p["cuda_in_every_participant"] == {"skipped": "no CUDA"}
    f = res["federation"]
    assert f["ok"] and f["preset"] == "quick" and len(f["round_seconds"]) == 2
