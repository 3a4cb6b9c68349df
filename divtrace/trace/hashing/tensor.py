"""Whole-value fingerprints, scheme "lane-gsum128-v2" (see `divtrace.trace.hashing.spec` for the math): of a whole
tensor, of a shard given its place in the global value, and the sum of shards' partials.

CPU tensors go through the C kernel (divtrace._native: any strided layout read in place, summary statistics in
the same pass); other devices, and CPUs where the extension was not built, through torch ops that never wait for
the device: they return an int64 tensor [2] on the tensor's device, which becomes hex later (`to_hex`, `hexes`:
the host reads, done in batches).
"""
from __future__ import annotations

import math
import sys

import torch

from divtrace.trace.hashing.base import STATS_KIND as _STATS_KIND, block_sums, finish_stats, native_eligible, summary_stats
from divtrace.trace.hashing import TENSOR_SCHEME, lanes, weights
from divtrace.trace.hashing.boxes import Runs, box, global_strides
from divtrace.trace.hashing.lanes import RunLanes, run_sums, stream_bytes, whole_lanes
from divtrace.trace.hashing.spec import BLOCK, combine_hex, to_hex as _hex  # noqa: F401 (combine_hex: re-exported)
from divtrace.trace.hashing.weights import i64
from divtrace.trace.memo import bounded_put
from divtrace.trace.records import json_safe

try:
    from divtrace import _native
except ImportError:  # built without a C compiler: the torch path computes the same numbers
    _native = None
if _native is not None and (sys.byteorder != "little" or not hasattr(_native, "fingerprint2")):
    _native = None  # (an extension built from an older _native.c lacks v2: torch until `setup.py build_ext` runs)
_PAIR = hasattr(_native, "fingerprint2_pair")  # (not in an extension built before it: two reads)
IMPLEMENTATION = "native" if _native is not None else "torch"  # how CPU tensors are hashed (meta.json hash_impl)

__all__ = ["TENSOR_SCHEME", "tensor_fingerprint", "tensor_partial", "partial_hex", "combine", "to_hex", "hexes", "from_hex",
           "combine_hex", "tensor_hash", "hash_with_stats", "hash_and_partial", "reads_pairs", "global_runs", "partial_with_stats",
           "IMPLEMENTATION"]
ZERO_HASH = "0" * 32
_PLACES: dict[tuple, tuple] = {}  # (local shape, global shape, offsets, itemsize) -> _place's answer


def _place(t: torch.Tensor, global_shape, offsets) -> tuple[Runs, int, tuple | None]:
    """(runs, global byte count, C kernel's (gbase, gstrides) or None for a whole value)."""
    if global_shape is None:
        if offsets is not None:
            raise TypeError("offsets given without global_shape")
        return Runs(t.numel(), (), (), 0), t.numel() * t.element_size(), None
    key = (tuple(t.shape), tuple(global_shape), None if offsets is None else tuple(offsets), t.element_size())
    got = _PLACES.get(key)
    if got is None:  # (a function of the shapes only: the same few layouts come back every layer)
        runs = box(t.shape, global_shape, offsets)
        got = (runs, math.prod(global_shape) * t.element_size(), (runs.base, global_strides(global_shape)))
        bounded_put(_PLACES, key, got)
    return got


def global_runs(t: torch.Tensor, global_shape, offsets) -> Runs:
    """Where each element of `t` (in its logical order) lies in the value of `global_shape` it is the block at
    `offsets` of (element units): with its dtype, what a partial depends on besides the values. Raises as
    `tensor_partial` where the block does not fit."""
    return _place(t, global_shape, offsets)[0]


def _native_sums(t: torch.Tensor, where, stats: bool):
    """(h0, h1, raw stats or None) from the C kernel, or None where it cannot read `t` in place."""
    if _native is None or not native_eligible(t):
        return None
    gbase, gstrides = where if where is not None else (0, None)
    kind = _STATS_KIND.get(t.dtype, 0) if stats else 0
    return _native.fingerprint2(t.data_ptr(), t.element_size(), t.shape, t.stride(), gbase, gstrides, kind)


