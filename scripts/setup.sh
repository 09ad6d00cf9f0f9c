#!/usr/bin/env bash
# Set up OmniDraft Fleet in a virtual environment (./.venv unless VENV is set).
# torch is installed first and pinned to the CPU build (an unpinned torch pulls GBs of CUDA
# packages); then the project itself with its dev extras.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade pip
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check torch==2.13.0
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -e ".[dev]"
echo "omnidraft installed in $VENV ($("$VENV/bin/python" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'))"
