"""What a divergence between runs of different layouts is, in the user's words (docs/sharded.md).

Where one side is a sharded run (divtrace.align.shards.view.RunView), the origin's op region says how each side
computed the value: "o_proj: 2 partial matmuls summed by all_reduce on a, one matmul over K=1024 on b"; a value
whose blocks were computed on separate ranks says so, and, where the bytes are stored, in which rank's block the
first difference lies. A value whose replicas differ is named as such.

In: a Divergence and the two traces (or run views). Out: `Divergence.shards` ({"a", "b", "why", ...}) and the
run's replica findings as warnings.
"""
from __future__ import annotations

_MATMULS = {"mm", "addmm", "bmm", "linear", "matmul"}


def _base(op: str | None) -> str:
    parts = (op or "").split(".")
    return parts[1] if len(parts) >= 3 else (op or "")


def _plan(t, vid):
    plan_of = getattr(t, "plan_of", None)
    if plan_of is None or vid is None:
        return None
    try:
        return plan_of(vid)[2]
    except KeyError:
        return None


def _contraction(t, i: int) -> int | None:
    """K of a matmul record: the size of the dim it sums over."""
    ins = t.rin[i]
    name = _base(t.rop[i])
    try:
        if name == "mm":
            return t.vkey[ins[0]][1][-1]
        if name == "addmm":
            return t.vkey[ins[1]][1][-1]
        if name in ("bmm", "matmul", "linear"):
            return t.vkey[ins[0]][1][-1]
    except (IndexError, KeyError, TypeError):
        return None
    return None


def _side_text(t, region: list, vid) -> str:
    """How one side computed the parting region."""
    base = getattr(t, "trace", t)
    ops = [(i, _base(op)) for i, op in region]
    mm = [(i, n) for i, n in ops if n in _MATMULS]
    colls = [(i, base.run.layouts[base.segment_of_index(i).rank].collectives.get(i - base.segment_of_index(i).ibase))
             for i, n in ops] if hasattr(base, "run") else []
    colls = [(i, c) for i, c in colls if c is not None]
    if mm and hasattr(base, "run"):
        vp = _plan(base, base.rout[mm[0][0]][0]) if base.rout[mm[0][0]] else None
        if vp is not None and vp.layout is not None and vp.layout[0] and vp.layout[0][0].startswith("P"):
            n = len(vp.layout[1])
            red = colls[0][1].kind if colls else "a reduction"
            return f"{n} partial matmuls summed by {red}"
        if vp is not None and vp.kind == "blocks":
            return f"{len(vp.blocks)} matmuls, one per block of the output ({'/'.join(vp.layout[0])})"
    if mm:
        k = _contraction(base, mm[0][0])
        return f"one matmul over K={k}" if k is not None else "one matmul"
    if colls:
        # a reduction of partial sums a submodule made (Megatron's RowParallelLinear: fc2, then all_reduce)
        ins = base.rin[colls[0][0]] or ()
        j = _matmul_behind(base, ins[0]) if ins and hasattr(base, "run") else None
        vp = _plan(base, ins[0]) if j is not None else None
        if not _partial(vp):
            vp = _plan(base, base.rout[j][0]) if j is not None and base.rout[j] else None
        if _partial(vp):
            return f"{len(vp.layout[1])} partial matmuls{_in_module(base, j)} summed by {colls[0][1].kind}"
        return f"{colls[0][1].kind} over {len(colls)} collective(s)"
    if not ops:  # the value is a submodule's output: the matmul that made it, if one did
        j = _matmul_behind(base, vid)
        if j is not None:
            k = _contraction(base, j)
            return (f"one matmul over K={k}" if k is not None else "one matmul") + _in_module(base, j)
    text = ", ".join(n for _, n in ops[:4]) or "no op (the value came from outside)"
    vp = _plan(base, vid) if hasattr(base, "run") else None
    if vp is not None and vp.kind == "blocks" and vp.layout is not None:
        dims = sorted({int(p[1:]) for p in vp.layout[0] if p.startswith("S")})
        text += f" on {len(vp.blocks)} blocks of dim {', '.join(map(str, dims))}, one per rank"
    return text


