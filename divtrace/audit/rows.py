"""Which dim of an op's inputs and outputs holds its rows (tokens), so that a row can be computed alone or in
another batch and compared with itself.

Without a token layout the row dim is read off the op and the shapes (the first dim of size > 1 unless said
otherwise below), never the feature dim of a matmul or a dim a softmax or a norm works along. Each op family
says which of its tensor inputs carry those rows (they are sliced) and which are shared by every row (weights,
keys and values of attention: passed whole):

- matmul (mm, addmm, bmm, baddbmm, linear, matmul): rows of the first matrix (the M dim of each matrix of a
  bmm);
- attention (the aten scaled-dot-product kernels): query rows, with their mask rows; keys and values whole.
  Causal attention computes a chunk of query rows [s, e) against keys [0, e) with a bottom-right causal mask,
  and one row against its prefix without a mask: what chunked prefill and decode run;
- pointwise ops (torch.Tag.pointwise, casts): the output's largest non-feature dim (T of [B, T, H] and of
  [B, H, T, D]), sliced in every input that has it after broadcasting;
- ops along a dim (softmax, reductions with `dim`, norms over trailing dims): the nearest dim of size > 1
  before those dims (T of [B, T, H] for a norm, the queries of [B, H, Tq, Tk] for a softmax);
- embedding: rows of the indices;
- custom ops (not aten): the leading dim of the first tensor input, when every tensor output has it too, and
  of every input of the same rank and size there (assumed: a custom op whose inputs index rows, such as group
  offsets, is cut wrongly; the report names the family "leading dim (assumed)");
- any other aten op (indexing, grouped matmuls, scatters): not audited, its inputs may index rows.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from divtrace.audit.replay import RecordedCall, Slot
from divtrace.repro.region import op_short

MATMUL = {"mm", "addmm", "bmm", "baddbmm", "linear", "matmul", "_int_mm", "_scaled_mm", "addmm_", "baddbmm_"}
ATTENTION = {"_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
             "scaled_dot_product_attention", "_scaled_dot_product_attention_math",
             "_scaled_dot_product_fused_attention_overrideable"}
EMBEDDING = {"embedding", "embedding_bag", "_embedding_bag"}
POINTWISE_EXTRA = {"_to_copy", "to", "clone", "copy_", "copy", "masked_fill", "masked_fill_", "where", "clamp",
                   "clamp_", "zeros_like", "ones_like", "full_like", "fill_", "floor_divide", "floor_divide_"}
# norms over the trailing `normalized_shape` dims
NORMS = {"native_layer_norm", "layer_norm", "rms_norm", "_fused_rms_norm"}
DIM_ARGS = ("dim", "dims")


@dataclass
class RowPlan:
    """How to take rows of this op: slice `inputs` (vid -> dim), compare `outputs` (output index -> dim)."""

    family: str
    n: int  # rows in the recorded call
    inputs: dict[int, int]
    outputs: dict[int, int]
    causal: dict | None = None  # attention with is_causal: {"q", "k", "v", "mask_arg", "dim"} (see module doc)
    extra: dict = field(default_factory=dict)


class NoRows(Exception):
    """The op's row dim cannot be determined (the reason is the message)."""


def _lead(shape, exclude=(), keep_last=False) -> int | None:
    """First dim of size > 1, not in `exclude` (and not the last dim of a matrix-shaped value unless
    `keep_last`); the first allowed dim when none is larger than 1; None when no dim is allowed."""
    dims = _allowed(shape, exclude, keep_last)
    if not dims:
        return None
    for d in dims:
        if shape[d] > 1:
            return d
    return dims[0]


def _allowed(shape, exclude=(), keep_last=False) -> list[int]:
    return [d for d in range(len(shape)) if d not in exclude and (keep_last or len(shape) < 2 or d < len(shape) - 1)]


def _before(shape, exclude) -> int | None:
    """For an op along `exclude` (softmax over keys, a norm over features): the nearest dim of size > 1 before
    them, where the tokens of [B, T, H] and [B, H, Tq, Tk] sit; else the leading dim outside them."""
    if exclude:
        for d in range(min(exclude) - 1, -1, -1):
            if shape[d] > 1:
                return d
    return _lead(shape, exclude=exclude, keep_last=True)


def _largest(shape, keep_last) -> int | None:
    """The largest non-feature dim (the first of equals): tokens in [B, T, H] and [B, H, T, D] unless the batch
    or the heads outnumber them."""
    dims = _allowed(shape, (), keep_last)
    if not dims:
        return None
    return max(dims, key=lambda d: (shape[d], -d))


def _norm_dims(v, ndim: int) -> set[int]:
    if v is None:
        return set(range(ndim))
    if isinstance(v, int):
        v = [v]
    return {d % ndim for d in v} if ndim else set()


