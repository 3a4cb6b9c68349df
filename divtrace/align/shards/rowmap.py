"""Which routed rows each op of one rank's module call holds (expert parallelism, docs/sharded.md "Routed rows").

An expert block runs its ops on slices of the rows routed to its rank (one expert at a time). Starting from the
call's routed inputs, whose routing says each local row's global row (token * top_k + slot), a row map follows the
rows through the ops whose row semantics the record proves: a slice or split (along dim 0 each chunk keeps its rows,
offset by its start; along another dim every chunk keeps them all), a row-wise op (elementwise, with
every other input broadcast along the rows), a matmul of the rows by a weight, a reshape that keeps dim 0, a cat.
Any other op ends the map (its outputs hold no known rows): nothing is guessed.

In: a rank's Trace, one of its ModuleCalls and the routed input rows (RunDir layouts). Out: vid -> the global row of
each of its rows (dim 0), and the chain of ops that computed one global row.
"""
from __future__ import annotations

_ROWWISE = {"silu", "sigmoid", "mul", "add", "sub", "div", "neg", "exp", "gelu", "relu", "tanh", "_to_copy", "clone",
            "contiguous", "detach", "alias", "pow", "rsqrt", "sqrt", "square", "abs", "log", "erf", "softplus",
            "hardswish", "leaky_relu", "clamp", "maximum", "minimum", "where"}
_MATMUL = {"mm": 0, "matmul": 0, "linear": 0, "addmm": 1}
_RESHAPE = {"view", "_unsafe_view", "reshape", "_reshape_alias", "unsqueeze", "flatten"}
_SPLIT = {"split", "split_with_sizes", "chunk", "unsafe_split", "unsafe_chunk", "unbind"}


def _base(op: str) -> str:
    parts = op.split(".")
    return parts[1] if len(parts) >= 3 else op


def _dim(d, ndim: int) -> int | None:
    if not isinstance(d, int) or ndim <= 0:
        return None
    return d + ndim if d < 0 else d


def routed_inputs(run, rank: int, call) -> dict[int, tuple]:
    """The call's inputs that hold routed rows on `rank`: vid -> each local row's global row."""
    lays = run.layouts[rank].values
    out = {}
    for _, v in call.inputs:
        lay = lays.get(v)
        if lay is not None and lay.routed and lay.routing is not None:
            out[v] = tuple(lay.global_rows())
    return out


def row_maps(t, call, seeds: dict[int, tuple]) -> dict[int, tuple]:
    """vid -> the global rows of its dim-0 rows, for the call's inputs in `seeds` and the outputs of the call's own
    ops that a proven rule carries them to (see the module docstring)."""
    rows = dict(seeds)
    for i in call.ops:
        rec = t.records[i]
        got = _carry(t, rec, rows)
        if got:
            for v, r in zip(rec.outputs, got):
                if r is not None and len(t.vkey[v][1]) >= 1 and t.vkey[v][1][0] == len(r):
                    rows.setdefault(v, r)
    return rows


def _shape(t, v) -> tuple:
    return tuple(t.vkey[v][1])


