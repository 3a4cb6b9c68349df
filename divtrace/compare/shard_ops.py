"""Inside an expert-parallel origin (docs/sharded.md "Routed rows"): the op, on the rank where it ran, that made the
first differing routed row; and a combine's order of summing each token's slots. Only what the records prove.

- `routed_op`: the first differing (token, slot) row was computed on rank R of a and R' of b (the routing says).
  On each of those ranks the module's call is followed row by row (divtrace.align.shards.rowmap): the ops that
  computed the row, in execution order. Where both sides ran the same op sequence on it, the first op pair whose
  output differs at that row is the op: compared by the row's bytes (full mode) or, in hash mode, by whole values
  where both sides' outputs hold the same rows in the same order (else nothing is claimed, and why is said).
- `combine_orders`: full mode. Each token's combine is recomputed from the recorded routed rows and routing weights
  (the combine's own inputs, on each rank), summed slot after slot in the recorded dtype, in candidate orders
  (routing order, rank order, expert order, reversed routing order). An order is named for a side only when it
  reproduces that side's recorded output bit for bit at every token; both are named only when they differ and the
  routing weights are equal on both sides.

In: a Divergence and the two run views (divtrace.align.shards.view). Out: dicts for `Divergence.shards`.
"""
from __future__ import annotations

from divtrace.align.shards.rowmap import call_on_rank, chain, routed_inputs, row_maps


def _base(t):
    return getattr(t, "trace", t)


def _listing(ch: list, n: int = 8) -> str:
    s = ", ".join(f"{op.split('.')[1] if op.count('.') >= 2 else op} #{i}" for i, op, _ in ch[:n])
    return s + (f", ... ({len(ch)} ops)" if len(ch) > n else "")


class _Side:
    """One side's rank that computed the row: its trace, the module's call there and the rows its values hold."""

    def __init__(self, view, rank: int, module: str, call_no: int, g: int):
        self.rank = rank
        self.t = view.run.traces[rank]
        self.call = call_on_rank(self.t, module, call_no)
        self.seeds = routed_inputs(view.run, rank, self.call) if self.call is not None else {}
        self.rows = row_maps(self.t, self.call, self.seeds) if self.seeds else {}
        self.chain = chain(self.t, self.call, self.rows, g) if self.seeds else []

    def row(self, v: int, pos: int):
        return self.t.tensor(v)[pos]

    def producer(self, v: int):
        """(place in the chain, or -1 for a routed input of the call), or None where the value holds no rows."""
        if v in self.seeds:
            return -1
        return next((j for j, (_, _, held) in enumerate(self.chain) if any(u == v for u, _ in held)), None)


def _bits_equal(x, y) -> bool:
    from divtrace.compare.metrics import bitwise_equal  # (torch: full mode only; a hash bisect never gets here)

    return bitwise_equal(x, y)


def _same(a: _Side, va: int, pa: int, b: _Side, vb: int, pb: int):
    """Whether the row is equal in a's value va (at row pa) and b's vb (at pb): True/False, or None (not proven).
    Returns (verdict, how)."""
    if a.t.has_bytes(va) and b.t.has_bytes(vb):
        return _bits_equal(a.row(va, pa), b.row(vb, pb)), "row"
    if a.rows[va] == b.rows[vb] and tuple(a.t.vkey[va][1]) == tuple(b.t.vkey[vb][1]):
        eq = a.t.vkey[va] == b.t.vkey[vb]
        if not eq and (va in a.t.vderived or vb in b.t.vderived):
            return None, None  # (a view's fingerprint made from its op: unequal ones do not prove other bytes)
        return eq, "value"
    return None, None


