"""Fingerprint schemes old (lane32-wsum128, rowlane-wsum2x32) against new (lane-gsum128-v2, row-gsum64-v2), as
ratios in one run: new time / old time, median over interleaved rounds (bench_record.rounds), per dtype and size.

Kinds (each on the same tensor, 1 thread):
- `C hash+stats`: the recorder's CPU call, one pass (fingerprint.fingerprint vs hashing.tensor.hash_with_stats);
- `C hash`: hash only (fingerprint.tensor_hash vs hashing.tensor.tensor_hash);
- `C rows`: token rows of 8 KiB read in place (tokens.rowhash.strided_row_hashes vs
  hashing.rows.strided_row_fingerprints);
- `torch hash`, `torch rows`: the torch-op paths on the CPU (what runs where the C extension is absent; the
  device path is the same code);
- `C shard` / `torch shard`: a column shard in place (the right half of a [rows, 2 x 8 KiB] value) hashed as the
  v2 partial against the v2 fingerprint of the same strided view as a whole value: what placing the bytes at
  their global lanes costs over hashing them (same bytes, same memory pattern). `copy shard` puts the partial
  against copying the shard and hashing the copy.

    python bench/bench_fingerprint.py [--repeats 4] [--sizes 4K,64K,1M,16M,64M] [--isa avx2] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_record import rounds  # noqa: E402

from divtrace.trace import fingerprint as v1  # noqa: E402
from divtrace.trace.hashing import rows as rows_v2, tensor as tensor_v2  # noqa: E402
from divtrace.record import rowhash  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64, "int8": torch.int8,
          "bool": torch.bool}
ROW_BYTES = 8192


def _size(s: str) -> int:
    mult = {"K": 1 << 10, "M": 1 << 20}
    return int(s[:-1]) * mult[s[-1]] if s[-1] in mult else int(s)


def _value(dtype, nbytes: int, width_bytes: int) -> torch.Tensor:
    es = torch.empty(0, dtype=dtype).element_size()
    width = max(1, min(width_bytes, nbytes) // es)
    rows = max(1, nbytes // es // width)
    g = torch.Generator().manual_seed(0)
    if dtype == torch.bool:
        return torch.rand(rows, width, generator=g) > 0.5
    if dtype == torch.int8:
        return torch.randint(-128, 128, (rows, width), generator=g, dtype=torch.int8)
    return torch.randn(rows, width, generator=g).to(dtype)


def _torch_v2(t):
    runs, nbytes, _ = tensor_v2._place(t, None, None)
    return tensor_v2._torch_sums(t, runs, nbytes)


class _NoNative:
    """Within: the row modules' C kernels hidden (their torch paths run)."""

    def __enter__(self):
        self.saved = rowhash._native_rows, rows_v2._native
        rowhash._native_rows = rows_v2._native = None

    def __exit__(self, *exc):
        rowhash._native_rows, rows_v2._native = self.saved


def _pairs(t: torch.Tensor) -> dict:
    rows = t.shape[0]
    half = t[:, t.shape[1] // 2:]
    gshape, off = tuple(t.shape), (0, t.shape[1] // 2)

    def torch_rows_v1():
        with _NoNative():
            rowhash.row_hashes(t)

    def torch_rows_v2():
        with _NoNative():
            rows_v2.row_fingerprints(t)

    def torch_shard():
        runs, nbytes, _ = tensor_v2._place(half, gshape, off)
        tensor_v2._torch_sums(half, runs, nbytes)

    return {
        "C hash+stats": (lambda: v1.fingerprint(t), lambda: tensor_v2.hash_with_stats(t)),
        "C hash": (lambda: v1.tensor_hash(t), lambda: tensor_v2.tensor_hash(t)),
        "C rows": (lambda: rowhash.strided_row_hashes(t, "n", rows),
                   lambda: rows_v2.strided_row_fingerprints(t, "n", rows)),
        "torch hash": (lambda: v1.tensor_hash(t, fused=True), lambda: _torch_v2(t)),
        "torch rows": (torch_rows_v1, torch_rows_v2),
        "C shard": (lambda: tensor_v2.tensor_fingerprint(half), lambda: tensor_v2.tensor_partial(half, gshape, off)),
        "torch shard": (lambda: _torch_v2(half), torch_shard),
        "copy shard": (lambda: tensor_v2.tensor_fingerprint(half.contiguous()),
                       lambda: tensor_v2.tensor_partial(half, gshape, off)),
    }


def _looped(fn, reps: int):
    def run():
        for _ in range(reps):
            fn()
    return run


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--sizes", default="4K,64K,1M,16M,64M")
    ap.add_argument("--dtypes", default=",".join(DTYPES))
    ap.add_argument("--kinds", default=None, help="comma-separated subset of the kinds")
    ap.add_argument("--isa", default=None, help="C kernel of both tensor schemes: avx512, avx2 or generic (default: "
                    "the fastest this CPU runs; the old row kernel picks its own)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    assert tensor_v2._native is not None and v1.IMPLEMENTATION == "native", "build the C extensions first"
    print(f"C kernel: {tensor_v2._native.use_isa(args.isa)}")
    out = []
    print(f"{'kind':<13} {'dtype':<5} {'size':>6} {'old ms':>9} {'new ms':>9} {'new/old':>8}")
    for kind in (args.kinds.split(",") if args.kinds else list(_pairs(_value(torch.float32, 4096, 64)))):
        for dname in args.dtypes.split(","):
            for s in args.sizes.split(","):
                nbytes = _size(s)
                t = _value(DTYPES[dname], nbytes, 2 * ROW_BYTES if "shard" in kind else ROW_BYTES)
                old, new = _pairs(t)[kind]
                reps = max(1, (4 << 20) // nbytes) if kind.startswith("C") else max(1, (256 << 10) // nbytes)
                med, ratio, _ = rounds({"old": _looped(old, reps), "new": _looped(new, reps)}, args.repeats)
                row = {"kind": kind, "dtype": dname, "bytes": nbytes, "old_ms": 1e3 * med["old"] / reps,
                       "new_ms": 1e3 * med["new"] / reps, "ratio": ratio["new"]}
                out.append(row)
                print(f"{kind:<13} {dname:<5} {s:>6} {row['old_ms']:9.4f} {row['new_ms']:9.4f} {row['ratio']:8.3f}",
                      flush=True)
    print("\nmedian new/old per kind (sizes from 64K; single small sizes time a few microseconds and are noisy):")
    for kind in dict.fromkeys(r["kind"] for r in out):
        rs = [r["ratio"] for r in out if r["kind"] == kind and r["bytes"] >= 64 << 10]
        fb = [r["ratio"] for r in out if r["kind"] == kind and r["bytes"] >= 64 << 10 and r["dtype"] in ("fp32", "bf16")]
        print(f"  {kind:<13} all dtypes {statistics.median(rs):.2f}" + (f"   fp32+bf16 {statistics.median(fb):.2f}" if fb else "")
              if rs else f"  {kind:<13} -")
    if args.json:
        args.json.write_text(json.dumps({"isa": tensor_v2._native.use_isa(args.isa), "results": out}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
