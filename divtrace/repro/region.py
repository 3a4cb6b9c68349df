"""Which ops a repro holds: the diverging pair of tensors, and each side's ops from shared values to it.

The target is the first divergence (from `bisect`), or the record the user names with `--at`. From each side's
diverging tensor the walk goes back through producers and stops where the divergence starts:
- at values the *other* side's computation also starts from or passes through (same dtype, shape and bytes
  anywhere in the cone of the other side's diverging tensor);
- at the inputs of the diverging module call, and at parameters (values from outside the recorded ops);
- at values computed from constants alone outside that call in more than a few ops (a causal mask the model's
  root code builds), which become inputs instead of pulling that code in.
What the walk passed through is the region; what it stopped at are the region's leaf inputs. Leaves made by
views or exact copies of a shared value are then traded for that value (up to a module boundary), so both
sides start from the same tensors and kernels see the recorded strides.

The walk is not confined to the call's own ops: a call that answers from a cache built by an earlier call (a
rope table) diverges in ops that ran before it, and those are the ones a repro needs.
"""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field

from divtrace.align.calls import Pairing
from divtrace.align.paths import PathMap
from divtrace.compare.bisect import bisect
from divtrace.compare.op_kinds import cast_rounds, constant_derived
from divtrace.compare.values import ValueComparator
from divtrace.errors import DivtraceError
from divtrace.trace.records import ModuleCall
from divtrace.trace.reader import Trace

# Ops that alias their input. A leaf that is a strided view of a contiguous value is replaced by that value and
# the views are replayed, so kernels see the recorded strides (a transposed K goes into bmm as it did).
ALIAS_OPS = {
    "view", "_unsafe_view", "reshape", "_reshape_alias", "transpose", "t", "permute", "expand", "unsqueeze",
    "squeeze", "select", "slice", "as_strided", "alias", "detach", "split", "split_with_sizes", "chunk", "unbind",
    "narrow", "unfold", "diagonal", "view_as", "expand_as", "movedim", "swapaxes", "swapdims", "flatten",
    "unflatten", "expand_copy", "view_copy",
}
RANDOM_OPS = {"rand", "randn", "rand_like", "randn_like", "randint", "randint_like", "randperm", "bernoulli",
              "bernoulli_", "dropout", "native_dropout", "normal", "normal_", "uniform_", "multinomial",
              "exponential_", "geometric_", "cauchy_", "log_normal_", "random_", "feature_dropout"}


def op_short(op: str) -> str:
    parts = op.split(".")
    return parts[1] if len(parts) >= 3 else op


@dataclass
class Target:
    """The pair of tensors to reproduce, and where the divergence was found."""

    va: int
    vb: int
    call_a: ModuleCall
    call_b: ModuleCall
    record: int  # A record index: the parting op, or the call's exit
    record_b: int | None
    op_a: str | None
    op_b: str | None
    cause: str
    tensor: str
    warnings: list[str] = field(default_factory=list)
    # Token alignment: each side's trace seen through the token (its keys decide which values the sides share),
    # and the index of the token's row in each side's output (the repro compares that row, not the batch).
    views: dict | None = None
    row_index: dict | None = None
    # Cut at an engine's parting op (repro/narrow.py): random trials keep the inputs no tie pairs as recorded.
    keep_untied: bool = False


@dataclass
class Side:
    """One side's region: ops (record indices, in execution order), leaf inputs (vids, first use first)."""

    trace: Trace
    ops: list[int]
    leaves: list[int]
    output: int
    call: ModuleCall
    before: int  # ops a repro of the whole diverging call would hold (its subtree, plus region ops outside it)
    roles: dict[int, str] = field(default_factory=dict)  # leaf vid -> activation | parameter | constant
    row_index: list | None = None  # token alignment: the side returns output[row_index] (":" is a whole dim)
    flat_row: bool = False  # ... flattened, where the other side's row has another shape ([H, D] against [H*D])


def _value_key(t: Trace, vid: int):
    v = t.values[vid]
    return v.dtype, tuple(v.shape), v.hash


def _first_divergence(ta: Trace, tb: Trace, path_map: PathMap | None):
    r = bisect(ta, tb, path_map=path_map, n_next=0)
    if r.verdict == "inconclusive":
        from divtrace.compare.verdict import Inconclusive

        raise Inconclusive(f"{ta.path} and {tb.path}: no divergence found to reproduce, and the comparison is "
                           f"inconclusive: {r.reason}")
    if r.first is None and not (r.verdict == "diverged" and getattr(r, "origins", None)):
        from divtrace.compare.params import param_line

        weights = param_line(r.parameters) if r.parameters and r.parameters.get("differ") else None
        raise DivtraceError(f"{ta.path} and {tb.path}: no divergence ({r.verdict}: {r.compared} tensor pairs compared, "
                            + (f"every final output bitwise equal; {weights}" if weights else "all bitwise equal")
                            + "); there is nothing to reproduce")
    return r


