"""What the fields of a trace may hold, known without importing torch: dtype names and their item sizes, shard
file names, fingerprints. Shared by every reader (divtrace/trace/index.py, reference.py) and by value access
(tensors.py)."""
from __future__ import annotations

import re

from divtrace.errors import DivtraceError

# torch is imported only where tensors are really needed (loading bytes, dtype objects): reading a hash trace
# and bisecting it needs none, and importing torch costs seconds and ~220 MB.

# dtype names (as on disk, without "torch.") -> itemsize. These exist in every torch divtrace supports.
_CORE_DTYPES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
                "int8": 1, "uint8": 1, "bool": 1, "complex64": 8, "complex128": 16}
# These are accepted only when the running torch has them (checked once per name, which imports torch).
_OPTIONAL_DTYPES = {"complex32": 4, "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1,
                    "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1, "float4_e2m1fn_x2": 1, "uint16": 2, "uint32": 4,
                    "uint64": 8}
# short name -> ("torch.<name>", itemsize), or None once a name is known not to be a dtype of this torch.
_DTYPE_INFO: dict = {k: ("torch." + k, n) for k, n in _CORE_DTYPES.items()}

_HEX32 = re.compile(r"[0-9a-f]{32}\Z")
_SHARD_NAME = re.compile(r"tensors-\d{5,}\.safetensors\Z")


def _dtype_info(short):
    """("torch.<short>", itemsize) when `short` names a dtype this torch has, else None."""
    try:
        return _DTYPE_INFO[short]
    except KeyError:
        pass
    except TypeError:  # unhashable: not a name
        return None
    if type(short) is not str or short not in _OPTIONAL_DTYPES:
        return None
    import torch

    info = ("torch." + short, _OPTIONAL_DTYPES[short]) if isinstance(getattr(torch, short, None), torch.dtype) else None
    _DTYPE_INFO[short] = info
    return info


def _dtype_full(name):
    """("torch.<x>", itemsize) for a field-form dtype name ("torch.float32"), else None."""
    if type(name) is not str or not name.startswith("torch."):
        return None
    return _dtype_info(name[6:])


def torch_dtype(name: str):
    """The torch.dtype for a field-form name ("torch.bfloat16"); imports torch."""
    if _dtype_full(name) is None:
        raise DivtraceError(f"unknown dtype {name!r} in trace")
    import torch

    return getattr(torch, name[6:])


def itemsize(name: str) -> int:
    """Bytes per element of a field-form dtype name, without importing torch."""
    info = _dtype_full(name)
    if info is None:
        raise DivtraceError(f"unknown dtype {name!r} in trace")
    return info[1]


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _str_or_none(x) -> bool:
    return x is None or isinstance(x, str)

