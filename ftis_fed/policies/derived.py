"""Offline participants derived from SmolLM2 by project code: reproducible, built on first use, cached.

``smollm2-bpe8k`` — a *different tokenizer*. SmolLM2's byte-level BPE assigns token id 252 + i to
the result of merge i, so keeping only the first 8,000 merges gives a valid, coarser BPE whose ids
are a prefix of SmolLM2's: the vocabulary shrinks from 49,152 to 8,252, most words split into more
pieces, and the model keeps exactly the embedding rows (tied LM head) of the surviving tokens. Its
tokenizer fingerprint differs from SmolLM2's, so batches between them can only be used at sequence
level, re-tokenized from text (``training.samples_from_batches``). It is weaker than SmolLM2
(it never saw these tokenizations), which makes it the participant with most to learn from peers.

``smollm2-arith`` — an *expertise* specialist: SmolLM2 after a short, seeded supervised fine-tune
on the procedural arithmetic train split (``build_specialist``; ~2 min on 2 CPU cores).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .models import OFFLINE_MODELS, resolve_model

BPE_BASE_IDS = 252  # 17 special tokens + 235 byte-level base symbols precede the first merge


def build_truncated_bpe(out: Path, merges: int = 8000, source: str = "smollm2") -> None:
    """SmolLM2 with its BPE cut to the first ``merges`` merges and embeddings sliced to match."""
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
