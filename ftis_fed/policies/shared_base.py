"""One copy of a base model for many LoRA participants in one process (``share-base = true``).

Participants of one worker process (``participants-per-worker``) that run LoRA on the same base
model (same folder, ``weights-dtype`` and ``quant``) hold one ``peft.PeftModel`` between them: the
first one loads the base and makes it a PeftModel with its adapter (``get_peft_model``), each next
one adds its own adapter to it (``PeftModel.add_adapter``), and every operation of a participant
first makes its adapter the active one (``PeftModel.set_adapter``, which also marks only that
adapter trainable); they use one tokenizer too. Each participant keeps its own adapter weights, optimizer (over its adapter's
parameters only), gradient-checkpointing setting, checkpoint and export; the base's weights are
frozen and read by all.

Results equal one participant per process: an adapter is initialised right after
``torch.manual_seed(policy-seed)``, exactly as ``HFPolicy`` does for an adapter of its own
(``from_pretrained`` draws nothing from torch's generator: ``tests/test_shared_base.py``); each
participant's own torch RNG stream (LoRA dropout) is the caller's to keep: the worker and the
in-process runner swap it per participant. The process must run one participant's operation at a
time (both do: the worker is single-threaded, ``commands/inprocess.py`` serialises).

Adapter names inside the PeftModel are ``a0``, ``a1``, ... (participant names may hold characters a
module name cannot); parameter names in checkpoints read ``default`` in their place, as a
participant with its own model writes them, so checkpoints move between the two layouts.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable

import torch

#: torch's default CPU seed: the state of the global generator in a fresh process (a participant
#: hosted with others starts its own RNG stream from it: the worker, ``commands/inprocess.py``)
TORCH_DEFAULT_SEED = 67280421310721
#: what a PeftModel names a lone adapter (and what checkpoints use)
DEFAULT = "default"


@dataclass
class SharedBase:
    """One base model as a PeftModel, and the adapters in it."""

    model: torch.nn.Module                      # the PeftModel
    hub_generation_config: object               # the base's own generation config (exports write it back)
    adapters: list[str] = field(default_factory=list)
    checkpointing: bool = False                 # gradient checkpointing as the model has it now
    tokenizer: object = None                    # the first participant's, used by all (read-only)

    def activate(self, adapter: str) -> None:
        """Make ``adapter`` the active (and only trainable) one; a no-op when it is."""
        if self.model.active_adapter != adapter:
            self.model.set_adapter(adapter)


_BASES: dict[tuple, SharedBase] = {}
_LOCK = threading.Lock()


def attach(key: tuple, load_base: Callable[[], torch.nn.Module], lora_config, seed: int,
           generation_config: Callable[[torch.nn.Module], object]) -> tuple[SharedBase, str]:
    """(the shared base for ``key``, the name of a new adapter in it made from ``lora_config``).
    ``load_base()`` loads the base the first time (``generation_config(model)`` takes its hub
    generation config off it); the adapter is initialised right after ``torch.manual_seed(seed)``."""
    from peft import get_peft_model

    with _LOCK:
        base = _BASES.get(key)
        if base is None:
            model = load_base()
            hub = generation_config(model)
            for p in model.parameters():
                p.requires_grad_(False)
            torch.manual_seed(seed)
            model = get_peft_model(model, lora_config, adapter_name="a0")
            base = _BASES[key] = SharedBase(model, hub, ["a0"])
            return base, "a0"
        name = f"a{len(base.adapters)}"
        torch.manual_seed(seed)
        base.model.add_adapter(name, lora_config)
        base.adapters.append(name)
        base.activate(name)
        return base, name


def existing(key: tuple) -> SharedBase | None:
    """The shared base for ``key`` if this process holds one."""
    return _BASES.get(key)


def adapter_parameters(model: torch.nn.Module, adapter: str) -> list[tuple[str, torch.nn.Parameter]]:
    """(checkpoint name, parameter) of ``adapter``'s weights in ``model``, in the model's parameter
    order (the order a participant with its own model lists its trainable parameters in). The
    checkpoint name has ``default`` where the parameter's name has ``adapter``."""
    out = []
    for n, p in model.named_parameters():
        parts = n.split(".")
        hit = [i for i in range(1, len(parts)) if parts[i] == adapter and parts[i - 1].startswith("lora_")]
        if hit:
            for i in hit:
                parts[i] = DEFAULT
            out.append((".".join(parts), p))
    return out


def shared_bases() -> int:
    """How many base models this process holds for shared-base participants."""
    return len(_BASES)
