"""Shared-prompt teacher-forced scoring: each distinct prompt runs once, its completions attend to it.

A GRPO batch holds G completions per prompt, and the chat template makes the prompt (system message +
question) longer than a short completion. ``token_logprobs`` runs every row as prompt+completion, so the
prompt's forward and backward are repeated G times. ``shared_token_logprobs`` computes the same (B,T)
log-probs in two decoder passes:

1. **prompt pass**: the U distinct prompts, right-padded to P = max prompt length, one row each. Every
   layer's keys/values (after RoPE) are recorded by ``_PromptRecorder`` (a transformers ``Cache`` whose
   ``update`` keeps the first tensors it sees and passes them through). They stay in the autograd graph,
   so gradients from every completion flow back through the prompt's forward exactly once, summed.
2. **completion pass**: each row's completion inputs c[0..T-2] at positions len(prompt)+j, attending to
   its prompt's recorded keys/values (``_PrefixReader.update`` returns ``cat(prompt_kv[row_prompt], kv)``,
   read-only) and causally to its own earlier completion tokens.

Completion token 0 is predicted by the prompt's last hidden state, token t >= 1 by the completion
pass at t-1; the LM head then runs in chunks exactly as in ``scoring.py``.

Masks are explicit 4D tensors ((B,1,q,kv), boolean for ``sdpa``, additive for ``eager``), which
transformers uses as given: the prompt pass is causal with padding keys masked (a pad query still sees
its prompt: no empty softmax row); the completion pass sees keys k < len(prompt) of the P prompt slots
and completion keys m <= j. Positions are passed explicitly, so rotary embeddings match the unshared rows.

Gradient checkpointing: transformers drops ``past_key_values`` inside checkpointed layers unless the layer
says it only reads the cache (``_can_checkpoint_with_cache``). Both caches here are replay-safe (the
recorder ignores the backward replay's second ``update``; the reader never mutates), so that flag is set
on the decoder layers for the duration of a call. Reentrant checkpointing would run the prompt pass
without a graph (no gradient through the recorded keys), so ``supports_shared_prefix`` refuses it and
callers fall back to the unshared computation.
"""

from __future__ import annotations

import contextlib
from typing import Sequence

import torch
from transformers.cache_utils import Cache, DynamicLayer

from ftis_fed.wire.batch import SamplingParams
from ftis_fed.policies.scoring import chunked_logprobs, unwrap_causal_lm

#: attention implementations whose mask argument we build (4D: boolean for sdpa, additive for eager).
ATTENTION_IMPLEMENTATIONS = ("sdpa", "eager")
#: architectures checked against the unshared computation (tests/test_prefix.py); others fall back.
MODEL_TYPES = ("llama", "qwen2", "mistral")


def prompt_index(prompt_ids: Sequence[Sequence[int]]) -> tuple[list[list[int]], list[int]]:
    """Distinct prompts in first-seen order, and each row's index into them."""
    first: dict[tuple[int, ...], int] = {}
    rows: list[int] = []
    for p in prompt_ids:
        rows.append(first.setdefault(tuple(int(t) for t in p), len(first)))
    return [list(p) for p in first], rows


def shared_layout(prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]]) -> tuple[int, int]:
    """(P, T): the prompt slots and completion positions a shared-prefix call pads these rows to. A row's
    values depend on the call's other rows only through them (tests/test_prefix.py): a call on some of
    the rows with ``pad_to`` = the whole call's layout gives them bit for bit."""
    return max(len(p) for p in prompt_ids), max(len(c) for c in completion_ids)


def worth_sharing(prompt_ids: Sequence[Sequence[int]]) -> bool:
    """Some prompt appears in more than one row (otherwise two passes only add work)."""
    return len({tuple(p) for p in prompt_ids}) < len(prompt_ids)


