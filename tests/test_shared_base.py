"""LoRA participants sharing one base model in a process (``share-base``) learn exactly as
participants with a model each: same rewards, losses and adapter weights after two rounds of the
real engine, with a real micro model (``policies/micro.py``), different ranks, learning rates and
LoRA dropout (each participant's own RNG stream), and each its own checkpoint and export."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ftis_fed.commands.inprocess import run_inprocess
from ftis_fed.policies import shared_base
from ftis_fed.policies.config import PolicyConfig

ROOT = Path(__file__).resolve().parents[1]
RUN_CONFIG = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]

#: three LoRA participants on one base with their own rank, rate and dropout; one full fine-tuning
POPULATION = {"defaults": {"model": "micro-llama-s", "adapter": "lora"},
              "participants": [{"name": "lo", "count": 3, "lora-dropout": 0.1,
                                "overrides": {"0": {"lora-r": 4, "lr": 1e-3}, "1": {"lora-r": 8, "lr": 5e-4},
                                              "2": {"lora-r": 2, "lr": 2e-3, "lora-dropout": 0.0}}},
                               {"name": "full", "adapter": "full", "lr": 5e-5}]}
#: per-row metrics that are timings or process facts, not results
VOLATILE = ("seconds", "worker/", "server_", "_s", "time", "pid")


def _run(tmp: Path, share: bool) -> Path:
    out = tmp / ("shared" if share else "separate")
    pop = json.loads(json.dumps(POPULATION))
    pop["participants"][0]["share-base"] = share
    rc = {**RUN_CONFIG, "population": json.dumps(pop), "output-dir": str(out), "num-rounds": 2,
          "task-families": "add30,sub30", "group-size": 4, "prompts-per-round": 2, "max-new-tokens": 8,
          "eval-every": 2, "eval-size": 8, "eval-ood-size": 2, "eval-max-new-tokens": 8,
          "checkpoint-every": 1, "export-final": True, "run-name": "shared-base"}
    shared_base._BASES.clear()
    assert run_inprocess(rc) == 2
    assert shared_base.shared_bases() == (1 if share else 0)        # one base model for the three
    shared_base._BASES.clear()
    return out


def _rows(out: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not any(t in k for t in VOLATILE)} for r in rows]


@pytest.mark.slow
def test_shared_base_equals_a_model_per_participant(tmp_path):
    sep, sh = _run(tmp_path, False), _run(tmp_path, True)
    a, b = _rows(sep), _rows(sh)
    assert len(a) == len(b) > 8
    rewards = [r for r in a if "reward/mean" in r]
    losses = [r for r in a if "train/loss" in r]
    assert len(rewards) >= 8 and len(losses) >= 8               # both rounds, every participant
    assert any(r["reward/mean"] > 0 for r in rewards)           # the micro model earns reward
    assert a == b                                                # rewards, losses, accuracies: identical
    for name in ("lo-0", "lo-1", "lo-2", "full"):
        ca = torch.load(next(sep.rglob(f"{name}/policy.pt")), weights_only=True)
        cb = torch.load(next(sh.rglob(f"{name}/policy.pt")), weights_only=True)
        assert ca["trainable"].keys() == cb["trainable"].keys() and ca["steps"] == cb["steps"] == 2
        for k in ca["trainable"]:
            assert torch.equal(ca["trainable"][k], cb["trainable"][k]), (name, k)
        if name != "full":                                     # trained: lora_B left its zero init
            assert any(t.abs().sum() > 0 for k, t in ca["trainable"].items() if "lora_B" in k)
    for name, r in (("lo-0", 4), ("lo-1", 8), ("lo-2", 2)):         # each its own rank and export
        ckpt = torch.load(next(sh.rglob(f"{name}/policy.pt")), weights_only=True)["trainable"]
        assert {t.shape[0] for k, t in ckpt.items() if "lora_A" in k} == {r}
        ea, eb = next(sep.rglob(f"{name}/export")), next(sh.rglob(f"{name}/export"))
        files = sorted(p.name for p in ea.iterdir())
        assert files == sorted(p.name for p in eb.iterdir()) and any(f.endswith(".safetensors") for f in files)
        for f in (f for f in files if f.endswith(".safetensors")):
            wa, wb = load_file(ea / f), load_file(eb / f)
            assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa), (name, f)


def test_share_base_needs_lora_on_the_hf_backend():
    with pytest.raises(ValueError, match=r"policy.share_base=True: .*needs adapter='lora'.*adapter is 'full'"):
        PolicyConfig(model="micro-llama-s", adapter="full", share_base=True)


def test_adding_and_switching_adapters_touch_two_of_them_and_match_peft_over_all(tmp_path):
    """#31: 256 participants in 8 workers spent ~10 s per worker in peft's add_adapter / set_adapter,
    which walk every adapter's modules (O(k) each, O(k^2) per worker). The shared base shows the
    model with its active adapter alone (peft: the two it switches between): every parameter (name, order, value, trainable flag),
    every layer's active adapter and the logits equal peft's own calls over all adapters, after each
    of five adapters (ranks 4, 8, 2, 16, 4, two with dropout) and six switches; and the modules
    ``add_adapter`` walks, and those the model shows between calls (what ``train()``, ``eval()`` and
    the shared-prefix check walk), stay as many with the 5th adapter as with the 2nd."""
    from peft import LoraConfig, get_peft_model
    from peft.tuners.tuners_utils import BaseTunerLayer
    from transformers import AutoModelForCausalLM

    from ftis_fed.policies.models import resolve_model

    path = resolve_model("micro-llama-s")

    def load():
        return AutoModelForCausalLM.from_pretrained(path)

    def lora(r: int, dropout: float) -> LoraConfig:
        return LoraConfig(r=r, lora_alpha=32.0, lora_dropout=dropout, target_modules="all-linear",
                          task_type="CAUSAL_LM")

    def state(model) -> list:
        return [(n, p.requires_grad, p.detach().clone()) for n, p in model.named_parameters()]

    def same(base, ref) -> None:
        model = base.model
        with base.everything():                                         # every adapter, as peft holds them
            a = state(model)
            assert sum(1 for _ in model.modules()) == sum(1 for _ in ref.modules())
        b = state(ref)
        assert [(n, g) for n, g, _ in a] == [(n, g) for n, g, _ in b]
        assert all(torch.equal(x, y) for (_, _, x), (_, _, y) in zip(a, b))
        layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
        ref_layers = [m for m in ref.modules() if isinstance(m, BaseTunerLayer)]
        assert [m.active_adapters for m in layers] == [m.active_adapters for m in ref_layers]
        assert model.active_adapter == ref.active_adapter
        shown.append(sum(1 for _ in model.modules()))                   # between calls: the active one alone
        ids = torch.arange(1, 13).reshape(2, 6)
        model.eval(), ref.eval()
        with torch.no_grad():
            assert torch.equal(model(input_ids=ids).logits, ref(input_ids=ids).logits)

    adapters = [(4, 0.0, 11), (8, 0.1, 12), (2, 0.0, 13), (16, 0.05, 14), (4, 0.0, 15)]
    key = (str(tmp_path), "fp32", "none")
    walked, shown = [], []
    try:
        base, _ = shared_base.attach(key, load, lora(*adapters[0][:2]), adapters[0][2], lambda m: m.generation_config)
        add = base.model.add_adapter

        def counting_add(*args, **kwargs):
            walked.append(sum(1 for _ in base.model.modules()))
            return add(*args, **kwargs)

        base.model.add_adapter = counting_add
        ref = load()
        for p in ref.parameters():
            p.requires_grad_(False)
        torch.manual_seed(adapters[0][2])
        ref = get_peft_model(ref, lora(*adapters[0][:2]), adapter_name="a0")
        for i, (r, dropout, seed) in enumerate(adapters[1:], 1):
            got, name = shared_base.attach(key, load, lora(r, dropout), seed, lambda m: m.generation_config)
            assert got is base and name == f"a{i}"
            torch.manual_seed(seed)
            ref.add_adapter(name, lora(r, dropout))
            ref.set_adapter(name)
            same(base, ref)
        assert len(walked) == 4 and len(set(walked)) == 1               # as many modules with 4 adapters as with 1
        with base.everything():
            assert sum(1 for _ in base.model.modules()) > walked[0]     # while the model holds more
        for name in ("a1", "a3", "a0", "a3", "a4", "a2"):
            base.activate(name)
            ref.set_adapter(name)
            same(base, ref)
        assert len(set(shown)) == 1                                     # the same with 1 adapter shown of 2 ... 5
        assert [n for n, _ in base.parameters_of("a3")] == [n for n, _ in shared_base.adapter_parameters(ref, "a3")]
        assert base.model.active_adapter == "a2" and shown[-1] == sum(1 for _ in base.model.modules())
    finally:
        shared_base._BASES.pop(key, None)
