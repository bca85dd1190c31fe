"""Offline participants derived from SmolLM2 by project code: reproducible, built on first use, cached.

``smollm2-bpe8k`` — a *different tokenizer*. SmolLM2's byte-level BPE assigns token id 252 + i to
the result of merge i, so keeping only the first 8,000 merges gives a valid, coarser BPE whose ids
are a prefix of SmolLM2's: the vocabulary shrinks from 49,152 to 8,252, most words split into more
pieces, and the model keeps exactly the embedding rows (tied LM head) of the surviving tokens. Its
tokenizer fingerprint differs from SmolLM2's, so batches between them can only be used at sequence
level, re-tokenized from text (``training.samples_from_batches``). It is weaker than SmolLM2
(it never saw these tokenizations), which makes it the participant with most to learn from peers.

``smollm2-sub30`` — an *expertise* specialist: SmolLM2 after a short, seeded supervised fine-tune
(``build_sft``: 80 steps x 16 problems of the ``sub30`` train split, bare-number replies; 5.4 min on
this 2-core machine). Greedy on 48 held-out problems, 16 new tokens: subtraction 33 % (base 12.5 %),
addition 6 % (base 23 %) -- it answers tersely and has forgotten some addition (docs/models.md).
"""

from __future__ import annotations

import json
from pathlib import Path

# torch is imported inside the builders: importing this module only registers them (the launcher's
# model-name check does, and needs no torch)
from ftis_fed.policies.store import OFFLINE_MODELS, TRAINED_BUILDS, resolve_model

BPE_BASE_IDS = 252  # 17 special tokens + 235 byte-level base symbols precede the first merge


def build_truncated_bpe(out: Path, merges: int = 8000, source: str = "smollm2") -> None:
    """SmolLM2 with its BPE cut to the first ``merges`` merges and embeddings sliced to match."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = Path(resolve_model(source))
    tj = json.loads((src / "tokenizer.json").read_text())
    model_tj = tj["model"]
    keep = BPE_BASE_IDS + merges
    vocab = {t: i for t, i in model_tj["vocab"].items() if i < keep}
    if len(vocab) != keep:
        raise ValueError(f"{source}: expected ids 0..{keep - 1} to be contiguous, got {len(vocab)}")
    model_tj["vocab"] = vocab
    model_tj["merges"] = model_tj["merges"][:merges]
    tj["added_tokens"] = [a for a in tj["added_tokens"] if a["id"] < keep]
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name.startswith("tokenizer") or f.name.endswith(".jinja") or f.name == "special_tokens_map.json":
            (out / f.name).write_bytes(f.read_bytes())
    (out / "tokenizer.json").write_text(json.dumps(tj, ensure_ascii=False))
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    model.resize_token_embeddings(keep)                                         # keeps rows [0, keep)
    model.config.vocab_size = keep
    model.save_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    if len(tok) != keep:
        raise ValueError(f"truncated tokenizer has {len(tok)} tokens, expected {keep}")


OFFLINE_MODELS["smollm2-bpe8k"] = build_truncated_bpe


def build_sft(out: Path, base: str, families: tuple[str, ...], steps: int, lr: float, batch: int = 16,
              seed: int = 0, reply: str = "{answer}") -> None:
    """Supervised fine-tune ``base`` on procedural train-split problems of ``families``.

    Each example is the chat-formatted question followed by ``reply`` (e.g. just the number) and
    EOS; the loss covers the reply tokens only. Seeded end to end (problems, order, init), so the
    result is reproducible on the same software versions.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ftis_fed.tasks.suite import task_at

    torch.manual_seed(seed)
    src = resolve_model(base)
    tok = AutoTokenizer.from_pretrained(src)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()

    def example(i: int) -> tuple[list[int], list[int]]:
        p = task_at(families[i % len(families)], "train", seed + 7919, i)
        prompt = tok.apply_chat_template([{"role": "user", "content": p.text}], add_generation_prompt=True,
                                         tokenize=True, return_dict=False)
        target = tok(reply.format(answer=p.reference), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        return list(prompt), list(target)

    decoder, head = model.get_decoder(), model.get_output_embeddings()
    for step in range(steps):
        rows = [example(step * batch + j) for j in range(batch)]
        L = max(len(p) + len(t) for p, t in rows)
        ids = torch.full((batch, L), tok.pad_token_id, dtype=torch.long)            # (B,L)
        attn = torch.zeros((batch, L), dtype=torch.long)                            # (B,L)
        pos, tgt = [], []                                                           # reply positions only
        for i, (p, t) in enumerate(rows):
            ids[i, : len(p) + len(t)] = torch.tensor(p + t)
            attn[i, : len(p) + len(t)] = 1
            pos += [(i, len(p) - 1 + j) for j in range(len(t))]
            tgt += t
        hidden = decoder(input_ids=ids, attention_mask=attn).last_hidden_state      # (B,L,H)
        rows_i, cols_i = zip(*pos)
        logits = head(hidden[list(rows_i), list(cols_i)])                           # (N,V): no (B,L,V)
        loss = torch.nn.functional.cross_entropy(logits, torch.tensor(tgt))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 50 == 0 or step == steps - 1:
            print(f"[build_sft {out.name}] step {step + 1}/{steps} loss {loss.item():.4f}", flush=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)


#: Unit/e2e tests: a 2-layer random-init model taught to answer one-digit sums (it gets some right,
#: so GRPO groups carry signal: ~11 % reward at T=0.7, a quarter of groups mixed).
OFFLINE_MODELS["tiny-arith"] = lambda out: build_sft(out, "tiny-llama", ("add1",), steps=200, lr=3e-3, batch=32)

#: Expertise heterogeneity: SmolLM2-135M-Instruct after a short supervised fine-tune on two-digit
#: subtraction (train split only; replies are the bare number). Built once on first use, seeded.
OFFLINE_MODELS["smollm2-sub30"] = lambda out: build_sft(out, "smollm2", ("sub30",), steps=80, lr=3e-5, batch=16)
TRAINED_BUILDS.update({"tiny-arith", "smollm2-sub30"})   # SFT: built with pinned kernels (store.TRAINED_BUILDS)
