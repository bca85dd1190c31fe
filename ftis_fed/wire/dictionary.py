"""The packaged zstd dictionary of wire format v2: small frames without paying for zstd's tables.

A default-run frame holds ~235 completion tokens; zstd alone spends a good part of such a payload
on describing its entropy tables (Huffman literals, FSE sequences) and has no earlier data to
match. A dictionary carries both, trained once on SmolLM2 rollouts of the task suite under a task seed
no run uses (``ftis_fed.bench.wiredict_train``: ``TRAINING_SETS``, ``TRAINING_TASK_SEED``): it never saw a measured prompt. Frames name it by ``dict_id`` in the header;
the encoder keeps the dictionary-compressed payload only when it is smaller (it is for small
frames; large ones hardly differ). Every participant must hold the same bytes: the file ships
with the package and is checked against its SHA-256 when first loaded, so a changed file fails
loudly instead of decoding peers' frames into garbage.

How it was trained, and how to make another: ``ftis_fed/bench/wiredict_train.py``.
"""

from __future__ import annotations

import base64
import hashlib
import importlib
from functools import lru_cache

import zstandard as zstd

#: dict_id -> (name, module holding its bytes as base85 ``DATA``, SHA-256 of the bytes). The bytes
#: live in a .py module because a Flower app bundle (FAB) carries only .py/.toml/.md/.json(l)/.yaml
#: files: a binary file in the package would be missing in every ``flwr run``
#: (tests/test_fab.py). Ids are never reused for new bytes.
DICTIONARIES = {
    1: ("wire-smollm2-v1", "ftis_fed.wire.dictionary_v1",
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