def _partial(vp) -> bool:
    """Whether a value's plan is a partial sum (its first mesh dim's placement `P`)."""
    return vp is not None and vp.layout is not None and bool(vp.layout[0]) and vp.layout[0][0].startswith("P")


_PASS = {"view", "_unsafe_view", "reshape", "_reshape_alias", "clone", "contiguous", "alias", "detach"}


def _matmul_behind(t, vid, steps: int = 4) -> int | None:
    """The record index of the matmul that made value `vid`, through up to `steps` views and copies; None if none."""
    for _ in range(steps):
        i = t.vprod.get(vid) if vid is not None else None
        if i is None:
            return None
        name = _base(t.rop[i])
        if name in _MATMULS:
            return i
        if name not in _PASS or not t.rin[i]:
            return None
        vid = t.rin[i][0]
    return None


def _in_module(t, i: int) -> str:
    """" (in fc2)": the leaf name of the module whose call holds record `i`, where the trace says."""
    try:
        path = t.calls[t.rcall[i]].module
    except (KeyError, IndexError, TypeError, AttributeError):
        return ""
    return f" (in {path.rsplit('.', 1)[-1]})" if path else ""


def _block_of(t, vid, diff) -> str | None:
    """In which rank's block the first difference lies (full mode: the first differing element's index)."""
    vp = _plan(getattr(t, "trace", t), vid)
    if vp is None or vp.kind != "blocks" or diff is None:
        return None
    first = getattr(diff, "first_index", None)
    if first is None:
        return None
    idx = list(first) if isinstance(first, (list, tuple)) else None
    if idx is None or len(idx) != len(vp.gshape):
        return None
    base = getattr(t, "trace", t)
    for rank, q, off in vp.blocks:
        shape = base.run.traces[rank].vkey[q][1]
        if all(o <= x < o + n for x, o, n in zip(idx, off, shape)):
            cut = [f"dim {d}: {o}..{o + n - 1}" for d, (o, n, g) in enumerate(zip(off, shape, vp.gshape)) if n != g]
            return f"rank {rank}'s block ({', '.join(cut)})"
    return None


def describe(d, ta, tb) -> dict | None:
    """`Divergence.shards` for a divergence where a side is a sharded run, else None."""
    sharded = [getattr(getattr(t, "trace", t), "run", None) is not None for t in (ta, tb)]
    if not any(sharded):
        return None
    out = {}
    parts = (d.module or "<root>").split(".")
    module = ".".join(parts[-2:]) if parts[-1].isdigit() else parts[-1]  # (a layer's index says little alone)
    for side, t, region, vid in (("a", ta, d.region_a, d.vid_a), ("b", tb, d.region_b, d.vid_b)):
        out[side] = _side_text(t, region, vid)
        vp = _plan(getattr(t, "trace", t), vid)
        if vp is not None and vp.note:
            out[f"note_{side}"] = vp.note
        block = _block_of(t, vid, d.diff)
        if block:
            out[f"block_{side}"] = block
    out["why"] = f"{module}: {out['a']} on a, {out['b']} on b"
    return out


def replica_warnings(ta, tb) -> list[str]:
    out = []
    for side, t in (("a", ta), ("b", tb)):
        for f in getattr(getattr(t, "trace", t), "findings", []) or []:
            out.append(f"{side} ({t.path}): {f}")
    return out


def annotate(result, ta, tb) -> None:
    """Fill `shards` on the result's divergences and add the replica findings to its warnings."""
    divs = getattr(result, "origin_divs", None) or []
    for d in [result.first, *getattr(result, "next", []), *divs]:
        if d is not None and getattr(d, "shards", None) is None:
            d.shards = describe(d, ta, tb)
    # A token-aligned result's origins are dicts made before this; `first` is one of them, so both say the same.
    for o, d in zip(getattr(result, "origins", None) or [], divs):
        if d is not None and isinstance(o, dict):
            o["shards"] = d.shards
    result.warnings.extend(w for w in replica_warnings(ta, tb) if w not in result.warnings)
