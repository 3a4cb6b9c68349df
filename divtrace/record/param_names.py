"""Which parameter or buffer of the recorded model a value from outside is: its name, in params.jsonl
(divtrace.trace.param_names), so bisect compares the two runs' weights by name (divtrace.compare.params).

A parameter enters a recording as an op input that no recorded op made: ValueIdentity.vid_of fingerprints it then
(and stores it in full mode), as any value from outside, and asks `seen(tensor, vid)` here. No tensor is read for
the name, and nothing runs per op: the id -> name map is built once per recording, at the first value from
outside, from the modules the recorder walked at its start; each value from outside costs one dict lookup. Entries
hold weak references and a lookup checks identity, so a freed parameter whose id a new tensor reuses is not named
by it; a parameter the map does not hold (replaced since: `module.weight = nn.Parameter(...)`) rebuilds it, a few
times a recording at most.

`unread=True` (record's `params="all"`, the default with ops=True): at the block's end, every parameter and
buffer no recorded op read (an MoE expert no token of this batch was routed to) is fingerprinted, hash only, so a
weight that differs there is seen too. Costs one read of those weights per recording; nothing for a model whose
ops read every weight (docs/performance.md). A DTensor parameter no op read gets its block's layout on its line
(`lay`: placements, global shape, offsets, the block's partial fingerprint), so bisect puts it together with the
other ranks' blocks.

`chunks=True` (record's `params="blocks"`), in hash mode (full mode: one no op read, which has no bytes), a
parameter that is not a DTensor: at the block's end its chunk partials (`ch`: 8 chunks along dim 0 and along its
last dim, each chunk's partial fingerprint at its place) are written too, so a run of another layout (TP=2 rows
32-63 of the vocab) is compared with the same rows of this whole weight, the rank whose block differs named, with
no bytes. Costs a read of each weight per chunk dim (+0.23x of bench_record's forward: docs/performance.md), so it
is asked for, never the default; without it a hash trace's whole weight is compared by its one fingerprint.

`enabled=False` (record's `params="none"`): no name is written (params.jsonl stays empty; meta.json says
`"params": "none"`, and bisect says why it compares no parameters).
"""
from __future__ import annotations

import weakref

import torch

from divtrace.trace.fingerprint import dtype_name

_REBUILDS = 4  # how often a parameter missing from the map may rebuild it in one recording


def _local(t):
    """The tensor an op reads for parameter `t`: a DTensor's local block (what the recorder fingerprints), else
    `t`; None when it has no plain bytes (meta, quantized, sparse, nested, another subclass)."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter) and type(t).__torch_dispatch__ is not \
            torch.Tensor.__torch_dispatch__:
        t = getattr(t, "_local_tensor", None)
        if not isinstance(t, torch.Tensor):
            return None
    if t.layout is not torch.strided or t.is_quantized or t.is_nested or t.is_meta:
        return None
    return t


def _read_on_host(t) -> bool:
    """Whether `t` is fingerprinted by the C kernel here (a CPU tensor), else by torch ops on its device."""
    return t.is_cpu


class ParamNames:
    """The names of one recording's parameters and buffers (one per Recorder)."""

    def __init__(self, unread: bool, enabled: bool = True, chunks: bool = False) -> None:
        self.unread = unread and enabled  # fingerprint what no op read, at the block's end
        self.chunks = chunks  # params="blocks": whole weights' chunk partials too (a read of each per chunk dim)
        self.enabled = enabled  # False: params="none", no name written
        self.modules: list = []  # (path, module) as the recorder walked them (compiled wrappers left out)
        self.out = None  # the trace's ParamNameWriter, from the start of the block
        self._by_id: dict | None = None  # id(tensor) -> (weak reference, name, kind)
        self._named: set[str] = set()  # names a line was written for
        self._rebuilds = 0

    def _named_tensors(self):
        """(name, tensor, kind) of every parameter, then every buffer, the first name of a tensor held under
        several (a tied weight), as named_parameters() / named_buffers() give them."""
        seen: set[int] = set()
        for attr, kind in (("_parameters", "parameter"), ("_buffers", "buffer")):
            for path, mod in self.modules:
                for n, t in getattr(mod, attr, {}).items():
                    if t is None or id(t) in seen:
                        continue
                    seen.add(id(t))
                    yield (f"{path}.{n}" if path else n), t, kind

    def _build(self) -> dict:
        m: dict = {}
        for name, t, kind in self._named_tensors():
            loc = _local(t)
            for x in (t, loc) if loc is not None and loc is not t else (t,):
                try:
                    m.setdefault(id(x), (weakref.ref(x), name, kind))
                except TypeError:  # (no weak references to it: it cannot be told from a reused id, so not named)
                    pass
        self._by_id = m
        return m

    def seen(self, t, vid: int) -> None:
        """Value `vid` came from outside as tensor `t`: write its name when it is a parameter or buffer."""
        if not self.enabled:
            return
        m = self._by_id if self._by_id is not None else self._build()
        e = m.get(id(t))
        if e is None or e[0]() is not t:
            if type(t) is not torch.nn.Parameter or self._rebuilds >= _REBUILDS:
                return
            self._rebuilds += 1
            e = self._build().get(id(t))
            if e is None or e[0]() is not t:
                return
        self.out.add({"v": vid, "name": e[1], "kind": e[2]})
        self._named.add(e[1])

    def finish(self) -> None:
        """At the block's end: (unread=True) a fingerprint line for every parameter and buffer no op read (with the
        chunk partials of one that is not a DTensor); in hash mode, a chunk line for each such parameter an op
        read."""
        if not self.enabled or self.out is None:
            return
        from divtrace.trace.hashing.tensor import hash_with_stats, tensor_fingerprint

        lines, on_device = [], []  # (a device tensor's fingerprint stays there until one read for all of them:
        # a host read per weight would wait for the device once per parameter of a big MoE)
        hash_mode = getattr(self.out._writer, "mode", None) == "hash"
        for name, t, kind in self._named_tensors():
            loc = _local(t)
            if loc is None:
                continue
            read = name in self._named
            chunked = self.chunks and loc is t and kind == "parameter" and t.dim() >= 1 and t.numel() > 0
            with torch.no_grad():
                if read or not self.unread:  # (hash mode: the chunks of a weight an op read, on a line of their own)
                    if read and hash_mode and chunked:
                        lines.append({"name": name, "kind": kind, "ch": _chunk_partials(t.detach(), on_device)})
                    continue
                line = {"name": name, "kind": kind, "dtype": dtype_name(loc.dtype), "shape": list(loc.shape)}
                if chunked:  # (full mode too: an unread weight has no bytes)
                    line["ch"] = _chunk_partials(t.detach(), on_device)
                if _read_on_host(loc):
                    line["h"] = hash_with_stats(loc.detach(), stats=False)[0]
                else:
                    on_device.append((line, "h", tensor_fingerprint(loc.detach())))
                if loc is not t:
                    lay = _block_layout(t, loc, on_device)
                    if lay is not None:
                        line["lay"] = lay
            lines.append(line)
        _land(on_device)
        for line in lines:
            self.out.add(line)
        self._by_id = None


