"""How a plain op carries its inputs' shard layouts to its outputs, at record time (for hash mode, a value's
partial fingerprint must be taken where it is made, at its global offsets).

Tensor-parallel code hands plain local tensors from op to op (HF's TP inference path runs every Linear on local
weights; attention runs on local heads), so a value's place in its global value follows from its inputs': a
matmul of replicated rows and a column block of the weight is a column block of the product; a view that keeps
the sharded dim outermost in its group keeps the block; a pointwise op of a block and a tensor broadcast along the
sharded dim is a block. A matmul over a sharded contraction dim is a partial sum (`P`) until a collective
reduces it. Where no rule applies, the output has no layout: the reader then treats it as this rank's own value,
compared across layouts only where the ranks agree (replicated), never guessed.

A plain input (no layout) counts as replicated here; the reader checks that it was (its bytes equal on every rank
of the layout's mesh) before it trusts a layout a rule made (divtrace.align.shards).

In: an op's name and arguments, each tensor argument's local shape and layout. Out: a layout per output (or None).
"""
from __future__ import annotations

from math import prod

import torch
from typing import NamedTuple

from divtrace.trace.memo import bounded_put


class Lay(NamedTuple):
    """A value's layout on this rank: mesh id, placement per mesh dim ("S<d>", "R", "P"), global shape and this
    rank's offsets; where it came from (`src`, `why`)."""

    mesh: int
    placements: tuple
    gshape: tuple
    offsets: tuple
    src: str = "rule"
    why: str | None = None


_SAME = {"_to_copy", "clone", "contiguous", "alias", "detach", "lift_fresh", "lift_fresh_copy", "wait_tensor",
         "_wrap_tensor_autograd", "fill_", "zero_", "copy_", "copy", "native_dropout", "dropout", "relu_", "silu_"}
_VIEWS = {"view", "_unsafe_view", "reshape", "_reshape_alias"}
_SDPA = {"_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
         "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
         "scaled_dot_product_attention", "_scaled_dot_product_attention_math"}
_SOFTMAX = {"_softmax", "softmax", "_log_softmax", "log_softmax"}
_REDUCE = {"mean", "sum", "amax", "amin"}


def _shard_dims(lay: Lay) -> list[int]:
    return [int(p[1:]) for p in lay.placements if p[0] == "S"]


def _pending(lay: Lay | None) -> bool:
    return lay is not None and any(p[0] == "P" for p in lay.placements)


def _sharded_dims(shape, lay: Lay) -> set[int]:
    """Dims whose local size or offset differs from the global value's."""
    return {d for d, (n, g, o) in enumerate(zip(shape, lay.gshape, lay.offsets)) if n != g or o} | set(_shard_dims(lay))


def _with(lay: Lay, gshape, offsets, dim_map: dict | None, why: str) -> Lay | None:
    """`lay` moved to a new shape: its S placements' dims renamed by `dim_map` (None: unchanged)."""
    pl = []
    for p in lay.placements:
        if p[0] == "S" and dim_map is not None:
            d = dim_map.get(int(p[1:]))
            if d is None:
                return None
            pl.append(f"S{d}")
        else:
            pl.append(p)
    return Lay(lay.mesh, tuple(pl), tuple(gshape), tuple(offsets), "rule", why)


def _same_shape(shape, lay: Lay, out_shape, why) -> Lay | None:
    return _with(lay, lay.gshape, lay.offsets, None, why) if tuple(out_shape) == tuple(shape) else None


