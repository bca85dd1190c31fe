"""``token_logprobs``: each completion token's log-prob under a model, the one entry point that
policies use. Rows that share a prompt compute it once where that pays (``prefix``); otherwise one
padded forward; the LM head's chunked log-softmax is ``scoring``'s."""

from __future__ import annotations

from typing import Sequence

import torch

from ftis_fed.policies.prefix import (masked_rows, shared_layout, shared_token_logprobs, supports_shared_prefix,
                                     worth_sharing)
from ftis_fed.policies.scoring import chunked_logprobs, pad_rows, unwrap_causal_lm
from ftis_fed.wire.batch import SamplingParams


def token_logprobs(model: torch.nn.Module, prompt_ids: Sequence[Sequence[int]],
                   completion_ids: Sequence[Sequence[int]], sampling: SamplingParams, pad_id: int,
                   grad: bool, chunk: int = 32, autocast_dtype: torch.dtype | None = None,
                   share_prefix: bool = False, head_graph_mb: float = 0.0, reference: bool = False,
                   layout: tuple | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Padded (B,T) log-probs of each completion token under ``model`` and ``sampling``.

    Positions past a completion's end hold 0. Runs as one micro-batch: callers split rows.
    share_prefix: rows with the same prompt compute it once (``prefix.shared_token_logprobs``: same
        values and gradients) when some prompt repeats and the model supports it.
    head_graph_mb: see ``chunked_logprobs`` (0 = always recompute the LM head's chunks in backward).
    reference: return (log-probs, the values a ``grad=False`` call gives, detached) from one forward
        (``chunked_logprobs``).
    layout: a ``token_layout`` of a call on more rows, these among them: score these rows as that call
        does (the same path and padding), so they get the values it gives them.
    """
    if layout is not None:
        if layout[0] != "shared":
            raise ValueError(f"layout {layout!r}: only a shared-prefix layout can be given")
        return shared_token_logprobs(model, prompt_ids, completion_ids, sampling, pad_id, grad, chunk,
                                     autocast_dtype, head_graph_mb, reference, pad_to=layout[1:])
    if token_layout(model, prompt_ids, completion_ids, share_prefix) is not None:
        return shared_token_logprobs(model, prompt_ids, completion_ids, sampling, pad_id, grad, chunk,
                                     autocast_dtype, head_graph_mb, reference)
    lm = unwrap_causal_lm(model)
    decoder, head = lm.get_decoder(), lm.get_output_embeddings()
    input_ids, attn, target_pos, tmask = pad_rows(prompt_ids, completion_ids, pad_id)
    B, T = tmask.shape
    if T == 0:
        return (torch.zeros((B, 0)),) * 2 if reference else torch.zeros((B, 0))
    device = next(lm.parameters()).device
    input_ids, attn, target_pos = input_ids.to(device), attn.to(device), target_pos.to(device)
    targets = torch.zeros((B, T), dtype=torch.long, device=device)               # (B,T)
    for i, c in enumerate(completion_ids):
        if len(c):
            targets[i, : len(c)] = torch.as_tensor(list(c), dtype=torch.long)
    with torch.set_grad_enabled(grad), torch.autocast(
            device.type, dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
        hidden = decoder(input_ids=input_ids, attention_mask=attn, use_cache=False).last_hidden_state  # (B,L,H)
        h = hidden.gather(1, target_pos.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))  # (B,T,H)
        lp = chunked_logprobs(head, h, targets, sampling, chunk, grad, head_graph_mb, reference)  # (B,T)
    return masked_rows(lp, tmask.to(device))


def token_layout(model: torch.nn.Module, prompt_ids: Sequence[Sequence[int]],
                 completion_ids: Sequence[Sequence[int]], share_prefix: bool) -> tuple | None:
    """How ``token_logprobs`` lays these rows out: ``("shared", P, T)`` when it shares their prompts
    (``prefix.shared_layout``), None otherwise (one padded forward: not described here). Rows of two calls
    with the same layout get the same values, whatever the other rows (tests/test_prefix.py)."""
    if share_prefix and worth_sharing(prompt_ids) and supports_shared_prefix(model):
        return ("shared", *shared_layout(prompt_ids, completion_ids))
    return None
