"""The GPU check: one run, one JSON line, every claim of docs/gpu.md that needs a GPU.

    sims/gpu_check.sh                     # on a CUDA machine (< 8 min on one GPU), prints one JSON line
    sims/gpu_check.sh --dry               # anywhere: the same code paths on the CPU with tiny models

Without ``--dry`` the check fails (exit 1) unless it really ran on CUDA: the ``cuda`` check needs a
kernel run on every visible GPU, and a check that could not run (no CUDA, no vLLM, no
bitsandbytes) counts as failed, not skipped; only ``--skip`` leaves a check out. ``--dry`` runs on
the CPU, reports ``"dry": true`` and ``"cuda_verified": false``, and says on stderr that nothing ran
on a GPU (CI runs it: tests/test_gpu_check.py).

Checks (each a key of the JSON line with ``ok``, ``seconds`` and its figures, or ``skipped`` with the
reason, or ``error``; on CUDA each also has ``peak_gpu_memory``):

- ``cuda``: what the driver shows (``devices.nvidia_driver``), what torch sees, and a matmul on each
  visible GPU compared with the CPU's; when torch sees no GPU, the one-line reason
  (``devices.cuda_problem``: e.g. a driver too old for torch's CUDA build).

- ``participants``: CUDA visible in every simulated participant. Real Ray actors that ask for no GPU
  (as Flower's simulation runs ClientApps) start a child process the way ``clients/worker.py``
  does, once with the actor's environment (Ray's mask) and once with ``devices.worker_env``; the
  child reports ``CUDA_VISIBLE_DEVICES`` and what torch sees. Dry: the pass-through is checked with
  the launcher's own value (or a pretend ``0`` when it has none); the CUDA part is skipped.
- ``bf16_weights``: the model loaded with bf16 *weights* (not autocast) on the device: every float
  parameter is bf16, weight bytes halve, greedy generation runs and its logits are finite.
- ``qlora``: bitsandbytes NF4 + LoRA (``HFPolicy``, quant=4bit): after ``generate`` every LoRA B
  matrix gets a non-zero gradient (the trap of ``ftis_fed/policies/quant.py``, here on CUDA).
- ``vllm``: ``sims/verify_vllm.run_mode`` for the ``full`` and ``lora`` refresh, each in fp32 (the
  tight check) and in bf16 (the path users get: ``weights-dtype = bf16``): recorded log-probs vs the
  trainer's teacher-forced ones (max error per sampling configuration), the weights reaching the
  engine after an update (fp32), and the peak GPU memory of each. Needs CUDA and vLLM.
- ``throughput``: tokens/s of HF ``generate`` and of vLLM on the same model, prompts and sampling
  (vLLM's part needs CUDA and vLLM); the ratio.
- ``federation``: a ``rounds``-round ``ftis-fed sim`` of the ``gpu-offline`` preset (dry:
  ``quick``), seconds per round from its metrics (``fed/round_seconds``). Off in ``--dry`` unless
  ``--federation``: on 2 CPU cores it takes minutes. ``--transport inprocess`` runs it through the
  same engine and participants without Flower and Ray (a machine that has neither).

Exit status: 0 when no check failed (and, without ``--dry``, CUDA really ran); 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from ftis_fed.policies.devices import (CUDA_ENV, VISIBLE_ENV, cuda_problem, launcher_env, nvidia_driver,  # noqa: E402
                                       worker_env)
from sims.verify_vllm import PeakGpuMemory  # noqa: E402

NO_CUDA = "no CUDA"
PROMPTS = ["What is 17 + 25? Answer with a number.", "Name three colours of the rainbow.",
           "Write one sentence about the sea.", "What is 9 times 7?"]


def cuda() -> bool:
    return torch.cuda.is_available()


# ----------------------------------------------------------------------------- CUDA itself

DRY_NOTE = "DRY RUN: CPU only, tiny models; nothing ran on a GPU, so this report proves nothing about CUDA"


def check_cuda(a) -> dict:
    """The driver's GPUs, torch's view, and a real kernel on every visible GPU (a matmul compared
    with the CPU's result). Without CUDA: the one-line reason, and a failure unless dry."""
    drv = nvidia_driver()
    out: dict = {"driver_gpus": list(drv.gpus), "driver_version": drv.version, "driver_cuda": drv.cuda,
                 "torch": torch.__version__, "torch_cuda": torch.version.cuda,
                 "cuda_visible_devices": os.environ.get(CUDA_ENV, "<unset>")}
    if not cuda():
        why = cuda_problem(drv, {"count": 0, "torch": torch.__version__, "cuda": torch.version.cuda}, os.environ) \
            or f"torch {torch.__version__} sees no CUDA device (torch.cuda.is_available() is False; no NVIDIA GPU shown by the driver)"
        if a.dry:
            return {**out, "skipped": "dry run", "why_no_cuda": why}
        return {**out, "ok": False, "error": why}
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(256, 256, generator=g), torch.randn(256, 256, generator=g)
    want = x @ y
    runs = []
    for i in range(torch.cuda.device_count()):
        got = (x.to(f"cuda:{i}") @ y.to(f"cuda:{i}")).cpu()
        torch.cuda.synchronize(i)
        runs.append({"device": f"cuda:{i}", "name": torch.cuda.get_device_name(i),
                     "capability": ".".join(map(str, torch.cuda.get_device_capability(i))),
                     "matmul_max_abs_err": float((got - want).abs().max())})
    out["kernels"] = runs
    out["ok"] = bool(runs) and all(r["matmul_max_abs_err"] < 1e-2 for r in runs)     # TF32 matmul: ~1e-3
    return out


# ----------------------------------------------------------------------------- participants

_CHILD = ("import json, os, torch; print(json.dumps({'cvd': os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>'), "
          "'cuda': torch.cuda.is_available(), 'count': torch.cuda.device_count(), "
          "'name': torch.cuda.get_device_name(0) if torch.cuda.is_available() else ''}))")

_RAY_PROBE = r"""
import json, os, subprocess, sys
import ray
from ftis_fed.policies.devices import worker_env
n, child = int(sys.argv[1]), sys.argv[2]
ray.init(num_cpus=n, include_dashboard=False, log_to_driver=False)

@ray.remote(num_cpus=1, num_gpus=0)
class Participant:
    def probe(self):
        run = lambda env: json.loads(subprocess.run([sys.executable, "-c", child], env=env, capture_output=True,
                                                    text=True, check=True).stdout)
        return {"actor_cvd": os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>"), "plain": run(dict(os.environ)),
                "worker": run(worker_env(os.environ))}

print(json.dumps(ray.get([Participant.remote().probe.remote() for _ in range(n)])))
ray.shutdown()
"""


def check_participants(a) -> dict:
    base = dict(os.environ)
    if not cuda() and CUDA_ENV not in base:
        base[CUDA_ENV] = "0"                      # dry: a pretend device list, to follow it through Ray
    env = launcher_env({k: v for k, v in base.items() if k != VISIBLE_ENV})
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    tmp = tempfile.mkdtemp(prefix="ray", dir="/tmp")                    # Ray's socket paths must be short
    env["RAY_TMPDIR"] = tmp
    try:
        r = subprocess.run([sys.executable, "-c", _RAY_PROBE, str(a.participants), _CHILD], env=env, cwd=ROOT,
                           capture_output=True, text=True, timeout=300)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if r.returncode != 0:
        raise RuntimeError(r.stderr[-2000:])
    got = json.loads(r.stdout.strip().splitlines()[-1])
    launcher = env[VISIBLE_ENV]
    out = {"launcher_visible": launcher, "actor_cvd": sorted({g["actor_cvd"] for g in got}),
           "plain_child_cuda_count": [g["plain"]["count"] for g in got],
           "worker_cvd": [g["worker"]["cvd"] for g in got],
           "worker_cuda_count": [g["worker"]["count"] for g in got],
           "worker_device_names": sorted({g["worker"]["name"] for g in got})}
    expected_cvd = "<unset>" if launcher == "all" else launcher
    out["passthrough_ok"] = all(c == expected_cvd for c in out["worker_cvd"])
    if cuda():
        out["ok"] = out["passthrough_ok"] and all(c == torch.cuda.device_count() for c in out["worker_cuda_count"])
    else:
        out["ok"] = out["passthrough_ok"]
        out["cuda_in_every_participant"] = {"skipped": NO_CUDA}
    return out


# ----------------------------------------------------------------------------- bf16 weights

def check_bf16(a) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ftis_fed.policies.models import resolve_model

    path = resolve_model(a.model)
    tok = AutoTokenizer.from_pretrained(path)
    m32 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    bytes32 = sum(p.numel() * p.element_size() for p in m32.parameters())
    del m32
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map={"": a.device})
    dtypes = sorted({str(p.dtype) for p in model.parameters() if p.is_floating_point()})
    bytes16 = sum(p.numel() * p.element_size() for p in model.parameters())
    ids = tok(PROMPTS[0], return_tensors="pt").input_ids.to(a.device)
    with torch.no_grad():
        logits = model(ids).logits
        gen = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id or tok.eos_token_id)
    out = {"device": str(next(model.parameters()).device), "param_dtypes": dtypes, "weight_bytes_fp32": bytes32,
           "weight_bytes_bf16": bytes16, "logits_finite": bool(torch.isfinite(logits).all()),
           "generated_tokens": int(gen.shape[1] - ids.shape[1])}
    out["ok"] = dtypes == ["torch.bfloat16"] and bytes16 * 2 == bytes32 and out["logits_finite"]
    return out


