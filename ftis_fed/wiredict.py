"""The packaged zstd dictionary of wire format v2: small frames without paying for zstd's tables.

A default-run frame holds ~235 completion tokens; zstd alone spends a good part of such a payload
on describing its entropy tables (Huffman literals, FSE sequences) and has no earlier data to
match. A dictionary carries both, trained once on SmolLM2 rollouts of the task suite under a task seed
no run uses (``TRAINING_SETS``, ``TRAINING_TASK_SEED``): it never saw a measured prompt. Frames name it by ``dict_id`` in the header;
the encoder keeps the dictionary-compressed payload only when it is smaller (it is for small
frames; large ones hardly differ). Every participant must hold the same bytes: the file ships
with the package and is checked against its SHA-256 when first loaded, so a changed file fails
loudly instead of decoding peers' frames into garbage.

    python -m ftis_fed.wiredict rollouts DIR             # the 42 training sets (SmolLM2, minutes)
    python -m ftis_fed.wiredict train OUT.zdict DIR/*.json
    python -m ftis_fed.wiredict embed OUT.zdict ftis_fed/wiredict_vN.py   # the bytes as a module
"""

from __future__ import annotations

import argparse
import dataclasses
import base64
import hashlib
import importlib
import textwrap
from functools import lru_cache
from pathlib import Path

import zstandard as zstd

#: dict_id -> (name, module holding its bytes as base85 ``DATA``, SHA-256 of the bytes). The bytes
#: live in a .py module because a Flower app bundle (FAB) carries only .py/.toml/.md/.json(l)/.yaml
#: files: a binary file in the package would be missing in every ``flwr run``
#: (tests/test_fab.py). Ids are never reused for new bytes.
DICTIONARIES = {
    1: ("wire-smollm2-v1", "ftis_fed.wiredict_v1",
        "1dda92176e8433042d5899f8201516eb267c39a75f7d798ea7e5810bb6575b9e"),
}
#: The dictionary encoders try by default.
DEFAULT = 1


def raw_bytes(dict_id: int) -> bytes:
    """The bytes of dictionary ``dict_id``, unchecked; KeyError if unknown."""
    _, module, _ = DICTIONARIES[dict_id]
    return base64.b85decode(importlib.import_module(module).DATA)


@lru_cache(maxsize=None)
def dictionary(dict_id: int) -> zstd.ZstdCompressionDict:
    """The packaged dictionary ``dict_id`` (checked against its SHA-256); KeyError if unknown."""
    name, _, sha = DICTIONARIES[dict_id]
    raw = raw_bytes(dict_id)
    got = hashlib.sha256(raw).hexdigest()
    if got != sha:
        raise RuntimeError(f"wire dictionary {name}: SHA-256 {got}, expected {sha} (its bytes were changed; "
                           "every participant must hold the same bytes)")
    return zstd.ZstdCompressionDict(raw, dict_type=zstd.DICT_TYPE_FULLDICT)


def training_samples(batches) -> list[bytes]:
    """Raw v2 payloads (without prompt ids; with and without texts) of each batch and of each of
    its groups alone: what the dictionary is trained on."""
    from .wire import WireOptions, _payload

    out = []
    for b in batches:
        parts = [b] + [dataclasses.replace(b, groups=(g,)) for g in b.groups]
        for texts in (False, True):
            opts = WireOptions(texts=texts, prompt_ids=False)
            out += [_payload(p, 2, opts) for p in parts]
    return out


#: (partition of 3, round) of the training sets: one per round 2..19 and 24..47 ...
TRAINING_SETS = tuple(((r + 2) % 3, r) for r in (*range(2, 20), *range(24, 48)))
#: ... of the task suite under this ``task-seed``, which no preset, test or bench uses (they use
#: 0): the dictionary never saw a prompt that a run or ``bench wire`` measures.
TRAINING_TASK_SEED = 7