def _call_by_key(t: Trace, module: str, call: int) -> ModuleCall:
    for c in t.calls.values():
        if c.module == module and c.call == call:
            return c
    raise DivtraceError(f"{t.path}: no call {call} of module {module!r}")


def token_row_index(view, vid: int) -> list | None:
    """The index of the token's row in value `vid` of a TokenView (":" for a whole dim), None when it has none."""
    from divtrace.trace import token_layout as layout

    e = view.tokens.index.index.get(vid)
    if e is None or e[0] != view.root_cid or e[2] < 0:
        return None
    g = view.tokens.index.grids[view.root_cid]
    if layout.cell_row(e[1], g.shape, view.cell) is None:
        return None
    return layout.row_index(e[1], g.shape, view.cell)


def _token_target(ta: Trace, tb: Trace, r, path_map: PathMap | None, at: int | None = None) -> Target:
    """An origin of a token-aligned bisect (the first, or `at`: the one whose parting op is record `at` of a):
    each side's call that holds the token, the differing values (each side's whole tensor, at the batch that side
    ran), and the token's row in each."""
    from divtrace.align.tokens import TokenView

    pick = [i for i, d in enumerate(r.origin_divs) if d is not None and (at is None or d.index == at)]
    if not pick:
        listed = ", ".join(f"{d.index} ({d.module or '<root>'} {d.op or d.op_b})" for d in r.origin_divs if d is not None)
        if at is not None:
            raise DivtraceError(f"{ta.path}: --at {at} is the record of no origin of this token-aligned bisect; its "
                                f"origins' records: {listed or 'none'}")
        kinds = ", ".join(o["cause_text"] for o in r.origins if o.get("cause_text"))
        raise DivtraceError(f"{ta.path} vs {tb.path}: the difference is no op to reproduce: {kinds}")
    i = pick[0]
    first = r.origin_divs[i]
    ra, ca, rb, cb = r.origin_cells[i]
    va_view, vb_view = TokenView(r.token_sides[0], ra, ca), TokenView(r.token_sides[1], rb, cb)
    call_a = next(c for c in va_view.calls.values() if c.module == first.module and c.call == first.call)
    call_b = Pairing(va_view, vb_view, path_map).partner(call_a)
    if call_b is None:
        raise DivtraceError(f"{tb.path}: no counterpart of {first.module or '<root>'} for the token; cannot cut a repro")
    rows = {}
    for s, view, vid in (("a", va_view, first.vid_a), ("b", vb_view, first.vid_b)):
        rows[s] = token_row_index(view, vid)
        if rows[s] is None:
            raise DivtraceError(f"{view.path}: the differing value of {first.module or '<root>'} has no row for the token "
                                "(its token layout is unknown); cannot cut a repro of one token's row")
    return Target(first.vid_a, first.vid_b, _recorded(ta, call_a), _recorded(tb, call_b), first.index,
                  first.index_b, first.op, first.op_b, first.cause, first.tensor,
                  views={"a": va_view, "b": vb_view}, row_index=rows)


def _recorded(t: Trace, call) -> ModuleCall:
    """The recorded call behind `call`: itself, or for a map's stand-in (vLLM's q_proj split from its fused qkv_proj)
    the call it stands for, which started at the same record."""
    got = t.calls.get(call.call_id)
    if got is not None and got.enter_index == call.enter_index:
        return got
    return next(c for c in t.calls.values() if c.enter_index == call.enter_index)


