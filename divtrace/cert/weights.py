"""Weight fingerprints for the ledger: per parameter, in a layout-independent form.

Each parameter is fingerprinted on its unsharded values (a DTensor is gathered with `full_tensor()`), under
its name after a parameter map: `vllm-hf` splits vLLM's fused projections into HF's separate ones
(`qkv_proj.weight` -> `q_proj.weight`, `k_proj.weight`, `v_proj.weight`; `gate_up_proj.weight` ->
`gate_proj.weight`, `up_proj.weight`) and cuts vLLM's padded vocabulary rows, so a vLLM engine and an HF
trainer holding the same weights give the same listing.

`fingerprint_weights` is the one place a weight is hashed: the scheme is written into the ledger
(`weight_hash_scheme`) so that another scheme (one that sums over shards) can replace it without a reader
mistaking one for the other.
"""
from __future__ import annotations

import re

import torch

from divtrace.errors import DivtraceError
from divtrace.trace.fingerprint import HASH_SCHEME, dtype_name, tensor_hash

WEIGHT_HASH_SCHEME = f"param-{HASH_SCHEME}"  # tensor_hash of each parameter's logical bytes
PARAM_MAPS = ("vllm-hf",)

_FUSED = {  # vLLM fused module name -> the HF modules its output (and weight rows) are the concatenation of
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


def fingerprint_weights(source, param_map: str | None = None) -> dict[str, list]:
    """{name: [dtype, shape, hash]} for every parameter of `source` (an `nn.Module`, a dict of tensors, or an
    iterable of (name, tensor) pairs), on unsharded values, under names after `param_map`."""
    out = {}
    for name, t in named_weights(source, param_map):
        t = t.detach()
        out[name] = [dtype_name(t.dtype).removeprefix("torch."), list(t.shape), tensor_hash(t)]
    return out


def named_weights(source, param_map: str | None = None):
    """(name, unsharded tensor) pairs of `source`, fused projections split and vocab padding cut per `param_map`."""
    if param_map not in (None, *PARAM_MAPS):
        raise DivtraceError(f"param_map={param_map!r}: unknown parameter map (known: {', '.join(PARAM_MAPS)})")
    if isinstance(source, torch.nn.Module):
        modules = dict(source.named_modules())
        pairs = source.named_parameters()
    else:
        modules = {}
        pairs = source.items() if isinstance(source, dict) else source
    for name, t in pairs:
        if not isinstance(t, torch.Tensor):
            raise DivtraceError(f"weights: {name!r} is {type(t).__name__}, not a tensor")
        t = _unsharded(name, t)
        if param_map == "vllm-hf":
            yield from _vllm_to_hf(name, t, modules.get(name.rpartition(".")[0]))
        else:
            yield name, t


def _unsharded(name: str, t: torch.Tensor) -> torch.Tensor:
    full = getattr(t, "full_tensor", None)  # a DTensor (FSDP2, tensor parallel): its whole value
    if full is not None:
        return full()
    if type(t).__name__ == "FlatParameter" or getattr(t, "_is_flat_param", False):
        raise DivtraceError(f"weights: {name!r} is an FSDP flat parameter (sharded and flattened); fingerprint the "
                            "model inside FSDP.summon_full_params(model), or pass the gathered state dict")
    return t


def _vllm_to_hf(name: str, t: torch.Tensor, module):
    if t.numel() == 0 and hasattr(module, "cpu_linear"):
        raise DivtraceError(f"weights: {name!r} is empty: vLLM's CPU backend packed this layer's weight for its own "
                            "GEMM and removed the tensor, so the engine's values cannot be read after loading; "
                            "fingerprint the weights you load into the engine instead (the state dict you sync)")
    mod_path, _, leaf = name.rpartition(".")
    parent, _, mod_name = mod_path.rpartition(".")
    parts = _FUSED.get(mod_name)
    if parts is not None and t.dim() >= 1:
        sizes = list(getattr(module, "output_sizes", None) or [])
        if len(sizes) != len(parts) or sum(sizes) != t.shape[0]:
            raise DivtraceError(f"weights: cannot split {name!r} [{', '.join(map(str, t.shape))}] into "
                                f"{', '.join(parts)}: its module's output_sizes is {sizes or 'missing'} (vllm-hf "
                                "needs the fused layer's output_sizes, one per part, summing to dim 0)")
        start = 0
        for part, size in zip(parts, sizes):
            yield f"{parent + '.' if parent else ''}{part}.{leaf}", t[start:start + size]
            start += size
        return
    org = getattr(module, "org_vocab_size", None)  # vLLM pads the vocabulary rows of its embedding and head
    if org is not None and re.search(r"(embed_tokens|lm_head)$", mod_path) and t.dim() >= 1 and t.shape[0] > org:
        t = t[:org]
    yield name, t


def compare_weights(a: dict | None, b: dict | None) -> dict:
    """How two listings differ: {"equal": bool | None, "differ": [names], "only_a": [...], "only_b": [...]}.
    `equal` is None when a listing is missing (nothing can be said)."""
    if a is None or b is None:
        return {"equal": None, "differ": [], "only_a": [], "only_b": []}
    differ = sorted(n for n in a.keys() & b.keys() if list(a[n]) != list(b[n]))
    only_a, only_b = sorted(a.keys() - b.keys()), sorted(b.keys() - a.keys())
    return {"equal": not (differ or only_a or only_b), "differ": differ, "only_a": only_a, "only_b": only_b}
