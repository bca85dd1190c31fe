"""Participants of different sizes: the builders of ftis_fed.policies.sized, on a tiny base (fast) and
on SmolLM2 (slow: the registered models, built once into the shared cache)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from ftis_fed.policies import sized
from ftis_fed.policies.models import OFFLINE_MODELS, resolve_model


def _weights(d):
    return load_file(str(d / "model.safetensors"))


def _logits(model, tok):
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 17 + 25? Reply with just the number."}],
                                  add_generation_prompt=True, tokenize=True, return_dict=False)
    with torch.no_grad():
        return model(input_ids=torch.tensor([list(ids)])).logits


def test_shallow_builder_keeps_the_chosen_layers_trains_and_is_deterministic(tmp_path):
    kw = dict(base="tiny-llama-b", layers=(0, 2), steps=3, lr=1e-3, batch=4, seed=0)
    sized.build_shallow(tmp_path / "a", **kw)
    sized.build_shallow(tmp_path / "b", **kw)
    a, b = _weights(tmp_path / "a"), _weights(tmp_path / "b")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)     # same seed, same model
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "a")
    assert model.config.num_hidden_layers == 2
    base = AutoModelForCausalLM.from_pretrained(resolve_model("tiny-llama-b"))
    # before training, layer 1 of the student was layer 2 of the base; training moved it
    assert not torch.equal(model.model.layers[1].mlp.up_proj.weight, base.model.layers[2].mlp.up_proj.weight)
    assert sum(p.numel() for p in model.parameters()) < sum(p.numel() for p in base.parameters())
    tok = AutoTokenizer.from_pretrained(tmp_path / "a")
    out = model.generate(torch.tensor([[tok.bos_token_id or 1]]), max_new_tokens=3, do_sample=False)
    assert out.shape[1] >= 2


def test_remapped_student_copies_the_source_layers_exactly():
    teacher, student = sized._remapped("tiny-llama-b", (2, 0))
    for j, i in enumerate((2, 0)):
        for (n1, p1), (n2, p2) in zip(student.model.layers[j].named_parameters(),
                                      teacher.model.layers[i].named_parameters()):
            assert n1 == n2 and torch.equal(p1, p2)
    with pytest.raises(ValueError, match="layer map"):
        sized._remapped("tiny-llama-b", (0, 3))


def test_grown_model_starts_as_the_same_function_and_has_more_layers(tmp_path):
    src, copies = sized.grown_layers(3, after=(0, 2))
    assert src == [0, 0, 1, 2, 2] and copies == [1, 4]
    sized.build_grown(tmp_path / "g", base="tiny-llama-b", after=(0, 2), steps=0, batch=2)
    grown = AutoModelForCausalLM.from_pretrained(tmp_path / "g")
    base = AutoModelForCausalLM.from_pretrained(resolve_model("tiny-llama-b"))
    assert grown.config.num_hidden_layers == 5
    tok = AutoTokenizer.from_pretrained(tmp_path / "g")
    torch.testing.assert_close(_logits(grown, tok), _logits(base, tok), rtol=1e-5, atol=1e-5)  # identity init
    sized.build_grown(tmp_path / "h", base="tiny-llama-b", after=(0, 2), steps=2, lr=1e-3, batch=2)
    trained = AutoModelForCausalLM.from_pretrained(tmp_path / "h")
    assert not torch.allclose(_logits(trained, tok), _logits(base, tok))        # briefly trained: moved


def test_sized_models_are_registered():
    assert OFFLINE_MODELS["smollm2-l20"] is sized.build_shallow
    assert OFFLINE_MODELS["smollm2-d36"] is sized.build_grown
    assert OFFLINE_MODELS["smollm2-l20-sft"] is sized.build_shallow_sft


def test_shallow_sft_fine_tunes_its_base_on_the_reply_and_is_deterministic(tmp_path):
    kw = dict(base="tiny-llama-b", steps=3, lr=1e-3, batch=4)
    sized.build_shallow_sft(tmp_path / "a", **kw)
    sized.build_shallow_sft(tmp_path / "b", **kw)
    a, b = _weights(tmp_path / "a"), _weights(tmp_path / "b")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)     # same seed, same model
    base = AutoModelForCausalLM.from_pretrained(resolve_model("tiny-llama-b"))
    tuned = AutoModelForCausalLM.from_pretrained(tmp_path / "a")
    assert tuned.config.num_hidden_layers == base.config.num_hidden_layers       # the base's architecture
    tok = AutoTokenizer.from_pretrained(tmp_path / "a")
    assert not torch.allclose(_logits(tuned, tok), _logits(base, tok))          # trained: moved


@pytest.mark.slow
@pytest.mark.parametrize("name,layers", [("smollm2-l20", 20), ("smollm2-l20-sft", 20), ("smollm2-d36", 36)])
def test_registered_sized_models_build_and_load(name, layers):
    model = AutoModelForCausalLM.from_pretrained(resolve_model(name))
    assert model.config.num_hidden_layers == layers
    n = sum(p.numel() for p in model.parameters())
    base = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(resolve_model("smollm2")).parameters())
    assert (n < base) if layers < 30 else (n > base)
