"""``ftis-fed bench step``: one on-policy GRPO step of ours next to TRL's ``GRPOTrainer``.

Prints ONE JSON line. Both sides run the same model, the same prompts, the same group size, the same
number of new tokens, the same temperature and the same reward (``Verifier``); a step is

    ours: HFPolicy.generate (G completions per prompt, one left-padded batch, sampling log-probs
          recorded) -> Verifier rewards -> CompletionBatch -> samples_from_batches (F-TIS, vertical
          groups) -> Trainer.step (one F-TIS optimizer step, micro-batches, chunked log-probs)
    TRL:  GRPOTrainer.train() optimizer step: transformers generate (one batch of prompts x G) ->
          reward -> advantages -> gradient_accumulation_steps micro-batches of forward + backward
          (TRL's fused LM head) -> clip -> AdamW

Each side runs in its own fresh subprocess (so the other's memory and caches do not leak in), with
the same torch thread count; rounds alternate the order (ours, TRL / TRL, ours, ...). Inside a
subprocess, ``--warmup`` steps run first (kernel set-up, optimizer state allocation) and the next
``--steps`` steps are timed; TRL's step is timed from ``on_step_begin`` to ``on_step_end`` (generation
+ rewards + loss + backward + optimizer), ours from ``generate`` to the end of ``Trainer.step``. Peak RSS is
each subprocess's ``ru_maxrss`` (model load, warm-up and timed steps included).

    ftis-fed bench step                                  # 8 prompts x 8 completions x 64 tokens
    ftis-fed bench step --threads 1 --repeats 3          # shared / noisy machine: see docs/benchmarks.md
    ftis-fed bench step --memory-sweep                   # + peak RSS of one update per micro_batch / logit_chunk

Forcing the length: both sides set ``min_new_tokens = max_new_tokens`` (EOS is masked until the
budget is reached: transformers' MinNewTokensLengthLogitsProcessor), so every completion has exactly
``max_new_tokens`` tokens on both sides. Ours: on the policy's ``model.generation_config`` (the
policy's own GenerationConfig leaves ``min_new_tokens`` unset, so generate merges it in; the EOS mask is
applied before our RecordingSampler). TRL: ``GRPOConfig.generation_kwargs``.

The command line is ``bench/cli.py``; ``python -m ftis_fed.bench.step <side> <config JSON>`` is a
worker's own entry (``spawn``). What both sides share (torch, numpy, the prompts, the verifier) is
imported here; each side's own stack is imported in its worker function only (ours: the policy and
trainer; TRL: ``trl``, ``datasets``), so a side's subprocess, whose peak RSS is measured, loads only
its own.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

from ftis_fed.policies.models import resolve_model
from ftis_fed.tasks.families import ID_FAMILIES
from ftis_fed.tasks.rewards import Verifier
from ftis_fed.tasks.suite import make_tasks
from ftis_fed.wire.batch import CompletionBatch, SamplingParams

#: Written into the JSON so a reader knows what was compared without reading this file.
NOTES = [
    "ours: HFPolicy(PolicyConfig(model, dtype, micro_batch, logit_chunk, logit_graph_mb, grad_checkpointing=False "
    "unless --grad-checkpointing, share_prefix=True unless --no-share-prefix)).generate -> Verifier rewards -> "
    "CompletionBatch -> samples_from_batches(mode F-TIS, vertical groups) -> Trainer.step (one AdamW step, "
    "torch's fused kernel)",
    "ours, where it differs in work (exact, same results): with share_prefix each prompt is prefilled once for "
    "its G rows in generate and scored once per micro-batch in the update; the sampler draws each token by "
    "inverse CDF instead of torch.multinomial (same distribution); the LM head's log-softmax is kept for "
    "backward (logit_graph_mb) instead of recomputed; a micro-batch whose rows all have advantage 0 (a group "
    "of equal rewards: zero gradient) gets no backward (ours.no_backward_rows) and, with the policy default "
    "score-zero-advantage = false, no forward either (ours.unscored_rows); TRL runs forward + backward over "
    "every row",
    "trl: GRPOTrainer, one optimizer step timed on_step_begin -> on_step_end (generate + rewards + "
    "forward/backward over gradient_accumulation_steps micro-batches + clip + AdamW)",
    "same model (fp32 weights), prompts (tasks.make_tasks(ID_FAMILIES[0], 'train')), G, temperature, "
    "top_p=1, top_k=0, reward (Verifier), lr, max_grad_norm=1, weight_decay=0, constant lr",
    "exact length: min_new_tokens = max_new_tokens on both sides (EOS masked until the budget): every "
    "completion has max_new_tokens tokens (checked, see completion_tokens)",
    "trl: per_device_train_batch_size = micro_batch, gradient_accumulation_steps = prompts*G/micro_batch, "
    "steps_per_generation = gradient_accumulation_steps (one generate of prompts*G rows per optimizer step, "
    "no extra old-logprob pass), num_iterations=1, beta=0 (no reference model), loss_type='grpo' (per-sequence "
    "length normalisation, as our length_norm='sequence'), scale_rewards='group', mask_truncated_completions="
    "False (all completions hit the budget), no vLLM, no continuous batching, use_cpu=True, bf16 = ours autocasts "
    "(both: fp32 weights, bf16 autocast), gradient_checkpointing per --trl-gradient-checkpointing, optimizer = "
    "TRL default (adamw_torch_fused), logging/saving off, report_to=[]",
    "each side in its own fresh subprocess, same torch thread count, order alternated per round; "
    "warm-up step(s) first, then timed step(s); peak RSS = ru_maxrss of that subprocess",
    "*_cpu_s / ours_over_trl_*_cpu: the same spans in process CPU time (time.process_time, all threads): with "
    "--threads 1 the work done, insensitive to other jobs on a shared machine (wall times are not)",
]


# ----------------------------------------------------------------------------- helpers

def _peak_rss_mb() -> float:
    """This process's peak resident set size in MiB (Linux ru_maxrss is in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _set_threads(n: int) -> None:
    if n > 0:
        torch.set_num_threads(n)


