#!/usr/bin/env bash
# Issue 31's GPU check, in one run (about 10 minutes on an H200; needs a CUDA GPU and transformers):
#   bash bench/gpu_check.sh [OUT_DIR]
# 1. the GPU tests: no sync inside divtrace (scoped sync debug mode), syncs of a recorded generate against a
#    plain one, GPU fingerprints against the CPU's of the same bytes, device path against host path
#    (tests/test_gpu_record.py), issue 28's rollout-vs-trainer origins on an H200-sized Llama in bf16 and fp32
#    (tests/test_gpu_origins.py), then the earlier CUDA tests (tests/test_cuda.py);
# 2. bench/bench_gpu.py: forward 4x1024 and rollout 8x64 on a 0.5B-class Llama in bf16, fastest of N rounds, as
#    ratios to the plain run, with the pinned copy bandwidth of the machine.
# Everything the docs need is printed and written under OUT_DIR (default: $OUT, else ./gpu-check).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${1:-${OUT:-gpu-check}}"
mkdir -p "$OUT_DIR"
PY="${PYTHON:-python}"
[ -x .venv/bin/python ] && PY=.venv/bin/python
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PY" - <<'PYEOF' | tee "$OUT_DIR/env.txt"
import torch, transformers
print("torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__)
print("gpu", torch.cuda.get_device_name() if torch.cuda.is_available() else None)
PYEOF
start=$(date +%s)
timeout 270 "$PY" -m pytest -q -p no:cacheprovider -rs -s tests/test_gpu_record.py tests/test_gpu_origins.py tests/test_cuda.py \
    --junitxml="$OUT_DIR/gpu-tests.xml" 2>&1 | tail -60 | tee "$OUT_DIR/gpu-tests.txt"
tests_rc=${PIPESTATUS[0]}
echo "gpu_check: tests exit $tests_rc after $(( $(date +%s) - start )) s"
timeout 300 "$PY" bench/bench_gpu.py --rounds 6 --rollout-rounds 3 --json "$OUT_DIR/bench_gpu.json" 2>&1 \
    | tail -120 | tee "$OUT_DIR/bench_gpu.txt"
bench_rc=${PIPESTATUS[0]}
echo "gpu_check: bench exit $bench_rc after $(( $(date +%s) - start )) s"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