def routed_op(d, ta, tb, rows: list) -> tuple[dict | None, str | None]:
    """(`shards.op`, None) for the op that made the first differing routed row, or (None, why it is not named)."""
    va, vb = _base(ta), _base(tb)
    if any(getattr(v, "run", None) is None or len(v.groups) != 1 for v in (va, vb)):
        return None, "a side is not one group of ranks"
    x = rows[0]
    k = _top_k(va, d.vid_a)
    if k is None:
        return None, "the routed rows' top-k is unknown"
    g = x["token"] * k + x["slot"]
    a = _Side(va, x["rank_a"], d.module, d.call, g)
    b = _Side(vb, x["rank_b"], d.module_b or d.module, d.call, g)
    where = f"(token {x['token']}, slot {x['slot']})"
    if a.call is None or b.call is None or not a.chain or not b.chain:
        return None, (f"no op of the module's call on rank {a.rank} of a or rank {b.rank} of b holds row {where} by a "
                      "rule divtrace can follow")
    names_a, names_b = [o for _, o, _ in a.chain], [o for _, o, _ in b.chain]
    if names_a != names_b or any(len(x[2]) != len(y[2]) for x, y in zip(a.chain, b.chain)):
        return None, (f"rank {a.rank} of a and rank {b.rank} of b run other ops on row {where} (a: "
                      f"{_listing(a.chain)}; b: {_listing(b.chain)})")
    for (ia, op, ha), (ib, op_b, hb) in zip(a.chain, b.chain):
        for (ua, pa), (ub, pb) in zip(ha, hb):
            eq, how = _same(a, ua, pa, b, ub, pb)
            if eq is None:
                return None, (f"not compared: rank {a.rank}'s ops hold row {where} with other rows than rank "
                              f"{b.rank}'s of b, in another order, and a hash-mode trace keeps no row fingerprints of "
                              f"op outputs (rank {a.rank}'s ops on the row: {_listing(a.chain)})")
            if not eq:
                return {"token": x["token"], "slot": x["slot"], "rank_a": a.rank, "index_a": ia, "op_a": op,
                        "rank_b": b.rank, "index_b": ib, "op_b": op_b, "compared": how,
                        "inputs": _inputs(a, ia, b, ib)}, None
    return None, f"every op of rank {a.rank} on row {where} gives the row b gives"


def _inputs(a: _Side, ia: int, b: _Side, ib: int) -> list[str]:
    """What differs among the op's inputs: an input made by another op of the row's computation on each side (the
    sides' ops agree pairwise up to here), or an input outside the rows whose value differs. Empty: equal inputs."""
    out = []
    ins_a, ins_b = a.t.rin[ia], b.t.rin[ib]
    for p, (ua, ub) in enumerate(zip(ins_a, ins_b)):
        ja, jb = a.producer(ua), b.producer(ub)
        if ja is not None and jb is not None:
            if ja != jb:
                out.append(f"input {p} is the output of {_made(a, ja)} on a, of {_made(b, jb)} on b")
        elif ja is not None or jb is not None:
            out.append(f"input {p} holds the routed rows on {'a' if ja is not None else 'b'} only")
        elif a.t.real_key(ua) != b.t.real_key(ub):
            derived = ua in a.t.vderived or ub in b.t.vderived
            out.append(f"input {p} (no routed rows: a weight or a constant) "
                       + ("is not compared (a view fingerprinted from its op)" if derived and not
                          (a.t.has_bytes(ua) and b.t.has_bytes(ub)) else "differs"))
    return out


def _made(s: _Side, j: int) -> str:
    if j < 0:
        return "the module's routed input"
    i, op, _ = s.chain[j]
    return f"{op} #{i}"


def _top_k(view, vid):
    s, _, vp = view.plan_of(vid)
    if not vp.routed or not vp.blocks:
        return None
    r, q, _ = vp.blocks[0]
    return view.run.layouts[r].values[q].top_k


def op_words(op: dict) -> str:
    ins = "; ".join(op["inputs"]) if op["inputs"] else "its inputs are equal"
    how = "its row's bytes" if op["compared"] == "row" else "the same rows in the same order, fingerprinted"
    return (f"computed at {op['op_a']} (record {op['index_a']} on rank {op['rank_a']} of a; {op['op_b']} record "
            f"{op['index_b']} on rank {op['rank_b']} of b), the first op on row (token {op['token']}, slot "
            f"{op['slot']}) whose output differs ({how}): {ins}")


# -- the combine ---------------------------------------------------------------------------------------------------
_ORDERS = ("routing order", "rank order", "expert order", "reversed routing order")


def combine_orders(d, ta, tb) -> tuple[dict | None, str | None]:
    """(`shards.combine`, None): the order in which each side sums a token's slots, where one candidate order
    reproduces each side's recorded output bit for bit at every token (full mode), the orders differ and the
    routing weights are equal; else (None, why not)."""
    sides = []
    for t, module, vid in ((ta, d.module, d.vid_a), (tb, d.module_b or d.module, d.vid_b)):
        got = _combine_side(_base(t), module, d.call, vid)
        if isinstance(got, str):
            return None, got
        sides.append(got)
    (wa, oka, n), (wb, okb, _) = sides
    if wa.keys() != wb.keys() or any(not _bits_equal(wa[t], wb[t]) for t in wa):
        return None, "the routing weights differ between a and b"
    if not oka or not okb:
        side = "a" if not oka else "b"
        return None, f"no candidate order ({', '.join(_ORDERS)}) reproduces side {side}'s output bit for bit"
    if oka[0] in okb:
        return None, "one order reproduces both sides"
    return {"order_a": oka[0], "order_b": okb[0], "orders_a": oka, "orders_b": okb, "tokens": n}, None


