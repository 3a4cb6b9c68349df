"""A dispatch mode that fails on every op that would make the host wait for a device: a scalar read
(`.item()`, `int()`, `float()`, `bool()`: aten._local_scalar_dense), an op whose output shape depends on the values
(nonzero, boolean masking, unique, ...), a copy between devices (`.cpu()`, `.to(other device)`), and a tensor
made from host data (torch.tensor(list) on a device is a blocking host-to-device copy). Code that runs under it
on the CPU issues none of these, so on a GPU it enqueues work and never waits; run the same code on `meta`
tensors too, where any read of values fails outright."""
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

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
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
