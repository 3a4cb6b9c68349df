#!/usr/bin/env bash
# The whole divtrace loop on the bundled example (RMSNorm cast order, bf16), checking every exit code:
# record both sides -> bisect -> repro -> verify the unchanged side (fails) -> verify a fix with trials, a shape
# sweep and profiling (passes) -> a batch-size-only fix (fails on the sweep) -> re-verify end to end (passes).
# Usage: bash examples/worked_example.sh [WORKDIR]     (after scripts/setup.sh; the venv need not be activated)
set -uo pipefail
cd "$(dirname "$0")/.."
W="${1:-runs/worked}"
# The venv scripts/setup.sh made (as demo.sh and test.sh use it), else whatever is on PATH.
VENV="${DIVTRACE_VENV:-.venv}"
if [ -x "$VENV/bin/divtrace" ]; then DT_DEFAULT="$VENV/bin/divtrace"; PY_DEFAULT="$VENV/bin/python"
else DT_DEFAULT=divtrace; PY_DEFAULT=python; fi
DT="${DIVTRACE:-$DT_DEFAULT}"
PY="${PYTHON:-$PY_DEFAULT}"
if ! command -v "$DT" >/dev/null 2>&1; then
    echo "worked example: no divtrace at $VENV/bin/divtrace nor on PATH: run bash scripts/setup.sh first" >&2
    exit 2
fi
rm -rf "$W" && mkdir -p "$W"
step() { echo; echo "== $*"; }
expect() {  # expect CODE command...: run it and fail the script unless it exits with CODE
    local want=$1; shift
    "$@"; local got=$?
    if [ "$got" -ne "$want" ]; then echo "FAILED: worked example: '$*' exited $got, expected $want"; exit 1; fi
}
step "1. record each side (each in its own process)"
expect 0 "$DT" record examples/llama_pair.py:training --out "$W/train" --label train --arg dtype=bf16
expect 0 "$DT" record examples/llama_pair.py:inference --out "$W/infer" --label infer --arg dtype=bf16 --arg variant=rmsnorm_cast
step "2. bisect: where do they part?"
expect 1 "$DT" bisect "$W/train" "$W/infer" --plot "$W/parting.png"
"$DT" bisect "$W/train" "$W/infer" --json > "$W/bisect.json"
step "3. repro: the diverging region as a standalone script"
expect 0 "$DT" repro "$W/train" "$W/infer" --out "$W/repro"
expect 1 "$PY" "$W/repro/repro.py" --trials 3
step "4. verify: the unchanged side still differs; the right fix holds; a batch-size-only fix is caught"
expect 1 "$DT" verify "$W/repro" --trials 5
expect 0 "$DT" verify "$W/repro" --patch examples/fixes/rmsnorm_cast_patch.py:side_b --side b --trials 20 --profile
expect 1 "$DT" verify "$W/repro" --patch examples/fixes/rmsnorm_cast_patch.py:side_b_batch_only --side b --trials 5
step "5. re-verify end to end with the fix in the model, at the recorded batch and at another"
expect 0 "$DT" verify --runs examples/llama_pair.py:training examples/fixes/rmsnorm_fixed.py:inference --arg-a dtype=bf16 --arg-b dtype=bf16
expect 0 "$DT" verify --runs examples/llama_pair.py:training examples/fixes/rmsnorm_fixed.py:inference --arg-a batch=3 --arg-b batch=3
echo
echo "PASSED: worked example: bisect found the cause, the repro fails, the fix verifies bitwise and end to end"
