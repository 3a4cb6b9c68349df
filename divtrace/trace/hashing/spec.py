"""The v2 fingerprint schemes in plain Python integers: the definition, and the reference the tests hold the C and
torch paths to (slow: one Python operation per byte).

Lanes: the value's bytes in logical (row-major) order, each element's bytes little-endian (bool as one byte,
complex as its real then imaginary part), zero-padded to a multiple of 4, read as little-endian signed int32 lanes.
Lane i is numbered by its place in the global value. A shard fills in only its own bytes: its partial fingerprint
is the fingerprint of the global byte stream with every byte it does not hold set to zero (`embed`).

    mix64(z)     = splitmix64's finalizer (below)
    w_r[j]       = mix64(SEED_W[r] + (j + 1) * GOLDEN) | 1,  j < 1024          (odd)
    u_r[q]       = mix64(SEED_U[r] + (q + 1) * GOLDEN) | 1,  any q >= 0        (odd)
    W_r(i)       = w_r[i mod 1024] * u_r[i div 1024]                            (odd; all mod 2**64)
    tensor:  H_r = sum_i lane_i * W_r(i)               mod 2**64, r = 0, 1;  hex "%016x%016x" % (H_0, H_1)
    row:     F   = sum_c rotl32(lane_c, 1) * W_0(c)    mod 2**64, lanes c numbered within the (global) row
"""
from __future__ import annotations

import itertools
import math

MASK = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
BLOCK = 1024
SEED_W = (0x5EED0, 0x5EED1)
SEED_U = (0xB10C0, 0xB10C1)


def mix64(z: int) -> int:
    z &= MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def inner_weight(r: int, j: int) -> int:
    return mix64(SEED_W[r] + (j + 1) * GOLDEN) | 1


def outer_weight(r: int, q: int) -> int:
    return mix64(SEED_U[r] + (q + 1) * GOLDEN) | 1


def lane_weight(r: int, i: int) -> int:
    """W_r(i): the weight of global lane i in sum r."""
    return inner_weight(r, i % BLOCK) * outer_weight(r, i // BLOCK) & MASK


def lanes(data: bytes) -> list[int]:
    """The byte stream as signed int32 lanes (zero-padded to a multiple of 4)."""
    data = bytes(data) + b"\0" * (-len(data) % 4)
    return [int.from_bytes(data[k:k + 4], "little", signed=True) for k in range(0, len(data), 4)]


def rotl1(x: int) -> int:
    """A lane rotated left by one bit, as a signed int32."""
    u = x & 0xFFFFFFFF
    r = ((u << 1) | (u >> 31)) & 0xFFFFFFFF
    return r - (1 << 32) if r >> 31 else r


def tensor_sums(data: bytes) -> tuple[int, int]:
    """(H_0, H_1) of a global byte stream."""
    v = lanes(data)
    return tuple(sum(x * lane_weight(r, i) for i, x in enumerate(v)) & MASK for r in (0, 1))


def row_sum(data: bytes) -> int:
    """F of one global row's byte stream."""
    return sum(rotl1(x) * lane_weight(0, c) for c, x in enumerate(lanes(data))) & MASK


def to_hex(h0: int, h1: int) -> str:
    return f"{h0 & MASK:016x}{h1 & MASK:016x}"


def combine_hex(partials) -> str:
    """The fingerprint whose blocks gave the stored hex `partials`: their sum, per half, mod 2**64 (plain integers,
    no torch: a hash-mode bisect never imports it)."""
    h0 = h1 = 0
    for h in partials:
        h0 += int(h[:16], 16)
        h1 += int(h[16:], 16)
    return to_hex(h0, h1)


def value_bytes(t) -> bytes:
    """A torch tensor's bytes in logical order (bool one byte each, complex as real and imaginary parts)."""
    import torch

    x = t.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
    if x.is_complex():
        x = torch.view_as_real(x) if x.dtype != torch.complex32 else x.view(torch.float16)
    return x.cpu().reshape(-1).view(torch.uint8).numpy().tobytes()


def embed(local_bytes: bytes, itemsize: int, local_shape, global_shape, offsets) -> bytes:
    """The global byte stream of a value of `global_shape` that holds `local_bytes` (a box of `local_shape` at
    `offsets`, row-major) and zeros everywhere else."""
    out = bytearray(itemsize * math.prod(global_shape))
    gstride = _strides(global_shape)
    for k, idx in enumerate(itertools.product(*(range(n) for n in local_shape))):
        g = sum((o + i) * s for o, i, s in zip(offsets, idx, gstride))
        out[g * itemsize:(g + 1) * itemsize] = local_bytes[k * itemsize:(k + 1) * itemsize]
    return bytes(out)


def tensor_partial(t, global_shape=None, offsets=None) -> tuple[int, int]:
    """(H_0, H_1) of torch tensor `t` as the box at `offsets` of a value of `global_shape` (default: the whole)."""
    data = value_bytes(t)
    if global_shape is None:
        return tensor_sums(data)
    return tensor_sums(embed(data, t.element_size(), t.shape, global_shape, offsets))


def row_partials(rows, row_shape=None, row_offsets=None) -> list[int]:
    """F of each row of `rows` ([R, *local row dims]) as the box at `row_offsets` of rows of `row_shape`."""
    out = []
    for r in range(rows.shape[0]):
        data = value_bytes(rows[r])
        if row_shape is not None:
            data = embed(data, rows.element_size(), rows.shape[1:], row_shape, row_offsets)
        out.append(row_sum(data))
    return out


def _strides(shape) -> list[int]:
    out, g = [], 1
    for n in reversed(list(shape)):
        out.append(g)
        g *= n
    return out[::-1]
