"""The token rows of a router's values on both sides, paired: what divtrace.compare.routing compares.

With token identity in both traces (HF inputs, declared tokens), a token's rows are paired by content, wherever
each run computed it (its root call and row on each side), and keyed by their row fingerprints (hash mode too).
Without it, the router calls pair by call number and their rows by index (full mode), or whole values (hash).

In: the origin (its module path), the two traces and their TraceTokens. Out: [(token description, row of a, row
of b)] for divtrace.compare.routing.compare_rows.
"""
from __future__ import annotations

from divtrace.record.topk_margin import OP as MARGIN_OP

TOPK = "aten.topk.default"


def router_parts(t, call) -> dict | None:
    """The router values of one module call of trace `t`: its own top-k's ids, the ids and weights it returns
    ([rows, k] outputs: integer and float), the margin value, the dtype the top-k saw; None if it runs no top-k."""
    rop, rin, rout = t.rop, t.rin, t.rout
    topk = [i for i in call.ops if rop[i] == TOPK]
    if not topk or len(rout[topk[0]]) < 2:
        return None
    i = topk[0]
    scores, chosen = rin[i][0], rout[i][1]
    values = t.values
    shape = values[chosen].shape
    ids = next((v for _, v in call.outputs if values[v].shape == shape and _is_int(values[v].dtype)), chosen)
    weights = next((v for _, v in call.outputs if values[v].shape == shape and not _is_int(values[v].dtype)), None)
    margin = next((rout[j][0] for j in call.ops if rop[j] == MARGIN_OP and rin[j] and rin[j][0] == scores), None)
    return {"chosen": chosen, "ids": ids, "weights": weights, "margin": margin, "dtype": values[scores].dtype,
            "margin_dtype": values[margin].dtype if margin is not None else None}


def _is_int(dtype: str) -> bool:
    return "int" in dtype or dtype == "torch.bool"


class _Row:
    """One token's row of a router call's values on one side: keys (fingerprints) and, where stored, values."""

    def __init__(self, view, parts: dict):
        self.view, self.parts = view, parts

    def key(self, what: str):
        vid = self.parts[what]
        return None if vid is None else self.view.vkey[vid]

    def values(self, what: str):
        vid = self.parts[what]
        if vid is None or not self.view.has_bytes(vid):
            return None
        return self.view.tensor(vid).reshape(-1).tolist()

    def margin(self):
        """The margin as a float where stored, 0.0 where its row fingerprint is an exact zero's, else None."""
        got = self.values("margin")
        if got is not None and len(got) == 1:
            return float(got[0])
        key = self.key("margin")
        zero = _zero_row(key[0]) if isinstance(key, tuple) and len(key) == 3 and isinstance(key[2], int) else None
        if zero is not None and key[2] & _MASK == zero & _MASK:
            return 0.0
        return None


_ZEROS: dict = {}
_MASK = (1 << 64) - 1


def _zero_row(dtype: str):
    """The row fingerprint of one element +0.0 of `dtype` (a tie's margin), as the trace stores row keys."""
    if dtype not in _ZEROS:
        import torch

        from divtrace.trace.hashing.rows import row_fingerprints

        dt = getattr(torch, dtype.removeprefix("torch."), None)
        _ZEROS[dtype] = int(row_fingerprints(torch.zeros(1, dtype=dt))[0]) if dt is not None else None
    return _ZEROS[dtype]