def find_target(ta: Trace, tb: Trace, at: int | None = None, path_map: PathMap | None = None) -> Target:
    result = _first_divergence(ta, tb, path_map)
    first = result.first
    if getattr(result, "alignment", "calls") == "tokens":
        return _token_target(ta, tb, result, path_map, at)
    pairing = Pairing(ta, tb, path_map)
    if at is None or at == first.index:
        ca = _call_by_key(ta, first.module, first.call)
        cb = pairing.partner(ca)
        return Target(first.vid_a, first.vid_b, ca, cb, first.index, first.index_b, first.op, first.op_b,
                      first.cause, first.tensor)
    if not isinstance(at, int) or not 0 <= at < len(ta.records):
        raise DivtraceError(f"{ta.path}: --at {at}: no such record (the trace has {len(ta.records)} records, 0.."
                            f"{len(ta.records) - 1})")
    rec = ta.records[at]
    ca = ta.calls[rec.call_id]
    cb = pairing.partner(ca)
    where = f"{ta.path}: --at {at}"
    if cb is None:
        raise DivtraceError(f"{where}: module {ca.module or '<root>'!r} call {ca.call} has no counterpart in {tb.path}")
    cmp = ValueComparator(ta, tb)
    if rec.kind in ("enter", "exit"):
        m = cmp.first_mismatch(ca.outputs, cb.outputs)
        if m is None:
            raise DivtraceError(f"{where}: the outputs of {ca.module or '<root>'!r} call {ca.call} are bitwise equal "
                                f"in both traces; nothing to reproduce there (the first divergence is record "
                                f"{first.index})")
        key, va, vb = m
        t = Target(va, vb, ca, cb, ca.exit_index if ca.exit_index is not None else at, cb.exit_index, None, None,
                   "origin", key)
    else:
        ops_a, ops_b = ca.ops, cb.ops
        if [ta.records[i].op for i in ops_a] != [tb.records[i].op for i in ops_b]:
            raise DivtraceError(
                f"{where}: {rec.op} in {ca.module or '<root>'!r} has no counterpart in {tb.path} (the two sides run "
                f"different op sequences there); pass the call's exit record {ca.exit_index} or the first divergence "
                f"(record {first.index}) instead")
        rb = tb.records[ops_b[ops_a.index(at)]]
        pair = next(((va, vb) for va, vb in zip(rec.outputs, rb.outputs) if not cmp.same(va, vb)), None)
        if pair is None:
            raise DivtraceError(f"{where}: the outputs of {rec.op} are bitwise equal in both traces; nothing to "
                                f"reproduce there (the first divergence is record {first.index})")
        t = Target(pair[0], pair[1], ca, cb, at, rb.index, rec.op, rb.op, "origin", f"output of {rec.op}")
    if cmp.first_mismatch(ca.inputs, cb.inputs) is not None:
        t.cause = "propagated"
        t.warnings.append(f"the inputs of {ca.module or '<root>'} call {ca.call} already differ, so this repro starts "
                          f"from different inputs on each side; the divergence originates earlier, at record "
                          f"{first.index} ({first.module or '<root>'})")
    return t


def _subtree_ops(t: Trace, call: ModuleCall) -> set[int]:
    end = call.exit_index if call.exit_index is not None else len(t.records)
    return {i for i in range(call.enter_index, end) if t.records[i].kind == "op"}


def _root_inputs(t: Trace) -> set[int]:
    return {v for c in t.roots() for _, v in c.inputs if t.values[v].producer is None}


def cone_keys(t: Trace, vid: int, key=None) -> set:
    """Keys of every value `vid` depends on (itself included): what the side's computation could start from.
    `key(vid)` (token alignment: the token's row key) replaces the whole-value key."""
    keys, seen, todo = set(), set(), [vid]
    while todo:
        v = todo.pop()
        if v in seen:
            continue
        seen.add(v)
        keys.add(key(v) if key is not None else _value_key(t, v))
        p = t.values[v].producer
        if p is not None:
            todo.extend(t.records[p].inputs)
    return keys


def _boundary_values(t: Trace) -> set[int]:
    out = set()
    for c in t.calls.values():
        out.update(v for _, v in c.inputs)
        out.update(v for _, v in c.outputs)
    return out


def _preserves_values(t: Trace, rec) -> bool:
    name = op_short(rec.op)
    if name in ALIAS_OPS or name in ("clone", "contiguous", "lift_fresh", "lift_fresh_copy"):
        return True
    # exact casts too (bf16 -> fp32): a side that widens a shared value starts from the shared value
    return name == "_to_copy" and not any(cast_rounds(t.values[rec.inputs[0]].dtype, t.values[v].dtype)
                                          for v in rec.outputs)


