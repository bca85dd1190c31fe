"""Participants of *different sizes*, derived offline from SmolLM2 by project code (size heterogeneity).

The paper pairs models of different sizes (Qwen2.5 1.5B with 3B). Here the sizes are made from the
one shipped model, reproducibly and without a hub:

``smollm2-l20`` — a *shallower* SmolLM2: 20 of its 30 decoder layers kept (``SHALLOW_LAYERS``), the
embeddings, final norm and tied head unchanged, then briefly **distilled** from SmolLM2
(``build_shallow``, 40 steps): each step takes 8 train-split problems of the ID families (``add30``,
``sub30``), chat-formatted question followed by the bare reference answer and EOS; the loss is the
KL divergence from the teacher's (SmolLM2's) next-token distribution to the student's at every
position (keeps the pruned model a language model close to its teacher) plus cross-entropy on the
reply tokens (makes it answer tersely and correctly). 99.1 M parameters instead of 134.5 M.

``smollm2-d36`` — a *deeper* SmolLM2 grown from it (``build_grown``): six of its layers duplicated
in place (``GROW_AFTER``), each copy **identity-initialised** (its attention output and MLP down
projections zeroed, so it adds nothing to the residual stream and the grown model computes exactly
SmolLM2's function), then briefly fine-tuned (12 steps x 8 problems) with the same reply loss so the new layers move off
identity. 155.8 M parameters.

Both are seeded end to end (problems, order, initialisation) and built once under the file lock of
``resolve_model`` into ``~/.cache/ftis-fed/models/<name>``. Measured sizes and held-out accuracy:
docs/models.md. A tiny configuration of the same builders (``tiny-llama-b`` as base) is what the fast
tests build.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

# torch is imported inside the builders: importing this module only registers them (the launcher's
# model-name check does, and needs no torch)
from ftis_fed.policies.store import OFFLINE_MODELS, TRAINED_BUILDS, resolve_model

#: SmolLM2's 30 layers -> the 20 the shallow model keeps: the first 14 and the last two whole, every
#: third one in between (late-middle layers are the most redundant ones in Llama-style models; keeping
#: only 14 layers left a reply cross-entropy of 15.9 nats before distillation, too far to recover in a
#: build of a few minutes).
SHALLOW_LAYERS = (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 16, 19, 22, 25, 28, 29)
#: Layers after which the deep model inserts an identity-initialised copy (spread over the middle).
GROW_AFTER = (6, 10, 14, 18, 22, 26)


def _remapped(base: str, src_layers: Sequence[int], zero: Sequence[int] = ()):
    """A model of ``base``'s architecture whose layer j is a copy of ``base``'s layer ``src_layers[j]``;
    layers whose new index is in ``zero`` get zero output projections (identity residual blocks)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    src = resolve_model(base)
    teacher = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    cfg = AutoConfig.from_pretrained(src)
    n = cfg.num_hidden_layers
    bad = [i for i in src_layers if not 0 <= i < n]
    if bad or not src_layers:
        raise ValueError(f"{base}: layer map {list(src_layers)} must be non-empty indices in 0..{n - 1}")
    cfg.num_hidden_layers = len(src_layers)
    if getattr(cfg, "layer_types", None) is not None:
        cfg.layer_types = [cfg.layer_types[i] for i in src_layers]
    student = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    old = teacher.state_dict()
    new = {}
    for k in student.state_dict():
        if ".layers." in k:
            head, rest = k.split(".layers.", 1)
            j, tail = rest.split(".", 1)
            new[k] = old[f"{head}.layers.{src_layers[int(j)]}.{tail}"].clone()
            if int(j) in zero and (tail.startswith("self_attn.o_proj.") or tail.startswith("mlp.down_proj.")):
                new[k].zero_()
        else:
            new[k] = old[k].clone()
    student.load_state_dict(new, strict=True)
    student.generation_config = teacher.generation_config
    return teacher, student