def token_rows(d, ta, tb, sa, sb) -> list:
    from divtrace.align.tokens import TokenView, shared_tokens
    from divtrace.compare.token_report import token_desc, where

    mod_a, mod_b = d.module, d.module_b or d.module
    parts: dict = {}

    def routers(t, view, root, module):
        got = parts.get((id(t), root, module))
        if got is None:
            calls = sorted((c for c in view.calls.values() if c.module == module), key=lambda c: c.call)
            got = parts[(id(t), root, module)] = [(c.call, router_parts(t, c)) for c in calls]
        return got

    rows = []
    for k in shared_tokens(sa, sb):
        (ra, ca), (rb, cb) = sa.where[k], sb.where[k]
        va, vb = TokenView(sa, ra, ca), TokenView(sb, rb, cb)
        pa = dict(routers(ta, va, ra, mod_a))
        for j, pb in routers(tb, vb, rb, mod_b):
            p = pa.get(j)
            if p is None or pb is None:
                continue
            if sa.row_key(p["ids"], ra, ca) is None or sb.row_key(pb["ids"], rb, cb) is None:
                continue  # this call of the router did not compute the token (another root call's rows)
            desc = dict(token_desc(sa, ra, ca), a=where(sa, ra, ca), b=where(sb, rb, cb))
            rows.append((desc, _Row(va, p), _Row(vb, pb)))
    return rows


def _row_hashes(t, vid: int) -> dict | None:
    """{global row: row fingerprint (int)} of a sharded run's value whose layouts carry its rows' fingerprints (a
    router's blocks of dim 0: record/placements.py), with no bytes read; None for other values and traces."""
    if getattr(getattr(t, "trace", t), "run", None) is None:
        return None
    from divtrace.compare.shard_cause import row_table

    got = row_table(t, vid)
    return None if got is None else {g: int(h[0], 16) for g, h in got.items()}


class _IndexView:
    """A trace seen through one row index of its router values (None: whole values), for traces without tokens:
    a row's bytes where stored, else its fingerprint where the run's layouts carry the rows' (hash mode)."""

    def __init__(self, t, row: int | None, cache: dict | None = None):
        self.t, self.row = t, row
        self.vkey = self
        self._rows = {} if cache is None else cache  # vid -> its row fingerprints (shared by one side's rows)

    def has_bytes(self, vid: int) -> bool:
        return self.row is not None and self.t.has_bytes(vid)

    def tensor(self, vid: int):
        x = self.t.tensor(vid)
        return x[self.row] if self.row is not None and x.dim() >= 1 else x

    def __getitem__(self, vid):
        if not self.has_bytes(vid):
            if self.row is not None:
                if vid not in self._rows:
                    self._rows[vid] = _row_hashes(self.t, vid)
                hashes = self._rows[vid]
                if hashes is not None and self.row in hashes:
                    return (self.t.values[vid].dtype, "row", hashes[self.row])
            return self.t.vkey[vid]
        x = self.tensor(vid)
        return (str(x.dtype), tuple(x.shape), x.contiguous().view(-1).view(__import__("torch").uint8).numpy().tobytes())


def whole_rows(d, ta, tb) -> list:
    calls = lambda t, m: {c.call: c for c in (t.calls.values() if isinstance(t.calls, dict) else t.calls)
                          if c.module == m}
    ca, cb = calls(ta, d.module), calls(tb, d.module_b or d.module)
    rows = []
    for j in sorted(set(ca) & set(cb)):
        pa, pb = router_parts(ta, ca[j]), router_parts(tb, cb[j])
        if pa is None or pb is None:
            continue
        hashed = None if ta.has_bytes(pa["ids"]) and tb.has_bytes(pb["ids"]) else (
            _row_hashes(ta, pa["ids"]), _row_hashes(tb, pb["ids"]))
        if hashed is None or (None not in hashed and hashed[0].keys() == hashed[1].keys()):
            n = min(ta.values[pa["ids"]].shape[0], tb.values[pb["ids"]].shape[0]) if hashed is None else \
                len(hashed[0])
            ca, cb = {}, {}  # (one per side: the row fingerprints read once)
            for r in range(n):
                ra, rb = _Row(_IndexView(ta, r, ca), pa), _Row(_IndexView(tb, r, cb), pb)
                rows.append(({"call": j, "row": r}, ra, rb))
        else:
            rows.append(({"call": j, "row": None}, _Row(_IndexView(ta, None), pa), _Row(_IndexView(tb, None), pb)))
    return rows

