"""4-bit / 8-bit (bitsandbytes) participants, and the CPU trap that silently kills their gradients.

bitsandbytes 0.50.2 on a CPU with AVX512-BF16: the first time a ``Linear4bit`` runs in eval mode
without grad (e.g. inside ``generate``), it repacks its weight into a CPU-only inference layout
(``_convert_weight_packed_for_cpu``). Afterwards the backward pass through that layer yields no
gradient for the input (no error for bias-free layers; an in-place error with bias), so every LoRA
adapter *below* it stops learning. ``disable_cpu_bf16_repacking`` turns the repacking off on every
4-bit layer before first use (tests/test_quant.py checks LoRA gradients are non-zero and the loss
moves after the model has generated).
"""

from __future__ import annotations

import torch


def require_bnb():
    try:
        import bitsandbytes as bnb  # noqa: F401
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ImportError("quant='4bit'/'8bit' needs bitsandbytes: pip install 'ftis-fed[quant]'") from e
    return bnb


def bnb_config(quant: str):
    """The transformers BitsAndBytesConfig for ``4bit`` (NF4, double quant) or ``8bit``."""
    require_bnb()
    from transformers import BitsAndBytesConfig

    compute = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    if quant == "4bit":
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                  bnb_4bit_compute_dtype=compute)
    if quant == "8bit":
        return BitsAndBytesConfig(load_in_8bit=True)
    raise ValueError(f"quant={quant!r}: must be '4bit' or '8bit'")


def disable_cpu_bf16_repacking(model: torch.nn.Module) -> int:
    """Set ``support_avx512bf16_for_cpu = False`` on every bnb Linear4bit; returns how many."""
    bnb = require_bnb()
    n = 0
    for m in model.modules():
        if isinstance(m, bnb.nn.Linear4bit):
            m.support_avx512bf16_for_cpu = False
            n += 1
    return n
