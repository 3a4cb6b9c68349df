"""Routed rows (expert parallelism): the rows an all_to_all moved to the rank of their experts, laid out by their
routing (docs/sharded.md, "Routed rows").

A module side declared `T@g` (record's `layouts=`: record/declared.py) holds rows routed to this rank: row i of the
tensor is the (token, slot) that the routing declared for it says. The routing is declared by the model code, on
the tensor, before the module runs:

    divtrace.routed(rows, tokens=tok, slots=slot, n_tokens=N, top_k=k, experts=eid)

(no-op outside a recording). A declared output with no routing of its own takes its module's routed input's (an
expert block's output rows are its input rows, computed). The global value of routed rows is `[N * top_k, *row]`:
the row of (token t, slot s) at row `t * top_k + s`, the order a one-process MoE holds its rows in when it keeps
them by token and slot. Each rank's piece of it is its rows at those places, so its partial fingerprint is the
sum of its rows' partials at their global rows (the lane scheme numbers lanes by their global place), and the
ranks' partials sum to the global fingerprint with no bytes moved. Each row's whole-row fingerprint is written too,
so hash mode tells which (token, slot) differs.

In: the routing declarations, the declared tensors. Out: the layout (placements.Lay with "T"), the partial, and
the line's routing fields (`rt`, `k`, `rh`: divtrace.trace.layouts).
"""
from __future__ import annotations

from typing import NamedTuple

from divtrace.errors import DivtraceError


class Routing(NamedTuple):
    tokens: tuple
    slots: tuple
    experts: tuple | None
    n_tokens: int
    top_k: int

    def rows(self) -> list[int]:
        """The global row of each local row."""
        return [t * self.top_k + s for t, s in zip(self.tokens, self.slots)]

    def table(self) -> list[list[int]]:
        if self.experts is None:
            return [[t, s] for t, s in zip(self.tokens, self.slots)]
        return [[t, s, e] for t, s, e in zip(self.tokens, self.slots, self.experts)]


def _ints(x, what: str) -> tuple:
    if hasattr(x, "tolist"):
        x = x.tolist()
    try:
        out = tuple(int(v) for v in x)
    except (TypeError, ValueError):
        raise DivtraceError(f"divtrace.routed: {what} must be a 1-D sequence of ints") from None
    return out


def make_routing(t, tokens, slots, n_tokens: int, top_k: int, experts=None) -> Routing:
    """The routing of tensor `t`'s rows, checked: one (token, slot) per row, tokens in [0, n_tokens), slots in
    [0, top_k). DivtraceError (one line) otherwise."""
    if not hasattr(t, "shape") or len(t.shape) < 1:
        raise DivtraceError("divtrace.routed: the routed value must be a tensor of rows ([rows, ...])")
    tok, slot = _ints(tokens, "tokens"), _ints(slots, "slots")
    exp = None if experts is None else _ints(experts, "experts")
    m = t.shape[0]
    if type(n_tokens) is not int or type(top_k) is not int or n_tokens < 1 or top_k < 1:
        raise DivtraceError(f"divtrace.routed: n_tokens and top_k must be positive ints, got {n_tokens!r}, {top_k!r}")
    for name, xs in (("tokens", tok), ("slots", slot), ("experts", exp)):
        if xs is not None and len(xs) != m:
            raise DivtraceError(f"divtrace.routed: {len(xs)} {name} for a tensor of {m} rows")
    if any(not 0 <= v < n_tokens for v in tok) or any(not 0 <= v < top_k for v in slot):
        raise DivtraceError(f"divtrace.routed: a token outside [0, {n_tokens}) or a slot outside [0, {top_k})")
    if len(set(zip(tok, slot))) != m:
        raise DivtraceError("divtrace.routed: a (token, slot) is given to two rows")
    return Routing(tok, slot, exp, n_tokens, top_k)


class Routes:
    """The routings declared in one rank's recording: by tensor (kept alive with it, so its id is not reused)
    and, for a module whose routed input was laid out, by module (its output rows take it)."""

    def __init__(self):
        self._by_tensor: dict[int, tuple] = {}
        self._by_module: dict[int, Routing] = {}

    def declare(self, t, routing: Routing) -> None:
        self._by_tensor[id(t)] = (t, routing)

    def of(self, t, module, side: str) -> Routing | None:
        got = self._by_tensor.get(id(t))
        r = got[1] if got is not None and got[0] is t else None
        if r is None and side == "out":
            r = self._by_module.get(id(module))
            if r is not None and len(r.tokens) != t.shape[0]:
                r = None
        if r is not None and side == "in":
            self._by_module[id(module)] = r
        return r


def routed_gshape(t, routing: Routing) -> tuple:
    return (routing.n_tokens * routing.top_k,) + tuple(t.shape[1:])


def routed_partial(t, routing: Routing):
    """The partial fingerprint (int64 [2]) of rows `t` at their global rows: runs of consecutive global rows are
    fingerprinted as one box each."""
    import torch

    from divtrace.trace.hashing.tensor import tensor_partial

    gshape = routed_gshape(t, routing)
    rows = routing.rows()
    order = sorted(range(len(rows)), key=rows.__getitem__)
    zeros = (0,) * (t.dim() - 1)
    total = torch.zeros(2, dtype=torch.int64)
    i = 0
    while i < len(order):
        j = i + 1
        while j < len(order) and rows[order[j]] == rows[order[j - 1]] + 1 and order[j] == order[j - 1] + 1:
            j += 1
        box = t[order[i]:order[j - 1] + 1]
        total += tensor_partial(box.contiguous(), gshape, (rows[order[i]],) + zeros).cpu()
        i = j
    return total


def row_hexes(t) -> list[str]:
    """Each row's whole-row fingerprint (row-gsum64-v2), as 16 hex digits."""
    from divtrace.trace.hashing.rows import row_fingerprints

    if t.shape[0] == 0:
        return []
    fps = row_fingerprints(t.reshape(t.shape[0], -1) if t.dim() == 1 else t)
    return [f"{v & ((1 << 64) - 1):016x}" for v in fps.cpu().tolist()]