def _torch_sums(t: torch.Tensor, runs: Runs, global_nbytes: int) -> torch.Tensor:
    if runs.n_runs == 0 or runs.run == 0:
        return torch.zeros(2, dtype=torch.int64, device=t.device)
    if not runs.counts and runs.base == 0:  # a whole value: blocks from lane 0, v1's block sums with v2's weights
        v = whole_lanes(t)
        sums = block_sums(v, weights.inner(v.device), fused=v.is_cpu and lanes.CPU_MATMUL)
        return (sums * weights.outer(sums.shape[1], v.device)).sum(1)
    b = stream_bytes(t).reshape(runs.n_runs, runs.run * t.element_size())
    blocks = -(-global_nbytes // 4) // BLOCK + 1
    return run_sums(RunLanes(b, runs, t.element_size()), blocks)


def tensor_partial(local: torch.Tensor, global_shape=None, offsets=None) -> torch.Tensor:
    """The partial fingerprint (int64 [2] on `local`'s device) of `local` as the box at `offsets` of a value of
    `global_shape` (a shard: DTensor's local tensor at its global offset, a torch.chunk piece). The partials of
    shards that tile the value sum (`combine`) to its fingerprint. Without global_shape: the whole tensor's."""
    runs, nbytes, where = _place(local, global_shape, offsets)
    got = _native_sums(local, where, stats=False)
    if got is not None:
        return torch.tensor([i64(got[0]), i64(got[1])], dtype=torch.int64)
    return _torch_sums(local, runs, nbytes)


def partial_hex(local: torch.Tensor, global_shape, offsets) -> str | None:
    """`to_hex(tensor_partial(local, global_shape, offsets))` straight from the C kernel's sums (no int64 tensor made
    and read back: a recording rank takes several hundred partials a forward); None where the kernel cannot read
    `local` in place (the caller takes tensor_partial's way)."""
    runs, nbytes, where = _place(local, global_shape, offsets)
    got = _native_sums(local, where, stats=False)
    return None if got is None else _hex(got[0], got[1])


def tensor_fingerprint(t: torch.Tensor) -> torch.Tensor:
    """The fingerprint of the whole tensor `t`'s bytes (int64 [2] on its device; `to_hex` makes the hex)."""
    return tensor_partial(t)


def combine(partials) -> torch.Tensor:
    """The fingerprint of the value whose shards gave `partials` (int64 [2] tensors, or one [k, 2] tensor):
    their sum mod 2**64, per half."""
    if not isinstance(partials, torch.Tensor):
        partials = torch.stack(list(partials))
    return partials.sum(0)


def to_hex(fp: torch.Tensor) -> str:
    """32 hex digits of one fingerprint (reads it to the host)."""
    h0, h1 = fp.tolist()
    return _hex(h0, h1)


def hexes(fps: torch.Tensor) -> list[str]:
    """The hex of each fingerprint of an int64 [N, 2] tensor, in one read to the host."""
    return [_hex(h0, h1) for h0, h1 in fps.cpu().tolist()]


def from_hex(h: str) -> tuple[int, int]:
    """(H_0, H_1) of a stored hex fingerprint."""
    return int(h[:16], 16), int(h[16:], 16)




def tensor_hash(t: torch.Tensor) -> str:
    """The hex fingerprint of `t` (what `fingerprint.hasher(TENSOR_SCHEME)` gives readers)."""
    return hash_with_stats(t, stats=False)[0]


def hash_with_stats(t: torch.Tensor, stats: bool = True) -> tuple[str, dict | None]:
    """(hex, summary stats ready for JSON) of the whole tensor `t`: one read in place with the C kernel, else torch
    ops (they read the stats to the host: for the recorder's CPU path, as fingerprint.fingerprint)."""
    if _native is not None and native_eligible(t):
        if t.numel() == 0:
            return ZERO_HASH, ({} if stats else None)
        kind = _STATS_KIND.get(t.dtype, 0) if stats else 0
        h, st = _native.fingerprint2_summary(t.data_ptr(), t.element_size(), t.shape, t.stride(), 0, None, kind)
        return h, (finish_stats(t, st) if stats else None)
    h = to_hex(tensor_fingerprint(t))
    return h, (json_safe(summary_stats(t)) if stats else None)


def reads_pairs(t: torch.Tensor) -> bool:
    """Whether `hash_and_partial` takes `t`'s fingerprint and partial in one read (the C kernel reads it in place)."""
    return _PAIR and _native is not None and native_eligible(t)


def hash_and_partial(t: torch.Tensor, global_shape, offsets, stats: bool = True) -> tuple[str, dict | None, str]:
    """(hex, stats) as `hash_with_stats(t, stats)`, and the hex of `t`'s partial as the block at `offsets` of a value
    of `global_shape` (`to_hex(tensor_partial(t, global_shape, offsets))`): with the C kernel, from one read of
    `t`'s bytes (each piece summed at its local and its global positions while it is in cache); elsewhere the two
    separately. Raises as `tensor_partial` where the block does not fit."""
    if not reads_pairs(t):
        h, st = hash_with_stats(t, stats)
        return h, st, to_hex(tensor_partial(t, global_shape, offsets))
    runs, nbytes, where = _place(t, global_shape, offsets)
    if t.numel() == 0:
        return ZERO_HASH, ({} if stats else None), ZERO_HASH
    gbase, gstrides = where if where is not None else (0, None)
    kind = _STATS_KIND.get(t.dtype, 0) if stats else 0
    h, st, p = _native.fingerprint2_pair(t.data_ptr(), t.element_size(), t.shape, t.stride(), gbase, gstrides, kind)
    return h, (finish_stats(t, st) if stats else None), p


def partial_with_stats(local: torch.Tensor, global_shape, offsets) -> tuple[torch.Tensor, dict]:
    """(partial fingerprint as in `tensor_partial`, summary stats of `local`'s values), in one pass on the CPU."""
    runs, nbytes, where = _place(local, global_shape, offsets)
    got = _native_sums(local, where, stats=True)
    if got is not None:
        return torch.tensor([i64(got[0]), i64(got[1])]), finish_stats(local, got[2])
    return _torch_sums(local, runs, nbytes), json_safe(summary_stats(local))
