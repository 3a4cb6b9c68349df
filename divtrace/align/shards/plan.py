"""The unshard plan of a run: for every value of the run, what its global value is and how to get it.

In the spirit of SGLang's comparator (its unsharder's planner and executor), but bitwise and in hash mode too:

1. **Data groups.** Ranks that computed the same tokens (the same token grids, or without tokens the same root
   inputs) form a group: tensor-parallel partners. Ranks with other data (data parallel, FSDP) are groups of their
   own; a token-aligned comparison pairs their rows by token identity. Each group is seen through its lowest
   rank (its representative).
2. **Alignment.** Ranks of a group run the same program: record i of one is record i of the other (the same op,
   or the same module's enter or exit). Where two ranks part, or one stopped, what follows cannot be put
   together: those values get RankLocal keys (docs/sharded.md says what that means for the verdict).
3. **Each value** of a representative, by its layout (divtrace.trace.layouts):
   - a block (`S`): the blocks of every rank of its mesh, each block once, must tile the global shape; replicas of
     a block must hold the same bytes. Its key is the global value's: the sum of the blocks' partial fingerprints.
     A layout a rule made is trusted only where the op's plain inputs were replicated.
   - a replica (`R`): every rank of its mesh must hold the same bytes, else a ReplicaMismatch (a finding: the
     walker reports it where it first appears).
   - a partial sum (`P`): RankLocal, compared only with a partial sum laid out the same way (keys.py).
   - a block whose other blocks are missing (a rank stopped before it, or has no trace): RankLocal, never
     compared.
   - routed rows (`T`): every (token, slot) row held by exactly one rank; keyed as the global value
     `[tokens * top_k, ...]` by the sum of the ranks' partials.
   - no layout: equal on every rank of the group -> replicated (the rank's key); else the ranks' own pieces
     (RankLocal). A group of one rank keeps its keys, except where a missing rank may have been its
     tensor-parallel partner.

In: a RunDir (divtrace.trace.run). Out: `Plan`: per group its ranks and each representative value's `ValuePlan`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from math import prod

from divtrace.align.shards.keys import RankLocal, ReplicaMismatch
from divtrace.trace.hashing.spec import combine_hex

_COMPUTE_RULES = {"mm", "addmm", "linear", "bmm", "_scaled_dot_product_flash_attention_for_cpu",
                  "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                  "_scaled_dot_product_cudnn_attention", "scaled_dot_product_attention"}


@dataclass
class ValuePlan:
    """How one value of a representative becomes a global value."""

    key: tuple
    kind: str  # "whole" (the representative's own bytes are the global value), "blocks", "local"
    gshape: tuple = ()
    blocks: list = field(default_factory=list)  # (rank, vid, offsets) of each distinct block ("blocks")
    rows: list | None = None  # (rank, vid) whose token rows sum to the global rows ("blocks" with row partials)
    note: str | None = None  # what a reader should know (a replica that differs, a missing block)
    layout: tuple | None = None  # (placements, mesh ranks, src, why) of the representative's layout
    real: tuple | None = None  # a derived view's blocks: the key of their bytes (the partials' sum; `key` is derived)
    routed: bool = False  # routed rows ("T"): each block's third item is its rows' global rows, not offsets
    # A key that holds the ranks' pieces (a partial sum, the ranks' own pieces): (rank, its vid) of each piece, in the
    # key's order, so a difference can be told rank by rank (divtrace.compare.shard_pieces); None for other values
    pieces: tuple | None = None


@dataclass
class Group:
    ranks: list[int]
    limit: int  # records of the representative that every rank of the group holds alike
    values: dict[int, ValuePlan] = field(default_factory=dict)
    unsure: bool = False  # a one-rank group that may have had a tensor-parallel partner among the missing ranks
    aligned: dict = field(default_factory=dict)  # rank -> how many leading records it holds alike with the rep's

    @property
    def rep(self) -> int:
        return self.ranks[0]


def _signature(t) -> tuple | None:
    """What tells ranks of one group from ranks of another: the inputs of their first root call (None before it
    was recorded: such a rank is placed in no group)."""
    roots = sorted((c for c in t.calls.values() if c.parent is None), key=lambda c: c.enter_index)
    if not roots:
        return None
    return tuple(t.vkey[v] for _, v in roots[0].inputs)


def _record_sig(t, i: int):
    op = t.rop[i]
    if op is not None:
        return op
    c = t.calls[t.rcall[i]]
    return ("e" if c.enter_index == i else "x", c.module)


def aligned_length(t0, t1) -> int:
    """How many leading records two ranks' traces hold alike (the same op, or the same module's enter/exit)."""
    n = min(len(t0.rcall), len(t1.rcall))
    for i in range(n):
        if t0.rop[i] != t1.rop[i] or (t0.rop[i] is None and _record_sig(t0, i) != _record_sig(t1, i)):
            return i
    return n


def correspondence(t0, t1, limit: int) -> dict[int, int]:
    """vid of t0 -> the vid of t1 in the same place, over the first `limit` records."""
    out: dict[int, int] = {}
    for i in range(limit):
        ins0 = t0.rin[i]
        if ins0 is not None:
            pairs = list(zip(ins0, t1.rin[i])) + list(zip(t0.rout[i], t1.rout[i]))
        else:
            c0, c1 = t0.calls[t0.rcall[i]], t1.calls[t1.rcall[i]]
            items0, items1 = (c0.inputs, c1.inputs) if c0.enter_index == i else (c0.outputs, c1.outputs)
            d1 = dict(items1)
            pairs = [(v, d1[k]) for k, v in items0 if k in d1]
        for a, b in pairs:
            out.setdefault(a, b)
    return out


def _tp_involved(layouts) -> bool:
    """Whether a rank's layouts show tensor parallelism over its activations (partial sums, a style's blocks, a
    matmul's or attention's blocks), as opposed to only gathering whole parameters (FSDP)."""
    for lay in layouts.values.values():
        if lay.pending or (lay.sharded and (lay.src in ("style", "declared") or (lay.src == "rule" and lay.why in _COMPUTE_RULES))):
            return True
    return False


class Planner:
    """Builds the Plan of a RunDir."""

    def __init__(self, run):
        self.run = run
        self.traces = run.traces
        self._corr: dict[tuple[int, int], dict[int, int]] = {}
        self._aligned: dict[tuple[int, int], int] = {}
        self.findings: list[str] = []

    def aligned(self, r0: int, q: int) -> int:
        key = (r0, q)
        if key not in self._aligned:
            self._aligned[key] = (len(self.traces[r0].rcall) if r0 == q
                                  else aligned_length(self.traces[r0], self.traces[q]))
        return self._aligned[key]

    def counterpart(self, r0: int, q: int, vid: int) -> int | None:
        if q == r0:
            return vid
        key = (r0, q)
        c = self._corr.get(key)
        if c is None:
            c = self._corr[key] = correspondence(self.traces[r0], self.traces[q], self.aligned(r0, q))
        return c.get(vid)

    def groups(self) -> list[Group]:
        sigs: dict[tuple, list[int]] = {}
        unplaced = []
        for r in self.run.ranks:
            sig = _signature(self.traces[r])
            if sig is None:
                unplaced.append(r)
            else:
                sigs.setdefault(sig, []).append(r)
        if not sigs:  # no rank got to its first root call: the lowest rank stands for the run (nothing to compare)
            sigs[()] = [unplaced.pop(0)]
        out = []
        for ranks in sorted(sigs.values()):
            aligned = {q: self.aligned(ranks[0], q) for q in ranks}
            limit = min(aligned.values())
            # A missing rank, or one that stopped before its first root call, could have been a one-rank group's
            # tensor-parallel partner: its plain values are then not taken for whole ones.
            unsure = (len(ranks) == 1 and bool(self.run.missing or unplaced)
                      and _tp_involved(self.run.layouts[ranks[0]]))
            out.append(Group(ranks, limit, unsure=unsure, aligned=aligned))
        return out

    # -- values ---------------------------------------------------------------------------------------------
    def plan(self, g: Group) -> None:
        r0 = g.rep
        t0 = self.traces[r0]
        lays = self.run.layouts[r0]
        for vid in sorted(t0.vkey):
            i = t0.vprod.get(vid, t0.vsrc.get(vid, 0))
            key = t0.vkey[vid]
            if i >= g.limit and len(g.ranks) > 1:
                g.values[vid] = ValuePlan(RankLocal((key[0], key[1], ("unaligned", r0, vid))), "local",
                                          note="past where the group's ranks part or stop")
                continue
            lay = lays.values.get(vid)
            vp = self._by_layout(g, vid, lay, i) if lay is not None else None
            if vp is None:
                vp = self._plain(g, vid)
            elif vp.kind == "blocks" and vid in t0.vprod \
                    and (t0.rop[t0.vprod[vid]].split(".") + [""])[1] in _GLOBAL_VIEWS:
                vp = _derived_blocks(t0, g, vid, vp)
            g.values[vid] = vp

    def _mesh_ranks(self, r0: int, mesh_id: int):
        m = self.run.layouts[r0].meshes.get(mesh_id)
        return (tuple(m.shape), tuple(m.ranks)) if m is not None else None

    def _peer(self, r0: int, q: int, vid: int, i: int):
        """(q's vid, q's layout of it, q's key) of r0's value `vid` defined at record i, or None."""
        if q not in self.traces or i >= self.aligned(r0, q):
            return None
        vq = self.counterpart(r0, q, vid)
        if vq is None:
            return None
        return vq, self.run.layouts[q].values.get(vq), self.traces[q].vkey[vq]

    def _same_layout(self, r0, lay, q, lq) -> bool:
        return (lq is not None and lq.placements == lay.placements and lq.global_shape == lay.global_shape
                and self._mesh_ranks(q, lq.mesh) == self._mesh_ranks(r0, lay.mesh))

    def _by_layout(self, g: Group, vid: int, lay, i: int) -> ValuePlan | None:
        r0 = g.rep
        t0 = self.traces[r0]
        key0 = t0.vkey[vid]
        mesh = self._mesh_ranks(r0, lay.mesh)
        if mesh is None:
            return None
        desc = (tuple(lay.placements), mesh[1], lay.src, lay.why)
        if lay.src == "rule" and not self._rule_inputs_ok(g, t0, i):
            return None
        peers = {}
        for q in mesh[1]:
            p = self._peer(r0, q, vid, i)
            if p is None or not self._same_layout(r0, lay, q, p[1]):
                missing = q not in self.traces
                why = (f"rank {q} " + ("has no trace" if missing else "holds no matching block")
                       + f" of this value ({'/'.join(lay.placements)} over ranks {list(mesh[1])})")
                return ValuePlan(RankLocal((key0[0], key0[1], ("missing", q, vid))), "local", note=why, layout=desc)
            peers[q] = p
        if lay.pending:
            pieces = tuple(p[2] for p in peers.values())  # (compared only with a partial sum laid out the same way)
            return ValuePlan(RankLocal((key0[0], key0[1], ("partial", tuple(lay.placements)) + pieces)),
                             "local", note="a partial sum before its reduction", layout=desc,
                             pieces=tuple((q, p[0]) for q, p in peers.items()))
        if lay.routed:
            return _routed_plan(key0, vid, lay, peers, desc)
        boxes: dict[tuple, list] = {}
        for q, (vq, lq, kq) in peers.items():
            boxes.setdefault(tuple(lq.offsets), []).append((q, vq, lq, kq))
        for off, reps in boxes.items():
            first = reps[0]
            bad = [q for q, _, _, k in reps[1:] if k != first[3]]
            if bad:
                if lay.src == "rule" and not lay.sharded:
                    return None  # a replica a rule assumed: the ranks' own values after all
                note = (f"replicas differ: ranks {bad} hold other bytes than rank {first[0]} for "
                        + ("the block at offsets " + str(list(off)) if lay.sharded else "this replicated value"))
                self.findings.append(note)
                return ValuePlan(ReplicaMismatch((key0[0], tuple(lay.global_shape), note)), "local", note=note,
                                 layout=desc)
        if not lay.sharded:
            return ValuePlan(key0, "whole", tuple(key0[1]), layout=desc)
        gshape = tuple(lay.global_shape)
        total = sum(prod(reps[0][3][1]) for reps in boxes.values())
        if total != prod(gshape) or any(reps[0][2].partial is None for reps in boxes.values()):
            return ValuePlan(RankLocal((key0[0], key0[1], ("untiled", vid))), "local", layout=desc,
                             note=f"the blocks do not tile the global shape {list(gshape)}")
        partial = combine_hex([reps[0][2].partial for reps in boxes.values()])
        blocks = [(reps[0][0], reps[0][1], tuple(off)) for off, reps in sorted(boxes.items())]
        rows = ([(q, vq) for q, vq, _ in blocks] if all(reps[0][2].row_partials for reps in boxes.values())
                else None)
        return ValuePlan((key0[0], gshape, partial), "blocks", gshape, blocks, rows, layout=desc)

    def _rule_inputs_ok(self, g: Group, t0, i: int) -> bool:
        """A rule assumed the op's plain inputs replicated: were they (keys already planned)?"""
        ins = t0.rin[i] if i < len(t0.rin) else None
        if ins is None:
            return True
        for u in ins:
            vp = g.values.get(u)
            if vp is not None and vp.kind == "local" and type(vp.key) is RankLocal and vp.key.kind == "local":
                return False
        return True

    def _plain(self, g: Group, vid: int) -> ValuePlan:
        r0 = g.rep
        key0 = self.traces[r0].vkey[vid]
        if len(g.ranks) == 1:
            if g.unsure:
                return ValuePlan(RankLocal((key0[0], key0[1], ("unverified", r0, vid))), "local",
                                 note="a missing rank may hold the rest of it")
            return ValuePlan(key0, "whole", tuple(key0[1]))
        keys, vids = [], []
        for q in g.ranks:
            vq = self.counterpart(r0, q, vid)
            keys.append(self.traces[q].vkey[vq] if vq is not None else None)
            vids.append((q, vq))
        if all(k == key0 for k in keys):
            return ValuePlan(key0, "whole", tuple(key0[1]))
        return ValuePlan(RankLocal((key0[0], key0[1], ("local",) + tuple(keys))), "local",
                         note="each rank holds its own piece, and no layout says how they make the whole",
                         pieces=tuple(vids))


def _routed_plan(key0, vid: int, lay, peers: dict, desc) -> ValuePlan:
    """Routed rows (`T`): every (token, slot) of the global value `[tokens * top_k, ...]` held by exactly one rank of
    the mesh; the key is the sum of the ranks' partials (each rank's rows at their global rows), the blocks each
    rank's rows with their global rows (docs/sharded.md, "Routed rows")."""
    seen: dict[int, int] = {}
    blocks = []
    for q, (vq, lq, _) in sorted(peers.items()):
        rows = lq.global_rows()
        for g in rows:
            if g in seen or lq.top_k != lay.top_k:
                why = (f"rank {q} and rank {seen[g]} both hold (token {g // lay.top_k}, slot {g % lay.top_k})"
                       if g in seen else f"rank {q} declares top_k {lq.top_k}, rank {min(peers)} {lay.top_k}")
                return ValuePlan(RankLocal((key0[0], key0[1], ("unrouted", vid))), "local", layout=desc,
                                 note=f"the routed rows do not fit together: {why}")
            seen[g] = q
        blocks.append((q, vq, tuple(rows)))
    gshape = tuple(lay.global_shape)
    if len(seen) != gshape[0]:
        return ValuePlan(RankLocal((key0[0], key0[1], ("unrouted", vid))), "local", layout=desc,
                         note=f"the ranks' routed rows hold {len(seen)} of the {gshape[0]} (token, slot) rows")
    partial = combine_hex([lq.partial for _, lq, _ in peers.values()])
    return ValuePlan((key0[0], gshape, partial), "blocks", gshape, blocks, None, layout=desc, routed=True)


def _derived_blocks(t0, g: Group, vid: int, vp: ValuePlan) -> ValuePlan:
    """Blocks of a view of blocks (a weight block's `t()`, a head block's transpose or slice): keyed as a one-process
    trace keys that view of the global input where it derives its fingerprint (from the op and the input's: the
    view of the global value is strided), so the two compare; the blocks' partials stay the key of the bytes
    (`real`). Only where the op's arguments hold no sizes of the rank's own block: the op applied to the global
    input's shape must give the value's global shape (t, transpose, permute; a slice, select, unsqueeze or squeeze
    off the split dim). Whether the rank itself derived its view does not matter: a rank's one K/V
    head `[B, T, 1, d]` transposed is contiguous, hashed from its bytes, while the global transpose is strided,
    derived on the one-process side (hash mode had counted the two as different: a false difference)."""
    from divtrace.trace.derived_views import view_fingerprint

    rec = t0.records[t0.vprod[vid]]
    src = g.values.get(rec.inputs[0]) if rec.inputs and len(set(rec.inputs)) == 1 else None
    if (src is None or src.kind == "local"
            or type(src.key[2]) is not str
            or not _strided_globally(rec, src.key[1], t0.values[rec.inputs[0]].stride, vp.key[1])):
        return vp
    key = (vp.key[0], vp.key[1], view_fingerprint(rec.op, src.key[2], src.key[0], list(src.key[1]), list(vp.key[1]),
                                                  rec.args, rec.kwargs))
    return ValuePlan(key, vp.kind, vp.gshape, vp.blocks, vp.rows, vp.note, vp.layout, real=vp.key, routed=vp.routed)


_GLOBAL_VIEWS = frozenset(("t", "transpose", "permute", "numpy_T", "mT", "slice", "select", "unsqueeze", "squeeze"))


def _strided_globally(rec, src_shape, src_stride, shape) -> bool:
    """Whether view op `rec`, with the rank's arguments, of the global input (of shape `src_shape`, its dims laid out
    in memory in the order of the rank's block's strides `src_stride`) gives the global shape `shape` as a
    non-contiguous view: what a one-process recorder derives a fingerprint for (divtrace.record.values). False where
    it cannot be told (an argument that is a tensor, arguments that do not fit the global shape)."""
    import torch

    args = rec.args[1:]
    if rec.kwargs or any(type(a) is dict for a in args) or len(src_stride) != len(src_shape):
        return False
    order = sorted(range(len(src_shape)), key=lambda d: (-src_stride[d], d))  # outermost first
    stride, n = [0] * len(src_shape), 1
    for d in reversed(order):
        stride[d], n = n, n * src_shape[d]
    try:
        fn = getattr(getattr(torch.ops.aten, rec.op.split(".")[1]), rec.op.split(".")[2])
        out = fn(torch.empty_strided(tuple(src_shape), tuple(stride), device="meta"), *args)
    except Exception:  # noqa: BLE001 (arguments that do not fit the global shape: sizes of the rank's block)
        return False
    return isinstance(out, torch.Tensor) and tuple(out.shape) == tuple(shape) and not out.is_contiguous()


def build_plan(run) -> tuple[list[Group], list[str], Planner]:
    """The groups of a RunDir with every representative value planned, and the replica findings."""
    p = Planner(run)
    groups = p.groups()
    for g in groups:
        p.plan(g)
    return groups, p.findings, p
