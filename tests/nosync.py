"""Traps for host reads of device values.

A dispatch mode that fails on every op that would make the host wait for a device: a scalar read
(`.item()`, `int()`, `float()`, `bool()`: aten._local_scalar_dense), an op whose output shape depends on the values
(nonzero, boolean masking, unique, ...), a copy between devices (`.cpu()`, `.to(other device)`), and a tensor
made from host data (torch.tensor(list) on a device is a blocking host-to-device copy). Code that runs under it
on the CPU issues none of these, so on a GPU it enqueues work and never waits; run the same code on `meta`
tensors too, where any read of values fails outright.

`HostReadTrap(when=...)` fails only while `when()` is true (a recorder's own bookkeeping, not the model's ops), and
`python_reads(when)` adds what never reaches the dispatcher on the CPU: `.tolist()`, `.numpy()`, `__array__`,
`.cpu()` and `.to("cpu")` (no-ops on a CPU tensor, a copy to the host on a device). Both look at the calling
thread only: dispatch modes are per thread, and a writer thread reading landed host buffers is allowed to.
`RecorderScope` is the `when` for divtrace: inside its bookkeeping (lifecycle.BUSY) and outside the one allowed
read, the root call's token identity (TokenRows.begin_root_call)."""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
_VALUE_READS = {aten._local_scalar_dense, aten.nonzero, aten.nonzero_static, aten.masked_select, aten.is_nonzero,
                aten.equal, aten.allclose, aten._unique, aten._unique2, aten.unique_dim, aten.unique_consecutive,
                aten.bincount, aten.histc, aten.item, aten.repeat_interleave, aten.masked_scatter, aten._assert_async}
_HOST_DATA = {aten.lift_fresh, aten.lift_fresh_copy}  # torch.tensor(host data): a blocking copy to a device


class HostReadError(AssertionError):
    pass


def _devices(x, out: set):
    if isinstance(x, torch.Tensor):
        out.add(x.device)
    elif isinstance(x, (list, tuple)):
        for y in x:
            _devices(y, out)
    elif isinstance(x, dict):
        for y in x.values():
            _devices(y, out)


class HostReadTrap(TorchDispatchMode):
    """`with HostReadTrap(): ...` raises HostReadError at the first op that would wait for a device."""

    def __init__(self, when=None):
        super().__init__()
        self.when = when
        self.checked = 0  # ops looked at while `when()` held

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.when is not None and not self.when():
            return func(*args, **kwargs)
        self.checked += 1
        if func.overloadpacket in _VALUE_READS:
            raise HostReadError(f"{func} reads tensor values to the host")
        if func.overloadpacket in _HOST_DATA:
            raise HostReadError(f"{func} makes a tensor from host data")
        name = func.overloadpacket.__name__
        if name in ("index", "index_put", "index_put_", "_index_put_impl_"):
            idx = args[1] if len(args) > 1 else kwargs.get("indices", ())
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in idx or ()):
                raise HostReadError(f"{func} with a boolean mask (its output shape depends on the values)")
        if name in ("_to_copy", "to", "copy_", "_copy_from", "_copy_from_and_resize"):
            devs: set = set()
            _devices(args, devs)
            dev = kwargs.get("device")
            if dev is not None:
                devs.add(torch.device(dev))
            if len(devs) > 1:
                raise HostReadError(f"{func} copies between devices {sorted(map(str, devs))}")
        return func(*args, **kwargs)


class RecorderScope:
    """`when` for the traps: true while divtrace does its own bookkeeping on this thread, except inside the
    root call's token identity (the input ids and positions, read once per root call: allowed)."""

    def __init__(self, monkeypatch):
        from divtrace.record.lifecycle import STATE
        from divtrace.record.token_rows import TokenRows

        self._state = STATE
        self.allowed = 0
        begin = TokenRows.begin_root_call
        scope = self

        def begin_root_call(self, *a, **k):
            scope.allowed += 1
            try:
                return begin(self, *a, **k)
            finally:
                scope.allowed -= 1

        monkeypatch.setattr(TokenRows, "begin_root_call", begin_root_call)

    def __call__(self) -> bool:
        return self._state.busy > 0 and not self.allowed


def python_reads(monkeypatch, when) -> list:
    """Make `.tolist()`, `.numpy()`, `__array__`, `.cpu()`, `.to(cpu)` and `.item()` raise HostReadError on this
    thread while `when()` holds; the list returned collects what was caught (also raised)."""
    import threading

    caught: list = []
    main = threading.get_ident()

    def guard(name, orig, is_read):
        def method(self, *a, **k):
            if threading.get_ident() == main and when() and is_read(self, a, k):
                caught.append(name)
                raise HostReadError(f"Tensor.{name} reads tensor values to the host")
            return orig(self, *a, **k)
        return method

    def to_cpu(self, a, k):
        dev = k.get("device", a[0] if a else None)
        return isinstance(dev, (str, torch.device)) and torch.device(dev).type == "cpu"

    always = lambda self, a, k: True  # noqa: E731
    for name, is_read in (("tolist", always), ("numpy", always), ("__array__", always), ("cpu", always),
                          ("item", always), ("to", to_cpu)):
        monkeypatch.setattr(torch.Tensor, name, guard(name, getattr(torch.Tensor, name), is_read))
    return caught
