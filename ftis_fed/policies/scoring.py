"""Teacher-forced per-token log-probs without materialising batch x length x vocab logits.

The decoder runs once per micro-batch of rows; the LM head and the sampling-distribution log-softmax
run over chunks of completion positions. With gradients, the graph keeps one (rows, chunk, V)
log-softmax per chunk while the micro-batch's (rows x positions x V) fp32 values fit in
``head_graph_mb`` MiB (the ``logit-graph-mb`` key: no LM-head recompute in backward); beyond that,
each chunk is wrapped in activation checkpointing, so backward recomputes its logits instead of
keeping them: peak memory is then one chunk of logits, not the whole batch's (SmolLM2-135M, 8x8x64
tokens in one pass: 11-15 GB).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch.utils.checkpoint import checkpoint

from ftis_fed.wire.batch import SamplingParams
from ftis_fed.policies.base import processed_logprobs


def unwrap_causal_lm(model: torch.nn.Module) -> torch.nn.Module:
    """The underlying *ForCausalLM module (through a peft wrapper if any)."""
    if hasattr(model, "get_base_model"):
        return model.get_base_model()
    return model


def pad_rows(prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]], pad_id: int):
    """Right-pad prompt+completion rows.

    Returns input_ids (B,L), attention_mask (B,L), target_pos (B,T) long: the position whose hidden
    state predicts completion token t (prompt_len - 1 + t), and tmask (B,T) bool.
    """
    rows = [list(p) + list(c) for p, c in zip(prompt_ids, completion_ids)]
    B = len(rows)
    L = max(len(r) for r in rows)
    T = max((len(c) for c in completion_ids), default=0)
    input_ids = torch.full((B, L), pad_id, dtype=torch.long)                     # (B,L)
    attn = torch.zeros((B, L), dtype=torch.long)                                 # (B,L)
    target_pos = torch.zeros((B, T), dtype=torch.long)                           # (B,T)
    tmask = torch.zeros((B, T), dtype=torch.bool)                                # (B,T)
    for i, (p, c) in enumerate(zip(prompt_ids, completion_ids)):
        n = len(p) + len(c)
        input_ids[i, :n] = torch.tensor(rows[i], dtype=torch.long)
        attn[i, :n] = 1
        if len(c):
            target_pos[i, : len(c)] = torch.arange(len(p) - 1, len(p) - 1 + len(c))
            tmask[i, : len(c)] = True
    return input_ids, attn, target_pos, tmask


def _chunk_logprobs(head: torch.nn.Module, h: torch.Tensor, targets: torch.Tensor,
                    sampling: SamplingParams) -> torch.Tensor:
    """(b,c,H) hidden, (b,c) targets -> (b,c) log-probs of the targets."""
    logits = head(h)                                                             # (b,c,V)
    lp = processed_logprobs(logits, sampling)                                    # (b,c,V)
    return lp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)                      # (b,c)


def keeps_head_graph(head: torch.nn.Module, rows: int, positions: int, head_graph_mb: float) -> bool:
    """Whether a micro-batch's LM-head log-softmax values (rows x positions x vocabulary, fp32) fit in
    ``head_graph_mb`` MiB, so the graph keeps them instead of recomputing each chunk in backward."""
    vocab = head.weight.shape[0] if hasattr(head, "weight") else 0
    return head_graph_mb > 0 and vocab > 0 and rows * positions * vocab * 4 <= head_graph_mb * 2 ** 20


class TargetLogProbs(torch.autograd.Function):
    """(B,T,H) hidden, (V,H) head weight, (B,T) targets -> (B,T) log-probs of the targets under
    log_softmax(h W^T / temperature), in chunks of positions, with a hand-written backward.

    The same function as ``_chunk_logprobs`` over the chunks without filters (top-k/top-p) and without
    bias, and what the autograd graph of that path keeps (one (B,T,V) fp32 tensor of log-probs), but its
    backward reuses that tensor in place (softmax = exp(log-probs), then the gradient of each target's
    log-prob, ``g * (onehot - softmax) / temperature``) and accumulates the head's weight gradient of all
    chunks into one tensor with ``addmm_``: no per-chunk (b,c,V) gradient tensors, zero-filled scatter
    buffers or (V,H) weight gradients to allocate and add. Tests: the same values and gradients as the
    autograd path."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float,
                chunk: int) -> torch.Tensor:
        outs, kept = [], []
        for s in range(0, h.shape[1], chunk):
            z = torch.matmul(h[:, s:s + chunk], weight.t()).div_(temperature)   # (b,c,V)
            z.sub_(torch.logsumexp(z, -1, keepdim=True))                          # log-probs, in place
            outs.append(z.gather(-1, targets[:, s:s + chunk, None]).squeeze(-1))  # (b,c)
            kept.append(z)
        ctx.save_for_backward(h, weight, targets)
        ctx.kept, ctx.temperature, ctx.chunk = kept, temperature, chunk
        return torch.cat(outs, dim=1)                                             # (B,T)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        h, weight, targets = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dh = [] if need_h else None
        dw = torch.zeros_like(weight) if need_w else None                        # (V,H)
        for i, s in enumerate(range(0, h.shape[1], ctx.chunk)):
            if ctx.kept[i] is None:
                raise RuntimeError("TargetLogProbs: a second backward through the same graph (retain_graph) "
                                   "is not supported: the kept log-probs are consumed in place")
            gc = g[:, s:s + ctx.chunk, None].to(weight.dtype)                    # (b,c,1)
            d = ctx.kept[i].exp_().mul_(-gc)                                      # -g * softmax
            d.scatter_add_(-1, targets[:, s:s + ctx.chunk, None], gc).div_(ctx.temperature)  # d logits
            ctx.kept[i] = None
            if need_h:
                dh.append(torch.matmul(d, weight))                                # (b,c,H)
            if need_w:
                hc = h[:, s:s + ctx.chunk]
                dw.addmm_(d.reshape(-1, d.shape[-1]).t(), hc.reshape(-1, hc.shape[-1]))
        return (torch.cat(dh, dim=1) if need_h else None), dw, None, None, None


