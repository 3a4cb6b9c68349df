#!/usr/bin/env bash
# Set up (scripts/setup.sh), then the two bundled examples:
# 1. the real RL scenario: an HF Llama rollout (generate with a KV cache, left-padded) against the trainer's
#    recompute (full-sequence micro-batches), fp32, bisected token by token;
# 2. a training-style and an inference-style run of a small Llama-style model (bf16, every planted difference on).
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit 2
VENV="${DIVTRACE_VENV:-.venv}"
DT="$VENV/bin/divtrace"
OUT="${DIVTRACE_DEMO_DIR:-runs/demo}"
VARIANT="${VARIANT:-all}"
rm -rf "$OUT"
set -e
echo "== 1. rollout vs trainer (examples/rollout_vs_trainer.py) =="
"$VENV/bin/python" examples/rollout_vs_trainer.py --out "$OUT/rl"
set +e
"$DT" bisect "$OUT/rl/train" "$OUT/rl/rollout"
rc=$?
echo "bisect exit code: $rc (0 identical, 1 diverged, 2 bad input, 3 inconclusive, 4 absorbed)"
[ "$rc" -le 1 ] || [ "$rc" -eq 4 ] || exit "$rc"  # (what parts here is this CPU's own kernels)
set -e
echo "== 2. planted differences (examples/llama_pair.py) =="
"$DT" record examples/llama_pair.py:training --out "$OUT/train" --label train --arg dtype=bf16
"$DT" record examples/llama_pair.py:inference --out "$OUT/infer" --label infer --arg dtype=bf16 --arg "variant=$VARIANT"
set +e
"$DT" bisect "$OUT/train" "$OUT/infer"
rc=$?
echo "bisect exit code: $rc (0 identical, 1 diverged, 2 bad input, 3 inconclusive, 4 absorbed)"
[ "$rc" -le 1 ] || exit "$rc"
exit 0