_CHUNKS = 8  # chunks per dim of a whole parameter's chunk partials (a TP degree of 2, 4 or 8 splits on them)


def _land(on_device) -> None:
    """Put each device fingerprint into its place ((container, key, int64 [2] tensor)), one read per device."""
    from divtrace.trace.hashing.tensor import hexes

    by_device: dict = {}
    for item in on_device:
        by_device.setdefault(item[2].device, []).append(item)
    for got in by_device.values():
        for (where, key, _), h in zip(got, hexes(torch.stack([fp for _, _, fp in got]))):
            where[key] = h


def _partial_into(where, key, x, shape, offsets, on_device) -> None:
    """where[key] = the partial fingerprint of block `x` of a value of `shape` at `offsets`: at once from the C kernel
    on the host, else left on the device for `_land`'s one read."""
    from divtrace.trace.hashing.tensor import partial_hex, tensor_partial

    h = partial_hex(x, shape, offsets) if _read_on_host(x) else None
    if h is None:
        on_device.append((where, key, tensor_partial(x, shape, offsets).reshape(-1)))
    else:
        where[key] = h


def _chunk_partials(t, on_device) -> list:
    """[[dim, [[start, length, partial], ..]], ..] of whole parameter `t`: along dim 0 and its last dim."""
    out, shape = [], list(t.shape)
    for dim in sorted({0, t.dim() - 1}):
        n = shape[dim]
        k = min(_CHUNKS, n)
        got = []
        for j in range(k):
            s, e = j * n // k, (j + 1) * n // k
            x = t.narrow(dim, s, e - s)
            offsets = [s if d == dim else 0 for d in range(t.dim())]
            entry = [s, e - s, None]
            _partial_into(entry, 2, x, shape, offsets, on_device)
            got.append(entry)
        out.append([dim, got])
    return out


def _block_layout(t, loc, on_device) -> dict | None:
    """The layout of DTensor parameter `t`'s local block `loc` ({"p", "g", "o", "h"}), or None where it has none
    that divtrace puts together (a placement other than Shard and Replicate, or one that does not fit)."""
    placements, mesh = getattr(t, "placements", None), getattr(t, "device_mesh", None)
    if placements is None or mesh is None:
        return None
    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        from divtrace.record.placements import _placement_code

        codes = [_placement_code(p, t.dim()) for p in placements]
        if any(c is None or c[0] not in "SR" for c in codes):
            return None
        local, offsets = compute_local_shape_and_global_offset(tuple(t.shape), mesh, placements)
        if tuple(local) != tuple(loc.shape):
            return None
        out = {"p": codes, "g": list(t.shape), "o": [int(o) for o in offsets]}
        if any(c[0] == "S" for c in codes):
            _partial_into(out, "h", loc.detach(), out["g"], out["o"], on_device)
        return out
    except Exception:  # (a mesh this rank is not in, a placement torch cannot place: no layout rather than a wrong one)
        return None