def _view(shape, lay: Lay, out_shape, size_args, why) -> Lay | None:
    """A reshape of a local block: each group of input dims whose sizes multiply to a group of output dims keeps
    the block only where the sharded dim is the group's outermost (its block is then a contiguous range of the
    group); the output dim that takes it is the one the view's size argument left as -1, else the only one
    that fits."""
    shape, out_shape = list(shape), list(out_shape)
    sharded = _sharded_dims(shape, lay)
    g_out, o_out = list(out_shape), [0] * len(out_shape)
    dim_map: dict[int, int] = {}
    i = j = 0
    while i < len(shape) or j < len(out_shape):
        gi, gj = [i] if i < len(shape) else [], [j] if j < len(out_shape) else []
        pi = shape[i] if i < len(shape) else 1
        pj = out_shape[j] if j < len(out_shape) else 1
        i, j = i + bool(gi), j + bool(gj)
        while pi != pj:
            if pi < pj and i < len(shape):
                gi.append(i)
                pi *= shape[i]
                i += 1
            elif j < len(out_shape):
                gj.append(j)
                pj *= out_shape[j]
                j += 1
            else:
                return None
        hit = [d for d in gi if d in sharded]
        if not hit:
            continue
        if len(hit) > 1 or any(shape[d] != 1 for d in gi[:gi.index(hit[0])]):
            return None
        d = hit[0]
        inner_in = prod(shape[d + 1:gi[-1] + 1])
        fits = []
        for k, e in enumerate(gj):
            inner_out = prod(out_shape[e + 1:gj[-1] + 1])
            if any(out_shape[x] != 1 for x in gj[:k]) or inner_out == 0:
                continue
            if ((lay.offsets[d] * inner_in) % inner_out or (lay.gshape[d] * inner_in) % inner_out
                    or out_shape[e] * inner_out != shape[d] * inner_in):
                continue
            fits.append(e)
        if len(fits) > 1 and size_args is not None:
            minus = [e for e in fits if e < len(size_args) and size_args[e] == -1]
            fits = minus if len(minus) == 1 else fits
        if len(fits) != 1:
            return None
        e = fits[0]
        inner_out = prod(out_shape[e + 1:gj[-1] + 1])
        g_out[e] = lay.gshape[d] * inner_in // inner_out
        o_out[e] = lay.offsets[d] * inner_in // inner_out
        dim_map[d] = e
    for p in lay.placements:
        if p[0] == "S" and int(p[1:]) not in dim_map:
            return None
    return _with(lay, g_out, o_out, dim_map, why)


def _permute(shape, lay: Lay, perm, why) -> Lay | None:
    perm = [p % len(shape) for p in perm]
    inv = {src: dst for dst, src in enumerate(perm)}
    return _with(lay, [lay.gshape[p] for p in perm], [lay.offsets[p] for p in perm], inv, why)


def _pointwise(items, out_shape, why) -> Lay | None:
    """Outputs of a broadcasting op: every input with a layout must agree on it (aligned to the output's dims);
    a plain input must be broadcast (size 1) along every sharded dim."""
    nd = len(out_shape)
    found = None
    for shape, lay in items:
        if lay is None or _pending(lay):
            if lay is not None:
                return None
            continue
        k = nd - len(shape)
        g = [1] * k + list(lay.gshape)
        o = [0] * k + list(lay.offsets)
        cand = _with(lay, [g[x] if out_shape[x] == (list(shape)[x - k] if x >= k else 1) else out_shape[x]
                           for x in range(nd)], o, {d: d + k for d in _shard_dims(lay)}, why)
        if cand is None:
            return None
        if found is None:
            found = cand
        elif (found.mesh, found.placements, found.gshape, found.offsets) != (cand.mesh, cand.placements,
                                                                              cand.gshape, cand.offsets):
            return None
    if found is None:
        return None
    sharded = {d for d in range(nd) if found.gshape[d] != out_shape[d] or found.offsets[d]}
    for shape, lay in items:
        if lay is None:
            k = nd - len(shape)
            if any(d >= k and shape[d - k] != 1 for d in sharded):
                return None
    return found


def _mm(a, b, why) -> Lay | None:
    """mm / addmm's product of a [M, K] and b [K, N]."""
    (sa, la), (sb, lb) = a, b
    if _pending(la) or _pending(lb):
        return None
    da = _sharded_dims(sa, la) if la else set()
    db = _sharded_dims(sb, lb) if lb else set()
    if not da and db == {1}:
        return Lay(lb.mesh, lb.placements, (sa[0], lb.gshape[1]), (0, lb.offsets[1]), "rule", why)
    if da == {0} and not db:
        return Lay(la.mesh, la.placements, (la.gshape[0], sb[1]), (la.offsets[0], 0), "rule", why)
    if da == {1} and db == {0} and la.mesh == lb.mesh and la.offsets[1] == lb.offsets[0] \
            and la.gshape[1] == lb.gshape[0] and len(la.placements) == 1 == len(lb.placements):
        return Lay(la.mesh, ("P",), (sa[0], sb[1]), (0, 0), "rule", why)
    return None


def _reduce_dims(args, nd) -> list[int] | None:
    dims = args[1] if len(args) > 1 else None
    if dims is None:
        return None
    dims = [dims] if isinstance(dims, int) else list(dims)
    return [d % nd for d in dims] if dims else None


