"""A simulated participant's share of its GPU, from the run config (the worker's memory cap)."""

from __future__ import annotations

from typing import Mapping

from ftis_fed.config.federation import federation_from_run_config, participant_names, participant_spec


def run_memory_share(run_config: Mapping[str, object], participant: str, cuda_count: int) -> float:
    """``participant``'s share of its card in a simulation: every declared participant's ``device``
    resolved against ``cuda_count`` cards (``auto`` spread by partition id), an explicit ``gpu-memory-share`` kept, the others sharing
    what is left of their card (``memory_shares``); 0.0 on the CPU. Its vLLM engine gets
    ``ENGINE_FRACTION`` of it."""
    from ftis_fed.policies.devices import memory_shares, select_device

    fed = federation_from_run_config(run_config)
    names = participant_names(run_config)
    devices, explicit, engines = {}, {}, []
    for pid, name in enumerate(names):
        spec = participant_spec(run_config, {"partition-id": pid, "num-partitions": len(names)}, fed)
        devices[name] = select_device(spec.policy.device, cuda_count, key=f"p{pid}-device", index=pid)
        explicit[name] = spec.policy.gpu_memory_share
        if spec.policy.backend == "vllm":
            engines.append(name)
    shares = memory_shares(devices, explicit, engines)
    return shares[participant].share if participant in shares else 0.0
