"""What a divergence between runs of different layouts is, in the user's words (docs/sharded.md).

Where one side is a sharded run (divtrace.align.shards.view.RunView), the origin's op region says how each side
computed the value: "o_proj: 2 partial matmuls summed by all_reduce on a, one matmul over K=1024 on b"; a value
whose blocks were computed on separate ranks says so, and, where the bytes are stored, in which rank's block the
first difference lies. A value whose replicas differ is named as such. A partial sum that differs names the ranks
whose partials differ, each with its own count (divtrace.compare.shard_pieces).

In: a Divergence and the two traces (or run views). Out: `Divergence.shards` ({"a", "b", "why", ...}) and the
run's replica findings as warnings.
"""
from __future__ import annotations

from divtrace.compare.shard_pieces import describe as partial_pieces, plan_of_value as _plan

_MATMULS = {"mm", "addmm", "bmm", "linear", "matmul"}


def _base(op: str | None) -> str:
    parts = (op or "").split(".")
    return parts[1] if len(parts) >= 3 else (op or "")


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
    if idx is None or not idx or len(idx) > len(vp.gshape):
        return None
    base = getattr(t, "trace", t)
    if len(idx) < len(vp.gshape):  # a token's row (token alignment): its index in the value's trailing dims, only
        # where those are the row's shape and the blocks are cut along them alone
        lead = len(vp.gshape) - len(idx)
        if list(getattr(diff, "shape_a", None) or ()) != list(vp.gshape[lead:]) or vp.routed:
            return None
        if any(base.run.traces[r].vkey[q][1][:lead] != tuple(vp.gshape[:lead]) for r, q, _ in vp.blocks):
            return None
        idx = [0] * lead + idx
    if vp.routed:  # routed rows: the first differing element's row is a (token, slot)
        for rank, q, rows in vp.blocks:
            if idx[0] in rows:
                k = base.run.layouts[rank].values[q].top_k
                return f"rank {rank}'s routed row (token {idx[0] // k}, slot {idx[0] % k})"
        return None
    for rank, q, off in vp.blocks:
        shape = base.run.traces[rank].vkey[q][1]
        if all(o <= x < o + n for x, o, n in zip(idx, off, shape)):
            cut = [f"dim {d}: {o}..{o + n - 1}" for d, (o, n, g) in enumerate(zip(off, shape, vp.gshape)) if n != g]
            return f"rank {rank}'s block ({', '.join(cut)})"
    return None


def row_table(t, vid) -> dict | None:
    """Whole rows of a run's value whose layouts carry their fingerprints (routed rows `T`; a declared block of
    dim 0): global row -> (row fingerprint, rank, expert or None, top-k or None); None for other values."""
    base = getattr(t, "trace", t)
    vp = _plan(base, vid)
    if vp is None or vp.kind != "blocks":
        return None
    out = {}
    for rank, q, where in vp.blocks:
        lay = base.run.layouts[rank].values.get(q)
        if lay is None or lay.row_hashes is None:
            return None
        rows = where if vp.routed else range(where[0], where[0] + len(lay.row_hashes))
        for i, (g, h) in enumerate(zip(rows, lay.row_hashes)):
            r = lay.routing[i] if lay.routing is not None else ()
            out[g] = (h, rank, r[2] if len(r) > 2 else None, lay.top_k)
    return out


def _differing_rows(ta, tb, vid_a, vid_b) -> list | None:
    """Where both sides' values carry row fingerprints (hash mode too): the rows that differ. Routed rows: each
    (token, slot) with the expert and rank that computed it on each side; a block of dim 0: each token (row)."""
    a, b = row_table(ta, vid_a), row_table(tb, vid_b)
    if a is None or b is None or a.keys() != b.keys():
        return None
    out = []
    for g in sorted(a):
        if a[g][0] != b[g][0]:
            k = a[g][3]
            if k is None:
                out.append({"token": g, "rank_a": a[g][1], "rank_b": b[g][1]})
            else:
                out.append({"token": g // k, "slot": g % k, "expert_a": a[g][2], "rank_a": a[g][1],
                            "expert_b": b[g][2], "rank_b": b[g][1]})
    return out


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
    rows = _differing_rows(ta, tb, d.vid_a, d.vid_b)
    if rows is not None:
        out["rows"] = rows
    out.update(partial_pieces(ta, tb, d))  # a partial sum (or the ranks' own pieces): which rank's differs, by how much
    out["why"] = f"{module}: {out['a']} on a, {out['b']} on b"
    if rows and "slot" in rows[0]:  # routed rows: which (token, slot) rows, computed where
        out["why"] = _routed_why(module, rows, [_rank_count(t, v) for t, v in ((ta, d.vid_a), (tb, d.vid_b))])
        from divtrace.compare.shard_ops import op_words, routed_op

        out["op"], note = routed_op(d, ta, tb, rows)  # the op, on the rank that computed the first differing row
        out["why"] += f"; {op_words(out['op'])}" if out["op"] else f"; the op is not named: {note}"
        if note:
            out["op_note"] = note
    elif _sums_equal_routed_rows(d, ta, tb) and rows:
        tokens = [x["token"] for x in rows]
        out["why"] = (f"{module}: combines routed rows that are equal on a and b, and its output differs at tokens "
                      f"{_few(tokens)}: the order in which a token's slots are summed, or the sum's kernel, differs "
                      f"(a: {out['a']}; b: {out['b']})")
        from divtrace.compare.shard_ops import combine_orders, combine_words

        out["combine"], note = combine_orders(d, ta, tb)  # full mode: the order that reproduces each side's sums
        if out["combine"]:
            out["why"] = combine_words(module, out["combine"], tokens, _few)
        else:
            out["combine_note"] = note
    return out


def _rank_count(t, vid) -> int:
    return len({r for r, _, _ in _plan(getattr(t, "trace", t), vid).blocks})


def _routed_why(module: str, rows: list, ranks: list) -> str:
    """Routed rows that differ, in words: the first few (token, slot) rows and the expert and rank of a that
    computed each."""
    def where(x):
        e = x["expert_a"]
        return f"{'' if e is None else f'expert {e} '}on rank {x['rank_a']} of a"

    listed = ", ".join(f"(token {x['token']}, slot {x['slot']}: {where(x)})" for x in rows[:4])
    more = f", ... ({len(rows)} in all)" if len(rows) > 4 else ""
    return (f"{module}: routed rows computed on {ranks[0]} ranks on a, {ranks[1]} on b; the rows that differ: "
            f"{listed}{more}")


def _few(xs: list) -> str:
    return str(xs) if len(xs) <= 8 else f"[{', '.join(map(str, xs[:8]))}, ... ({len(xs)} in all)]"


def _sums_equal_routed_rows(d, ta, tb) -> bool:
    """Whether the origin call reads routed rows (`T`) that are equal on both sides (a combine: the weighted sum of
    each token's expert outputs), while its output is not routed rows."""
    found = []
    for t, module in ((ta, d.module), (tb, d.module_b or d.module)):
        base = getattr(t, "trace", t)
        call = next((c for c in base.calls.values() if c.module == module and c.call == d.call), None)
        if call is None:
            return False
        routed = [v for _, v in call.inputs if getattr(_plan(base, v), "routed", False)]
        if not routed:
            return False
        found.append(base.vkey[routed[0]])
    return found[0] == found[1]


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