class _Walk:
    """One side's walk back from its diverging tensor (see the module docstring for where it stops)."""

    CONST_OPS = 8  # a constant computed outside the call in more ops than this is taken as an input instead

    def __init__(self, t: Trace, start: int, call: ModuleCall, other_keys: set, key=None):
        self.t, self.start, self.call, self.other = t, start, call, other_keys
        self.key = key if key is not None else (lambda vid: _value_key(t, vid))
        self.subtree = _subtree_ops(t, call)
        self.call_inputs = {v for _, v in call.inputs}
        self.memo: dict = {}

    def stops(self, vid: int) -> bool:
        p = self.t.values[vid].producer
        return p is None or (vid != self.start and (
            self.key(vid) in self.other or vid in self.call_inputs))

    def walk(self, roots, ops: set, leaves: set, const_rule: bool = True) -> None:
        seen, todo = set(), list(roots)
        while todo:
            vid = todo.pop()
            if vid in seen:
                continue
            seen.add(vid)
            if self.stops(vid):
                leaves.add(vid)
                continue
            p = self.t.values[vid].producer
            if p in ops:
                continue
            if const_rule and p not in self.subtree and constant_derived(self.t, p, self.memo):
                sub_ops: set = set()
                self.walk([vid], sub_ops, set(), const_rule=False)
                if len(sub_ops) > self.CONST_OPS:
                    leaves.add(vid)
                    continue
            ops.add(p)
            todo.extend(self.t.records[p].inputs)

    def climb(self, ops: set, leaves: set) -> None:
        """Replace a leaf made by value-preserving ops (views, copies) from a shared value by that value, up to a
        module boundary or a computing op, so both sides start from the same tensors; a strided leaf made by views
        is replaced by its base either way, so kernels see the recorded strides."""
        t, boundary = self.t, _boundary_values(self.t)
        changed = True
        while changed:
            changed = False
            for vid in sorted(leaves):
                v = t.values[vid]
                p = v.producer
                if p is None or vid in boundary:
                    continue
                rec = t.records[p]
                if len(set(rec.inputs)) != 1 or not _preserves_values(t, rec):
                    continue
                src = rec.inputs[0]
                strided = not _contiguous(v.shape, v.stride) and op_short(rec.op) in ALIAS_OPS
                if self.key(src) not in self.other and not strided:
                    continue
                ops.add(p)
                leaves.discard(vid)
                if t.values[src].producer not in ops:
                    leaves.add(src)
                changed = True
        # a leaf another region op produces is no leaf
        produced = {o for i in ops for o in t.records[i].outputs}
        leaves.difference_update(produced)


def build_side(t: Trace, other: Trace, start: int, call: ModuleCall, other_start: int, key=None,
               other_key=None, other_keys: set | None = None) -> Side:
    """Each side's region and leaf inputs, from shared values to its diverging tensor `start`. `key`, `other_key`:
    how each side's values are keyed (default: whole fingerprints; token alignment: the token's rows).
    `other_keys`: what the walk stops at, when not the cone of `other_start` (repro/narrow.py)."""
    if other_keys is None:
        other_keys = cone_keys(other, other_start, other_key)
    w = _Walk(t, start, call, other_keys, key)
    ops, leaves = set(), set()
    w.walk([start], ops, leaves)
    w.climb(ops, leaves)
    ordered_ops = sorted(ops)
    consumed = [v for i in ordered_ops for v in t.records[i].inputs]
    produced = {v for i in ordered_ops for v in t.records[i].outputs}
    order = list(dict.fromkeys(v for v in consumed + [start] if v not in produced))
    roots = _root_inputs(t)
    roles = {}
    for vid in order:
        p = t.values[vid].producer
        if p is None:
            roles[vid] = "activation" if vid in roots else "parameter"
        else:
            roles[vid] = "constant" if constant_derived(t, p, w.memo) else "activation"
    return Side(t, ordered_ops, order, start, call, len(w.subtree | ops), roles)


def _contiguous(shape, stride) -> bool:
    expect = 1
    for n, s in reversed(list(zip(shape, stride))):
        if n != 1 and s != expect:
            return False
        expect *= n
    return True


def modules_of(side: Side) -> list[str]:
    """Module paths whose calls hold the side's region ops (what a full-mode re-record must include)."""
    names = {side.call.module}
    for i in side.ops:
        names.add(side.trace.calls[side.trace.records[i].call_id].module)
    return sorted(names)


