"""How the token bisect names tokens, origins and absorbed differences in its result (bisect --json's `first`,
`origins`, `absorbed`, `final.first_differing_token`).

In: the two traces' tokens and what the token bisect found (token_origins, token_sweep). Out: JSON-ready dicts.
"""
from __future__ import annotations

from divtrace.align.tokens import TraceTokens
from divtrace.compare.op_kinds import VALUE_PRESERVING
from divtrace.compare.results import Divergence
from divtrace.trace import token_layout as layout


def token_desc(tok: TraceTokens, cid: int, cell: int) -> dict:
    g = tok.index.grids[cid]
    s = g.seq[cell]
    key = g.keys[cell]
    return {"position": g.pos[cell], "id": g.ids[cell],
            "seq": {"id": f"{key:016x}"[:8], "number": s, "first_ids": tok.index.first_ids.get(s, [])}}


def where(tok: TraceTokens, cid: int, cell: int) -> dict:
    g = tok.index.grids[cid]
    out = {"call": g.root_call, "row": cell}
    if len(g.shape) == 2:
        out["batch_row"], out["col"] = divmod(cell, g.shape[1])
    rank = _own_rank(tok.trace, cid)
    if rank is not None:
        out["rank"], out["rank_call"] = rank
    return out


def _own_rank(view, cid: int) -> tuple[int, int] | None:
    """(rank, its own root call number) where a run view's root call `cid` is one rank's alone (data parallel,
    FSDP: each rank holds its own sequences, and the view's root calls are the ranks' one after the other); None for
    a one-process trace and for a group whose ranks all hold the token (tensor parallel)."""
    segments = getattr(view, "segments", None)
    if not segments or len(segments) < 2:
        return None
    seg = next((s for s in segments if s.cbase <= cid < s.cend), None)
    if seg is None or len(seg.group.ranks) != 1:
        return None
    before = sum(1 for c in seg.trace.calls.values() if c.module == "" and c.call_id + seg.cbase < cid)
    return seg.rank, before


def token_of(sa: TraceTokens, sb: TraceTokens, key: int) -> dict:
    (ra, ca), (rb, cb) = sa.where[key], sb.where[key]
    return {**token_desc(sa, ra, ca), "a": where(sa, ra, ca), "b": where(sb, rb, cb)}


def origin_extra(sa, sb, d: Divergence, ra, ca, rb, cb, uncompared: list) -> dict:
    """`token`, `rows` and, where proven, `batch_invariance` of an origin found for one token."""
    out = {"token": {**token_desc(sa, ra, ca), "a": where(sa, ra, ca), "b": where(sb, rb, cb)}}
    rows = {"a": None, "b": None}
    for side, tok, root, idx in (("a", sa, ra, d.index if d.kind == "op" else None),
                                 ("b", sb, rb, d.index_b if d.kind == "op" else None)):
        if idx is None:
            continue
        outs = tok.trace.rout[idx] if idx < len(tok.trace.rout) else None
        if not outs:
            continue
        e = tok.index.index.get(outs[0])
        if e is not None and e[0] == root:
            rows[side] = layout.row_count(e[1], tok.index.grids[root].shape) if e[2] >= 0 else None
    out["rows"] = rows
    out["inputs_compared"] = "all" if not uncompared else uncompared
    # Only where both sides part at the same op and run the same computing ops (another op, or another algorithm:
    # split-K's slice, mm, mm, add against one mm, is another computation whatever the batch sizes), and only when
    # every input of the op was compared for the token: then its output row differs from equal inputs.
    if d.cause == "origin" and d.op is not None and d.op == d.op_b and rows["a"] and rows["b"] and \
            rows["a"] != rows["b"] and computing_ops(d.region_a) == computing_ops(d.region_b):
        op = d.op
        if uncompared:
            out["batch_invariance"] = {
                "batch_invariant": None, "rows": rows,
                "note": f"{op} ran over {rows['a']} rows on a and {rows['b']} on b; batch invariance is not judged: "
                        f"{'; '.join(uncompared[:2])} was not compared for the token"}
        else:
            out["batch_invariance"] = {
                "batch_invariant": False, "rows": rows,
                "note": f"{op} ran over {rows['a']} rows on a and {rows['b']} on b: every input row of the token is "
                        "equal and its output row differs, so the kernel's result depends on the batch size (not "
                        "batch-invariant)"}
    return out


def computing_ops(region: list[tuple[int, str]]) -> list[str]:
    """A region's op names without the ops that only rearrange values (views, slices); casts are kept."""
    keep = {"_to_copy", "copy_", "copy"}
    return [op for _, op in region if (op.split(".") + [""])[1] not in VALUE_PRESERVING - keep]


def absorbed_list(absorbed: dict, final_differ: set) -> list[dict]:
    """The sweep's absorbed differences as `absorbed` entries, most tokens first: where the difference sits, how
    many tokens it is absorbed for, and how many of those still have a differing final value for another
    reason."""
    out = []
    for (label, kind, op_a, op_b), keys in absorbed.items():
        module, _, call = label.partition(" #")
        note = {"op": "the op's output row differs, the module's output row is equal",
                "inputs": "the call's input rows differ (as one side fuses or splits them), its output rows are equal",
                "module": "the call's output rows differ, its parent's output rows are equal",
                "unkept": ("the call's output rows differ, its root call's output holds no row of these tokens "
                           "(logits_to_keep): their own final values are not compared")}[kind]
        out.append({"module": module, "call": int(call) if call else 0, "kind": "module" if kind == "unkept" else kind,
                    "op": op_a, "op_b": op_b,
                    "tokens": len(keys), "tokens_final_differs": len(keys & final_differ), "note": note})
    out.sort(key=lambda e: (-e["tokens"], e["module"], e["op"] or ""))
    return out