_MEMO: dict[tuple, tuple] = {}  # propagate's answers: a function of the op, its scalar arguments, shapes and layouts
_SCALARS = (int, float, bool, str, type(None))


def _args_key(args) -> tuple:
    """The op's arguments with each tensor as None (their shapes and layouts are in `items`)."""
    out = []
    for a in args:
        if type(a) in _SCALARS:
            out.append(a)
        elif type(a) in (list, tuple):
            out.append(tuple(x if type(x) in _SCALARS else None if hasattr(x, "data_ptr") else x for x in a))
        else:
            out.append(None if hasattr(a, "data_ptr") else a)
    return tuple(out)


def propagate(name: str, pointwise: bool, args, items: dict, out_shapes: list) -> list:
    """Layouts of an op's outputs (a list as long as `out_shapes`, None where none follows). `items` maps the
    position of each tensor argument (an int, or (position, k) inside a list) to its (local shape, layout).
    Answers are kept (every layer runs the same ops on the same shapes and layouts)."""
    try:
        key = (name, pointwise, _args_key(args), tuple(items.items()), tuple(out_shapes))
        got = _MEMO.get(key)
    except TypeError:  # (an argument that cannot be a key)
        key = got = None
    if got is not None:
        return list(got)
    got = _propagate(name, pointwise, args, items, out_shapes)
    if key is not None:
        bounded_put(_MEMO, key, tuple(got))
    return got