def _examples(tok, families: Sequence[str], seed: int, start: int, batch: int):
    """``batch`` chat-formatted train-split problems -> padded ids (B,L), attention (B,L), reply mask (B,L)
    (True where the *next* token is a reply token: the positions whose prediction the CE loss scores)."""
    import torch
    from ftis_fed.tasks.suite import task_at

    rows = []
    for j in range(batch):
        i = start + j
        p = task_at(families[i % len(families)], "train", seed + 7919, i)
        prompt = tok.apply_chat_template([{"role": "user", "content": p.text}], add_generation_prompt=True,
                                         tokenize=True, return_dict=False)
        reply = tok(str(p.reference), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        rows.append((list(prompt), reply))
    L = max(len(p) + len(r) for p, r in rows)
    ids = torch.full((batch, L), tok.pad_token_id, dtype=torch.long)                 # (B,L)
    attn = torch.zeros((batch, L), dtype=torch.long)                                 # (B,L)
    reply_pos = torch.zeros((batch, L), dtype=torch.bool)                            # (B,L)
    for b, (p, r) in enumerate(rows):
        ids[b, : len(p) + len(r)] = torch.tensor(p + r)
        attn[b, : len(p) + len(r)] = 1
        reply_pos[b, len(p) - 1: len(p) + len(r) - 1] = True
    return ids, attn, reply_pos


def _train(out: Path, tok, student, teacher, *, families: Sequence[str], steps: int, lr: float, batch: int,
           seed: int, kd_weight: float) -> None:
    """Distil / fine-tune ``student``: kd_weight * KL(teacher || student) over all real positions
    + cross-entropy of the reply tokens. Seeded; prints the loss every 20 steps."""
    import torch
    torch.manual_seed(seed)
    teacher.eval()
    student.train()
    opt = torch.optim.AdamW(student.parameters(), lr=lr, weight_decay=0.0)
    for step in range(steps):
        ids, attn, reply_pos = _examples(tok, families, seed, step * batch, batch)
        logits = student(input_ids=ids, attention_mask=attn).logits                  # (B,L,V)
        real = attn.bool().clone()                                                   # (B,L)
        real[:, -1] = False
        real &= torch.roll(attn.bool(), -1, dims=1)                                  # next token is real
        tgt = torch.roll(ids, -1, dims=1)                                            # (B,L)
        ce = torch.nn.functional.cross_entropy(logits[reply_pos], tgt[reply_pos])
        loss = ce
        if kd_weight > 0:
            with torch.no_grad():
                t_logp = torch.log_softmax(teacher(input_ids=ids, attention_mask=attn).logits[real], -1)  # (N,V)
            s_logp = torch.log_softmax(logits[real], -1)                                                  # (N,V)
            kd = (t_logp.exp() * (t_logp - s_logp)).sum(-1).mean()
            loss = ce + kd_weight * kd
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 20 == 0 or step == steps - 1:
            print(f"[sized {out.name}] step {step + 1}/{steps} loss {loss.item():.4f} (reply CE {ce.item():.4f})",
                  flush=True)


def build_shallow(out: Path, base: str = "smollm2", layers: Sequence[int] = SHALLOW_LAYERS,
                  families: Sequence[str] = ("add30", "sub30"), steps: int = 40, lr: float = 1e-4,
                  batch: int = 8, seed: int = 0, kd_weight: float = 1.0) -> None:
    """``base`` with only ``layers`` kept, distilled from ``base`` (KL on every position + reply CE)."""
    import torch
    from transformers import AutoTokenizer

    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(resolve_model(base))
    teacher, student = _remapped(base, layers)
    _train(out, tok, student, teacher, families=families, steps=steps, lr=lr, batch=batch, seed=seed,
           kd_weight=kd_weight)
    student.save_pretrained(out)
    tok.save_pretrained(out)


def grown_layers(n: int, after: Sequence[int]) -> tuple[list[int], list[int]]:
    """(source layer of each layer of the grown model, indices of the inserted copies)."""
    src, copies = [], []
    for i in range(n):
        src.append(i)
        if i in after:
            copies.append(len(src))
            src.append(i)
    return src, copies


def build_grown(out: Path, base: str = "smollm2", after: Sequence[int] = GROW_AFTER,
                families: Sequence[str] = ("add30", "sub30"), steps: int = 12, lr: float = 1e-5,
                batch: int = 8, seed: int = 0) -> None:
    """``base`` with an identity-initialised copy inserted after each layer in ``after``, then
    ``steps`` of reply fine-tuning (no distillation term: at step 0 it *is* the teacher)."""
    import torch
    from transformers import AutoConfig, AutoTokenizer

    torch.manual_seed(seed)
    src = resolve_model(base)
    tok = AutoTokenizer.from_pretrained(src)
    layer_src, copies = grown_layers(AutoConfig.from_pretrained(src).num_hidden_layers, after)
    teacher, student = _remapped(base, layer_src, zero=copies)
    _train(out, tok, student, teacher, families=families, steps=steps, lr=lr, batch=batch, seed=seed,
           kd_weight=0.0)
    student.save_pretrained(out)
    tok.save_pretrained(out)


#: Size heterogeneity: a shallower, distilled SmolLM2 (20 of 30 layers, 99.1 M parameters).
OFFLINE_MODELS["smollm2-l20"] = build_shallow
#: Size heterogeneity: a deeper SmolLM2 (36 layers, 156 M), grown with identity-initialised copies.
OFFLINE_MODELS["smollm2-d36"] = build_grown


#: The SFT phase of ``smollm2-l20-sft`` (``build_shallow_sft``): reply-only cross-entropy on the ID
#: families' train split, bare-number replies (``derived.build_sft``).
SHALLOW_SFT = dict(families=("add30", "sub30"), steps=60, lr=1e-4, batch=8, seed=0)


def build_shallow_sft(out: Path, base: str = "smollm2-l20", **kw) -> None:
    """``base`` (the distilled shallow model) after a seeded supervised fine-tune on the ID families'
    train split (``SHALLOW_SFT``, overridable by keyword): makes the small model *competent* on the
    task, not only a language model close to its teacher. The loss touches the reply tokens only, so a
    step costs a fraction of a distillation step (no teacher, no full-vocabulary KL)."""
    from ftis_fed.policies.derived import build_sft

    args = {**SHALLOW_SFT, **kw}
    build_sft(out, base, tuple(args["families"]), steps=args["steps"], lr=args["lr"], batch=args["batch"],
              seed=args["seed"])


#: The small participant of the grid: smollm2-l20 made competent (docs/models.md).
OFFLINE_MODELS["smollm2-l20-sft"] = build_shallow_sft
#: Distillation and SFT: built with pinned kernels (store.TRAINED_BUILDS).
TRAINED_BUILDS.update({"smollm2-l20", "smollm2-d36", "smollm2-l20-sft"})
