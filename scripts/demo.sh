#!/usr/bin/env bash
# Set up (scripts/setup.sh), then the main job on the bundled example: record a training-style run and an
# inference-style run of a small Llama-style model (bf16, every planted difference on) and bisect them.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit 2
VENV="${DIVTRACE_VENV:-.venv}"
DT="$VENV/bin/divtrace"
OUT="${DIVTRACE_DEMO_DIR:-runs/demo}"
VARIANT="${VARIANT:-all}"
rm -rf "$OUT"
set -e
"$DT" record examples/llama_pair.py:training --out "$OUT/train" --label train --arg dtype=bf16
"$DT" record examples/llama_pair.py:inference --out "$OUT/infer" --label infer --arg dtype=bf16 --arg "variant=$VARIANT"
set +e
"$DT" bisect "$OUT/train" "$OUT/infer"
rc=$?
echo "bisect exit code: $rc (0 identical, 1 diverged, 2 bad input, 3 inconclusive)"
[ "$rc" -le 1 ] || exit "$rc"
exit 0