def _propagate(name: str, pointwise: bool, args, items: dict, out_shapes: list) -> list:
    none = [None] * len(out_shapes)
    lays = [v for v in items.values() if v[1] is not None]
    if not lays or not out_shapes or any("T" in v[1].placements for v in lays):  # (routed rows: no rule carries them)
        return none
    base = name.split(".")[1] if name.count(".") >= 2 else name
    first = items.get(0)
    why = base
    if base in _SAME and first is not None and first[1] is not None:
        return [_same_shape(first[0], first[1], out_shapes[0], why)] + none[1:]
    structural = base in _VIEWS or base in _SOFTMAX or base in _REDUCE or base in (
        "t", "transpose", "permute", "unsqueeze", "expand", "slice", "narrow", "select", "split", "split_with_sizes",
        "chunk", "unbind", "topk")
    if structural and (first is None or first[1] is None):
        return none
    shape, lay = first if first is not None else (None, None)
    if _pending(lay) and base not in _VIEWS:
        return none
    if base in _VIEWS:
        size = args[1] if len(args) > 1 and isinstance(args[1], (list, tuple)) else None
        return [_view(shape, lay, out_shapes[0], size, why)]
    if base in ("t", "transpose", "permute"):
        nd = len(shape)
        if base == "permute":
            perm = list(args[1])
        else:
            d0, d1 = (0, 1) if base == "t" else (args[1] % nd, args[2] % nd)
            perm = list(range(nd))
            perm[d0], perm[d1] = perm[d1], perm[d0]
        return [_permute(shape, lay, perm, why) if nd >= 2 or base != "t" else lay._replace(src="rule", why=why)]
    if base == "unsqueeze":
        d = args[1] % (len(shape) + 1)
        return [_with(lay, lay.gshape[:d] + (1,) + lay.gshape[d:], lay.offsets[:d] + (0,) + lay.offsets[d:],
                      {x: x + (x >= d) for x in _shard_dims(lay)}, why)]
    if base == "expand":
        target = list(out_shapes[0])
        k = len(target) - len(shape)
        sharded = {d + k for d in _sharded_dims(shape, lay)}
        if any(shape[d - k] != target[d] for d in sharded):
            return none
        return [_with(lay, [target[x] if x not in sharded else lay.gshape[x - k] for x in range(len(target))],
                      [0] * k + list(lay.offsets), {d: d + k for d in _shard_dims(lay)}, why)]
    if base in ("slice", "narrow", "select"):
        dim = args[1] % len(shape) if len(args) > 1 else 0
        if dim in _sharded_dims(shape, lay):
            return none
        if base == "select":
            keep = [x for x in range(len(shape)) if x != dim]
            return [_with(lay, [lay.gshape[x] for x in keep], [lay.offsets[x] for x in keep],
                          {x: keep.index(x) for x in _shard_dims(lay)}, why)]
        out = list(out_shapes[0])
        return [_with(lay, [out[x] if x == dim else lay.gshape[x] for x in range(len(shape))],
                      [0 if x == dim else lay.offsets[x] for x in range(len(shape))], None, why)]
    if base in ("split", "split_with_sizes", "chunk", "unbind"):
        dim = (args[2] if len(args) > 2 else 0) if base != "unbind" else (args[1] if len(args) > 1 else 0)
        dim %= len(shape)
        if dim in _sharded_dims(shape, lay):
            return none
        out = []
        for s in out_shapes:
            if base == "unbind":
                keep = [x for x in range(len(shape)) if x != dim]
                out.append(_with(lay, [lay.gshape[x] for x in keep], [lay.offsets[x] for x in keep],
                                 {x: keep.index(x) for x in _shard_dims(lay)}, why))
            else:
                out.append(_with(lay, [s[x] if x == dim else lay.gshape[x] for x in range(len(shape))],
                                 [0 if x == dim else lay.offsets[x] for x in range(len(shape))], None, why))
        return out
    if base == "cat":
        parts = [items[k] for k in sorted(k for k in items if isinstance(k, tuple) and k[0] == 0)]
        parts = [p for p in parts if tuple(p[0]) != (0,)]  # (cat skips empty 1-D tensors: a cache's first step)
        dim = (args[1] if len(args) > 1 else 0)
        if not parts or any(p[1] is None or _pending(p[1]) for p in parts):
            return none
        shape0, lay0 = parts[0]
        dim %= len(shape0)
        if any(dim in _sharded_dims(s, l) for s, l in parts):
            return none
        keys = {(l.mesh, l.placements, tuple(g for x, g in enumerate(l.gshape) if x != dim),
                 tuple(o for x, o in enumerate(l.offsets) if x != dim)) for _, l in parts}
        if len(keys) != 1:
            return none
        out = list(out_shapes[0])
        return [_with(lay0, [out[x] if x == dim else lay0.gshape[x] for x in range(len(out))],
                      [0 if x == dim else lay0.offsets[x] for x in range(len(out))], None, why)]
    if base in _SOFTMAX:
        dim = args[1] % len(shape)
        return [None if dim in _sharded_dims(shape, lay) else _same_shape(shape, lay, out_shapes[0], why)]
    if base == "topk":  # values and indices: the block kept where the top-k runs along another dim
        dim = (args[2] if len(args) > 2 else -1) % len(shape)
        if dim in _sharded_dims(shape, lay):
            return none
        out = list(out_shapes[0])
        return [_with(lay, [out[x] if x == dim else lay.gshape[x] for x in range(len(shape))],
                      [0 if x == dim else lay.offsets[x] for x in range(len(shape))], None, why)] * 2
    if base in _REDUCE:
        dims = _reduce_dims(args, len(shape))
        if dims is None or set(dims) & _sharded_dims(shape, lay):
            return none
        keep = len(out_shapes[0]) == len(shape)
        kept = list(range(len(shape))) if keep else [x for x in range(len(shape)) if x not in dims]
        return [_with(lay, [1 if (keep and x in dims) else lay.gshape[x] for x in kept],
                      [0 if (keep and x in dims) else lay.offsets[x] for x in kept],
                      {x: kept.index(x) for x in _shard_dims(lay)}, why)]
    if base in ("mm", "addmm"):
        pos = (0, 1) if base == "mm" else (1, 2)
        a, b = items.get(pos[0]), items.get(pos[1])
        if a is None or b is None or (base == "addmm" and items.get(0, (None, None))[1] is not None
                                      and not _pending(items[0][1]) and _mm(a, b, why) is not None
                                      and _mm(a, b, why).placements == ("P",)):
            return none
        return [_mm(a, b, why)]
    if base == "bmm":
        a, b = items.get(0), items.get(1)
        if a is None or b is None:
            return none
        (sa, la), (sb, lb) = a, b
        da = _sharded_dims(sa, la) if la else set()
        db = _sharded_dims(sb, lb) if lb else set()
        if da == db == {0} and la.offsets[0] == lb.offsets[0] and la.mesh == lb.mesh:
            return [Lay(la.mesh, la.placements, (la.gshape[0], sa[1], sb[2]), (la.offsets[0], 0, 0), "rule", why)]
        return none
    if base in _SDPA:
        q, k, v = items.get(0), items.get(1), items.get(2)
        if q is None or k is None or v is None or any(x[1] is None or _pending(x[1]) for x in (q, k, v)):
            return none
        if any(_sharded_dims(s, l) != {1} for s, l in (q, k, v)):
            return none
        sq, lq = q
        out = []
        for s in out_shapes:
            if len(s) >= 2 and s[0] == sq[0] and s[1] == sq[1]:
                out.append(Lay(lq.mesh, lq.placements, (s[0], lq.gshape[1]) + tuple(s[2:]),
                               (0, lq.offsets[1]) + (0,) * (len(s) - 2), "rule", why))
            else:
                out.append(None)
        return out
    if pointwise:
        tensors = [v for v in items.values()]
        return [_pointwise(tensors, out_shapes[0], why)] + none[1:]
    return none