def _prompts(n: int, seed: int):
    return make_tasks(ID_FAMILIES[0], "train", n, seed)


def _autocast_bf16(dtype: str) -> bool:
    """Whether our policy autocasts to bf16 for ``dtype`` here (TRL's ``bf16`` flag mirrors it)."""
    from ftis_fed.policies.hf import cpu_has_bf16        # our side's rule; the TRL worker asks it too

    if dtype == "fp32":
        return False
    return dtype == "bf16" or torch.cuda.is_available() or cpu_has_bf16()


def _our_policy(c: dict):
    """Our side's ``HFPolicy`` with the bench config's policy settings (the ours and memory workers)."""
    from ftis_fed.policies import PolicyConfig
    from ftis_fed.policies.hf import HFPolicy

    return HFPolicy(PolicyConfig(model=c["model"], dtype=c["dtype"], micro_batch=c["micro_batch"],
                                 logit_chunk=c["logit_chunk"], grad_checkpointing=c["grad_checkpointing"],
                                 logit_graph_mb=c.get("logit_graph_mb", 256.0),
                                 share_prefix=c.get("share_prefix", True), seed=c["seed"]))


# ----------------------------------------------------------------------------- workers (one per subprocess)

def ours_worker(c: dict) -> dict:
    """Our side: ``warmup + steps`` on-policy steps in this process; times of the last ``steps``."""
    _set_threads(c["threads"])
    from ftis_fed.learn.objective import ObjectiveConfig                  # our side's stack (module docstring)
    from ftis_fed.learn.rollouts import scored_groups
    from ftis_fed.learn.training import Trainer, samples_from_batches

    t0 = time.perf_counter()
    pol = _our_policy(c)
    pol.model.generation_config.min_new_tokens = c["max_new_tokens"]      # exactly max_new_tokens tokens
    load_s = time.perf_counter() - t0
    rss_loaded = _peak_rss_mb()
    prompts = _prompts(c["prompts"], c["seed"])
    sampling = SamplingParams(temperature=c["temperature"], max_new_tokens=c["max_new_tokens"])
    objective = ObjectiveConfig(mode=c["mode"], norm_constant=c["max_new_tokens"])
    trainer = Trainer(pol, objective)
    verifier = Verifier()
    steps, gen, train, tokens, rewards, no_backward, unscored = [], [], [], [], [], [], []
    cpu: dict[str, list] = {"step": [], "generate": []}
    for k in range(c["warmup"] + c["steps"]):
        t0, p0 = time.perf_counter(), time.process_time()
        rolls = pol.generate(prompts, c["group_size"], sampling, seed=c["seed"] + k)
        t1, p1 = time.perf_counter(), time.process_time()
        groups = scored_groups(rolls, verifier)
        batch = CompletionBatch("bench", "bench-step", k, k, pol.model_id, pol.tokenizer_fp, pol.vocab_size,
                                sampling, tuple(groups)).validate()
        samples = samples_from_batches([batch], "bench", pol.tokenizer_fp, objective)
        metrics = trainer.step(samples, sampling)
        t2, p2 = time.perf_counter(), time.process_time()
        if k >= c["warmup"]:
            cpu["step"].append(p2 - p0)
            cpu["generate"].append(p1 - p0)
            steps.append(t2 - t0)
            gen.append(t1 - t0)
            train.append(t2 - t1)
            tokens.append(batch.num_completion_tokens)
            rewards.append(float(np.mean([x for g in groups for x in g.rewards])))
            no_backward.append(int(metrics.get("train/no_backward_rows", 0)))
            unscored.append(int(metrics.get("train/unscored_rows", 0)))
        if not np.isfinite(metrics.get("train/loss", 0.0)):
            raise RuntimeError(f"non-finite loss at step {k}: {metrics}")
    return {"side": "ours", "step_s": steps, "generate_s": gen, "train_s": train, "load_s": load_s,
            "step_cpu_s": cpu["step"], "generate_cpu_s": cpu["generate"],
            "train_cpu_s": [s - g for s, g in zip(cpu["step"], cpu["generate"])],
            "completion_tokens": tokens, "reward_mean": rewards, "no_backward_rows": no_backward,
            "unscored_rows": unscored,
            "threads": torch.get_num_threads(), "autocast": str(pol.autocast), "rss_after_load_mb": round(rss_loaded),
            "peak_rss_mb": round(_peak_rss_mb())}


