"""Where a shard's elements sit in its global value: a box of the global shape at some offsets falls into runs,
each contiguous both in the box's own row-major order and in the global one (pure Python, no torch)."""
from __future__ import annotations

import math
from dataclasses import dataclass

from divtrace.errors import DivtraceError


def global_strides(shape) -> tuple[int, ...]:
    """Row-major element strides of `shape`."""
    out, g = [], 1
    for n in reversed(list(shape)):
        out.append(g)
        g *= n
    return tuple(out[::-1])


@dataclass(frozen=True)
class Runs:
    """A box as runs of `run` elements: one per index of the outer dims (`counts`, row-major), run k of outer
    index (i_0, ...) starting at global element `base + sum(i_d * gstrides[d])`."""
    run: int
    counts: tuple[int, ...]
    gstrides: tuple[int, ...]
    base: int

    @property
    def n_runs(self) -> int:
        return math.prod(self.counts)

    def starts(self) -> list[int]:
        """Global element index of each run's first element, in order (host ints)."""
        out = [self.base]
        for c, g in zip(self.counts, self.gstrides):
            out = [s + i * g for s in out for i in range(c)]
        return out

    def strides_all_multiple_of(self, m: int, itemsize: int) -> bool:
        """Whether every run starts at a global byte offset congruent to the first one's, modulo `m` bytes."""
        return all(c == 1 or (g * itemsize) % m == 0 for c, g in zip(self.counts, self.gstrides))


def box(local_shape, global_shape, offsets) -> Runs:
    """The runs of a box of `local_shape` at `offsets` in a row-major value of `global_shape`. Raises DivtraceError
    when the box does not fit."""
    local_shape, global_shape = tuple(int(n) for n in local_shape), tuple(int(n) for n in global_shape)
    offsets = tuple(int(o) for o in offsets) if offsets is not None else (0,) * len(global_shape)
    if not len(local_shape) == len(global_shape) == len(offsets):
        raise DivtraceError(f"shard of shape {list(local_shape)} at offsets {list(offsets)} does not match the global "
                            f"shape {list(global_shape)} (different number of dims)")
    for n, g, o in zip(local_shape, global_shape, offsets):
        if o < 0 or n < 0 or o + n > g:
            raise DivtraceError(f"shard of shape {list(local_shape)} at offsets {list(offsets)} does not fit in the "
                                f"global shape {list(global_shape)}")
    gs = global_strides(global_shape)
    base = sum(o * s for o, s in zip(offsets, gs))
    if any(n == 0 for n in local_shape):
        return Runs(0, (0,), (0,), base)
    k, run = len(local_shape), 1  # dims k.. are whole: one run spans them, and dim k-1 partly
    while k > 0 and local_shape[k - 1] == global_shape[k - 1]:
        k -= 1
        run *= local_shape[k]
    if k > 0:
        k -= 1
        run *= local_shape[k]
    counts, strides = [], []
    for d in range(k):  # outer dims of size 1 drop; a whole dim merges into the one before it
        if local_shape[d] == 1:
            continue
        if counts and strides[-1] == gs[d] * local_shape[d]:
            counts[-1] *= local_shape[d]
            strides[-1] = gs[d]
        else:
            counts.append(local_shape[d])
            strides.append(gs[d])
    return Runs(run, tuple(counts), tuple(strides), base)
