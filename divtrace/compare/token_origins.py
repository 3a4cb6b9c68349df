"""Every origin of the tokens whose final values differ, with true counts, in execution order.

- Positions first: a token whose position ids (as the model used them: `used`, else the ones fed) differ between
  the sides is computed at another position; that is its cause ("position ids differ"), before any op.
- The other tokens are grouped by their first differing module (the sweep's), so every distinct place is walked,
  not only the first tokens by position. Each group's representatives are walked along differing outputs
  (output_walker); a group's tokens count for the origin its representative leads to.
- A parting op with an input that was not compared for the token (a decode step's KV cache against a trainer's
  per-token K rows) is no proven origin yet: where a token the representative attends to (an earlier token of its
  sequence) differs inside the same module, that token's difference is the origin, reaching this token through
  attention; it is walked and counted there.
- An attention op whose own rows of the token are equal on both sides reads the K/V rows of the earlier tokens of
  its sequence too: its inputs are equal for the token only when those rows are. Where an earlier token's rows of
  the op's inputs differ, that token's difference is the origin (walked from where its rows first differ, which
  may be a module before this one, its own output equal: absorbed for it, not for the tokens attending to it).
- The order: an origin's op offset in its root call's forward (side a). A decode step's op is never earlier by wall
  time: offsets are within one forward.

In: the sweep, the compared finals, the folded views. Out: `Origin`s, the first one first.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from divtrace.align.tokens import TraceTokens
from divtrace.align.views import TokenViews
from divtrace.compare.op_kinds import attention_module, reads_other_tokens
from divtrace.compare.output_walker import OutputWalker
from divtrace.compare.results import Divergence
from divtrace.compare.values import TokenComparator

MAX_WALKS = 48
MAX_KV_CHECKS = 64  # earlier tokens whose K/V rows are checked for one attention origin
MAX_HOPS = 8  # tokens followed back through attention, one after the other
_LATE = 1 << 60


@dataclass
class Origin:
    d: Divergence | None  # None for a positions origin
    key: int  # the representative token
    cells: tuple  # (root a, cell a, root b, cell b) of the representative
    tokens: set = field(default_factory=set)
    order: int = _LATE  # the parting op's offset in its root call's forward on side a
    kind: str = "op"  # "op" | "module" | "positions" | "derivation"
    note: str | None = None  # how it reaches the tokens counted (through attention over another token's K/V)
    uncompared: list = field(default_factory=list)  # inputs of the parting op not compared for the token
    positions: tuple | None = None  # (a's, b's) position ids, for a positions origin
    walked_for: int | None = None  # the token walked to find it (its final differs; `key` may be another token)
    offset: int = 0  # the parting op's record offset in its module call: the same op in every root call

    def signature(self):
        d = self.d
        if d is None:
            return (self.kind,)
        return (d.module, d.call, d.op, d.op_b, d.kind, self.offset)


def position_diffs(sa: TraceTokens, sb: TraceTokens, shared: list) -> dict:
    """token key -> (position id on a, on b) where both are known and differ: `used` (read inside the call) where
    recorded, else what was fed."""
    out = {}
    for k in shared:
        pa, pb = _position(sa, k), _position(sb, k)
        if pa >= 0 and pb >= 0 and pa != pb:
            out[k] = (pa, pb)
    return out


def _position(tok: TraceTokens, k: int) -> int:
    cid, cell = tok.where[k]
    g = tok.index.grids[cid]
    if g.used is not None:
        return g.used[cell]
    return g.fed[cell]


def find_origins(sa: TraceTokens, sb: TraceTokens, views: TokenViews, explain: list, first_module: dict,
                 module_rows: dict, positions: dict, fin_a: dict, fin_b: dict, tol=None,
                 any_differs=None) -> tuple[list[Origin], int]:
    """(the origins, the first one first; how many tokens were walked). `any_differs`: the tokens with a differing
    row anywhere (the sweep's), the earlier tokens an attention origin's K/V rows are checked for."""
    found: list[Origin] = []
    if any(k in positions for k in explain):
        # every token computed at another position, whether its own final value was compared or not (prompt rows
        # of a rollout under logits_to_keep=1 have none): the lowest position names it
        k0 = min(positions, key=lambda k: (_pos_of(sa, k), k))
        o = Origin(None, k0, _cells(sa, sb, k0), set(positions), order=-1, kind="positions",
                   positions=positions[k0])
        found.append(o)
    rest = [k for k in explain if k not in positions]
    groups: dict = {}
    for k in rest:
        groups.setdefault(first_module.get(k, (_LATE, None))[1], []).append(k)
    for g in groups.values():
        g.sort(key=lambda k: _first(sa, k))
    # Representatives: one per group first, then round robin, up to MAX_WALKS walks.
    reps: list[tuple] = []
    depth = 0
    while len(reps) < MAX_WALKS and any(len(g) > depth for g in groups.values()):
        for label, g in groups.items():
            if depth < len(g) and len(reps) < MAX_WALKS and (depth < 2 or len(reps) < MAX_WALKS // 2):
                reps.append((label, g[depth]))
        depth += 1
    walker_for = _Walkers(sa, sb, views, tol, first_module, set(any_differs or ()))
    by_group: dict = {}
    for label, k in reps:
        o = _walk(walker_for, sa, sb, k, fin_a, fin_b, module_rows)
        if o is not None:
            o.walked_for = k
            by_group.setdefault(label, []).append(o)
    for label, g in groups.items():
        walked = by_group.get(label)
        if not walked:
            continue
        reps_keys = {o.walked_for for o in walked}
        for o in walked:
            o.tokens = {o.walked_for}
        for k in g:
            if k not in reps_keys:
                walked[0].tokens.add(k)
        found.extend(walked)
    # One origin per place: the walk of its first token (lowest position, then the earlier root call and row of
    # side a: on a data-parallel / FSDP run view, the lower rank's sequence) names it, token and records alike.
    # The same op of another rank's forward is another record of the view: the token and the records it names
    # must be one walk's, never one walk's token with another's records.
    merged: dict = {}
    for o in found:
        sig = o.signature()
        have = merged.get(sig)
        if have is None:
            merged[sig] = o
            continue
        if _first(sa, o.key) < _first(sa, have.key):
            merged[sig], have, o = o, o, have
        have.tokens |= o.tokens
        have.note = have.note or o.note  # (some of its tokens it reaches through attention)
    return sorted(merged.values(), key=lambda o: (o.order, _first(sa, o.key))), len(reps)


class _Walkers:
    def __init__(self, sa, sb, views, tol, first_module=None, any_differs=()):
        self.sa, self.sb, self.views, self.tol = sa, sb, views, tol
        self.first_module = first_module or {}
        self.any_differs = any_differs

    def __call__(self, k: int):
        ra, ca = self.sa.where[k]
        rb, cb = self.sb.where[k]
        va, vb, pairing = self.views.pair(ra, ca, rb, cb)
        return OutputWalker(va, vb, pairing, TokenComparator(va, vb, self.tol)), (ra, ca, rb, cb)


def _walk(walker_for, sa, sb, k, fin_a, fin_b, module_rows) -> Origin | None:
    walker, cells = walker_for(k)
    va, vb = walker.a, walker.b
    fa, fb = fin_a.get(k), fin_b.get(k)
    target = (fa.vid, fb.vid, "final value") if fa is not None and fb is not None and fa.kind == fb.kind else None
    try:
        d = walker.localize_output(va.root, vb.root, target)
    except AssertionError:
        if fa is not None and fb is not None and fa.kind != fb.kind:
            return Origin(None, k, cells, order=_LATE - 1, kind="derivation")
        return None
    o = Origin(d, k, cells, order=_order(va, d, cells[0]), kind=d.kind, offset=_offset(va, d))
    if fa is not None and fb is not None and fa.kind != fb.kind and d.module == "" and d.cause == "origin" \
            and not walker.output_differs(va.root, vb.root):
        o.kind, o.d = "derivation", None  # only the logprobs derived from the logits differ
        o.order = _LATE - 1
        return o
    o.uncompared = walker.uncompared_inputs(d) if d.kind == "op" else []
    if any(("cross-token" in u or "no token rows" in u) and not _made_from_no_token(walker, d, u)
           for u in o.uncompared):
        via = _through_attention(walker_for, sa, k, d, module_rows)
        if isinstance(via, str):  # the other token's rows differ before this module: k's first difference is here
            o.note = via
        elif via is not None:
            return via
    elif d.kind == "op" and reads_other_tokens(d.op):
        via = _through_kv_rows(walker_for, sa, k, d)
        if isinstance(via, str):  # an earlier token's K/V rows differ, and where they first do is not proven
            o.note = via
            o.uncompared = [via]
        elif via is not None:
            return via
    elif d.kind == "op" and o.uncompared and attention_module(d.module):
        via = _through_own_code_attention(walker_for, sa, k, d, module_rows)
        if via is not None:
            return via
    return o


# ops that only re-lay one input's elements out (or copy them): a weight's t(), a cast of it
_LAYOUT_OPS = frozenset(("t", "transpose", "permute", "view", "_unsafe_view", "reshape", "alias", "expand", "slice",
                         "select", "unsqueeze", "squeeze", "clone", "contiguous", "_to_copy", "detach", "lift_fresh"))


def _made_from_no_token(walker, d: Divergence, what: str) -> bool:
    """Whether the op input `what` names ("input N of ...", not compared for the token: no token rows) is, on both
    sides, a named parameter that no recorded op computed, seen through ops that only lay it out (a weight's `t()`): a weight that differs is the op's own input, read alike by every token, not another
    token's K/V rows; the token's origin is this op, not an earlier token's difference."""
    if not what.startswith("input ") or d.index is None or d.index_b is None:
        return False
    try:
        pos = int(what.split(" ", 2)[1])
    except ValueError:
        return False
    from divtrace.compare.params import name_of_value

    for t, i in ((walker.a, d.index), (walker.b, d.index_b)):
        if pos >= len(t.rin[i]):
            return False
        v = t.rin[i][pos]
        for _ in range(16):
            j = t.vprod.get(v)
            if j is None:
                break
            ins = set(t.rin[j] or ())
            if len(ins) != 1 or (t.rop[j].split(".") + [""])[1] not in _LAYOUT_OPS:
                return False
            v = ins.pop()
        else:
            return False
        named = name_of_value(t, v)  # a named parameter (not a buffer: a KV cache may be one, written by a kernel)
        if named is None or named[0] != "parameter":
            return False
    return True


def _order(view, d: Divergence, root_cid: int) -> int:
    root = view.calls[root_cid]
    at = d.index if d.index is not None else root.enter_index
    return at - root.enter_index


def _offset(view, d: Divergence) -> int:
    call = next((c for c in view.calls.values() if c.module == d.module and c.call == d.call), None)
    return (d.index - call.enter_index) if call is not None and d.index is not None else 0


def _earlier_differing(sa: TraceTokens, k: int, module_rows: dict, labels) -> tuple[int, set]:
    """(k's position in its sequence, {(position, token)} of each earlier token of k's sequence whose rows differ at
    one of the module labels)."""
    ra, ca = sa.where[k]
    g = sa.index.grids[ra]
    seq, pos = g.seq[ca], g.pos[ca]
    cands = set()
    for label in labels:
        for x, differs in module_rows[label][1].items():
            if differs and x != k and x in sa.where:
                rx, cx = sa.where[x]
                gx = sa.index.grids[rx]
                if gx.seq[cx] == seq and gx.pos[cx] < pos:
                    cands.add((gx.pos[cx], x))
    return pos, cands


def _through_attention(walker_for, sa: TraceTokens, k: int, d: Divergence, module_rows: dict):
    """Where `d` (for token k) parts at an op with an input not compared for k (attention over the other tokens'
    K/V): the earlier tokens of k's sequence whose rows differ inside the same module are where it comes from.
    The earliest such token is walked inside that module (what makes its rows differ, whether or not its own
    output shows it), and k is counted there. Where that token's rows differ at the module's inputs already, k's
    first difference stays k's own op here: a note (str) says so."""
    prefix = d.module + "."
    mods = [label for label in module_rows if label == d.module or label.split(" #")[0].startswith(prefix)]
    pos, cands = _earlier_differing(sa, k, module_rows, mods)
    if not cands:
        return None
    px, x = min(cands)
    walker, cells = walker_for(x)
    va, vb = walker.a, walker.b
    ma = next((c for c in va.calls.values() if c.module == d.module and c.call == d.call), None)
    mb = walker.pairing.partner(ma) if ma is not None else None
    if mb is None or not walker.differs(ma, mb):
        return None
    dx = walker.localize(ma, mb)
    if dx.cause != "origin":  # x's rows differ at the module's inputs already: from an earlier module of x's
        return (f"reaches the token at position {pos} through attention over the K/V rows of the token at position "
                f"{px} of its sequence, which differ before this module (from an earlier origin of that token's)")
    o = Origin(dx, x, cells, {k}, order=_order(va, dx, cells[0]), kind=dx.kind, offset=_offset(va, dx),
               note=f"reaches the token at position {pos} through attention over the K/V rows of the token at "
                    f"position {px} of its sequence")
    o.uncompared = walker.uncompared_inputs(dx) if dx.kind == "op" else []
    return o


def _through_kv_rows(walker_for, sa: TraceTokens, k: int, d: Divergence, hops: int = 0):
    """Where `d` (for token k) parts at an attention op whose inputs' rows of k are equal: the op reads the K/V rows
    of the earlier tokens of k's sequence too. The earliest such token x (same root call) whose rows of the op's
    inputs differ is where k's difference comes from: x is walked from where its rows first differ (the sweep's
    first differing module for x; that module's inputs equal for x), and k is counted there. None where every
    earlier token's rows of the op's inputs are equal (k's inputs are then all equal: the op is the origin); a
    note (str) where x's first difference cannot be localized (k's op stays, its inputs not all equal)."""
    ra, ca = sa.where[k]
    g = sa.index.grids[ra]
    seq, pos = g.seq[ca], g.pos[ca]
    cands = []
    for x in walker_for.any_differs:
        if x == k or x not in sa.where:
            continue
        rx, cx = sa.where[x]
        if rx == ra and g.seq[cx] == seq and g.pos[cx] < pos:
            cands.append((g.pos[cx], x))
    cands.sort()
    for n, (px, x) in enumerate(cands):
        if n == MAX_KV_CHECKS:
            return (f"the op reads the K/V rows of the earlier tokens of its sequence; those of more than "
                    f"{MAX_KV_CHECKS} earlier tokens differ somewhere and were not all checked")
        walker, cells = walker_for(x)
        if cells[2] != walker_for.sb.where[k][0] or not _op_inputs_differ(walker, d):
            continue
        reach = (f"reaches the token at position {pos} through attention over the K/V rows of the token at position "
                 f"{px} of its sequence")
        dx = _first_difference(walker, x, walker_for.first_module)
        if dx is None or dx.cause != "origin":
            return (f"{reach}, whose first difference is not localized: the attention's inputs are not all equal for "
                    "the token")
        o = Origin(dx, x, cells, {k}, order=_order(walker.a, dx, cells[0]), kind=dx.kind,
                   offset=_offset(walker.a, dx), note=reach)
        o.uncompared = walker.uncompared_inputs(dx) if dx.kind == "op" else []
        if dx.kind == "op" and reads_other_tokens(dx.op) and not o.uncompared and hops < MAX_HOPS:
            via = _through_kv_rows(walker_for, sa, x, dx, hops + 1)  # x's own difference came through attention
            if isinstance(via, Origin):
                via.tokens, via.note = {k}, reach
                return via
            if isinstance(via, str):
                o.note, o.uncompared = f"{reach}; {via}", [via]
        return o
    return None


def _through_own_code_attention(walker_for, sa: TraceTokens, k: int, d: Divergence, module_rows: dict, hops: int = 0):
    """Where `d` (for token k) parts in the own code of an attention module (self_attn: an engine's attention
    written in torch ops, or code one side has and the other not), with inputs of the parting ops not compared:
    the attention reads the K/V rows of the earlier tokens of k's sequence. The earliest such token x whose rows
    differ inside the module (at its output or any module under it, in any root call) is where k's difference
    comes from when x's first difference (the sweep's first differing module for x, walked like a token of its
    own, possibly through attention again) is an earlier op of the forward than k's parting op: k is counted
    there. None otherwise (x's difference is the same op as k's, such as a rotary multiply every token has: k's
    op stays k's origin; or it is not localized)."""
    prefix = d.module + "."
    mods = [label for label in module_rows if label.split(" #")[0] == d.module or label.startswith(prefix)]
    pos, cands = _earlier_differing(sa, k, module_rows, mods)
    if not cands:
        return None
    px, x = min(cands)
    walker, cells = walker_for(x)
    dx = _inside(walker, d) or _first_difference(walker, x, walker_for.first_module)
    if dx is None or dx.cause != "origin" or dx.kind != "op":
        return None
    if dx.index is None or d.index is None or dx.index >= d.index:  # not an earlier op than k's own parting op (a's)
        return None
    reach = (f"reaches the token at position {pos} through attention over the K/V rows of the token at position "
             f"{px} of its sequence")
    o = Origin(dx, x, cells, {k}, order=_order(walker.a, dx, cells[0]), kind=dx.kind, offset=_offset(walker.a, dx),
               note=reach)
    o.uncompared = walker.uncompared_inputs(dx)
    if o.uncompared and attention_module(dx.module) and hops < MAX_HOPS:  # x's own difference came through attention
        via = _through_own_code_attention(walker_for, sa, x, dx, module_rows, hops + 1)
        if via is not None:
            via.tokens, via.note = {k}, reach
            return via
    return o


def _inside(walker, d: Divergence) -> Divergence | None:
    """The walker's token's difference inside d's module (its call in the token's root call, or d's call), where
    that call's output differs for the token and its inputs do not (the module's own code, or a call under it,
    made it); else None."""
    calls = [c for c in walker.a.calls.values() if c.module == d.module]
    ca = next((c for c in calls if c.call == d.call), None) if len(calls) != 1 else calls[0]
    cb = walker.pairing.partner(ca) if ca is not None else None
    if cb is None or not walker.differs(ca, cb):
        return None
    dx = walker.localize(ca, cb)
    return dx if dx.cause == "origin" else None


def _op_inputs_differ(walker, d: Divergence) -> bool:
    """Whether the rows of token (the walker's) in the inputs of d's op differ on the two sides."""
    if d.index is None or d.index_b is None:
        return False
    ins_a, ins_b = walker.a.rin[d.index], walker.b.rin[d.index_b]
    return len(ins_a) == len(ins_b) and any(not walker.cmp.same(va, vb) for va, vb in zip(ins_a, ins_b))


def _first_difference(walker, x: int, first_module: dict) -> Divergence | None:
    """x's first difference: inside the module call whose output rows of x differ first (the sweep's), or None.
    Where that call's input rows of x differ already, its parent's own code made them (the sweep's first module is
    the first to exit: an o_proj whose input is its attention's output, which differs for x because the attention
    read an earlier token's K/V rows): the walk goes up to the first ancestor that localizes x's difference."""
    got = first_module.get(x)
    if got is None:
        return None
    path, _, n = got[1].partition(" #")
    ca = next((c for c in walker.a.calls.values() if c.module == path and c.call == (int(n) if n else 0)), None)
    cb = walker.pairing.partner(ca) if ca is not None else None
    if cb is None or not walker.differs(ca, cb):
        return None
    d = walker.localize(ca, cb)
    while d.cause == "propagated" and ca.parent is not None and ca.parent in walker.a.calls:
        pa = walker.a.calls[ca.parent]
        pb = walker.pairing.partner(pa)
        if pb is None or not walker.differs(pa, pb):
            break
        ca, cb = pa, pb
        d = walker.localize(ca, cb)
    return d


def _cells(sa, sb, k):
    ra, ca = sa.where[k]
    rb, cb = sb.where[k]
    return (ra, ca, rb, cb)


def _pos_of(sa: TraceTokens, k: int) -> int:
    cid, cell = sa.where[k]
    return sa.index.grids[cid].pos[cell]


def _first(sa: TraceTokens, k: int) -> tuple:
    """Which of two tokens comes first: the lower position, then side a's earlier root call and row."""
    cid, cell = sa.where[k]
    g = sa.index.grids[cid]
    return g.pos[cell], g.root_call, cell, k
