"""The transformers backend: full fine-tuning, LoRA, and 4-bit / 8-bit + LoRA (QLoRA).

Generation uses ``model.generate`` with every built-in warper switched off and one logits processor
of ours, ``RecordingSampler``, that applies ``processed_logprobs`` (temperature, top-k, top-p), draws
each token from exactly that distribution and records its log-prob (``generate`` itself runs greedy
on the sampler's one-hot scores). So
the recorded log-probs are those of the actual sampling distribution by construction, and ``score``
recomputes them with the same function (tests check the two agree).

Nothing of the model's own ``generation_config.json`` reaches sampling: transformers fills every
generation setting a call leaves unset (``None``) from it (``repetition_penalty``, ``min_p``,
``typical_p``, ``no_repeat_ngram_size``, ``suppress_tokens``, ``bad_words_ids``, extra EOS ids,
...), which would add logits processors the recorded log-probs do not describe. The loaded model's
``generation_config`` is therefore replaced by a neutral ``GenerationConfig()`` (the original is
kept as ``hub_generation_config`` and written back by ``export``), and each generate call sets
sampling explicitly (``sampling_generation_config``).

The backend does not optimise: ``ftis_fed.learn.training.Trainer`` steps ``trainable_parameters()``.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from transformers import AutoModelForCausalLM, GenerationConfig, LogitsProcessor, LogitsProcessorList

from ftis_fed.atomic import atomic_dir
from ftis_fed.wire.batch import SamplingParams
import ftis_fed.policies.quant as quantization
from ftis_fed.policies.base import Policy, Prompt, Rollout, processed_logprobs, tokenizer_fingerprint
from ftis_fed.policies.config import WEIGHT_DTYPES, PolicyConfig
from ftis_fed.policies.models import load_tokenizer, resolve_model
from ftis_fed.policies.weights_fp import weights_fingerprint
from ftis_fed.policies.logprobs import token_layout, token_logprobs
from ftis_fed.policies.scoring import unwrap_causal_lm
from ftis_fed.policies.shared_base import attach, existing


def cpu_has_bf16() -> bool:
    """AVX512-BF16 or AMX-BF16 present (Linux /proc/cpuinfo)."""
    with contextlib.suppress(OSError):
        flags = Path("/proc/cpuinfo").read_text()
        return "avx512_bf16" in flags or "amx_bf16" in flags
    return False


def sampling_generation_config(max_new_tokens: int, tokenizer, do_sample: bool = True) -> GenerationConfig:
    """The whole generation configuration, explicitly: plain multinomial sampling at T=1 with no
    filter, or greedy decoding (what ``HFPolicy.generate`` runs: its ``RecordingSampler`` applies
    temperature / top-k / top-p, draws the token and hands greedy decoding a one-hot score), stopping
    only at the tokenizer's EOS or the budget. Every setting that could add a logits processor is set to
    its neutral value (the model's generation_config is neutral too: see the module docstring)."""
    neutral = dict(temperature=1.0, top_k=0 if do_sample else None, top_p=1.0, min_p=None, typical_p=1.0, epsilon_cutoff=0.0,
                   eta_cutoff=0.0, repetition_penalty=1.0, encoder_repetition_penalty=1.0,
                   no_repeat_ngram_size=0, encoder_no_repeat_ngram_size=0, length_penalty=1.0,
                   diversity_penalty=0.0, min_length=0, min_new_tokens=None, num_beams=1, num_beam_groups=1,
                   renormalize_logits=False, remove_invalid_values=False)
    return GenerationConfig(do_sample=do_sample, max_new_tokens=max_new_tokens, eos_token_id=tokenizer.eos_token_id,
                            pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, **neutral)


class RecordingSampler(LogitsProcessor):
    """Turns the raw logits into the sampling distribution's log-probs, draws the next token from it
    and records that token's log-prob (memory: one (B,) value per step).

    The draw is inverse-CDF sampling (one uniform per row against the float64 cumulative sum of the
    probabilities: exactly the distribution ``processed_logprobs`` defines; a zero-probability token,
    e.g. one cut by top-k/top-p, is never drawn). The processor returns a one-hot score (0 for the
    drawn token, -inf elsewhere), so ``generate`` runs in greedy mode and its argmax takes the token:
    ``torch.multinomial`` over the full vocabulary, which draws one exponential variate per token, cost
    ~14 % of generation's CPU time (64 rows x 49k vocabulary, SmolLM2, measured), the cumulative sum ~1 %.
    Randomness comes from torch's global generator (``torch.manual_seed`` before ``generate``).
    """

    def __init__(self, sampling: SamplingParams, prompt_len: int):
        self.sampling = sampling
        self.prompt_len = prompt_len
        self.recorded: list[torch.Tensor] = []                                   # each (B,)
        self._buffers: dict[str, torch.Tensor] = {}                              # (B,V) work tensors, reused

    def _buffer(self, name: str, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A (B,V) work tensor kept across decode steps: one allocation per generate call instead of one
        per step (fresh multi-MB tensors are page-faulted memory on every step)."""
        b = self._buffers.get(name)
        if b is None or b.shape != like.shape or b.device != like.device:
            b = self._buffers[name] = torch.empty(like.shape, dtype=dtype, device=like.device)
        return b

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        sp = self.sampling
        if (not sp.top_k or sp.top_k >= scores.shape[-1]) and sp.top_p >= 1.0:
            # processed_logprobs without its filters, into a reused buffer (same kernels, same values)
            lp = torch.log_softmax(scores.float() / sp.temperature, -1,
                                   out=self._buffer("lp", scores, torch.float32))            # (B,V)
        else:
            lp = processed_logprobs(scores, sp)                                  # (B,V)
        tokens = sample_from_logprobs(lp, self._buffer("cdf", lp, torch.float64),
                                      self._buffer("onehot", lp, lp.dtype))         # (B,)
        self.recorded.append(lp.gather(-1, tokens[:, None]).squeeze(-1).float())
        return self._buffer("onehot", lp, lp.dtype).fill_(float("-inf")).scatter_(-1, tokens[:, None], 0.0)

    def finish(self, sequences: torch.Tensor) -> torch.Tensor:
        """(B, T) recorded log-probs of the generated part of ``sequences`` (``generate`` replaces the
        tokens of rows that already ended with the pad id: their values past EOS are meaningless)."""
        T = sequences.shape[1] - self.prompt_len
        if len(self.recorded) < T:
            raise RuntimeError(f"RecordingSampler saw {len(self.recorded)} steps for {T} generated tokens")
        return torch.stack(self.recorded[:T], dim=1) if T else torch.zeros((sequences.shape[0], 0))


def sample_from_logprobs(lp: torch.Tensor, cdf: torch.Tensor | None = None,
                         probs: torch.Tensor | None = None) -> torch.Tensor:
    """(B,V) log-probs -> (B,) token ids drawn from exp(lp) (inverse CDF, one uniform per row).

    The cumulative sum is in float64 and the uniform is scaled by its total, so rounding cannot pick a
    token past the mass; a token with probability 0 spans an empty interval and is never drawn
    (``searchsorted(..., right=True)`` returns the first index whose cumulative mass exceeds the draw).
    cdf, probs: optional (B,V) float64 / lp-dtype buffers to compute it in."""
    if cdf is None:
        cdf = torch.empty(lp.shape, dtype=torch.float64, device=lp.device)
    torch.cumsum(cdf.copy_(torch.exp(lp, out=probs)), -1, out=cdf)              # (B,V)
    u = torch.rand((lp.shape[0], 1), dtype=torch.float64, device=lp.device) * cdf[:, -1:]   # (B,1)
    tokens = torch.searchsorted(cdf, u, right=True).squeeze(1).clamp_(max=lp.shape[-1] - 1)  # (B,)
    bad = ~torch.isfinite(lp.gather(-1, tokens[:, None]).squeeze(-1))
    if bool(bad.any()):                        # only if the row's mass is 0 or NaN: its most likely token
        tokens = torch.where(bad, lp.argmax(-1), tokens)
    return tokens


def use_checkpointing(cfg: PolicyConfig, prompt_ids: Sequence[Sequence[int]],
                      completion_ids: Sequence[Sequence[int]]) -> bool:
    """Gradient checkpointing for one training micro-batch: ``grad-checkpointing`` = true always;
    otherwise when ``grad-checkpointing-tokens`` > 0 and the micro-batch's padded tokens (rows x the
    longest prompt + completion) exceed it."""
    if cfg.grad_checkpointing:
        return True
    if cfg.grad_checkpointing_tokens <= 0 or not prompt_ids:
        return False
    longest = max(len(p) + len(c) for p, c in zip(prompt_ids, completion_ids))
    return len(prompt_ids) * longest > cfg.grad_checkpointing_tokens


def sparse_tied_embedding_gradient(model: torch.nn.Module) -> bool:
    """On CPU, let the input embedding of a model whose LM head shares its weight return a sparse
    gradient (the rows of the tokens seen) instead of a dense vocabulary x hidden one.

    The dense path allocates, zero-fills and adds one (V, H) tensor per embedding call (SmolLM2: 113 MB,
    twice per shared-prefix micro-batch; fresh pages are expensive on a CPU VM). Autograd sums the sparse
    rows into the LM head's dense gradient of the same parameter before accumulating, so the parameter's
    gradient stays dense (clipping and fused AdamW unchanged) and equals the dense computation (tests).
    Untied embeddings keep the dense gradient (fused AdamW refuses sparse ones). Returns whether applied."""
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    ok = (type(emb) is torch.nn.Embedding and head is not None and getattr(head, "weight", None) is emb.weight
          and emb.weight.requires_grad and emb.weight.device.type == "cpu")
    if ok:
        emb.sparse = True
    return ok


def left_pad(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token rows for generation: (input_ids, attention_mask), both (N, max_len) long."""
    P = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), P), pad_id, dtype=torch.long)
    attn = torch.zeros_like(input_ids)
    for i, r in enumerate(rows):
        input_ids[i, P - len(r):] = torch.tensor(list(r), dtype=torch.long)
        attn[i, P - len(r):] = 1
    return input_ids, attn


