"""A vLLM participant's start-up (ftis_fed/policies/vllm_policy.py), with a stand-in for vLLM: the
engine gets max-model-len and the memory utilization from the participant's keys, bad values are
errors naming the key and the limit, and the whole start-up holds the card's lock."""

from __future__ import annotations

import fcntl
import importlib.machinery
import os
import sys
import tomllib
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ftis_fed.config.keys import federation_from_run_config
from ftis_fed.config.participants import participant_spec
from ftis_fed.config.validation import validate_run_config
from ftis_fed.policies.config import PolicyConfig

ROOT = Path(__file__).resolve().parent.parent


class FakeLLM:
    """Records its arguments and whether the card lock was held while it started and synced."""

    made: list["FakeLLM"] = []
    lock_path: Path | None = None

    def __init__(self, model, **kw):
        self.model, self.kw = model, kw
        self.held_at_start = self._lock_held()
        self.rpcs: list[tuple] = []
        FakeLLM.made.append(self)

    @classmethod
    def _lock_held(cls) -> bool:
        fd = os.open(cls.lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)
        return False

    def collective_rpc(self, name, args=()):
        self.rpcs.append((name, self._lock_held()))
        return [{}]

    def reset_prefix_cache(self):
        return True


@pytest.fixture
def fake_vllm(monkeypatch, tmp_path):
    mod = types.ModuleType("vllm")
    mod.__spec__ = importlib.machinery.ModuleSpec("vllm", None)
    mod.LLM = FakeLLM
    monkeypatch.setitem(sys.modules, "vllm", mod)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)        # a pretend GPU machine
    monkeypatch.setenv("FTIS_FED_RUNTIME", str(tmp_path / "rt"))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5")                      # the worker pinned it to card 5
    FakeLLM.made, FakeLLM.lock_path = [], tmp_path / "rt" / "gpu-5.lock"
    return mod


def _trainer(ctx: int = 2048):
    model = torch.nn.Linear(4, 4)
    model.config = SimpleNamespace(max_position_embeddings=ctx)
    return SimpleNamespace(model=model, tokenizer=[0] * 10, model_id="fake", tokenizer_fp="fp", vocab_size=10)


def test_engine_gets_the_participants_memory_keys_and_starts_under_the_card_lock(fake_vllm, tmp_path):
    from ftis_fed.policies.vllm_policy import VLLMPolicy

    cfg = PolicyConfig(backend="vllm", max_model_len=1024, gpu_memory_utilization=0.2)
    pol = VLLMPolicy(cfg, trainer=_trainer(), model_path=str(tmp_path), work_dir=tmp_path / "w")
    llm = FakeLLM.made[-1]
    assert llm.kw["max_model_len"] == 1024 and llm.kw["gpu_memory_utilization"] == 0.2
    assert llm.held_at_start and llm.rpcs == [("ftis_reload_weights", True)]   # start and first sync locked
    assert not FakeLLM._lock_held()                                          # released once started
    assert pol.weights_version == 1
    # derived: 0.4 of the share; nothing set: 0.35 and the model's own context
    VLLMPolicy(PolicyConfig(backend="vllm", gpu_memory_share=0.5), trainer=_trainer(), model_path=str(tmp_path),
               work_dir=tmp_path / "w2")
    assert FakeLLM.made[-1].kw["gpu_memory_utilization"] == pytest.approx(0.2)
    VLLMPolicy(PolicyConfig(backend="vllm"), trainer=_trainer(), model_path=str(tmp_path), work_dir=tmp_path / "w3")
    assert FakeLLM.made[-1].kw["gpu_memory_utilization"] == 0.35 and "max_model_len" not in FakeLLM.made[-1].kw


def test_a_start_up_waits_while_another_holds_the_card(fake_vllm, tmp_path, monkeypatch):
    """Another participant is starting on card 5: this one does not start its engine until it is done."""
    from ftis_fed.policies.vllm_policy import VLLMPolicy

    FakeLLM.lock_path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(FakeLLM.lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.pwrite(fd, b"pid 4242 (vLLM start-up of other)", 0)
    said = []
    import ftis_fed.policies.vllm_policy as vp

    real = vp.card_lock

    def card_lock(what, env=None, log=None):
        def log_and_release(msg):
            said.append(msg)
            fcntl.flock(fd, fcntl.LOCK_UN)                      # the other participant finishes its start-up
        return real(what, env, log=log_and_release)

    monkeypatch.setattr(vp, "card_lock", card_lock)
    try:
        VLLMPolicy(PolicyConfig(backend="vllm"), trainer=_trainer(), model_path=str(tmp_path), work_dir=tmp_path / "w")
    finally:
        os.close(fd)
    assert len(FakeLLM.made) == 1 and FakeLLM.made[0].held_at_start
    assert said and "waiting for GPU 5: pid 4242 (vLLM start-up of other) is starting on it" in said[0]


def test_max_model_len_beyond_the_models_context_names_the_key_and_the_limit(fake_vllm, tmp_path):
    from ftis_fed.policies.vllm_policy import VLLMPolicy

    with pytest.raises(ValueError, match=r"max-model-len=4096: more than the model's context, 2048 tokens"):
        VLLMPolicy(PolicyConfig(backend="vllm", max_model_len=4096), trainer=_trainer(2048), model_path=str(tmp_path),
                   work_dir=tmp_path / "w")
    assert not FakeLLM.made and not FakeLLM._lock_held()


def _rc(**over) -> dict:
    rc = dict(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"])
    rc.update(over)
    return rc


def test_bad_values_are_errors_naming_the_key_and_the_limit():
    fed = federation_from_run_config(_rc())
    node = {"partition-id": 1, "num-partitions": 4}
    cases = [({"backend": "vllm", "p1-max-model-len": -5}, r"p1-max-model-len=-5: must be >= 0"),
             ({"backend": "vllm", "p1-gpu-memory-utilization": 0.99}, r"p1-gpu-memory-utilization=0.99: must be in \[0, 0.95\]"),
             ({"p1-max-model-len": 512}, r"p1-max-model-len=512: applies to vLLM participants only"),
             ({"backend": "vllm", "p1-gpu-memory-share": 0.3, "p1-gpu-memory-utilization": 0.5},
              r"p1-gpu-memory-utilization=0.5: more than this participant's gpu-memory-share=0.3")]
    for over, msg in cases:
        with pytest.raises(ValueError, match=msg):
            participant_spec(_rc(**over), node, fed)
    ok = participant_spec(_rc(backend="vllm", **{"p1-max-model-len": 512, "p1-gpu-memory-utilization": 0.3}), node, fed)
    assert (ok.policy.max_model_len, ok.policy.gpu_memory_utilization) == (512, 0.3)
    with pytest.raises(ValueError, match=r"max-model-len=16 \(participant smol-full\): must be more than "
                                         r"max-new-tokens / eval-max-new-tokens \(24\)"):
        validate_run_config(_rc(backend="vllm", **{"max-model-len": 16}), check_models=False)