def trl_worker(c: dict) -> dict:
    """TRL's side: ``GRPOTrainer.train()`` for ``warmup + steps`` optimizer steps; times of the last ``steps``."""
    _set_threads(c["threads"])
    from datasets import Dataset                                          # TRL's side's stack (module docstring)
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    n_rows = c["prompts"] * c["group_size"]
    if n_rows % c["micro_batch"]:
        raise ValueError(f"prompts*group_size={n_rows} must be a multiple of micro_batch={c['micro_batch']}")
    prompts = _prompts(c["prompts"], c["seed"])
    ds = Dataset.from_list([{"prompt": [{"role": "user", "content": p.text}], "task_id": p.task_id,
                             "reference": p.reference} for p in prompts])
    out_dir = tempfile.mkdtemp(prefix="ftis-bench-trl-")
    bf16 = _autocast_bf16(c["dtype"])
    args = GRPOConfig(
        output_dir=out_dir, use_cpu=not torch.cuda.is_available(), bf16=bf16,
        gradient_checkpointing=c["trl_gradient_checkpointing"],
        per_device_train_batch_size=c["micro_batch"], gradient_accumulation_steps=n_rows // c["micro_batch"],
        num_generations=c["group_size"], max_completion_length=c["max_new_tokens"],
        temperature=c["temperature"], top_p=1.0, top_k=0, beta=0.0, num_iterations=1, loss_type="grpo",
        scale_rewards="group", mask_truncated_completions=False, use_vllm=False,
        learning_rate=c["lr"], lr_scheduler_type="constant", max_grad_norm=1.0, weight_decay=0.0,
        max_steps=c["warmup"] + c["steps"], logging_strategy="no", save_strategy="no", report_to=[],
        seed=c["seed"], dataloader_num_workers=0, log_completions=False,
        generation_kwargs={"min_new_tokens": c["max_new_tokens"]},
        model_init_kwargs={"dtype": torch.float32},
    )
    assert args.steps_per_generation == args.gradient_accumulation_steps and args.generation_batch_size == n_rows

    timing: dict[str, list] = {"step": [], "generate": [], "tokens": [], "rewards": [], "step_cpu": [],
                               "generate_cpu": []}

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t0, self.p0 = time.perf_counter(), time.process_time()

        def on_step_end(self, args, state, control, **kw):
            timing["step"].append(time.perf_counter() - self.t0)
            timing["step_cpu"].append(time.process_time() - self.p0)

    verifier_reward = Verifier().as_trl_reward()

    def reward(prompts, completions, **kw):                           # records the mean reward per call
        out = verifier_reward(prompts, completions, **kw)
        timing["rewards"].append(sum(out) / max(len(out), 1))
        return out

    reward.__name__ = verifier_reward.__name__
    t0 = time.perf_counter()
    trainer = GRPOTrainer(model=resolve_model(c["model"]), reward_funcs=reward, args=args,
                          train_dataset=ds, callbacks=[StepTimer()])
    load_s = time.perf_counter() - t0
    rss_loaded = _peak_rss_mb()
    generate = trainer._generate                                     # timing wrapper only

    def timed_generate(prompts_):
        t, p = time.perf_counter(), time.process_time()
        out = generate(prompts_)
        timing["generate"].append(time.perf_counter() - t)
        timing["generate_cpu"].append(time.process_time() - p)
        timing["tokens"].append(int(sum(len(x) for x in out[1])))
        return out

    trainer._generate = timed_generate
    trainer.train()
    w = c["warmup"]
    if len(timing["step"]) != w + c["steps"] or len(timing["generate"]) != w + c["steps"]:
        raise RuntimeError(f"expected {w + c['steps']} steps with one generate each, got {timing}")
    steps, gen = timing["step"][w:], timing["generate"][w:]
    steps_cpu, gen_cpu = timing["step_cpu"][w:], timing["generate_cpu"][w:]
    return {"side": "trl", "step_s": steps, "generate_s": gen, "train_s": [s - g for s, g in zip(steps, gen)],
            "step_cpu_s": steps_cpu, "generate_cpu_s": gen_cpu,
            "train_cpu_s": [s - g for s, g in zip(steps_cpu, gen_cpu)],
            "load_s": load_s, "completion_tokens": timing["tokens"][w:], "reward_mean": timing["rewards"][w:],
            "threads": torch.get_num_threads(), "bf16": bf16,
            "gradient_checkpointing": bool(args.gradient_checkpointing), "optim": str(args.optim),
            "rss_after_load_mb": round(rss_loaded), "peak_rss_mb": round(_peak_rss_mb())}