def training_rollouts(out_dir, model: str = "smollm2") -> list[Path]:
    """Generate the dictionary's training rollouts (default run's sampling: 4 task prompts x G=4,
    24 new tokens, T=0.7; sampling seed 1000 * round + partition; task seed ``TRAINING_TASK_SEED``) as ``bench wire`` rollout files."""
    from .batch import SamplingParams
    from .bench.wire import RolloutSet, save_rollouts
    from .policies import PolicyConfig, build_policy
    from .tasks.suite import TaskSpec

    policy = build_policy(PolicyConfig(model=model, seed=0))
    sampling = SamplingParams(temperature=0.7, max_new_tokens=24)
    out = []
    for p, r in TRAINING_SETS:
        prompts = TaskSpec(prompts_per_round=4, seed=TRAINING_TASK_SEED).prompts_for_round(p, 3, r)[:4]
        rolls = policy.generate(prompts, 4, sampling, 1000 * r + p)
        path = Path(out_dir) / f"p{p}_r{r}.json"
        save_rollouts(RolloutSet(rolls, sampling, policy.model_id, policy.tokenizer_fp, policy.vocab_size), path)
        out.append(path)
    return out


def train(rollout_files, size: int = 8192, dict_id: int = DEFAULT) -> bytes:
    """A zstd dictionary of ``size`` bytes from rollouts saved by ``ftis-fed bench wire --rollouts-file``."""
    from .bench.wire import load_rollouts, rollouts_to_batch

    batches = [rollouts_to_batch(load_rollouts(f)) for f in rollout_files]
    d = zstd.train_dictionary(size, training_samples(batches), dict_id=dict_id, k=16, d=8, level=19)
    return d.as_bytes()


def embed_module(raw: bytes, name: str) -> str:
    """The source of a module holding dictionary ``raw`` as base85 ``DATA`` (see ``DICTIONARIES``)."""
    body = "\n".join(f'    "{line}"' for line in textwrap.wrap(base64.b85encode(raw).decode(), 96))
    return (f'''"""Wire dictionary ``{name}`` ({len(raw)} bytes, SHA-256 {hashlib.sha256(raw).hexdigest()}) as base85.

A Python module rather than a binary file because a Flower app bundle (FAB) carries only .py, .toml,
.md, .json(l) and .yaml files: a data file next to the code would be missing in every ``flwr run``.
Generated by ``python -m ftis_fed.wiredict embed``; do not edit (``wiredict.dictionary`` checks the
decoded bytes against the SHA-256 pinned in ``wiredict.DICTIONARIES``).
"""

DATA = (
{body}
)
''')


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ftis_fed.wiredict", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="train a dictionary from saved rollouts")
    t.add_argument("out")
    t.add_argument("rollouts", nargs="+")
    t.add_argument("--size", type=int, default=8192)
    e = sub.add_parser("embed", help="write a trained dictionary as a Python module (FABs carry no binary files)")
    e.add_argument("zdict")
    e.add_argument("module_file")
    e.add_argument("--name", default="wire-smollm2-v1")
    g = sub.add_parser("rollouts", help="generate the training rollouts into a folder")
    g.add_argument("out_dir")
    a = ap.parse_args(argv)
    if a.cmd == "rollouts":
        Path(a.out_dir).mkdir(parents=True, exist_ok=True)
        for path in training_rollouts(a.out_dir):
            print(path)
        return 0
    if a.cmd == "embed":
        raw = Path(a.zdict).read_bytes()
        Path(a.module_file).write_text(embed_module(raw, a.name))
        print(f"{a.module_file}: {a.name}, {len(raw)} bytes, sha256 {hashlib.sha256(raw).hexdigest()}")
        return 0
    raw = train(a.rollouts, a.size)
    Path(a.out).write_bytes(raw)
    print(f"{a.out}: {len(raw)} bytes, sha256 {hashlib.sha256(raw).hexdigest()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