# ----------------------------------------------------------------------------- 4-bit LoRA

def check_qlora(a) -> dict:
    try:
        import bitsandbytes as bnb
    except ImportError:
        return {"skipped": "bitsandbytes not installed"}
    from ftis_fed.wire.batch import SamplingParams
    from ftis_fed.policies import PolicyConfig, Prompt, build_policy

    sp = SamplingParams(temperature=0.7, max_new_tokens=12)
    pol = build_policy(PolicyConfig(model=a.model, adapter="lora", quant="4bit", lora_r=4, micro_batch=8,
                                    dtype="bf16" if cuda() else "fp32"))
    layers = [m for m in pol.model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    prompts = [Prompt(f"q/{i}", t, "") for i, t in enumerate(PROMPTS[:2])]
    rolls = pol.generate(prompts, 3, sp, seed=0)                                  # eval-mode 4-bit forward
    P = [r.prompt_ids.tolist() for r in rolls for _ in r.completion_ids]
    C = [c.tolist() for r in rolls for c in r.completion_ids]
    pol.model.zero_grad(set_to_none=True)
    pol.model.train()
    pol.score_padded(P, C, sp, grad=True).sum().backward()
    b = [0.0 if p.grad is None else p.grad.abs().sum().item()
         for n, p in pol.model.named_parameters() if p.requires_grad and "lora_B" in n]
    out = {"device": str(pol.device), "linear4bit_layers": len(layers), "lora_B": len(b),
           "lora_B_nonzero": sum(g > 0 for g in b), "min_grad_abs_sum": min(b) if b else 0.0}
    out["ok"] = bool(layers) and len(b) == len(layers) and out["lora_B_nonzero"] == len(b)
    return out


# ----------------------------------------------------------------------------- vLLM

def _vllm_missing() -> str | None:
    if not cuda():
        return NO_CUDA
    from ftis_fed.policies.vllm_policy import vllm_available

    return None if vllm_available() else "vllm not installed (see docs/gpu.md)"


def check_vllm(a) -> dict:
    why = _vllm_missing()
    if why:
        return {"skipped": why}
    from sims import verify_vllm

    args = SimpleNamespace(model=a.model, prompts=3, group=4, max_new_tokens=24, seed=1234, lr=0.0, engine_dtype="",
                           fidelity_only=False, tol_max=verify_vllm.TOL_MAX, tol_mean=verify_vllm.TOL_MEAN)
    out: dict = {}
    for mode in a.vllm_modes:
        for dtype in a.vllm_dtypes:
            res = verify_vllm.run_mode(mode, args, dtype)
            fid = res["fidelity"]
            out[mode if dtype == "fp32" else f"{mode}_{dtype}"] = {
                "ok": res["ok"], "dtype": dtype, "init_s": res["init_s"], "tolerance": res["tolerance"],
                "fidelity_max_abs": max(v["max_abs"] for v in fid.values()),
                "fidelity_mean_abs": max(v["mean_abs"] for v in fid.values()),
                "refresh_ok": res.get("refresh_check", {}).get("ok"),
                "update_and_refresh_s": res.get("update_and_refresh_s"),
                "peak_gpu_memory": res["peak_gpu_memory"]}
    out["ok"] = all(v["ok"] for v in out.values())
    return out


# ----------------------------------------------------------------------------- throughput

def _tokens_per_s(pol, prompts, group, sp) -> tuple[float, int]:
    pol.generate(prompts[:1], 1, sp, seed=0)                                      # warm-up
    if cuda():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    rolls = pol.generate(prompts, group, sp, seed=1)
    if cuda():
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    n = sum(len(c) for r in rolls for c in r.completion_ids)
    return n / dt, n


def check_throughput(a) -> dict:
    from ftis_fed.wire.batch import SamplingParams
    from ftis_fed.policies import PolicyConfig, Prompt, build_policy

    sp = SamplingParams(temperature=1.0, max_new_tokens=a.gen_tokens)
    prompts = [Prompt(f"t/{i}", PROMPTS[i % len(PROMPTS)], "") for i in range(a.gen_prompts)]
    cfg = PolicyConfig(model=a.model, dtype="bf16" if cuda() else "fp32")
    hf = build_policy(cfg)
    hf_tps, hf_n = _tokens_per_s(hf, prompts, a.group, sp)
    out: dict = {"model": a.model, "sequences": a.gen_prompts * a.group, "max_new_tokens": a.gen_tokens,
                 "hf_tokens_per_s": round(hf_tps, 1), "hf_tokens": hf_n, "hf_device": str(hf.device)}
    why = _vllm_missing()
    if why:
        out["vllm"] = {"skipped": why}
        out["ok"] = hf_n > 0
        return out
    from ftis_fed.policies.vllm_policy import VLLMPolicy

    vl = VLLMPolicy(cfg, trainer=hf, engine_kwargs={"gpu_memory_utilization": 0.4, "max_model_len": 1024})
    try:
        v_tps, v_n = _tokens_per_s(vl, prompts, a.group, sp)
    finally:
        vl.close()
    out.update(vllm_tokens_per_s=round(v_tps, 1), vllm_tokens=v_n, vllm_over_hf=round(v_tps / hf_tps, 1))
    out["ok"] = hf_n > 0 and v_n > 0
    return out


# ----------------------------------------------------------------------------- federation

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_federation(a) -> dict:
    if a.dry and not a.federation:
        return {"skipped": "dry run without --federation (minutes on a CPU)"}
    from ftis_fed.commands.sim import simulate, simulate_inprocess

    preset = a.preset or ("gpu-offline" if cuda() else "quick")
    tmp = Path(tempfile.mkdtemp(prefix="ftis-gpu-check-"))
    saved = dict(os.environ)
    os.environ.update(launcher_env({**os.environ, "FLWR_HOME": str(tmp / "flwr-home"),
                                    "FTIS_FED_RUNTIME": str(tmp / "rt")}))
    try:
        t0 = time.perf_counter()
        run_config = [f"num-rounds={a.rounds}", f'output-dir="{tmp / "out"}"']
        with contextlib.redirect_stdout(sys.stderr):
            if a.transport == "inprocess":         # the same engine and participants, no Flower or Ray
                rc = simulate_inprocess(ROOT, run_config=run_config, preset=preset)
            else:
                rc = simulate(ROOT, run_config=run_config, preset=preset, address=f"127.0.0.1:{_free_port()}",
                              stream=False)
        wall = time.perf_counter() - t0
        rows = [json.loads(line) for line in (tmp / "out" / "metrics.jsonl").read_text().splitlines()
                if line.strip()] if (tmp / "out" / "metrics.jsonl").exists() else []
    finally:
        os.environ.clear()
        os.environ.update(saved)
        for d in (tmp / "rt",):
            for pid in d.glob("*.pid") if d.exists() else []:
                with contextlib.suppress(ProcessLookupError, ValueError, PermissionError):
                    os.kill(int(pid.read_text()), 9)
        if not a.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    per_round = [round(float(r["fed/round_seconds"]), 1) for r in rows if "fed/round_seconds" in r]
    return {"preset": preset, "transport": a.transport, "rounds": a.rounds, "exit_status": rc,
            "wall_s": round(wall, 1),
            "round_seconds": per_round, "ok": rc == 0 and len(per_round) == a.rounds}


# ----------------------------------------------------------------------------- main

CHECKS = {"cuda": check_cuda, "participants": check_participants, "bf16_weights": check_bf16, "qlora": check_qlora,
          "vllm": check_vllm, "throughput": check_throughput, "federation": check_federation}


def fail_unrun(check: dict) -> bool:
    """Outside a dry run a check that did not run (for want of CUDA, vLLM, ...) fails, and so does
    the check holding such a part; only ``--skip`` leaves one out. True when it failed that way."""
    bad = False
    for v in list(check.values()):
        if isinstance(v, dict) and fail_unrun(v):
            bad = True
    why = check.get("skipped")
    if why and why != "--skip":
        check.setdefault("error", f"not run ({why}): a real GPU check must run it")
        bad = True
    if bad:
        check["ok"] = False
    return bad


def versions() -> dict:
    out = {"python": platform.python_version(), "torch": torch.__version__,
           "cuda_runtime": torch.version.cuda}
    for mod in ("transformers", "flwr", "vllm", "bitsandbytes", "peft", "ray"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception:                                         # noqa: BLE001 - absent or broken: reported
            out[mod] = None
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry", action="store_true", help="CPU, tiny models; CUDA-only parts reported as skipped")
    ap.add_argument("--model", default="", help="offline model name or folder (default: smollm2; dry: tiny-llama)")
    ap.add_argument("--participants", type=int, default=3)
    ap.add_argument("--group", type=int, default=8, help="completions per prompt in the throughput check")
    ap.add_argument("--gen-prompts", type=int, default=8)
    ap.add_argument("--gen-tokens", type=int, default=128)
    ap.add_argument("--vllm-modes", nargs="+", default=["full", "lora"], choices=["full", "lora"])
    ap.add_argument("--vllm-dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"],
                    help="fp32: the tight fidelity check; bf16: the path users get (weights-dtype = bf16)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--preset", default="", help="federation preset (default gpu-offline; dry: quick)")
    ap.add_argument("--federation", action="store_true", help="with --dry: run the federation too")
    ap.add_argument("--transport", choices=("flwr", "inprocess"), default="flwr",
                    help="how the federation runs: flwr (ftis-fed sim: flwr run, Ray) or inprocess (the same "
                         "engine and participants without Flower, for a machine without flwr/ray)")
    ap.add_argument("--skip", default="", help="comma-separated checks to leave out")
    ap.add_argument("--keep", action="store_true", help="keep the federation's output folder")
    ap.add_argument("--out", default="", help="also append the JSON line to this file")
    a = ap.parse_args(argv)
    if a.dry:
        a.model = a.model or "tiny-llama"
        a.group, a.gen_prompts, a.gen_tokens = min(a.group, 2), min(a.gen_prompts, 2), min(a.gen_tokens, 8)
        a.participants = min(a.participants, 2)
    a.model = a.model or "smollm2"
    a.device = "cuda:0" if cuda() else "cpu"
    skip = {s.strip() for s in a.skip.split(",") if s.strip()}
    unknown = skip - set(CHECKS)
    if unknown:
        ap.error(f"--skip {sorted(unknown)}: checks are {sorted(CHECKS)}")
    res: dict = {"check": "gpu_check", "dry": a.dry, "model": a.model, "device": a.device,
                 "cuda": {"available": cuda(), "count": torch.cuda.device_count() if cuda() else 0,
                          "names": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
                          if cuda() else []},
                 "versions": versions()}
    if a.dry:
        res["dry_note"] = DRY_NOTE
        print(f"[gpu_check] {DRY_NOTE}", file=sys.stderr, flush=True)
    t_all = time.perf_counter()
    for name, fn in CHECKS.items():
        if name in skip:
            res[name] = {"skipped": "--skip"}
            continue
        t0 = time.perf_counter()
        if not a.dry and name != "cuda" and res.get("cuda", {}).get("ok") is not True:
            res[name] = {"skipped": "the cuda check did not pass"}
            fail_unrun(res[name])
            continue
        try:
            with contextlib.redirect_stdout(sys.stderr), PeakGpuMemory() as peak:   # the JSON line stays alone
                res[name] = fn(a)
            if cuda():
                res[name]["peak_gpu_memory"] = peak.result
        except Exception as e:                                                  # noqa: BLE001 - reported
            res[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:2000],
                         "trace": traceback.format_exc()[-1500:]}
        if not a.dry:
            fail_unrun(res[name])
        res[name]["seconds"] = round(time.perf_counter() - t0, 1)
        print(f"[gpu_check] {name}: {json.dumps(res[name])[:300]}", file=sys.stderr, flush=True)
    res["total_s"] = round(time.perf_counter() - t_all, 1)
    failed = [k for k in CHECKS if isinstance(res.get(k), dict) and res[k].get("ok") is False]
    res["failed"] = failed
    res["cuda_verified"] = bool(not a.dry and res.get("cuda", {}).get("ok") is True)
    res["ok"] = not failed and (a.dry or res["cuda_verified"])
    if a.dry:
        print(f"[gpu_check] {DRY_NOTE}", file=sys.stderr, flush=True)
    elif not res["ok"]:
        print(f"[gpu_check] FAILED: {', '.join(failed)}; cuda: {res.get('cuda', {}).get('error', 'ok')}",
              file=sys.stderr, flush=True)
    line = json.dumps(res)
    print(line, flush=True)
    if a.out:
        with open(a.out, "a") as fh:
            fh.write(line + "\n")
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
