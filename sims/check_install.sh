#!/usr/bin/env bash
# Check, without installing anything, that ftis-fed with the vLLM extra resolves on a CUDA Linux
# machine (pip --dry-run; see sims/check_install.py and docs/gpu.md). Prints one JSON line per check.
#
#   sims/check_install.sh                 # recommended pins, for manylinux x86_64 / Python 3.11 and 3.12
#   sims/check_install.sh --native        # on the CUDA machine itself: for this interpreter
#   PYTHON=/path/to/python sims/check_install.sh --pins pyproject
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if [[ " $* " == *" --native "* || " $* " == *" --python-version "* ]]; then
  exec "$PY" sims/check_install.py "$@"
fi
rc=0
for v in 3.11 3.12; do
  "$PY" sims/check_install.py --python-version "$v" "$@" || rc=1
done
exit $rc