def supports_shared_prefix(model: torch.nn.Module) -> bool:
    """Whether ``shared_token_logprobs`` is exact for ``model``: a checked architecture, full attention in
    every layer, an attention implementation whose 4D mask we build, non-reentrant checkpointing."""
    lm = unwrap_causal_lm(model)
    cfg = lm.config
    if getattr(cfg, "model_type", None) not in MODEL_TYPES:
        return False
    if getattr(cfg, "_attn_implementation", None) not in ATTENTION_IMPLEMENTATIONS:
        return False
    if any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or ())):
        return False
    if getattr(cfg, "use_sliding_window", False) and getattr(cfg, "sliding_window", None):
        return False
    for m in lm.modules():
        fn = getattr(m, "_gradient_checkpointing_func", None)
        if getattr(m, "gradient_checkpointing", False) and fn is not None:
            if getattr(fn, "keywords", {}).get("use_reentrant", True) is not False:
                return False
    return True


class _PromptRecorder(Cache):
    """Records each layer's first (keys, values) and passes them through unchanged (replay-safe)."""

    def __init__(self):
        super().__init__(layer_class_to_replicate=DynamicLayer)
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.kv.setdefault(layer_idx, (key_states, value_states))               # each (U,kvh,P,d)
        return key_states, value_states


class _PrefixReader(Cache):
    """Prepends each row's prompt keys/values (recorded by the prompt pass); never mutates."""

    def __init__(self, recorder: _PromptRecorder, rows: torch.Tensor):
        super().__init__(layer_class_to_replicate=DynamicLayer)
        self.recorder, self.rows = recorder, rows                                # rows: (B,) prompt index

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        pk, pv = self.recorder.kv[layer_idx]                                     # (U,kvh,P,d)
        keys = torch.cat([pk.index_select(0, self.rows).to(key_states.dtype), key_states], dim=-2)
        values = torch.cat([pv.index_select(0, self.rows).to(value_states.dtype), value_states], dim=-2)
        return keys, values                                                      # (B,kvh,P+C,d)


@contextlib.contextmanager
def _layers_keep_cache(decoder: torch.nn.Module):
    """Let checkpointed decoder layers keep ``past_key_values`` (our caches are replay-safe)."""
    layers = [m for m in decoder.modules() if hasattr(type(m), "_can_checkpoint_with_cache")]
    saved = [m.__dict__.get("_can_checkpoint_with_cache") for m in layers]
    for m in layers:
        m._can_checkpoint_with_cache = True
    try:
        yield
    finally:
        for m, s in zip(layers, saved):
            if s is None:
                del m._can_checkpoint_with_cache
            else:
                m._can_checkpoint_with_cache = s


def _mask_4d(allowed: torch.Tensor, impl: str) -> torch.Tensor:
    """(B,q,kv) bool 'may attend' -> the 4D mask ``impl`` takes: bool (sdpa) or additive fp32 (eager)."""
    if impl == "sdpa":
        return allowed[:, None]                                                  # (B,1,q,kv)
    neg = torch.finfo(torch.float32).min
    return torch.zeros(allowed.shape, dtype=torch.float32, device=allowed.device).masked_fill(
        ~allowed, neg)[:, None]                                                  # (B,1,q,kv)