def check_values(target: Target, sa: Side, sb: Side) -> None:
    """Every value a repro needs must have its bytes in the trace; else say exactly what to record."""
    missing = []
    for side, vid_out in ((sa, target.va), (sb, target.vb)):
        need = list(side.leaves) + [vid_out]
        if any(not side.trace.has_bytes(v) for v in need):
            missing.append(side)
    if not missing:
        return
    cmds = []
    for side in missing:
        t = side.trace
        mods = modules_of(side)
        inc = "^(" + "|".join(re.escape(m) for m in mods) + ")$" if len(mods) > 1 else "^" + re.escape(mods[0]) + "$"
        engine = t.meta.get("engine")
        if isinstance(engine, dict) and engine.get("name"):  # an engine records from Python only
            cmds.append(f"divtrace.record(llm, {str(t.path) + '-full'!r}, mode='full', include={inc!r}) around the "
                        f"same {engine['name']} run")
            continue
        entry = t.meta.get("entry")
        args = " ".join(f"--arg {shlex.quote(f'{k}={v}')}" for k, v in (t.meta.get("entry_args") or {}).items())
        target_s = f"{shlex.quote(entry)} {args}".strip() if entry else "ENTRY"
        cmds.append(f"divtrace record {target_s} --mode full --include {shlex.quote(inc)} "
                    f"--out {shlex.quote(str(t.path) + '-full')}  (or in Python: divtrace.record(model, path, "
                    f"mode='full', include={inc!r}))")
    what = " and ".join(f"{s.trace.path} (mode={s.trace.mode})" for s in missing)
    raise DivtraceError(f"{what}: a repro needs the recorded tensors of the diverging region, and this trace holds "
                        f"only fingerprints there; record them with: " + " ; ".join(cmds)
                        + ", then run divtrace repro on the new traces")


def _consts(rec) -> str:
    """An op's non-tensor arguments, for telling whether two records ran the same op the same way."""
    import json

    def strip(x):
        if isinstance(x, dict) and set(x) == {"$v"}:
            return "$T"
        if isinstance(x, list):
            return [strip(y) for y in x]
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items()}
        return x

    return json.dumps([rec.op, strip(rec.args), strip(rec.kwargs)], sort_keys=True)


def common_suffix_start(sa: Side, sb: Side) -> tuple[int, int] | None:
    """Where both regions end in the same computation (same ops, same constants) applied to tensors that already
    differ, the earliest such differing pair: the first diverging output. A fused-RoPE divergence seen at the
    attention output is then reproduced at the RoPE output, without the attention that only carries it. None when
    the regions do not end alike, or the common part only moves values (views)."""
    from divtrace.compare.op_kinds import is_computing

    ta, tb = sa.trace, sb.trace
    in_a, in_b = set(sa.ops), set(sb.ops)
    frontier, seen, todo, computing = [], set(), [(sa.output, sb.output)], False
    while todo:
        va, vb = todo.pop()
        if (va, vb) in seen or _value_key(ta, va) == _value_key(tb, vb):
            continue
        seen.add((va, vb))
        pa, pb = ta.values[va].producer, tb.values[vb].producer
        ra = ta.records[pa] if pa in in_a else None
        rb = tb.records[pb] if pb in in_b else None
        if (ra is not None and rb is not None and _consts(ra) == _consts(rb) and len(ra.inputs) == len(rb.inputs)
                and ra.outputs.index(va) == rb.outputs.index(vb)):
            computing = computing or is_computing(ra, ta)
            todo.extend(zip(ra.inputs, rb.inputs))
            continue
        if ra is None or rb is None or ta.values[va].dtype != tb.values[vb].dtype or \
                ta.values[va].shape != tb.values[vb].shape:
            return None  # the sides part at something that is no clean pair of tensors: keep the whole region
        frontier.append((va, vb))
    if not computing or not frontier or frontier == [(sa.output, sb.output)]:
        return None
    return min(frontier, key=lambda p: ta.values[p[0]].producer)


def row_shape(side: Side) -> list[int] | None:
    """The shape of the token's row a token-aligned side returns, None for a whole-value side."""
    if side.row_index is None:
        return None
    shape = side.trace.values[side.output].shape
    return [n for n, i in zip(shape, list(side.row_index) + [":"] * (len(shape) - len(side.row_index))) if i == ":"]


def flatten_rows(sides: dict[str, Side]) -> None:
    """Rows of the same token in another shape on each side (HF's [H, D] head rows against an engine's [H*D]) are
    compared flat, as bisect compares them."""
    sa, sb = row_shape(sides["a"]), row_shape(sides["b"])
    if sa is not None and sb is not None and sa != sb:
        sides["a"].flat_row = sides["b"].flat_row = True


def parting_record(side: Side) -> int | None:
    """The side's first op that computes (not a view, copy or constant): where its region parts from the other's."""
    from divtrace.compare.op_kinds import is_computing

    memo: dict = {}
    for i in side.ops:
        if not constant_derived(side.trace, i, memo) and is_computing(side.trace.records[i], side.trace):
            return i
    return None
