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

Between operations the model shows only the active adapter: the LoRA layers' module and
parameter dicts (``lora_A``, ``lora_B``, ``lora_dropout``, ...) hold that adapter's entries alone,
the others wait in ``SharedBase.full``. Everything that walks the model's modules (peft's
``add_adapter`` and ``set_adapter``, ``model.train()`` / ``eval()``, the shared-prefix check, an
export's ``state_dict``) then costs the same with 2 adapters or 200, as with a model of one's own;
walked whole, each would cost O(k) with k adapters, and a worker of k participants O(k^2) to start
(measured: the 32nd adapter ~0.3 s on micro-llama-s, and with 128 adapters a training step's
``train()`` / ``eval()`` / prefix checks ~0.3 s of its ~0.8 s). A switch shows peft the two adapters
it switches between, so it does to them what it does over all; the others are not active, not
trainable and not in any forward, as peft leaves them. ``tests/test_shared_base.py`` checks every
parameter (name, order, value, trainable flag), every layer's active adapter and the logits against
peft's own calls over all adapters.

Adapter names inside the PeftModel are ``a0``, ``a1``, ... (participant names may hold characters a
module name cannot); parameter names in checkpoints read ``default`` in their place, as a
participant with its own model writes them, so checkpoints move between the two layouts.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

#: torch's default CPU seed: the state of the global generator in a fresh process (a participant
#: hosted with others starts its own RNG stream from it: the worker, ``commands/inprocess.py``)
TORCH_DEFAULT_SEED = 67280421310721
#: what a PeftModel names a lone adapter (and what checkpoints use)
DEFAULT = "default"


@dataclass
class SharedBase:
    """One base model as a PeftModel, and the adapters in it. Between calls the model shows only
    its active adapter (see the module docstring): ``stores`` are the tuner layers' module and
    parameter dicts as (dict, attribute) pairs, ``full`` the whole store of each, which the dict's
    own attribute holds only while ``everything()`` runs."""

    model: torch.nn.Module                      # the PeftModel
    hub_generation_config: object               # the base's own generation config (exports write it back)
    adapters: list[str] = field(default_factory=list)
    checkpointing: bool = False                 # gradient checkpointing as the model has it now
    tokenizer: object = None                    # the first participant's, used by all (read-only)
    stores: list = field(default_factory=list)  # (ModuleDict / ParameterDict, "_modules" / "_keys" / "_parameters")
    full: list = field(default_factory=list)    # each store with every adapter, in the order they were added

    @classmethod
    def around(cls, model: torch.nn.Module, hub_generation_config: object, adapter: str) -> "SharedBase":
        """The shared base of a PeftModel made with its first adapter, ``adapter``."""
        from peft.tuners.tuners_utils import BaseTunerLayer

        stores = []
        for layer in (m for m in model.modules() if isinstance(m, BaseTunerLayer)):
            for attr in layer.adapter_layer_names + layer.other_param_names:
                d = getattr(layer, attr, None)
                if isinstance(d, torch.nn.ModuleDict):
                    stores.append((d, "_modules"))
                elif isinstance(d, torch.nn.ParameterDict):
                    stores += [(d, "_keys"), (d, "_parameters")]
        base = cls(model, hub_generation_config, [adapter], stores=stores,
                   full=[getattr(d, name) for d, name in stores])
        base._show((adapter,))
        return base

    def _show(self, names) -> None:
        """Each store holds the entries of ``names`` only (in the order of ``names``)."""
        for (d, attr), full in zip(self.stores, self.full):
            object.__setattr__(d, attr, {n: full[n] for n in names if n in full})

    def _collect(self) -> None:
        """Entries the shown stores gained (a new adapter) go into the whole stores, last."""
        for (d, attr), full in zip(self.stores, self.full):
            shown = getattr(d, attr)
            if shown is not full:
                full.update(shown)

    def activate(self, adapter: str) -> None:
        """Make ``adapter`` the active (and only trainable) one, and the only one shown; a no-op
        when it is. peft's ``set_adapter`` sees the two it switches between."""
        current = self.model.active_adapter
        if current != adapter:
            self._show((current, adapter))
            self.model.set_adapter(adapter)
            self._collect()
            self._show((adapter,))

    def add(self, name: str, lora_config) -> None:
        """A new adapter ``name`` (peft's ``add_adapter``, which sees the active one only), made the
        active one."""
        self.model.add_adapter(name, lora_config)
        self._collect()
        self.adapters.append(name)
        self.activate(name)

    @contextlib.contextmanager
    def everything(self) -> Iterator[None]:
        """Every adapter shown while the block runs (what peft's own calls would see), then the
        active one alone again."""
        for (d, attr), full in zip(self.stores, self.full):
            object.__setattr__(d, attr, full)
        try:
            yield
        finally:
            self._show((self.model.active_adapter,))

    def parameters_of(self, adapter: str) -> list[tuple[str, torch.nn.Parameter]]:
        """``adapter_parameters`` of ``adapter`` (walking its own entries of the tuner layers only)."""
        active = self.model.active_adapter
        self._show((adapter,))
        try:
            return adapter_parameters(self.model, adapter)
        finally:
            self._show((active,))


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
            base = _BASES[key] = SharedBase.around(model, hub, "a0")
            return base, "a0"
        name = f"a{len(base.adapters)}"
        torch.manual_seed(seed)
        base.add(name, lora_config)
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