class HFPolicy(Policy):
    """A transformers causal LM that generates, scores and exposes its trainable parameters."""

    def __init__(self, cfg: PolicyConfig):
        self.cfg = cfg
        path = resolve_model(cfg.model)                 # may build and warm up the model (its own seeds)
        base = existing(self._share_key(path)) if cfg.share_base else None
        self.tokenizer = base.tokenizer if base is not None else load_tokenizer(path)   # share-base: one
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        torch.manual_seed(cfg.seed)                     # after any build: the adapter's init is the same
        self.shared = None                              # share-base: the SharedBase holding the model
        self.adapter_name = "default"                   # share-base: this policy's adapter in it
        self.model = self._load_model(path)             # whether the model cache was warm or not
        self.checkpointing = False
        if cfg.grad_checkpointing:                      # active in train() mode only: generation keeps its cache
            self._set_checkpointing(True)
        self.model_id = cfg.label
        self.tokenizer_fp = tokenizer_fingerprint(self.tokenizer)
        self.weights_fp = weights_fingerprint(path)     # the bytes it started from (not the adapter's)
        self.vocab_size = int(max(len(self.tokenizer), self.model.get_input_embeddings().weight.shape[0]))
        if self.shared is not None:                     # its own adapter's weights only, in model order
            self.own_parameters = dict(self.shared.parameters_of(self.adapter_name))
            self.trainable = list(self.own_parameters.values())
        else:
            self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.autocast = self._autocast_dtype()

    # ------------------------------------------------------------------ loading
    def _lora_config(self):
        from peft import LoraConfig

        return LoraConfig(r=self.cfg.lora_r, lora_alpha=self.cfg.lora_alpha, lora_dropout=self.cfg.lora_dropout,
                          target_modules="all-linear", task_type="CAUSAL_LM")

    def _share_key(self, path: str) -> tuple:
        """share-base: policies whose key is the same share one base model (and tokenizer)."""
        return (str(Path(path).resolve()), self.cfg.weights_dtype, self.cfg.quant)

    def _load_model(self, path: str) -> torch.nn.Module:
        if self.cfg.share_base:                         # one base per process, an adapter per participant
            self.shared, self.adapter_name = attach(self._share_key(path), lambda: self._load_base(path), self._lora_config(),
                                                    self.cfg.seed, lambda _: self.hub_generation_config)
            self.hub_generation_config = self.shared.hub_generation_config
            if self.shared.tokenizer is None:           # one tokenizer too (~18 MB for a 49k vocabulary)
                self.shared.tokenizer = self.tokenizer
            return self.shared.model
        model = self._load_base(path)
        if self.cfg.adapter == "lora":
            from peft import get_peft_model

            for p in model.parameters():
                p.requires_grad_(False)
            model = get_peft_model(model, self._lora_config())
        sparse_tied_embedding_gradient(unwrap_causal_lm(model))         # full fine-tuning on CPU only
        return model

    def _load_base(self, path: str) -> torch.nn.Module:
        """The model as ``from_pretrained`` loads it, its generation config neutral (the hub's kept
        as ``hub_generation_config``)."""
        kwargs: dict = {"dtype": getattr(torch, WEIGHT_DTYPES[self.cfg.weights_dtype])}
        if self.cfg.quant != "none":
            kwargs["quantization_config"] = quantization.bnb_config(self.cfg.quant)
            kwargs["device_map"] = {"": "cuda:0" if torch.cuda.is_available() else "cpu"}
        elif torch.cuda.is_available():
            kwargs["device_map"] = {"": "cuda:0"}
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
        self.hub_generation_config = model.generation_config      # written back by export only
        model.generation_config = GenerationConfig()              # nothing of it leaks into sampling
        if self.cfg.quant != "none":
            quantization.disable_cpu_bf16_repacking(model)
        return model

    def _activate(self) -> None:
        """share-base: make this policy's adapter the model's active one, with its own gradient
        checkpointing setting (a no-op for a policy with a model of its own)."""
        if self.shared is not None:
            self.shared.activate(self.adapter_name)
            if self.shared.checkpointing != self.checkpointing:
                self._apply_checkpointing(self.checkpointing)

    def _autocast_dtype(self) -> torch.dtype | None:
        if self.cfg.dtype == "fp32":
            return None
        if self.cfg.dtype == "bf16" or torch.cuda.is_available() or cpu_has_bf16():
            return torch.bfloat16
        return None

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _autocast(self):
        return torch.autocast(self.device.type, dtype=self.autocast or torch.bfloat16,
                              enabled=self.autocast is not None)

    # ------------------------------------------------------------------ generate
    @torch.no_grad()
    def generate(self, prompts: Sequence[Prompt], group_size: int, sampling: SamplingParams,
                 seed: int) -> list[Rollout]:
        """G completions per prompt, all prompts in one left-padded batch."""
        if group_size < 1:
            raise ValueError(f"group_size={group_size}: must be >= 1")
        self._activate()
        tok = self.tokenizer
        prompt_ids = [self.format_prompt(p.text) for p in prompts]
        rows = [ids for ids in prompt_ids for _ in range(group_size)]
        input_ids, attn = left_pad(rows, tok.pad_token_id)                       # (N,P)
        P = input_ids.shape[1]
        sampler = RecordingSampler(sampling, prompt_len=P)
        gen_cfg = sampling_generation_config(sampling.max_new_tokens, tok, do_sample=False)  # the sampler draws
        torch.manual_seed(seed)
        self.model.eval()
        with self._autocast():
            cache = self._shared_prompt_cache(input_ids, attn, group_size) if self.cfg.share_prefix else None
            seqs = self.model.generate(input_ids=input_ids.to(self.device), attention_mask=attn.to(self.device),
                                       generation_config=gen_cfg, logits_processor=LogitsProcessorList([sampler]),
                                       **({"past_key_values": cache} if cache is not None else {}))
        seqs = seqs.cpu()
        logps = sampler.finish(seqs).cpu()                                       # (N, T)
        gen = seqs[:, P:]                                                        # (N, T)
        out: list[Rollout] = []
        for pi, p in enumerate(prompts):
            c_ids, c_lp, texts = [], [], []
            for j in range(group_size):
                r = pi * group_size + j
                ids = gen[r].tolist()
                n = ids.index(tok.eos_token_id) + 1 if tok.eos_token_id in ids else len(ids)
                c_ids.append(np.asarray(ids[:n], dtype=np.int64))
                c_lp.append(np.minimum(logps[r, :n].numpy().astype(np.float32), 0.0))
                texts.append(tok.decode(ids[:n], skip_special_tokens=True))
            out.append(Rollout(p, np.asarray(prompt_ids[pi], dtype=np.int64), c_ids, c_lp, texts))
        return out

    def _shares_prefills(self) -> bool:
        """Whether a prefilled, repeated KV cache is exact for this architecture (``prefix.MODEL_TYPES``,
        checked by tests/test_prefix.py)."""
        from ftis_fed.policies.prefix import MODEL_TYPES

        return getattr(unwrap_causal_lm(self.model).config, "model_type", None) in MODEL_TYPES

    def _prefilled_cache(self, ids: torch.Tensor, repeats: int, mask: torch.Tensor | None = None):
        """The KV cache of ``ids`` (U,L), each row's entries repeated ``repeats`` times (U*repeats rows).
        With ``mask`` (left padding), positions come from it exactly as ``generate`` derives them."""
        from transformers import DynamicCache

        kwargs = {}
        if mask is not None:
            pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)                           # (U,L)
            kwargs = {"attention_mask": mask.to(self.device), "position_ids": pos.to(self.device)}
        cache = DynamicCache(config=unwrap_causal_lm(self.model).config)
        self.model(input_ids=ids.to(self.device), past_key_values=cache, use_cache=True, logits_to_keep=1,
                   **kwargs)
        cache.batch_repeat_interleave(repeats)                                              # (U*repeats, ...)
        return cache

    def _shared_prompt_cache(self, input_ids: torch.Tensor, attn: torch.Tensor, group_size: int):
        """The KV cache of every row's first P-1 prompt positions, computed once per prompt and repeated
        for its ``group_size`` rows (rows are grouped: prompt k owns rows k*G .. k*G+G-1), or None when
        there is nothing to share (G = 1, a one-token prompt) or the architecture is not one of
        ``prefix.MODEL_TYPES`` (checked by tests/test_prefix.py). ``generate`` then runs only the last
        prompt position and the decode steps; positions come from the mask exactly as ``generate``
        derives them (left padding), so the rows see the same keys/values as an unshared prefill."""
        P = input_ids.shape[1]
        if group_size < 2 or P < 2 or not self._shares_prefills():
            return None                                  # nothing to share, or an architecture not checked
        return self._prefilled_cache(input_ids[::group_size, : P - 1], group_size,
                                     mask=attn[::group_size, : P - 1])                     # (U,P-1) each

    @torch.no_grad()
    def generate_greedy(self, prompts: Sequence[Prompt], max_new_tokens: int, batch_size: int = 64) -> list[str]:
        """Greedy replies, ``batch_size`` prompts per ``generate``. The rows' longest common token prefix
        (the chat template's system message) is prefilled once (``_common_prefix_rows``)."""
        self._activate()
        tok = self.tokenizer
        self.model.eval()
        texts: list[str] = []
        gen_cfg = sampling_generation_config(max_new_tokens, tok, do_sample=False)
        for s in range(0, len(prompts), batch_size):
            rows = [self.format_prompt(p.text) for p in prompts[s:s + batch_size]]
            with self._autocast():
                shared = self._common_prefix_rows(rows) if self.cfg.share_prefix else None
                if shared is None:
                    input_ids, attn = left_pad(rows, tok.pad_token_id)           # (n,P)
                    kwargs = {}
                else:
                    input_ids, attn, cache = shared
                    kwargs = {"past_key_values": cache}
                seqs = self.model.generate(input_ids=input_ids.to(self.device),
                                           attention_mask=attn.to(self.device), generation_config=gen_cfg, **kwargs)
            texts += tok.batch_decode(seqs[:, input_ids.shape[1]:].cpu(), skip_special_tokens=True)
        return texts

    def _common_prefix_rows(self, rows: Sequence[Sequence[int]]):
        """(input_ids, attention_mask, cache) for rows that share their first L tokens, or None (one row,
        L < 2, or an architecture not in ``prefix.MODEL_TYPES``).

        Layout: [common prefix | padding | the row's rest], the padding masked. The prefix's keys/values
        are computed once (one row) and repeated for every row; positions come from the mask as
        ``generate`` derives them (cumulative sum), so each row's rest sits at positions L, L+1, ... exactly
        as in a left-padded batch: the same computation as ``left_pad`` rows, with the prefix done once."""
        if len(rows) < 2 or not self._shares_prefills():
            return None
        rows = [list(r) for r in rows]
        L = min(len(os.path.commonprefix(rows)), min(len(r) for r in rows) - 1)  # each row keeps >= 1 own token
        if L < 2:
            return None
        prefix = torch.tensor(rows[0][:L], dtype=torch.long)[None]                          # (1,L)
        rest_ids, rest_attn = left_pad([r[L:] for r in rows], self.tokenizer.pad_token_id)   # (n,R)
        input_ids = torch.cat([prefix.expand(len(rows), -1), rest_ids], dim=1)              # (n,L+R)
        attn = torch.cat([torch.ones_like(input_ids[:, :L]), rest_attn], dim=1)
        return input_ids, attn, self._prefilled_cache(prefix, len(rows))

    # ------------------------------------------------------------------ score
    def score(self, prompt_ids, completion_ids, sampling: SamplingParams, grad: bool = False) -> list[torch.Tensor]:
        self._activate()
        out: list[torch.Tensor] = []
        self.model.train(grad)
        for s in range(0, len(prompt_ids), self.cfg.micro_batch):
            lp = self.score_padded(prompt_ids[s:s + self.cfg.micro_batch],
                                   completion_ids[s:s + self.cfg.micro_batch], sampling, grad)
            out += [lp[i, : len(c)] for i, c in enumerate(completion_ids[s:s + self.cfg.micro_batch])]
        return out

    def score_padded(self, prompt_ids, completion_ids, sampling: SamplingParams, grad: bool,
                     reference: bool = False, layout: tuple | None = None) -> torch.Tensor:
        """(b,T) log-probs for one micro-batch (see logprobs.token_logprobs). With gradient and
        ``grad-checkpointing-tokens`` > 0, checkpointing is switched on for this micro-batch when its
        padded tokens exceed the threshold (``use_checkpointing``). reference: see
        ``score_padded_and_reference``; layout: see ``score_layout``."""
        self._activate()
        if grad and self.cfg.grad_checkpointing_tokens > 0:
            self._set_checkpointing(use_checkpointing(self.cfg, prompt_ids, completion_ids))
        out = token_logprobs(self.model, prompt_ids, completion_ids, sampling, self.tokenizer.pad_token_id,
                             grad=grad, chunk=self.cfg.logit_chunk, autocast_dtype=self.autocast,
                             share_prefix=self.cfg.share_prefix, head_graph_mb=self.cfg.logit_graph_mb,
                             reference=reference, layout=layout)
        return tuple(x.cpu() for x in out) if reference else out.cpu()

    def score_layout(self, prompt_ids, completion_ids) -> tuple | None:
        """``logprobs.token_layout``: a shared-prefix call's (P, T) padding; None for the unshared path,
        and with dropout (a training-mode call's values are a draw)."""
        self._activate()
        if self._training_dropout():
            return None
        return token_layout(self.model, prompt_ids, completion_ids, self.cfg.share_prefix)

    def score_padded_and_reference(self, prompt_ids, completion_ids, sampling: SamplingParams, grad: bool):
        """The reference from the same forward: the decoder's hidden states do not depend on the mode
        or on the gradient, so only the LM head's no-grad values are computed besides (``scoring.
        chunked_logprobs``), unless dropout is active in training mode (then the base class's second
        pass in evaluation mode)."""
        if grad and self._training_dropout():
            return super().score_padded_and_reference(prompt_ids, completion_ids, sampling, grad)
        return self.score_padded(prompt_ids, completion_ids, sampling, grad, reference=True)

    def _training_dropout(self) -> bool:
        """Whether training mode draws dropout anywhere in the model (a module or attention dropout)."""
        lm = unwrap_causal_lm(self.model)
        return (float(getattr(lm.config, "attention_dropout", 0.0) or 0.0) > 0
                or any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in self.model.modules()))

    def retokenize(self, prompt_text: str, completion_text: str, ended: bool) -> tuple[list[int], list[int]]:
        """A peer's text in this model's tokenizer and chat template; EOS appended only when the
        sender's completion ended with EOS (a completion cut at max-new-tokens has none, and an
        appended EOS would add a log pi(EOS) term the sender's summed log-prob lacks)."""
        ids = list(self.tokenizer(completion_text, add_special_tokens=False)["input_ids"])
        return self.format_prompt(prompt_text), (ids + [self.tokenizer.eos_token_id] if ended else ids)

    def _set_checkpointing(self, on: bool) -> None:
        model_has = self.shared.checkpointing if self.shared is not None else self.checkpointing
        self.checkpointing = on
        if on != model_has:
            self._apply_checkpointing(on)

    def _apply_checkpointing(self, on: bool) -> None:
        lm = unwrap_causal_lm(self.model)
        if on:
            lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            lm.gradient_checkpointing_disable()
        if self.shared is not None:
            self.shared.checkpointing = on

    # ------------------------------------------------------------------ export
    def export(self, path: str | Path) -> Path:
        """The trained model as ``save_pretrained`` writes it, into ``path`` (replaced atomically:
        written next to it, then renamed): for LoRA (and 4-bit/8-bit QLoRA) the peft adapter folder
        (``adapter_config.json`` names the base model folder), otherwise the full model folder in its
        weights dtype; both with the tokenizer and the model's own generation_config.json."""
        lm = unwrap_causal_lm(self.model)
        with atomic_dir(path) as tmp:
            neutral, lm.generation_config = lm.generation_config, self.hub_generation_config
            try:
                if self.shared is not None:             # this adapter only, as its own model's export
                    self.model.save_pretrained(tmp, selected_adapters=[self.adapter_name])
                    for f in (Path(tmp) / self.adapter_name).iterdir():
                        f.replace(Path(tmp) / f.name)
                    (Path(tmp) / self.adapter_name).rmdir()
                else:
                    self.model.save_pretrained(tmp)
                if self.cfg.adapter == "lora":
                    self.hub_generation_config.save_pretrained(tmp)
            finally:
                lm.generation_config = neutral
            self.tokenizer.save_pretrained(tmp)
        return Path(path)

    # ------------------------------------------------------------------ training hooks / state
    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return self.trainable

    def train_mode(self, training: bool) -> None:
        self._activate()
        self.model.train(training)

    def trainable_state(self) -> dict[str, torch.Tensor]:
        if self.shared is not None:
            return {n: p.detach().cpu().clone() for n, p in self.own_parameters.items()}
        return {n: p.detach().cpu().clone() for n, p in self.model.named_parameters() if p.requires_grad}

    def load_trainable_state(self, state: dict[str, torch.Tensor], source: str = "state") -> None:
        names = self.own_parameters if self.shared is not None else dict(self.model.named_parameters())
        with torch.no_grad():
            for n, t in state.items():
                if n not in names:
                    raise ValueError(f"checkpoint {source}: parameter {n!r} not in model {self.model_id}")
                names[n].copy_(t)
