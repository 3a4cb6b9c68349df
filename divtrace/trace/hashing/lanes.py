"""Torch side of the v2 schemes, shared by tensors and rows: a value's bytes in logical order, cut into runs at
their global byte positions and then into 32-bit lanes (a lane a run holds in part keeps only its bytes), and the
weighted lane sums. Device-agnostic and sync-free: every shape and index bound comes from host integers (the
shapes), every index tensor is made on the device from aranges, and nothing is read back."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from divtrace.trace.hashing.base import CPU_ROWS, flat_bytes, scratch
from divtrace.trace.hashing import weights
from divtrace.trace.hashing.boxes import Runs
from divtrace.trace.hashing.spec import BLOCK

_CHUNK = 1 << 22  # lanes per int64 temporary (32 MiB)
CPU_MATMUL = True  # CPU tensors take the int64 matmul; tests set it False to run the accelerators' form here


def stream_bytes(t: torch.Tensor) -> torch.Tensor:
    """`t`'s bytes in logical order as a 1-D uint8 tensor (bool one byte each, complex as real and imaginary)."""
    flat = flat_bytes(t)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1) if flat.dtype != torch.complex32 else flat.view(torch.float16)
    if flat.dtype != torch.uint8:  # (int8, fp8 and bool too: padding and gathers then take one dtype)
        flat = flat.view(torch.uint8)
    return flat


def whole_lanes(t: torch.Tensor) -> torch.Tensor:
    """The int32 lanes of all of `t` (1-D; zero-padded bytes at the end)."""
    b = stream_bytes(t)
    pad = -b.numel() % 4
    if pad or b.storage_offset() % 4:  # (a slice starting mid-lane: int32 views refuse it)
        b = F.pad(b, (0, pad)) if pad else torch.empty(b.shape, dtype=torch.uint8, device=b.device).copy_(b)
    return b.view(torch.int32)


def affine(base: int, counts, strides, device) -> torch.Tensor:
    """int64 [prod(counts)]: base + sum(i_d * strides[d]) over the row-major grid of `counts`, made on `device`."""
    s = torch.full((1,), base, dtype=torch.int64, device=device)
    for c, g in zip(counts, strides):
        s = (s.unsqueeze(-1) + torch.arange(c, dtype=torch.int64, device=device) * g).reshape(-1)
    return s