def shared_prefix_hidden(decoder: torch.nn.Module, prompt_ids: Sequence[Sequence[int]],
                         completion_ids: Sequence[Sequence[int]], pad_id: int, impl: str,
                         device: torch.device, pad_to: tuple[int, int] = (0, 0)) -> torch.Tensor:
    """(B,T,H) hidden states: [:, t] predicts completion token t (T = longest completion >= 1).
    pad_to: (P, T) at least: prompts padded to P slots, completions to T (``shared_layout``)."""
    unique, rows = prompt_index(prompt_ids)
    U, B = len(unique), len(rows)
    lens_p = torch.tensor([len(p) for p in unique], dtype=torch.long, device=device)        # (U,)
    if int(lens_p.min()) < 1:
        raise ValueError("shared-prefix scoring: every prompt needs at least one token")
    P = max(int(lens_p.max()), pad_to[0])
    T = max(max(len(c) for c in completion_ids), pad_to[1])
    row_u = torch.tensor(rows, dtype=torch.long, device=device)                             # (B,)

    p_ids = torch.full((U, P), pad_id, dtype=torch.long)                                    # (U,P)
    for u, p in enumerate(unique):
        p_ids[u, : len(p)] = torch.tensor(p, dtype=torch.long)
    ar_p = torch.arange(P, device=device)
    allowed_p = (ar_p[None, :, None] >= ar_p[None, None, :]) & (ar_p[None, None, :] < lens_p[:, None, None])
    recorder = _PromptRecorder()
    hp = decoder(input_ids=p_ids.to(device), attention_mask=_mask_4d(allowed_p, impl),     # (U,P,H)
                 position_ids=ar_p[None].expand(U, -1), past_key_values=recorder, use_cache=False
                 ).last_hidden_state
    h_first = hp[torch.arange(U, device=device), lens_p - 1].index_select(0, row_u)        # (B,H)
    C = T - 1                                                                               # completion inputs
    if C == 0:
        return h_first[:, None]                                                             # (B,1,H)
    c_ids = torch.full((B, C), pad_id, dtype=torch.long)                                    # (B,C)
    for i, c in enumerate(completion_ids):
        n = min(len(c), C)
        if n:
            c_ids[i, :n] = torch.as_tensor(list(c)[:n], dtype=torch.long)
    ar_c = torch.arange(C, device=device)
    row_len = lens_p.index_select(0, row_u)                                                 # (B,)
    see_prompt = (ar_p[None, :] < row_len[:, None])[:, None, :].expand(B, C, P)             # (B,C,P)
    see_self = (ar_c[:, None] >= ar_c[None, :])[None].expand(B, C, C)                       # (B,C,C)
    allowed_c = torch.cat([see_prompt, see_self], dim=-1)                                   # (B,C,P+C)
    hc = decoder(input_ids=c_ids.to(device), attention_mask=_mask_4d(allowed_c, impl),     # (B,C,H)
                 position_ids=row_len[:, None] + ar_c[None], past_key_values=_PrefixReader(recorder, row_u),
                 use_cache=False).last_hidden_state
    return torch.cat([h_first[:, None], hc], dim=1)                                         # (B,T,H)


def shared_token_logprobs(model: torch.nn.Module, prompt_ids: Sequence[Sequence[int]],
                          completion_ids: Sequence[Sequence[int]], sampling: SamplingParams, pad_id: int,
                          grad: bool, chunk: int = 32, autocast_dtype: torch.dtype | None = None,
                          head_graph_mb: float = 0.0, reference: bool = False,
                          pad_to: tuple[int, int] = (0, 0)) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Padded (B,T) log-probs of each completion token: the same values and gradients as
    ``logprobs.token_logprobs``, each distinct prompt computed once. Positions past a completion hold 0.
    reference: (log-probs, their no-grad values), as ``scoring.chunked_logprobs``.
    pad_to: (P, T) at least, as in a call with more rows (``shared_layout``)."""
    lm = unwrap_causal_lm(model)
    decoder, head = lm.get_decoder(), lm.get_output_embeddings()
    B = len(completion_ids)
    T = max(max((len(c) for c in completion_ids), default=0), pad_to[1])
    if T == 0:
        return (torch.zeros((B, 0)),) * 2 if reference else torch.zeros((B, 0))
    device = next(lm.parameters()).device
    lengths = torch.tensor([len(c) for c in completion_ids], device=device)
    tmask = torch.arange(T, device=device)[None, :] < lengths[:, None]                     # (B,T)
    targets = torch.zeros((B, T), dtype=torch.long, device=device)                          # (B,T)
    for i, c in enumerate(completion_ids):
        if len(c):
            targets[i, : len(c)] = torch.as_tensor(list(c), dtype=torch.long)
    impl = lm.config._attn_implementation
    with torch.set_grad_enabled(grad), _layers_keep_cache(decoder), torch.autocast(
            device.type, dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
        h = shared_prefix_hidden(decoder, prompt_ids, completion_ids, pad_id, impl, device, pad_to)  # (B,T,H)
        lp = chunked_logprobs(head, h, targets, sampling, chunk, grad, head_graph_mb, reference)  # (B,T)
    return masked_rows(lp, tmask)


def masked_rows(lp: torch.Tensor | tuple[torch.Tensor, ...], tmask: torch.Tensor):
    """(B,T) log-probs (or a tuple of them) with the positions past each completion set to 0."""
    if isinstance(lp, tuple):
        return tuple(masked_rows(x, tmask) for x in lp)
    return torch.where(tmask, lp, torch.zeros_like(lp))