def _combine_side(view, module: str, call_no: int, vid: int):
    """({token: its routing weights}, the candidate orders that reproduce every token's output, tokens checked) of
    one side, or why not (a string)."""
    if getattr(view, "run", None) is None or len(view.groups) != 1:
        return "a side is not one group of ranks"
    vc = next((c for c in view.calls.values() if c.module == module and c.call == call_no), None)
    routed = [v for _, v in vc.inputs if getattr(view.plan_of(v)[2], "routed", False)] if vc else []
    if not routed or vid not in {v for _, v in vc.outputs}:
        return "the combine's routed input or output is not found"
    if not view.has_bytes(routed[0]) or not view.has_bytes(vid):
        return "hash mode: no bytes to recompute the sums from"
    k = _top_k(view, routed[0])
    rows = view.tensor(routed[0])
    rank_of = _expert_ranks(view)
    _, rep_vid, vp = view.plan_of(vid)
    blocks = vp.blocks if vp.kind == "blocks" else [(view.segments[0].rank, rep_vid, (0,))]
    weights, outs, keys = {}, [], []
    for rank, q, off in blocks:
        tr = view.run.traces[rank]
        rc = call_on_rank(tr, module, call_no)
        if rc is None or q not in {v for _, v in rc.outputs}:
            return f"rank {rank}'s combine call is not found"
        n = tr.vkey[q][1][0]
        ws = [v for _, v in rc.inputs if tuple(tr.vkey[v][1]) == (n, k) and "float" in tr.vkey[v][0]]
        tv = [v for _, v in rc.inputs if v in routed_inputs(view.run, rank, rc)]
        if len(ws) != 1 or len(tv) != 1 or not tr.has_bytes(ws[0]) or not tr.has_bytes(q):
            return f"rank {rank}'s combine has no single routing-weight input of shape [{n}, {k}]"
        w, out = tr.tensor(ws[0]), tr.tensor(q)
        experts = {r[0] * k + r[1]: r[2] for r in view.run.layouts[rank].values[tv[0]].routing if len(r) > 2}
        for i in range(n):
            t = off[0] + i
            weights[t] = w[i]
            es = [experts.get(t * k + s) for s in range(k)]
            keys.append({"routing order": list(range(k)), "reversed routing order": list(range(k))[::-1],
                         "expert order": None if None in es else sorted(range(k), key=lambda s: (es[s], s)),
                         "rank order": None if None in es or rank_of is None or any(e not in rank_of for e in es)
                         else sorted(range(k), key=lambda s: (rank_of[es[s]], es[s], s))})
        outs.append((off[0], w, out))
    ok = [name for name in _ORDERS if all(kk[name] is not None for kk in keys)
          and _reproduces(rows, outs, k, [kk[name] for kk in keys])]
    return weights, ok, len(keys)


def _reproduces(rows, outs, k: int, perms: list) -> bool:
    """Whether summing each token's weighted slots in the order `perms` gives every block's output bit for bit."""
    import torch

    j0 = 0
    for lo, w, out in outs:
        n = out.shape[0]
        perm = torch.tensor(perms[j0:j0 + n], dtype=torch.long).reshape(n, k)
        j0 += n
        tok = torch.arange(lo, lo + n).unsqueeze(1) * k
        r = rows[tok + perm]
        ww = w.gather(1, perm)
        y = ww[:, 0:1] * r[:, 0]
        for j in range(1, k):
            y = y + ww[:, j:j + 1] * r[:, j]
        if not _bits_equal(y, out):
            return False
    return True


def _expert_ranks(view) -> dict | None:
    """expert -> the rank that computed its rows: from the first routed value whose rows sit on more than one rank,
    each expert's on exactly one (the rows dispatched to the experts' ranks); None where no value shows it."""
    g = view.groups[0]
    for vid in sorted(g.values):
        vp = g.values[vid]
        if not vp.routed or len({r for r, _, _ in vp.blocks}) < 2:
            continue
        where: dict = {}
        for rank, q, _ in vp.blocks:
            for r in view.run.layouts[rank].values[q].routing or []:
                if len(r) > 2:
                    where.setdefault(r[2], set()).add(rank)
        if where and all(len(x) == 1 for x in where.values()):
            return {e: next(iter(x)) for e, x in where.items()}
    return None


def combine_words(module: str, c: dict, tokens: list, few) -> str:
    return (f"{module}: combine order differs: a sums slots in {c['order_a']}, b in {c['order_b']} (each order, "
            f"recomputed from the equal routed rows and routing weights, gives its side's output bit for bit at all "
            f"{c['tokens']} tokens); its output differs at tokens {few(tokens)}")
