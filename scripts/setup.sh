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
# The editable install (~13 s) is skipped when this venv already imports divtrace from this checkout and what the
# install depends on is unchanged: a stamp in the venv holds a hash of pyproject.toml, setup.py, the C sources,
# the extras and the checkout's path. Delete the stamp (or the venv) to force a reinstall.
EXTRAS="${DIVTRACE_EXTRAS:-test}"
STAMP="$VENV/.divtrace-install-stamp"
want=$("$VENV/bin/python" -c '
import glob, hashlib, os, sys
h = hashlib.sha256(os.path.realpath(".").encode() + b"\0" + sys.argv[1].encode())
for p in ["pyproject.toml", "setup.py", *sorted(glob.glob("divtrace/*.c"))]:
    h.update(b"\0" + p.encode() + b"\0" + (open(p, "rb").read() if os.path.exists(p) else b"(none)"))
print(h.hexdigest())' "$EXTRAS")
VENV_PY="$(cd "$VENV" && pwd)/bin/python"
HERE="$(pwd)"
installed_here() {  # run from / so that the checkout itself is not on sys.path
    (cd / && "$VENV_PY" -c '
import os, sys
import divtrace
sys.exit(os.path.dirname(os.path.realpath(divtrace.__file__)) != os.path.realpath(sys.argv[1]))' "$HERE/divtrace") \
        >/dev/null 2>&1
}
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && installed_here; then
    echo "setup: $VENV already has this checkout installed and pyproject.toml, setup.py and the C sources are" \
         "unchanged; install skipped (rm $STAMP to force it)"
else
    rm -f "$STAMP"
    $PIP install -q -e ".[$EXTRAS]"
    echo "$want" > "$STAMP"
fi
"$VENV/bin/python" -c "import torch, divtrace; print(f'divtrace {divtrace.__version__} with torch {torch.__version__} in $VENV')"
