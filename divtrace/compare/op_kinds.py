"""What an aten op does to values, read from its record: whether it computes (or only moves, aliases, selects
or exactly casts them), whether it writes into an argument, whether it is computed from constants alone. Where
two computations part is always an op that computes, on data.

torch.finfo of the float dtypes is written out here, so that telling casts apart needs no torch (a hash-trace
bisect never imports it).

In: op records and a trace's index (divtrace.trace). Out: answers for the walker (walker.py), repro's region
(divtrace.repro.region) and audit.
"""
from __future__ import annotations

from collections import namedtuple

from divtrace.trace.reader import Trace, itemsize
from divtrace.trace.records import OpRecord

# Ops that only move, alias or select values: never where two computations part, though they can sit in a region.
VALUE_PRESERVING = {
    "view", "_unsafe_view", "reshape", "_reshape_alias", "transpose", "t", "permute", "expand", "unsqueeze",
    "squeeze", "select", "slice", "as_strided", "alias", "detach", "clone", "contiguous", "unfold", "split",
    "split_with_sizes", "chunk", "unbind", "narrow", "flatten", "lift_fresh", "lift_fresh_copy", "repeat", "cat",
    "stack", "index_select", "gather", "embedding", "_to_copy", "copy_", "copy", "expand_as", "view_as",
    "movedim", "diagonal", "fill_", "zeros_like", "empty_like", "new_empty", "new_zeros",
}


# Ops whose output row for one token reads the rows of other tokens of its sequence (attention over K and V): a
# token's own input rows being equal does not make its inputs equal.
ATTENTION = {"_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
             "scaled_dot_product_attention", "_scaled_dot_product_attention_math",
             "_scaled_dot_product_fused_attention_overrideable", "_flash_attention_forward",
             "_efficient_attention_forward"}


def reads_other_tokens(op: str | None) -> bool:
    """Whether an op (`aten.NAME.overload`, or `ns.NAME...`) is an attention: one whose output row for a token reads
    other tokens' K/V rows. aten's attentions by name; another namespace's op by `attention` or `attn` in its name
    (vLLM's `unified_attention`, flash-attn's ops)."""
    if not op:
        return False
    ns, _, rest = op.partition(".")
    name = rest.split(".")[0] if rest else ns
    if ns == "aten":
        return name in ATTENTION
    return "attention" in name or "attn" in name


def attention_module(path: str | None) -> bool:
    """Whether a module path names an attention module (its last part holds `attn` or `attention`: HF's and vLLM's
    `self_attn`, vLLM's `attn`, Megatron's `self_attention`/`core_attention`): one whose own code may read the K/V
    rows of other tokens, in ops no name tells (an attention written in torch ops)."""
    if not path:
        return False
    last = path.rsplit(".", 1)[-1].lower()
    return "attn" in last or "attention" in last


_FInfo = namedtuple("_FInfo", "bits eps max tiny")  # the torch.finfo fields cast_rounds reads

# torch.finfo of the floating dtypes, written out so that telling casts apart needs no torch (a hash-trace
# bisect never imports it); tests/test_bisect_scale.py checks every entry against torch.finfo.
_FINFO = {
    "torch.float64": _FInfo(64, 2.220446049250313e-16, 1.7976931348623157e+308, 2.2250738585072014e-308),
    "torch.float32": _FInfo(32, 1.1920928955078125e-07, 3.4028234663852886e+38, 1.1754943508222875e-38),
    "torch.float16": _FInfo(16, 0.0009765625, 65504.0, 6.103515625e-05),
    "torch.bfloat16": _FInfo(16, 0.0078125, 3.3895313892515355e+38, 1.1754943508222875e-38),
    "torch.float8_e4m3fn": _FInfo(8, 0.125, 448.0, 0.015625),
    "torch.float8_e5m2": _FInfo(8, 0.25, 57344.0, 6.103515625e-05),
    "torch.float8_e4m3fnuz": _FInfo(8, 0.125, 240.0, 0.0078125),
    "torch.float8_e5m2fnuz": _FInfo(8, 0.125, 57344.0, 3.0517578125e-05),
    "torch.float8_e8m0fnu": _FInfo(8, 1.0, 1.7014118346046923e+38, 5.877471754111438e-39),
}
# Floating dtypes torch.finfo does not describe (packed fp4): any cast to or from them may round.
_FLOAT_WITHOUT_FINFO = {"torch.float4_e2m1fn_x2"}


def _finfo(name: str):
    itemsize(name)  # DivtraceError for a name that is not a dtype of this torch
    return _FINFO.get(name)


def cast_rounds(dtype_in: str, dtype_out: str) -> bool:
    """Whether a cast can change values: to a float with less precision or range, float to int, or int to a
    16-bit-or-narrower float (positions in bf16 round above 256). Widening casts are exact."""
    if dtype_in == dtype_out:
        return False
    fi, fo = _finfo(dtype_in), _finfo(dtype_out)
    if dtype_in in _FLOAT_WITHOUT_FINFO or dtype_out in _FLOAT_WITHOUT_FINFO:
        return True  # no precision to compare: say it may round (a computing op), never that it cannot
    if fo is None:
        return fi is not None or dtype_out != "torch.bool"
    if fi is None:
        return dtype_in != "torch.bool" and fo.bits <= 16
    return fo.eps > fi.eps or fo.max < fi.max or fo.tiny > fi.tiny


def is_computing(rec: OpRecord, trace: Trace) -> bool:
    """False for ops that only rearrange values, and for casts that cannot round."""
    return computing(rec.op, rec.inputs, rec.outputs, trace)


def computing(op: str, inputs: list, outputs: list, trace: Trace) -> bool:
    parts = op.split(".")
    name = parts[1] if len(parts) >= 2 else op
    if name not in VALUE_PRESERVING:
        return True
    if name in ("_to_copy", "copy_", "copy"):
        key = trace.vkey  # (dtype, shape, hash) per vid
        dts_in = [key[v][0] for v in inputs]
        dts_out = [key[v][0] for v in outputs]
        src = dts_in[-1] if name == "copy_" and len(dts_in) > 1 else (dts_in[0] if dts_in else None)
        return src is not None and any(cast_rounds(src, d) for d in dts_out)
    return False


def writes_in_place(op: str) -> bool:
    """Whether an aten op writes into an argument: an in-place form (`add_`, `copy_`) or an `out=` overload."""
    parts = op.split(".")
    return len(parts) >= 2 and (parts[1].endswith("_") or (len(parts) >= 3 and parts[2].startswith("out")))


def constant_derived(trace: Trace, index: int, memo: dict, scope: set | None = None) -> bool:
    """True for ops computed from constants alone (a causal mask from `full`+`triu`, an `arange`): they carry
    no data from the inputs, so they are never where two computations of the data part. With `scope` (the op
    indices of one call's own code) a value from outside it counts as data, which keeps the walk inside the
    call; without, it is iterative anyway: a chain of producers can be as long as the run."""
    stack = [index]
    rin, vprod = trace.rin, trace.vprod  # op inputs per record; vid -> producer (produced values only)
    while stack:
        i = stack[-1]
        if i in memo:
            stack.pop()
            continue
        result, pending = True, []
        for vid in rin[i]:
            p = vprod.get(vid)
            if p is None or memo.get(p) is False or (scope is not None and p not in scope):
                result = False
                break
            if p not in memo:
                pending.append(p)
        if result and pending:
            stack.extend(pending)  # producers have lower indices: no cycles
        else:
            memo[i] = result
            stack.pop()
    return memo[index]
