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
ops read every weight (docs/performance.md).
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

    def __init__(self, unread: bool) -> None:
        self.unread = unread  # fingerprint what no op read, at the block's end
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
        """At the block's end (unread=True): a fingerprint line for every parameter and buffer no op read."""
        if not self.unread or self.out is None:
            return
        from divtrace.trace.hashing.tensor import hash_with_stats, hexes, tensor_fingerprint

        lines, on_device = [], []  # (a device tensor's fingerprint stays there until one read for all of them:
        # a host read per weight would wait for the device once per parameter of a big MoE)
        for name, t, kind in self._named_tensors():
            if name in self._named:
                continue
            loc = _local(t)
            if loc is None:
                continue
            line = {"name": name, "kind": kind, "dtype": dtype_name(loc.dtype), "shape": list(loc.shape)}
            with torch.no_grad():
                if _read_on_host(loc):
                    line["h"] = hash_with_stats(loc.detach(), stats=False)[0]
                else:
                    on_device.append((line, tensor_fingerprint(loc.detach())))
            lines.append(line)
        by_device: dict = {}
        for line, fp in on_device:
            by_device.setdefault(fp.device, []).append((line, fp))
        for got in by_device.values():
            for (line, _), h in zip(got, hexes(torch.stack([fp for _, fp in got]))):
                line["h"] = h
        for line in lines:
            self.out.add(line)
        self._by_id = None