def _carry(t, rec, rows: dict) -> list | None:
    """The rows of each output of op record `rec`, or None where no rule proves them."""
    name = _base(rec.op)
    ins = list(rec.inputs)
    if not ins or not rec.outputs:
        return None
    args = rec.args if isinstance(rec.args, list) else []
    x = ins[0]
    if name == "slice":
        r = rows.get(x)
        if r is None or len(args) < 2:
            return None
        d = _dim(args[1], len(_shape(t, x)))
        if d != 0:
            return [r]
        start, end = (args[2] if len(args) > 2 else None), (args[3] if len(args) > 3 else None)
        step = args[4] if len(args) > 4 else 1
        if not all(a is None or isinstance(a, int) for a in (start, end, step)) or not step or step < 0:
            return None
        return [r[start:end:step]]
    if name in _SPLIT:
        r = rows.get(x)
        dim = args[2] if len(args) > 2 else (rec.kwargs or {}).get("dim", 0)
        d = _dim(dim, len(_shape(t, x)))
        if name in ("unbind",) or r is None or d is None:
            return None
        if d == 0:
            return _split_rows(t, rec, name, args, r)
        return [r] * len(rec.outputs)
    if name in _MATMUL:
        pos = _MATMUL[name]
        r = rows.get(ins[pos]) if len(ins) > pos else None
        if r is None or len(_shape(t, ins[pos])) != 2 or any(v in rows for j, v in enumerate(ins) if j != pos):
            return None
        return [r]
    if name in _RESHAPE:
        r = rows.get(x)
        out = _shape(t, rec.outputs[0])
        return [r] if r is not None and out and out[0] == _shape(t, x)[0] else None
    if name == "cat":
        ts = args[0] if args and isinstance(args[0], list) else None
        d = args[1] if len(args) > 1 else (rec.kwargs or {}).get("dim", 0)
        vids = [a.get("$v") for a in ts or [] if isinstance(a, dict)]
        if not vids or len(vids) != len(ts) or any(v not in rows for v in vids):
            return None
        d = _dim(d, len(_shape(t, vids[0])))
        if d == 0:
            return [tuple(g for v in vids for g in rows[v])]
        return [rows[vids[0]]] if d is not None and all(rows[v] == rows[vids[0]] for v in vids) else None
    if name in _ROWWISE:
        return _rowwise(t, rec, rows)
    return None


def _split_rows(t, rec, name: str, args: list, r: tuple) -> list | None:
    """A split along dim 0: each chunk keeps its rows, offset by the chunk's start. The chunks' sizes come from the
    op's arguments (split: a size; split_with_sizes: the sizes; chunk: a count), and every output must hold them."""
    n, arg = len(r), args[1] if len(args) > 1 else None
    if name in ("split_with_sizes",):
        sizes = list(arg) if isinstance(arg, list) and all(isinstance(a, int) and a >= 0 for a in arg) else None
    elif isinstance(arg, int) and arg > 0:
        size = arg if name in ("split", "unsafe_split") else -(-n // arg)  # chunk: ceil(n / chunks)
        sizes = [min(size, n - s) for s in range(0, n, size)] if size else None
        if name in ("chunk", "unsafe_chunk") and n == 0:
            sizes = None
    else:
        sizes = None
    if sizes is None or sum(sizes) != n or len(sizes) != len(rec.outputs):
        return None
    out, start = [], 0
    for v, size in zip(rec.outputs, sizes):
        shape = _shape(t, v)
        if not shape or shape[0] != size:
            return None
        out.append(r[start:start + size])
        start += size
    return out


def _rowwise(t, rec, rows: dict) -> list | None:
    """An elementwise op: its mapped inputs must hold the same rows, every other input must be broadcast along
    them (fewer dims than the output, or size 1 at the output's dim 0)."""
    out = _shape(t, rec.outputs[0])
    mapped = {rows[v] for v in rec.inputs if v in rows}
    if len(mapped) != 1 or not out:
        return None
    for v in rec.inputs:
        if v in rows:
            continue
        s = _shape(t, v)
        if len(s) >= len(out) and s[len(s) - len(out)] != 1:
            return None
    r = mapped.pop()
    return [r] * len(rec.outputs) if out[0] == len(r) else None


def chain(t, call, rows: dict, g: int) -> list:
    """The ops of the call that computed global row `g`, in execution order: (record index, op, [(output vid, the
    row's place in it)...]) for each op with an output holding it."""
    out = []
    for i in call.ops:
        held = [(v, rows[v].index(g)) for v in t.rout[i] if v in rows and g in rows[v]]
        if held:
            out.append((i, t.rop[i], held))
    return out


def call_on_rank(t, module: str, call_no: int):
    """The ModuleCall of `module`'s call number `call_no` in one rank's trace, or None."""
    return next((c for c in t.calls.values() if c.module == module and c.call == call_no), None)
