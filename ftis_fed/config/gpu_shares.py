"""A simulated participant's share of its GPU, from the run config (the worker's memory cap)."""

from __future__ import annotations

from typing import Mapping

from ftis_fed.config.participants import participant_names, participant_value, population_members, simulated
from ftis_fed.policies.devices import memory_shares, select_device


def run_memory_share(run_config: Mapping[str, object], participant: str, cuda_count: int) -> float:
    """``participant``'s share of its card in a simulation: every declared participant's ``device``
    resolved against ``cuda_count`` cards (``auto`` spread by partition id), an explicit ``gpu-memory-share`` kept, the others sharing
    what is left of their card (``memory_shares``); 0.0 on the CPU. Its vLLM engine gets
    ``ENGINE_FRACTION`` of it. Reads the three keys of each participant it needs (``participant_value``),
    not its whole spec, and parses nothing else of the run config (the worker has parsed it)."""
    names = participant_names(run_config)
    members = population_members(run_config)
    devices, explicit, engines = {}, {}, []
    for pid, name in enumerate(names):
        at = simulated(run_config, pid, len(names), members)
        devices[name] = select_device(participant_value(at, "device"), cuda_count, key=at.named("device"), index=pid)
        explicit[name] = participant_value(at, "gpu-memory-share")
        if participant_value(at, "backend") == "vllm":
            engines.append(name)
    shares = memory_shares(devices, explicit, engines)
    return shares[participant].share if participant in shares else 0.0