def margin_layout(shape, lay: Lay | None, dim: int) -> Lay | None:
    """The layout of a top-k's margin (divtrace.record.topk_margin: one element per row, `dim` reduced away) whose
    scores of local `shape` have layout `lay`: the scores' block or replica with `dim` removed; None where `dim`
    is sharded or the scores have no layout (or a pending sum)."""
    if lay is None:
        return None
    got = propagate("aten.amax.default", False, [None, [dim]], {0: (tuple(shape), lay)},
                    [tuple(n for d, n in enumerate(shape) if d != dim % len(shape))])[0]
    return None if got is None else got._replace(why="topk_margin")


# (op, its arguments with each tensor marked, each tensor argument's (local shape, layout), output shapes) ->
# the rules' layouts of its outputs (or None: no rule input); every layer runs the same ops on the same layouts
_RULED: dict[tuple, tuple | None] = {}
_TENSOR = ("tensor",)  # a tensor's place in ruled_layouts' key


def ruled_layouts(func, name: str, args, ins: tuple, tensors_in, plain_in, vids_in, by_vid, plain_out) -> tuple | None:
    """`propagate`'s layouts for an op's outputs (record/placements.Placements.op_outputs), or None where no tensor
    argument has a layout; `ins`: each tensor argument's (local shape, layout or None), in `tensors_in`'s order.
    Kept per key: the arguments with tensors marked, in order, and `ins` fix `_arg_items`'s answer (each tensor
    argument's position, shape and layout), so it is built on a miss only."""
    try:
        key = (func, _marked(args), ins, tuple(p.shape for p in plain_out))
        got = _RULED.get(key, False)
    except TypeError:  # (an argument that cannot be a key)
        key, got = None, False
    if got is not False:
        return got
    items = _arg_items(args, tensors_in, plain_in, vids_in, by_vid)
    if items is not None:
        pointwise = torch.Tag.pointwise in getattr(func, "tags", ())
        got = tuple(propagate(name, pointwise, args, items, [tuple(p.shape) for p in plain_out]))
    else:
        got = None
    if key is not None:
        bounded_put(_RULED, key, got)
    return got


def _marked(args) -> tuple:
    """`args` with each tensor as `_TENSOR` (lists and tuples one level down too: `_arg_items` looks no deeper, and
    a deeper list raises TypeError, so the op is not kept); the rest as it is."""
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append(_TENSOR)
        elif type(a) in (list, tuple):
            out.append(tuple(_TENSOR if isinstance(x, torch.Tensor) else _flat(x) for x in a))
        else:
            out.append(a)
    return tuple(out)


def _flat(x):
    if isinstance(x, (list, tuple, dict)):
        raise TypeError("nested")
    return x


def _arg_items(args, tensors_in, plain_in, vids_in, by_vid) -> dict | None:
    """Position of each tensor argument (int, or (position, k) in a list) -> (local shape, layout or None)."""
    of, laid = {}, False
    for t, p, v in zip(tensors_in, plain_in, vids_in):
        lay = by_vid.get(v)
        laid = laid or lay is not None
        of[id(t)] = (tuple(p.shape), lay)
    if not laid:
        return None
    items = {}
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            e = of.get(id(a))
            if e is not None:
                items[i] = e
        elif isinstance(a, (list, tuple)):
            for k, x in enumerate(a):
                if isinstance(x, torch.Tensor):
                    e = of.get(id(x))
                    if e is not None:
                        items[(i, k)] = e
    if not any(v[1] is not None for v in items.values()):
        return None
    return items