def _tensor_slots(call: RecordedCall) -> list[Slot]:
    from torch.utils._pytree import tree_flatten

    return [s for s in tree_flatten([call.args, call.kwargs])[0] if isinstance(s, Slot)]


def _outputs_with(out_shapes: list, n: int, dim_for) -> dict[int, int]:
    res = {}
    for i, shp in enumerate(out_shapes):
        d = dim_for(i, shp)
        if d is not None and 0 <= d < len(shp) and shp[d] == n:
            res[i] = d
    return res


def plan_rows(call: RecordedCall, shapes: dict[int, list], out_shapes: list[list]) -> RowPlan:
    """The row plan of `call`, given the recorded shapes of its tensor inputs (vid -> shape) and outputs."""
    name = op_short(call.op)
    slots = _tensor_slots(call)
    if not slots:
        raise NoRows("no tensor input (values made from constants)")
    first = slots[0].vid
    if not out_shapes:
        raise NoRows("no tensor output")
    tags = getattr(call.fn, "tags", ()) or ()

    if name in MATMUL:
        return _matmul(call, name, shapes, out_shapes)
    if name in ATTENTION:
        return _attention(call, shapes, out_shapes)
    if name in EMBEDDING:
        idx = call.arg("indices") or call.arg("input")
        if not isinstance(idx, Slot):
            raise NoRows("embedding without an index tensor")
        ishape = shapes[idx.vid]
        d = _lead(ishape, keep_last=True)
        if d is None:
            raise NoRows("embedding of a scalar index")
        n = ishape[d]
        return RowPlan("embedding", n, {idx.vid: d}, _outputs_with(out_shapes, n, lambda i, s: d))
    if name in NORMS:
        x = call.arg("input")
        ns = call.arg("normalized_shape")
        if not isinstance(x, Slot):
            raise NoRows("norm without an input tensor")
        xs = shapes[x.vid]
        k = len(ns) if isinstance(ns, (list, tuple)) else 1
        d = _before(xs, set(range(len(xs) - k, len(xs))))
        if d is None:
            raise NoRows("the norm covers every dim")
        n = xs[d]
        return RowPlan("norm", n, {x.vid: d},
                       _outputs_with(out_shapes, n, lambda i, s: d if len(s) == len(xs) else None))
    if torch.Tag.pointwise in tags or name in POINTWISE_EXTRA:
        return _pointwise(call, slots, shapes, out_shapes)
    schema = call.schema
    dim_arg = next((a.name for a in (schema.arguments if schema else []) if a.name in DIM_ARGS), None)
    if dim_arg is not None and slots:
        return _along_dim(call, dim_arg, first, slots, shapes, out_shapes)
    if call.op.split(".")[0] in ("aten", "prims", "prim"):
        # indexing, grouped and scatter ops: some inputs say where rows go (indices, offsets, counts), so rows
        # cannot be cut without changing what the op computes
        raise NoRows(f"no row rule for aten {name} (divtrace does not know which of its inputs are rows)")
    return _leading(call, first, slots, shapes, out_shapes)


def _matmul(call, name, shapes, out_shapes) -> RowPlan:
    first_matrix = {"addmm": "mat1", "addmm_": "mat1", "baddbmm": "batch1", "baddbmm_": "batch1", "linear": "input"}
    a = call.arg(first_matrix.get(name, "self"))
    if not isinstance(a, Slot):
        raise NoRows("matmul without a first matrix tensor")
    ashape = shapes[a.vid]
    if len(ashape) < 2 and name != "linear":
        raise NoRows("matmul of a vector")
    if name in ("bmm", "baddbmm", "baddbmm_"):
        d = len(ashape) - 2  # the M dim of each matrix
    else:
        d = _lead(ashape)  # linear/matmul on [B, T, K]: the first dim of size > 1 before K
    n = ashape[d]
    inputs = {a.vid: d}
    # a bias or accumulator with one row per row of the product is sliced with it (addmm(bias[M, N], ...))
    for arg in ("self", "input", "bias"):
        b = call.arg(arg)
        if isinstance(b, Slot) and b.vid != a.vid and b.vid in shapes:
            bs = shapes[b.vid]
            off = len(ashape) - len(bs)
            if d - off >= 0 and bs[d - off] == n and n > 1:
                inputs[b.vid] = d - off
    for arg in ("scale_a",):
        s = call.arg(arg)
        if isinstance(s, Slot) and shapes.get(s.vid) and shapes[s.vid][0] == n and n > 1:
            inputs[s.vid] = 0
    out_rank = len(out_shapes[0])
    od = d + (out_rank - len(ashape))
    return RowPlan("matmul", n, inputs, _outputs_with(out_shapes[:1], n, lambda i, s: od))