def fused_head_ok(head: torch.nn.Module, h: torch.Tensor, sampling: SamplingParams) -> bool:
    """Whether ``TargetLogProbs`` computes this LM head exactly: a plain fp32 ``nn.Linear`` without bias,
    no top-k / top-p filter, no autocast."""
    return (type(head) is torch.nn.Linear and head.bias is None and head.weight.dtype == torch.float32
            and h.dtype == torch.float32 and not torch.is_autocast_enabled(h.device.type)
            and (not sampling.top_k or sampling.top_k >= head.weight.shape[0]) and sampling.top_p >= 1.0)


def chunked_logprobs(head: torch.nn.Module, h: torch.Tensor, targets: torch.Tensor, sampling: SamplingParams,
                     chunk: int, grad: bool, head_graph_mb: float = 0.0,
                     reference: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """(B,T,H) hidden states, (B,T) targets -> (B,T) float log-probs, the LM head run over ``chunk``
    positions at a time; with gradient each chunk is checkpointed (its logits recomputed in backward)
    unless the whole (B,T,V) log-softmax fits in ``head_graph_mb`` MiB (``keeps_head_graph``): then the graph
    keeps it, through ``TargetLogProbs`` where that applies (``fused_head_ok``).

    reference: return (log-probs, reference), the reference being, detached, the values a call with
    ``grad=False`` gives on the same hidden states (the chunks through ``_chunk_logprobs``). Only
    ``TargetLogProbs`` computes its values with another formula (equal up to rounding), so only that path
    runs the head's chunks a second time, without graph; on every other path the reference is the
    log-probs themselves."""
    outs = []
    recompute = grad and not keeps_head_graph(head, h.shape[0], h.shape[1], head_graph_mb)
    if grad and not recompute and fused_head_ok(head, h, sampling):
        lp = TargetLogProbs.apply(h, head.weight, targets, float(sampling.temperature), chunk).float()
        if not reference:
            return lp
        with torch.no_grad():
            return lp, chunked_logprobs(head, h.detach(), targets, sampling, chunk, False)
    for s in range(0, h.shape[1], chunk):
        hc, tc = h[:, s:s + chunk], targets[:, s:s + chunk]
        if recompute:
            outs.append(checkpoint(_chunk_logprobs, head, hc, tc, sampling, use_reentrant=False))
        else:
            outs.append(_chunk_logprobs(head, hc, tc, sampling))
    lp = torch.cat(outs, dim=1).float()
    return (lp, lp.detach()) if reference else lp
