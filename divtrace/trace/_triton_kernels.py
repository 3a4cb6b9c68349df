"""The Triton kernels of divtrace.trace.device_kernels (imported only where Triton is installed).

Fingerprint (docs/trace-format.md, "Fingerprint schemes"): H_r = sum_i lane_i * w_r[i mod 1024] * u_r[i div 1024]
mod 2**64, lanes the value's bytes as signed int32. A program takes LANES lanes (whole weight blocks): per block
the lanes times w_r summed, times u_r of the block, added up; the partials of all programs are summed by the second
kernel (wrapping int64 arithmetic: any grouping gives the same sums). Row r: F = sum_c rotl32(lane_c, 1) * W_0(c).

Statistics (for people, as the C kernel's): min, max and sum (float64) of the finite elements, finite and NaN
counts, over the elements of the same bytes, read as the value's dtype in the same program.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_FLOAT_OF = {torch.float32: 0, torch.float64: 1, torch.float16: 2, torch.bfloat16: 3}


@triton.jit
def _value_pass(lanes_ptr, elems_ptr, w_ptr, u_ptr, u_stride, part_i_ptr, part_f_ptr, n_lanes, n_elems, n_blocks,
                BLOCKS: tl.constexpr, ELEMS: tl.constexpr, STATS: tl.constexpr, F64: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, 1024)
    w0 = tl.load(w_ptr + j)
    w1 = tl.load(w_ptr + 1024 + j)
    acc0 = tl.zeros([1], dtype=tl.int64)
    acc1 = tl.zeros([1], dtype=tl.int64)
    for kb in tl.static_range(BLOCKS):
        q = pid * BLOCKS + kb
        offs = q * 1024 + j
        x = tl.load(lanes_ptr + offs, mask=offs < n_lanes, other=0).to(tl.int64)
        qm = q < n_blocks
        u0 = tl.load(u_ptr + q, mask=qm, other=0)
        u1 = tl.load(u_ptr + u_stride + q, mask=qm, other=0)
        acc0 += tl.sum(x * w0, axis=0) * u0
        acc1 += tl.sum(x * w1, axis=0) * u1
    k = tl.arange(0, 1)
    tl.store(part_i_ptr + pid * 4 + k, acc0)
    tl.store(part_i_ptr + pid * 4 + 1 + k, acc1)
    if STATS:
        e = tl.arange(0, ELEMS)
        if F64:
            lo = tl.full([1], float("inf"), tl.float64)
            hi = tl.full([1], float("-inf"), tl.float64)
        else:
            lo = tl.full([1], float("inf"), tl.float32)
            hi = tl.full([1], float("-inf"), tl.float32)
        total = tl.zeros([1], dtype=tl.float64)
        fin_c = tl.zeros([1], dtype=tl.int64)
        nan_c = tl.zeros([1], dtype=tl.int64)
        for kb in tl.static_range(BLOCKS):
            offs = (pid * BLOCKS + kb) * ELEMS + e
            m = offs < n_elems
            if F64:
                v = tl.load(elems_ptr + offs, mask=m, other=0.0).to(tl.float64)
            else:
                v = tl.load(elems_ptr + offs, mask=m, other=0.0).to(tl.float32)
            fin = ((v - v) == 0) & m
            lo = tl.minimum(lo, tl.min(tl.where(fin, v, float("inf")), axis=0))
            hi = tl.maximum(hi, tl.max(tl.where(fin, v, float("-inf")), axis=0))
            total += tl.sum(tl.where(fin, v, 0.0).to(tl.float64), axis=0)
            fin_c += tl.sum(fin.to(tl.int64), axis=0)
            nan_c += tl.sum(((v != v) & m).to(tl.int64), axis=0)
        tl.store(part_i_ptr + pid * 4 + 2 + k, fin_c)
        tl.store(part_i_ptr + pid * 4 + 3 + k, nan_c)
        tl.store(part_f_ptr + pid * 3 + k, lo.to(tl.float64))
        tl.store(part_f_ptr + pid * 3 + 1 + k, hi.to(tl.float64))
        tl.store(part_f_ptr + pid * 3 + 2 + k, total)


@triton.jit
def _value_reduce(part_i_ptr, part_f_ptr, out_i_ptr, out_f_ptr, n_parts, CHUNK: tl.constexpr, CHUNKS: tl.constexpr,
                  STATS: tl.constexpr):
    c = tl.arange(0, CHUNK)
    h0 = tl.zeros([1], dtype=tl.int64)
    h1 = tl.zeros([1], dtype=tl.int64)
    lo = tl.full([1], float("inf"), tl.float64)
    hi = tl.full([1], float("-inf"), tl.float64)
    total = tl.zeros([1], dtype=tl.float64)
    fin_c = tl.zeros([1], dtype=tl.int64)
    nan_c = tl.zeros([1], dtype=tl.int64)
    for i in tl.static_range(CHUNKS):  # (a constant count: Triton's interpreter wants its loop bounds as ints)
        p = i * CHUNK + c
        m = p < n_parts
        h0 += tl.sum(tl.load(part_i_ptr + p * 4, mask=m, other=0), axis=0)
        h1 += tl.sum(tl.load(part_i_ptr + p * 4 + 1, mask=m, other=0), axis=0)
        if STATS:
            fin_c += tl.sum(tl.load(part_i_ptr + p * 4 + 2, mask=m, other=0), axis=0)
            nan_c += tl.sum(tl.load(part_i_ptr + p * 4 + 3, mask=m, other=0), axis=0)
            lo = tl.minimum(lo, tl.min(tl.load(part_f_ptr + p * 3, mask=m, other=float("inf")), axis=0))
            hi = tl.maximum(hi, tl.max(tl.load(part_f_ptr + p * 3 + 1, mask=m, other=float("-inf")), axis=0))
            total += tl.sum(tl.load(part_f_ptr + p * 3 + 2, mask=m, other=0.0), axis=0)
    k = tl.arange(0, 1)
    tl.store(out_i_ptr + k, h0)
    tl.store(out_i_ptr + 1 + k, h1)
    if STATS:  # device_results.device_words' layout: lo at word 2, hi at 6, the sum at 10, then the counts
        tl.store(out_f_ptr + 2 + k, lo)
        tl.store(out_f_ptr + 6 + k, hi)
        tl.store(out_f_ptr + 10 + k, total)
        tl.store(out_f_ptr + 11 + k, fin_c.to(tl.float64))
        tl.store(out_f_ptr + 12 + k, nan_c.to(tl.float64))


def value_words(t: torch.Tensor, inner: torch.Tensor, outer, stats: bool, lanes_per_program: int) -> torch.Tensor:
    lanes = t.reshape(-1).view(torch.int32)
    n = lanes.shape[0]
    blocks = -(-n // 1024)
    per = lanes_per_program // 1024
    programs = -(-blocks // per)
    u = outer(blocks)
    parts = torch.empty(programs * 7, dtype=torch.int64, device=t.device)
    part_i, part_f = parts[: programs * 4], parts[programs * 4:].view(torch.float64)
    out = torch.empty(13 if stats else 2, dtype=torch.int64, device=t.device)
    elems = t.reshape(-1)
    _value_pass[(programs,)](lanes, elems, inner, u, u.stride(0), part_i, part_f, n, elems.shape[0], blocks,
                             BLOCKS=per, ELEMS=4096 // t.element_size(), STATS=stats, F64=t.dtype == torch.float64)
    chunks = 1 << max(0, (programs - 1).bit_length() - 10)  # a power of two (few kernel variants)
    _value_reduce[(1,)](part_i, part_f, out, out.view(torch.float64), programs, CHUNK=1024, CHUNKS=chunks,
                        STATS=stats)
    return out


@triton.jit
def _row_pass(lanes_ptr, w_ptr, u_ptr, out_ptr, lanes_per_row, BLOCKS: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, 1024)
    w0 = tl.load(w_ptr + j)
    acc = tl.zeros([1], dtype=tl.int64)
    for kb in tl.static_range(BLOCKS):
        c = kb * 1024 + j
        x = tl.load(lanes_ptr + r * lanes_per_row + c, mask=c < lanes_per_row, other=0)
        rot = (x << 1) | ((x >> 31) & 1)  # rotl32(lane, 1), in int32
        acc += tl.sum(rot.to(tl.int64) * w0, axis=0) * tl.load(u_ptr + kb)
    tl.store(out_ptr + r + tl.arange(0, 1), acc)


def row_words(x: torch.Tensor, w0: torch.Tensor, outer) -> torch.Tensor:
    lanes = x.view(torch.int32)
    rows, per_row = lanes.shape
    blocks = -(-per_row // 1024)
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    _row_pass[(rows,)](lanes, w0, outer(blocks)[0], out, per_row, BLOCKS=blocks)
    return out