def _attention(call, shapes, out_shapes) -> RowPlan:
    q, k, v = call.arg("query"), call.arg("key"), call.arg("value")
    if not all(isinstance(x, Slot) for x in (q, k, v)):
        raise NoRows("attention without query/key/value tensors")
    qs, ks = shapes[q.vid], shapes[k.vid]
    if len(qs) < 2:
        raise NoRows("attention on a query of rank < 2")
    d = len(qs) - 2
    n, s_len = qs[d], ks[len(ks) - 2]
    inputs = {q.vid: d}
    mask_arg = "attn_mask" if call.arg_position("attn_mask") is not None or _kw(call, "attn_mask") else (
        "attn_bias" if call.arg_position("attn_bias") is not None or _kw(call, "attn_bias") else None)
    mask = call.arg(mask_arg) if mask_arg else None
    if isinstance(mask, Slot):
        ms = shapes[mask.vid]
        if len(ms) >= 2 and ms[-2] == n and n > 1:
            inputs[mask.vid] = len(ms) - 2
    causal = None
    if call.arg("is_causal") is True:
        if isinstance(mask, Slot):
            raise NoRows("causal attention with a mask as well")
        if n != s_len:
            raise NoRows(f"causal attention of {n} queries over {s_len} keys (top-left aligned)")
        causal = {"k": k.vid, "v": v.vid, "mask_arg": mask_arg, "dim": d, "kdim": len(ks) - 2}
    outputs = {0: len(out_shapes[0]) - 2} if len(out_shapes[0]) >= 2 and out_shapes[0][-2] == n else {}
    if not outputs:
        raise NoRows("attention output without the query rows")
    return RowPlan("attention", n, inputs, outputs, causal=causal)


def _kw(call, name) -> bool:
    s = call.schema
    return s is not None and any(a.name == name for a in s.arguments)


def _pointwise(call, slots, shapes, out_shapes) -> RowPlan:
    out = out_shapes[0]
    d = _largest(out, keep_last=len(out) < 2)
    if d is None:
        raise NoRows("a scalar output")
    n = out[d]
    inputs = {}
    for s in slots:
        shp = shapes[s.vid]
        j = d - (len(out) - len(shp))
        if j >= 0 and shp[j] == n and n > 1:
            inputs.setdefault(s.vid, j)
    if n > 1 and not inputs:
        raise NoRows("no input carries the output's rows")
    if n == 1:  # one row: it is padded into a larger batch through the first input that has the dim
        for s in slots:
            shp = shapes[s.vid]
            j = d - (len(out) - len(shp))
            if j >= 0 and shp[j] == 1 and len(shp) == len(out):
                inputs.setdefault(s.vid, j)
        if not inputs:
            raise NoRows("a single row that no input carries")
    return RowPlan("pointwise", n, inputs,
                   _outputs_with(out_shapes, n, lambda i, s: d - (len(out) - len(s))))


def _along_dim(call, dim_arg, first, slots, shapes, out_shapes) -> RowPlan:
    xs = shapes[first]
    dims = _norm_dims(call.arg(dim_arg), len(xs))
    d = _before(xs, dims)
    if d is None:
        raise NoRows(f"the op works along every dim ({dim_arg}={call.arg(dim_arg)!r})")
    n = xs[d]
    inputs = {first: d}
    for s in slots[1:]:
        if shapes[s.vid] == xs and n > 1:
            inputs.setdefault(s.vid, d)
    keep = call.arg("keepdim") is True

    def out_dim(i, s):
        if len(s) == len(xs):
            return d
        if not keep and len(s) == len(xs) - len(dims):
            return d - sum(1 for r in dims if r < d)
        return None

    outputs = _outputs_with(out_shapes, n, out_dim)
    if not outputs:
        raise NoRows("no output keeps the input's rows")
    return RowPlan("along a dim", n, inputs, outputs)


def _leading(call, first, slots, shapes, out_shapes) -> RowPlan:
    xs = shapes[first]
    d = _lead(xs)
    if d is None:
        raise NoRows("row dim unknown: the first input is a scalar")
    n = xs[d]
    if any(len(s) <= d or s[d] != n for s in out_shapes):
        raise NoRows(f"row dim unknown: the outputs {out_shapes} do not all keep dim {d} (size {n}) of the first "
                     "input")
    inputs = {first: d}
    for s in slots[1:]:
        shp = shapes[s.vid]
        if len(shp) == len(xs) and shp[d] == n and n > 1:
            inputs.setdefault(s.vid, d)
    return RowPlan("leading dim (assumed)", n, inputs, {i: d for i in range(len(out_shapes))})
