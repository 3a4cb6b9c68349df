"""Fused Triton kernels for the device path: a value's v2 fingerprint and summary statistics in one pass over its
bytes (two launches: the pass, then the reduction of its per-program partials), and its token-row fingerprints
in one launch.

Torch ops compute the same numbers (divtrace.trace.device_results) but materialize int64 products and masked
copies: about thirty times a value's bytes of memory traffic and a dozen launches per value, where these read it
once. Used on CUDA tensors where Triton imports; anywhere else, or once a kernel failed to build (said in
meta.json's `device_path.kernels`), the torch ops. The tests run them in Triton's interpreter on the CPU
(TRITON_INTERPRET=1) against the C kernel.

Layouts: whole values that are contiguous, aligned 32-bit lanes of any dtype (statistics for float32, float64,
float16 and bfloat16); rows that are contiguous rows of whole lanes. Everything else takes the torch ops.
"""
from __future__ import annotations

import importlib.util
import os

import torch

_STATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_LANES_PER_PROGRAM = 8192  # 8 weight blocks of 1024 lanes: 32 KiB of a value per program
_state = {"broken": None, "loaded": None}


def available(t: torch.Tensor) -> bool:
    """Whether the kernels may run on `t`'s device (CUDA with Triton; the CPU only under Triton's interpreter)."""
    if _state["broken"] is not None:
        return False
    if t.is_cuda:
        return _load() is not None
    return os.environ.get("TRITON_INTERPRET") == "1" and _CPU_INTERPRETED["on"] and _load() is not None


_CPU_INTERPRETED = {"on": False}  # tests: run the kernels on CPU tensors in Triton's interpreter


def status() -> str:
    """What meta.json says about the kernels: "triton", or why the torch ops ran."""
    if _state["broken"] is not None:
        return f"torch ops (a Triton kernel failed: {_state['broken'][:200]})"
    if _state["loaded"] is None:
        return "torch ops (no Triton)" if importlib.util.find_spec("triton") is None else "torch ops"
    return "triton"


def _load():
    k = _state["loaded"]
    if k is None and _state["broken"] is None and importlib.util.find_spec("triton") is not None:
        try:
            from divtrace.trace import _triton_kernels as k
        except Exception as e:  # (a Triton that does not build here)
            _state["broken"] = f"{type(e).__name__}: {e}"
            return None
        _state["loaded"] = k
    return k


def value_words(t: torch.Tensor, inner: torch.Tensor, outer, stats: bool) -> torch.Tensor | None:
    """int64 words as device_results.device_words lays them out ([h0, h1] or the 13 with statistics), or None
    where the kernels do not take `t`'s layout. `inner` is the weights' w [2, 1024], `outer(blocks)` their u."""
    es = t.element_size()
    nbytes = t.numel() * es
    if (not nbytes or nbytes % 4 or not t.is_contiguous() or t.is_conj() or t.is_neg() or t.is_complex()
            or (t.storage_offset() * es) % 4 or es not in (1, 2, 4, 8)):
        return None
    stats = stats and t.dtype in _STATS
    if t.is_floating_point() and not stats and t.dtype not in _STATS:
        return None  # (fp8: statistics through the torch ops)
    k = _load()
    try:
        return k.value_words(t, inner, outer, stats, _LANES_PER_PROGRAM)
    except Exception as e:
        _state["broken"] = f"{type(e).__name__}: {e}"
        return None


def row_words(x: torch.Tensor, w0: torch.Tensor, outer) -> torch.Tensor | None:
    """int64 [R]: the v2 row fingerprints of the rows of `x` ([R, K], contiguous, rows of whole aligned lanes), or
    None where the kernel does not take it."""
    es = x.element_size()
    if (x.dim() != 2 or not x.shape[0] or not x.shape[1] or (x.shape[1] * es) % 4 or not x.is_contiguous()
            or x.is_conj() or x.is_neg() or x.is_complex() or (x.storage_offset() * es) % 4):
        return None
    k = _load()
    try:
        return k.row_words(x, w0, outer)
    except Exception as e:
        _state["broken"] = f"{type(e).__name__}: {e}"
        return None
