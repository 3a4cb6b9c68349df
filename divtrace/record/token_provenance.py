"""The token layout of a value whose shape fits two layouts (divtrace.trace.token_layout: AMBIGUOUS, [B, H, T, d]
with H == T), told from the op that made it and its inputs' layouts.

A prefill of B prompts of T tokens on a model with H == T heads (4 prompts of 4 tokens, 4 heads) gives every
heads tensor the shape [T, T, T, d]: by shape alone [B, T, H, d] and [B, H, T, d] cannot be told apart, so those
values had no token rows and the ops between the projections and the attention output could not be compared per
token. A bisect then had only the region's ends and named its first computing op (the rotary multiply) for what
the attention kernel did. The op says which it is: a view of a [B, T, H*d] value keeps B and T first, a transpose
of dims 1 and 2 swaps the two layouts, an elementwise op or a slice or cat along the last dim keeps its inputs'
layout, attention's output has its query's. Only these ops, and only where the inputs agree; else the value stays
ambiguous (compared whole), as before.

In: the op's name, its encoded arguments ({"$v": vid} for tensors), the input values' shapes, the layouts of the
root call's values so far. Out: "bt", "bht" or None.
"""
from __future__ import annotations

_KNOWN = ("bt", "bht")
_VIEWS = {"view", "_unsafe_view", "reshape", "_reshape_alias", "clone", "contiguous", "alias", "detach", "_to_copy",
          "lift_fresh"}
_POINTWISE: dict[str, bool] = {}  # op name -> whether torch tags it pointwise


def _pointwise(op: str) -> bool:
    got = _POINTWISE.get(op)
    if got is None:
        try:
            import torch

            ns, name, overload = op.split(".")
            f = getattr(getattr(getattr(torch.ops, ns), name), overload)
            got = torch.Tag.pointwise in f.tags
        except Exception:  # (not an op torch names so)
            got = False
        _POINTWISE[op] = got
    return got


def _vid(a) -> int | None:
    return a.get("$v") if isinstance(a, dict) else None


def _int(a) -> int | None:
    return a if type(a) is int else None


def layout_from_op(op: str, args, shapes: dict, code_of, shape) -> str | None:
    """The layout ("bt" or "bht") of a value of `shape` that op `op` made from `args` (encoded), given `shapes`
    (input vid -> shape) and `code_of(vid)` (an input's layout, or None); None where the op does not say."""
    parts = op.split(".")
    short = parts[1] if len(parts) == 3 else op
    nd = len(shape)
    args = list(args or ())
    if nd < 3 or not args:
        return None
    first = _vid(args[0])
    c = code_of(first) if first is not None else None
    src = shapes.get(first) if first is not None else None
    if short == "transpose" and len(args) >= 3 and _int(args[1]) is not None and _int(args[2]) is not None:
        if c in _KNOWN and src is not None and len(src) == nd and {args[1] % nd, args[2] % nd} == {1, 2}:
            return "bht" if c == "bt" else "bt"
        return None
    if short in _VIEWS:
        if c == "bt" and src is not None and tuple(src[:2]) == tuple(shape[:2]):
            return "bt"
        if c == "bht" and src is not None and len(src) >= 3 and tuple(src[:3]) == tuple(shape[:3]):
            return "bht"
        return None
    if "scaled_dot_product" in short:  # (its first output: the query's shape)
        return c if c in _KNOWN and src is not None and tuple(src) == tuple(shape) else None
    if short in ("slice", "narrow"):
        dim = _int(args[1]) if len(args) > 1 else None
        if (c in _KNOWN and dim is not None and dim % nd == nd - 1 and src is not None and len(src) == nd
                and tuple(src[:-1]) == tuple(shape[:-1])):
            return c
        return None
    if short == "cat" and isinstance(args[0], list):
        dim = _int(args[1]) if len(args) > 1 else 0
        vids = [_vid(x) for x in args[0]]
        if dim is None or dim % nd != nd - 1 or None in vids:
            return None
        codes = {code_of(v) for v in vids}
        ok = all(shapes.get(v) is not None and len(shapes[v]) == nd and tuple(shapes[v][:-1]) == tuple(shape[:-1])
                 for v in vids)
        return codes.pop() if ok and len(codes) == 1 and next(iter(codes)) in _KNOWN else None
    if _pointwise(op):  # the inputs of the output's own shape: their layout, where they agree
        codes = {code_of(v) for a in args if (v := _vid(a)) is not None and tuple(shapes.get(v) or ()) == tuple(shape)}
        codes.discard(None)
        return codes.pop() if len(codes) == 1 and next(iter(codes)) in _KNOWN else None
    return None
