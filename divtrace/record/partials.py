"""The partial fingerprints of a rank's block values (an `S` layout: record/placements.py), each the value's part of
its global value's fingerprint at its global offsets (divtrace.trace.hashing.tensor), taken once per value with as
few reads of its bytes as can be:

- an op result made as a block: its own fingerprint and its partial from one read (`block_fp`, through
  ValueIdentity.block_fp; the partial waits per tensor until the value is bound: `take_pair`);
- a parameter's block, or a view of one, met again (every forward of every recording in the process): kept by its
  fingerprint, dtype, shape and layout (`_PARTIALS`);
- a value whose fingerprint is another's (a `view` of a block into heads and back keeps its source's) and whose
  elements lie where the other's did in the global value: the other's partial (`by_content`, this recording);
- else read (a transposed block copied first, `_readable`), on the device path through its batches.

In: the values about to be bound with a block layout, their fingerprints (ValueIdentity). Out: hex partials (or,
on the device path, slots of its batches).
"""
from __future__ import annotations

import torch

from divtrace.trace.hashing.tensor import (global_runs, hash_and_partial, partial_hex, reads_pairs, tensor_partial,
                                           to_hex)
from divtrace.trace.memo import bounded_put

# (value fingerprint, dtype, local shape, global shape, offsets) -> hex partial of a parameter block or a view of
# one (Partials.keys): the same weights come back every forward of every recording in a process
_PARTIALS: dict[tuple, str] = {}


def has_block(placements) -> bool:
    return any(p[0] == "S" for p in placements)


def _readable(t: torch.Tensor) -> torch.Tensor:
    """`t`, or a contiguous copy where one is much faster to fingerprint: a transposed view (a weight block's `t()`,
    innermost stride not 1), which the kernel reads column by column (lm_head's [512, 16000] block: 22 ms in
    place, 7.5 ms copied and read). The fingerprint depends on the values at their positions only, so both give the
    same partial; the copy lives until the partial is taken (up to 64 MiB: a bigger block is read in place rather
    than doubled in memory)."""
    if t.dim() >= 2 and t.stride(-1) != 1 and 1 << 14 <= t.numel() and t.numel() * t.element_size() <= 64 << 20:
        return t.contiguous()
    return t


class Partials:
    """The block values' partials of one rank's recording (one per Placements)."""

    def __init__(self, values, writer, out):
        self.values = values  # the recording's ValueIdentity (values' fingerprints: `keys`), or None
        self.writer = writer
        self.out = out  # the LayoutWriter (its device path, if any)
        self.pairs: dict[int, tuple] = {}  # id(op result) -> (it, its layout, hex partial): block_fp's, for its bind
        self.by_content: dict[tuple, str] = {}  # (fingerprint, dtype, global runs) -> hex partial (`keys`)

    def block_fp(self, t, lay):
        """(hex, stats) of op result `t` with layout `lay`, where `lay` is a block and the C kernel reads `t`: taken
        from the same read as its partial (hashing.tensor.hash_and_partial), which waits in `pairs` until `t` is
        bound. None otherwise (the writer fingerprints `t`, `of` takes the partial)."""
        if not has_block(lay.placements) or self.writer.device is not None or not reads_pairs(t):
            return None
        if self.writer.mode != "hash" and not t.is_contiguous():  # (full mode hashes the contiguous copy it stores)
            return None
        try:
            h, stats, partial = hash_and_partial(t, lay.gshape, lay.offsets)
        except Exception:  # (a layout that does not fit: said where the partial is taken)
            return None
        self.pairs[id(t)] = (t, lay, partial)  # (`t` held: its id is not reused while the entry lives)
        return h, stats

    def take_pair(self, t, lay) -> str | None:
        """The partial block_fp took for `t` with layout `lay`, taken out (None where it took none)."""
        pair = self.pairs.pop(id(t), None) if self.pairs else None
        return pair[2] if pair is not None and pair[0] is t and pair[1] is lay else None

    def of(self, t, vid: int, lay, partial=None):
        """The partial of value `vid` (tensor `t`, block layout `lay`): `partial` where block_fp took it, else a
        kept one, else read. Raises where the layout does not fit `t`."""
        key, ckey = self.keys(t, vid, lay)
        if partial is not None:
            if ckey is not None:  # (for the views of `t` that come next)
                bounded_put(self.by_content, ckey, partial)
            return partial
        partial = _PARTIALS.get(key) if key is not None else None
        if partial is not None:
            if ckey is not None:  # (a weight block kept from an earlier recording: for its views of this one, such
                bounded_put(self.by_content, ckey, partial)  # as HF's `to_local` view, else read again each forward)
            return partial
        if ckey is not None:
            partial = self.by_content.get(ckey)
        if partial is not None:
            return partial
        x = _readable(t)
        dev = self.out.device
        if dev is not None and dev.takes(t):  # the device path: to the host with its batches
            return dev.batches.add(tensor_partial(x, lay.gshape, lay.offsets).reshape(-1))
        partial = partial_hex(x, lay.gshape, lay.offsets) if t.is_cpu else None
        if partial is None:
            partial = tensor_partial(x, lay.gshape, lay.offsets)
            if partial.device.type == "cpu":  # (else read to the host with the layouts' next flush)
                partial = to_hex(partial)
        if type(partial) is str:
            if key is not None:
                bounded_put(_PARTIALS, key, partial)
            if ckey is not None:
                bounded_put(self.by_content, ckey, partial)
        return partial

    def keys(self, t, vid: int, lay) -> tuple:
        """(key in `_PARTIALS`, key in `by_content`) of `t`'s partial, each None where it has none.
        `_PARTIALS` (every recording in the process): a parameter's block, or a view of one, whose fingerprint (taken
        from its bytes, or derived from its source's) this recording holds. The partial is a function of the values
        at their positions, which the fingerprint, dtype and shape stand for, so a weight met again (every forward,
        every recording) is not read again (nor its transposed block copied).
        `by_content` (this recording): any value with a fingerprint, by (fingerprint, dtype, where each element lies
        in the global value: hashing.tensor.global_runs). A view that keeps its source's fingerprint and whose
        elements lie where the source's did gets the source's partial, not read again."""
        if self.values is None or self.out.device is not None:
            return None, None
        v = self.values.known(t, vid)
        if v is None or type(v.hash) is not str:
            return None, None
        try:
            ckey = (v.hash, v.dtype, global_runs(t, lay.gshape, lay.offsets))
        except Exception:  # (a layout that does not fit: said where the partial is read)
            ckey = None
        if not (v.producer is None or v.derived):
            return None, ckey  # (activations: new values every forward, never met again as such)
        return (v.hash, v.dtype, tuple(t.shape), lay.gshape, lay.offsets), ckey
