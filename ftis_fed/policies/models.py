"""``resolve_model(name)``: a participant's ``model`` setting -> a local folder ``from_pretrained``
reads, with every offline builder registered (base models in ``store``, derived models in
``derived``, sized ones in ``sized``, the research tier's in ``micro``). See ``store`` for the cache and the names.
"""

from __future__ import annotations

import ftis_fed.policies.derived  # noqa: F401  (importing it registers its builders)
import ftis_fed.policies.micro  # noqa: F401  (likewise: the research tier's family)
import ftis_fed.policies.sized  # noqa: F401  (likewise)
from ftis_fed.policies.store import (OFFLINE_MODELS, SMOLLM2_GGUF, build_smollm2, build_tiny, cache_root, file_lock,
                                     is_built, load_tokenizer, resolve_model, smollm2_gguf_dir)

__all__ = ["OFFLINE_MODELS", "SMOLLM2_GGUF", "build_smollm2", "build_tiny", "cache_root", "file_lock", "is_built",
           "load_tokenizer", "resolve_model", "smollm2_gguf_dir"]
