#!/usr/bin/env bash
# One GPU check, one JSON line on stdout (progress on stderr); see sims/gpu_check.py and docs/gpu.md.
#
#   sims/gpu_check.sh --out gpu_check.jsonl    # on a CUDA machine: < 8 min on one GPU
#   sims/gpu_check.sh --dry                    # anywhere: CPU, tiny models, CUDA parts "skipped"
# PYTHON selects the interpreter (default: .venv/bin/python if present, else python3).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
export PYTHONUNBUFFERED=1
exec timeout "${GPU_CHECK_TIMEOUT_S:-900}" "$PY" sims/gpu_check.py "$@"
