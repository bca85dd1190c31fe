"""``python -m ftis_fed.policies.build_pinned NAME OUT``: builds the registered offline model ``NAME``
into ``OUT`` in this process, the child that ``store.resolve_model`` starts with AVX2-pinned kernels for
a build that trains (``store.TRAINED_BUILDS``: why, there)."""

from __future__ import annotations

import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    name, out = sys.argv[1:] if argv is None else argv
    from ftis_fed.policies.models import OFFLINE_MODELS  # noqa: F401  (every builder registered)
    from ftis_fed.policies.store import build_here

    build_here(name, Path(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