class RunLanes:
    """The lanes of a value's runs: `lanes` int32 [..., n_runs, L] (zero where a run holds no byte of the lane),
    `starts` the global lane index of each run's lane 0 (int64 [n_runs] on the device), and `phase` the one
    inner-block phase (start mod 1024) every run shares, or None when they differ."""

    def __init__(self, b: torch.Tensor, runs: Runs, itemsize: int):
        dev = b.device
        run_bytes = runs.run * itemsize
        lane_strides = [g * itemsize // 4 for g in runs.gstrides]
        if runs.strides_all_multiple_of(4, itemsize):  # every run starts at the same byte of its lane
            ph = runs.base * itemsize % 4
            tail = -(ph + run_bytes) % 4
            if ph or tail:
                b = F.pad(b, (ph, tail))
            first = (runs.base * itemsize - ph) // 4
            self.first = first if not runs.counts else None  # one run: its start is a host int, no index tensor
            self.starts = affine(first, runs.counts, lane_strides, dev) if runs.counts else None
            self.phase = first % BLOCK if runs.strides_all_multiple_of(4 * BLOCK, itemsize) else None
        else:  # 1- and 2-byte elements in runs that start at different bytes of their lanes: shift each run
            bs = affine(runs.base * itemsize, runs.counts, [g * itemsize for g in runs.gstrides], dev)
            ph = bs & 3
            width = -(-(3 + run_bytes) // 4) * 4
            src = torch.arange(width, dtype=torch.int64, device=dev) - ph.unsqueeze(-1)
            valid = (src >= 0) & (src < run_bytes)
            src = src.clamp(0, run_bytes - 1).expand(*b.shape[:-1], width)
            b = torch.where(valid, b.gather(-1, src), 0).to(torch.uint8)
            self.starts = (bs - ph) >> 2
            self.first = self.phase = None
        if b.storage_offset() % 4 or not b.is_contiguous():  # (a slice starting mid-lane: int32 views refuse it)
            b = torch.empty(b.shape, dtype=torch.uint8, device=dev).copy_(b)
        self.lanes = b.view(torch.int32)


_CPU_SCRATCH = CPU_ROWS * BLOCK  # int64 elements of base.scratch(): 2 MiB, in cache between widening and products


def dot_last(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """int64 [S, *x.shape[:-1]]: sum_k x[..., k] * w[s, k] mod 2**64 for int32 lanes x [..., K] and int64 w [S, K].
    On CPU: widened into a cache-sized scratch buffer, then one int64 matrix-vector product per sum (4x an int64
    matmul's speed here); elsewhere multiply and sum in chunks (accelerators have no int64 matmul). Both wrap
    the same way."""
    lead = x.shape[:-1]
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    n = x2.shape[0]
    out = torch.empty(w.shape[0], n, dtype=torch.int64, device=x.device)
    if x.is_cpu and CPU_MATMUL:
        step = max(1, _CPU_SCRATCH // max(k, 1))
        buf = scratch().view(-1) if k <= _CPU_SCRATCH else None
        for s in range(0, n, step):
            c = x2[s:s + step]
            sc = buf[:c.numel()].view(c.shape).copy_(c) if buf is not None else c.to(torch.int64)
            for r in range(w.shape[0]):
                torch.mv(sc, w[r], out=out[r, s:s + c.shape[0]])
    else:
        step = max(1, _CHUNK // max(k, 1))
        for s in range(0, n, step):
            c = x2[s:s + step].to(torch.int64)
            for r in range(w.shape[0]):
                out[r, s:s + c.shape[0]] = (c * w[r]).sum(-1)
    return out.reshape(w.shape[0], *lead)


def lane_index(rl: RunLanes) -> torch.Tensor:
    """int64 [n_runs, L]: the global lane index of every lane of `rl` (made on the device)."""
    L = rl.lanes.shape[-1]
    j = torch.arange(L, dtype=torch.int64, device=rl.lanes.device)
    return (j + rl.first).unsqueeze(0) if rl.first is not None else rl.starts.unsqueeze(-1) + j


def rotl1(x: torch.Tensor) -> torch.Tensor:
    """int32 lanes rotated left by one bit: (x << 1) wraps; the arithmetic x >> 31 is 0 or -1, masked to the bit."""
    return (x << 1) | ((x >> 31) & 1)


def run_sums(rl: RunLanes, blocks: int, sums: int = 2) -> torch.Tensor:
    """int64 [sums]: the weighted sum of the lanes of a value's runs at their global positions. `blocks` bounds
    the global block index (from shapes). Runs at one block phase are cut at block boundaries into pieces (a
    matrix-vector product each, then one outer weight per block); runs at different phases take each lane's own
    weight."""
    x = rl.lanes
    n_runs, L = x.shape[-2], x.shape[-1]
    w, dev = weights.inner(x.device)[:sums], x.device
    if rl.phase is None:  # each lane's own weight, gathered (runs at different phases: no common block cut)
        w_all = weights.lane_weights(lane_index(rl), blocks, sums).reshape(sums, -1)
        return dot_last(x.reshape(*x.shape[:-2], n_runs * L), w_all)
    ph = rl.phase
    head = min(L, (BLOCK - ph) % BLOCK)
    full = (L - head) // BLOCK
    tail = L - head - full * BLOCK
    pieces = []  # block sums [sums, ..., n_runs, blocks of the piece], in block order
    if head:
        pieces.append(dot_last(x[..., :head], w[:, ph:ph + head]).unsqueeze(-1))
    if full:
        body = x[..., head:head + full * BLOCK].reshape(*x.shape[:-1], full, BLOCK)
        pieces.append(dot_last(body, w))
    if tail:
        pieces.append(dot_last(x[..., L - tail:], w[:, :tail]).unsqueeze(-1))
    s = torch.cat(pieces, dim=-1) if len(pieces) > 1 else pieces[0]
    nq = s.shape[-1]
    if rl.first is not None:  # one run: its blocks are consecutive, a slice of the table
        q0 = rl.first // BLOCK
        u = weights.outer(blocks, dev)[:sums, q0:q0 + nq]
    else:
        q = (rl.starts >> 10).unsqueeze(-1) + torch.arange(nq, dtype=torch.int64, device=dev)  # [n_runs, nq]
        u = weights.outer(blocks, dev)[:sums][:, q]  # [sums, n_runs, nq]
    u = u.reshape(sums, *([1] * (s.dim() - 3)), n_runs, nq)
    return (s * u).sum((-1, -2))
