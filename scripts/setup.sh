#!/usr/bin/env bash
# Create .venv and install divtrace into it. A torch already importable by python3 (for example your CUDA
# build) is kept: the venv sees it through --system-site-packages. Otherwise the CPU torch 2.13.0 is installed
# (on this project's machines it comes from local disk; a plain `torch` would pull a multi-GB CUDA build).
# Override: DIVTRACE_TORCH="torch==X.Y.Z" to choose another torch, DIVTRACE_VENV=path for another venv.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${DIVTRACE_VENV:-.venv}"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv --system-site-packages "$VENV"
fi
PIP="$VENV/bin/python -m pip --disable-pip-version-check"
if [ -n "${DIVTRACE_TORCH:-}" ]; then
    $PIP install -q "$DIVTRACE_TORCH"
elif ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
    $PIP install -q "torch==2.13.0"
fi
$PIP install -q -e ".[${DIVTRACE_EXTRAS:-test}]"
"$VENV/bin/python" -c "import torch, divtrace; print(f'divtrace {divtrace.__version__} with torch {torch.__version__} in $VENV')"