def memory_worker(c: dict) -> dict:
    """Peak RSS of one of our updates (no generation) on prompts*G rows of max_new_tokens random tokens:
    how memory depends on micro_batch and logit_chunk. Warm-up update first (optimizer state), then one."""
    _set_threads(c["threads"])
    from ftis_fed.learn.objective import ObjectiveConfig                  # our side's stack (module docstring)
    from ftis_fed.learn.training import Trainer, TrainSample

    pol = _our_policy(c)
    rss_loaded = _peak_rss_mb()
    sampling = SamplingParams(temperature=c["temperature"], max_new_tokens=c["max_new_tokens"])
    g = torch.Generator().manual_seed(c["seed"])
    prompts = [pol.format_prompt(p.text) for p in _prompts(c["prompts"], c["seed"])]
    samples = []
    for i in range(c["prompts"] * c["group_size"]):
        comp = torch.randint(0, pol.vocab_size, (c["max_new_tokens"],), generator=g).tolist()
        lp = -np.random.default_rng(i).exponential(1.0, c["max_new_tokens"]).astype(np.float32)
        samples.append(TrainSample(prompts[i // c["group_size"]], comp, lp, float(lp.sum()),
                                   float(np.random.default_rng(i).standard_normal()), "bench", True))
    trainer = Trainer(pol, ObjectiveConfig())
    trainer.step(samples, sampling)
    after_warmup = _peak_rss_mb()
    t = time.perf_counter()
    trainer.step(samples, sampling)
    return {"micro_batch": c["micro_batch"], "logit_chunk": c["logit_chunk"], "update_s": round(time.perf_counter() - t, 2),
            "rss_after_load_mb": round(rss_loaded), "peak_after_first_update_mb": round(after_warmup),
            "peak_rss_mb": round(_peak_rss_mb())}


#: (micro_batch, logit_chunk) pairs of ``--memory-sweep``: logit_chunk at a fixed micro-batch (is the LM-head
#: memory flat?), then micro_batch at a fixed chunk (decoder activations scale with it).
SWEEP = ((8, 8), (8, 32), (8, 64), (4, 32), (16, 32))

WORKERS = {"ours": ours_worker, "trl": trl_worker, "memory": memory_worker}


def spawn(side: str, c: dict, timeout: float | None = None) -> dict:
    """Run one worker in a fresh interpreter (thread env vars set before torch loads); its result dict."""
    env = dict(os.environ)
    if c["threads"] > 0:
        for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            env[k] = str(c["threads"])
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    proc = subprocess.run([sys.executable, "-m", "ftis_fed.bench.step", side, json.dumps(c)],
                          capture_output=True, text=True, env=env, timeout=timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"bench step worker {side!r} failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1])


# ----------------------------------------------------------------------------- driver

def _median(xs):
    return round(statistics.median(xs), 3) if xs else None


def run_bench_step(model: str = "smollm2", prompts: int = 8, group_size: int = 8, max_new_tokens: int = 64,
                   temperature: float = 0.7, dtype: str = "auto", micro_batch: int = 8, logit_chunk: int = 32,
                   mode: str = "F-TIS", lr: float = 1e-5, repeats: int = 2, warmup: int = 1, steps: int = 1,
                   threads: int = 0, seed: int = 0, grad_checkpointing: bool = False,
                   trl_gradient_checkpointing: bool = False, share_prefix: bool = True,
                   logit_graph_mb: float = 256.0,
                   memory_sweep: bool = False, sides: tuple[str, ...] = ("ours", "trl"),
                   log=None) -> dict:
    """Alternate fresh-subprocess runs of each side ``repeats`` times -> one result dict."""
    c = dict(model=model, prompts=prompts, group_size=group_size, max_new_tokens=max_new_tokens,
             temperature=temperature, dtype=dtype, micro_batch=micro_batch, logit_chunk=logit_chunk, mode=mode,
             lr=lr, warmup=warmup, steps=steps, threads=threads, seed=seed, grad_checkpointing=grad_checkpointing,
             trl_gradient_checkpointing=trl_gradient_checkpointing, share_prefix=share_prefix,
             logit_graph_mb=logit_graph_mb)
    runs: dict[str, list[dict]] = {s: [] for s in sides}
    for r in range(repeats):
        for side in (sides if r % 2 == 0 else sides[::-1]):
            res = spawn(side, c)
            runs[side].append(res)
            if log:
                log(f"round {r} {side}: step {res['step_s']} generate {res['generate_s']} "
                    f"peak {res['peak_rss_mb']} MiB")
    keys = ("step_s", "generate_s", "train_s", "completion_tokens", "reward_mean", "step_cpu_s", "generate_cpu_s",
            "train_cpu_s")
    flat = {s: {k: [x for run in runs[s] for x in run.get(k, ())] for k in keys} for s in sides}
    want = prompts * group_size * max_new_tokens
    result = {
        "bench": "step", "model": model, "prompts": prompts, "group_size": group_size,
        "max_new_tokens": max_new_tokens, "temperature": temperature, "dtype": dtype, "micro_batch": micro_batch,
        "logit_chunk": logit_chunk, "mode": mode, "repeats": repeats, "warmup_steps": warmup,
        "timed_steps_per_run": steps, "threads": runs[sides[0]][0]["threads"],
        "grad_checkpointing": grad_checkpointing, "share_prefix": share_prefix, "logit_graph_mb": logit_graph_mb,
        "trl_gradient_checkpointing": trl_gradient_checkpointing,
    }
    for s in sides:
        f = flat[s]
        if any(t != want for t in f["completion_tokens"]):
            raise RuntimeError(f"{s}: completion tokens per step {f['completion_tokens']}, expected {want}")
        result[s] = {
            "step_s": [round(x, 2) for x in f["step_s"]], "median_step_s": _median(f["step_s"]),
            "median_generate_s": _median(f["generate_s"]), "median_train_s": _median(f["train_s"]),
            "step_cpu_s": [round(x, 2) for x in f["step_cpu_s"]], "median_step_cpu_s": _median(f["step_cpu_s"]),
            "median_generate_cpu_s": _median(f["generate_cpu_s"]), "median_train_cpu_s": _median(f["train_cpu_s"]),
            "completion_tokens_per_step": want, "reward_mean": [round(x, 3) for x in f["reward_mean"]],
            "peak_rss_mb": [run["peak_rss_mb"] for run in runs[s]],
            "rss_after_load_mb": [run["rss_after_load_mb"] for run in runs[s]],
            "load_s": [round(run["load_s"], 1) for run in runs[s]],
        }
        if "no_backward_rows" in runs[s][0]:         # ours: rows of all-equal-reward groups (zero gradient)
            result[s]["no_backward_rows"] = [x for run in runs[s] for x in run["no_backward_rows"]]
            result[s]["unscored_rows"] = [x for run in runs[s] for x in run.get("unscored_rows", [])]
        for k in ("autocast", "bf16", "gradient_checkpointing", "optim"):
            if k in runs[s][0]:
                result[s][k] = runs[s][0][k]
    if set(sides) == {"ours", "trl"}:
        o, t = result["ours"], result["trl"]
        result["ours_over_trl_step"] = round(o["median_step_s"] / t["median_step_s"], 3)
        result["ours_over_trl_generate"] = round(o["median_generate_s"] / t["median_generate_s"], 3)
        result["ours_over_trl_train"] = round(o["median_train_s"] / t["median_train_s"], 3)
        if o["median_step_cpu_s"] and t["median_step_cpu_s"]:       # process CPU time: robust to other load
            for k in ("step", "generate", "train"):
                result[f"ours_over_trl_{k}_cpu"] = round(o[f"median_{k}_cpu_s"] / t[f"median_{k}_cpu_s"], 3)
        result["target_ratio"] = 0.5                 # issue 12 (issue 3: 1.0)
    if "ours" in sides:
        result["ours_peak_rss_mb"] = max(result["ours"]["peak_rss_mb"])
        result["target_peak_rss_mb"] = 4096
    if memory_sweep:
        sweep = []
        for mb, ch in SWEEP:
            res = spawn("memory", dict(c, micro_batch=mb, logit_chunk=ch))
            sweep.append(res)
            if log:
                log(f"memory micro_batch={mb} logit_chunk={ch}: {res}")
        result["memory_sweep"] = sweep
    result["notes"] = NOTES
    return result


if __name__ == "__main__":                               # a worker (``spawn``): one JSON line
    print(json.dumps(WORKERS[sys.argv[1]](json.loads(sys.argv[2]))), flush=True)
