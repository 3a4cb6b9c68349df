"""Parameters of runs of different layouts (TP=2 against one process, FSDP2 against one process, TP=2 against TP=4),
compared by name in global coordinates, and the replicas of one run checked equal to each other.

Each side's holding of a name is put together from its ranks (`gather`):
- one process: the whole value (`whole`);
- a run whose ranks' values of the name have a layout (layouts.jsonl: a DTensor parameter's local tensor, `param`
  or `dtensor`; or, for a parameter no op read, the layout on its fingerprint line in params.jsonl) of `S` and `R`
  placements only: each rank's block at its global offsets (`blocks`), which must tile the global value;
- a run whose ranks hold it with no layout, all of one dtype and shape (`copies`): each rank's tensor is taken for a
  whole copy only where that shape is the other side's global shape (a norm weight HF's TP plan leaves whole, an
  FSDP2 parameter all-gathered for the forward). Anything else (a partial sum, routed rows, a layout on some ranks
  only, other shapes on other ranks with no layout, copies against copies) is not compared, with the reason.

Then (`compare`): the global fingerprints (the blocks' partial fingerprints summed, no bytes moved), and each block
of each side against the other side's same place: its partial against the other side's, taken from the other
side's blocks that tile that place, from the bytes where the other side holds them (full mode), or from its chunk
partials (a whole parameter's, params.jsonl `ch`, hash mode). Full mode also puts the bytes together, counts the
elements that differ and names the rows. A differing parameter names the ranks whose block differs and the
block's place. Never a difference where names, dtypes or global shapes do not pair.

Replicas: the ranks of one side that hold the same place of a value (an `R` placement, a copy) are checked equal to
each other; a copy that differs from the lowest rank's is a finding of that run on its own (`replicas`).

In: the per-rank traces and their names. Out: the entries of `parameters` (docs/json.md).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from math import prod

from divtrace.trace.hashing.spec import combine_hex

_ROWS = 16  # differing rows named (full mode)


@dataclass
class Piece:
    """One rank's holding of a value: its place in the global value (start, length per dim) and its partial
    fingerprint there (the whole's fingerprint where the place is the whole)."""

    rank: int | None
    trace: object
    vid: int | None
    region: tuple
    hash: str


@dataclass
class Held:
    """One side's holding of one value of a name."""

    dtype: str
    shape: tuple
    how: str  # "whole", "blocks" or "copies"
    pieces: list = field(default_factory=list)
    chunks: list | None = None  # [(dim, [(start, length, partial)])] of a whole parameter (hash mode)


def gather(side: list, layouts_of) -> tuple[dict, dict]:
    """({name: [Held per value] or a reason it is not put together}, {name: kind}) of one side: `side` is
    [(rank or None, trace, ParamNames)]."""
    by_name: dict[str, dict] = {}
    kinds: dict[str, str] = {}
    for rank, t, names in side:
        for name, vals in names.values.items():
            by_name.setdefault(name, {})[rank] = (t, vals)
            kinds.setdefault(name, names.kinds.get(name, "parameter"))
    out = {}
    for name, ranks in by_name.items():
        counts = {len(v[1]) for v in ranks.values()}
        if len(counts) != 1:
            out[name] = "its ranks hold different numbers of values of it (written in place on some ranks only)"
            continue
        held = []
        for i in range(counts.pop()):
            h = _held(name, {r: (t, vals[i]) for r, (t, vals) in ranks.items()}, layouts_of)
            if isinstance(h, str):
                held = h
                break
            held.append(h)
        out[name] = held
    return out, kinds


def _held(name, ranks: dict, layouts_of) -> Held | str:
    if list(ranks) == [None]:
        t, nv = ranks[None]
        shape = tuple(nv.key[1])
        return Held(nv.key[0], shape, "whole", [Piece(None, t, nv.vid, _whole(shape), nv.key[2])], nv.chunks)
    laid, plain = [], []
    for r, (t, nv) in sorted(ranks.items()):
        lay = nv.layout if nv.vid is None else layouts_of(t).values.get(nv.vid)
        (plain if lay is None else laid).append((r, t, nv, lay))
    if laid and plain:
        return (f"rank {plain[0][0]} holds it with no layout, rank {laid[0][0]} as a block: the layout of the "
                "value is not known on every rank")
    if plain:
        keys = {nv.key[:2] for _, _, nv, _ in plain}
        if len(keys) != 1:
            return "its ranks hold it in other shapes or dtypes with no layout (blocks divtrace has no layout for)"
        shape = tuple(plain[0][2].key[1])
        return Held(plain[0][2].key[0], shape, "copies",
                    [Piece(r, t, nv.vid, _whole(shape), nv.key[2]) for r, t, nv, _ in plain])
    gshapes = {tuple(lay.global_shape) for *_, lay in laid}
    dtypes = {nv.key[0] for _, _, nv, _ in laid}
    if len(gshapes) != 1 or len(dtypes) != 1:
        return "its ranks' layouts name other global shapes or dtypes"
    gshape = gshapes.pop()
    pieces = []
    for r, t, nv, lay in laid:
        p = list(lay.placements)
        if not all(x == "R" or x.startswith("S") for x in p):
            return f"rank {r} holds it as {p} (a partial sum or routed rows, not put together here)"
        local = tuple(nv.key[1])
        if len(local) != len(gshape) or any(o + n > g for o, n, g in zip(lay.offsets, local, gshape)):
            return f"rank {r}'s block does not fit its layout"
        sharded = any(x.startswith("S") for x in p)
        if sharded and not lay.partial:
            return f"rank {r}'s block has no partial fingerprint"
        if not sharded and local != gshape:
            return f"rank {r}'s replica is not of the global shape"
        pieces.append(Piece(r, t, nv.vid, tuple(zip(lay.offsets, local)), lay.partial if sharded else nv.key[2]))
    if not _tiles(gshape, {p.region for p in pieces}):
        return "its ranks' blocks do not cover the global value once (a rank's trace missing, or blocks that overlap)"
    return Held(dtypes.pop(), gshape, "blocks", pieces)


def _whole(shape) -> tuple:
    return tuple((0, n) for n in shape)


def _vol(region) -> int:
    return prod(n for _, n in region)


def _inside(inner, outer) -> bool:
    return all(o <= i and i + n <= o + m for (i, n), (o, m) in zip(inner, outer))


def _disjoint(x, y) -> bool:
    return any(a + n <= b or b + m <= a for (a, n), (b, m) in zip(x, y))


def _tiles(shape, regions, within=None) -> bool:
    """Whether the distinct `regions` (all inside `within`, the whole by default) cover it once."""
    within = within or _whole(shape)
    regions = list(regions)
    if not all(_inside(r, within) for r in regions) or sum(map(_vol, regions)) != _vol(within):
        return False
    return all(_disjoint(x, y) for i, x in enumerate(regions) for y in regions[i + 1:])


def _reps(h: Held) -> dict:
    """region -> the lowest rank's piece there (the representative of its copies)."""
    out = {}
    for p in sorted(h.pieces, key=lambda p: -1 if p.rank is None else p.rank):
        out.setdefault(p.region, p)
    return out


def replicas(name: str, kind: str, side: str, h: Held) -> list[dict]:
    """The places of `h` held by several ranks whose copies differ: one finding per place."""
    out = []
    reps = _reps(h)
    for region, ref in reps.items():
        same = [p for p in h.pieces if p.region == region]
        bad = [p.rank for p in same if p.hash != ref.hash]
        if bad:
            out.append({"side": side, "name": name, "kind": kind, "dtype": h.dtype, "shape": list(h.shape),
                        "offsets": [o for o, _ in region], "block": [n for _, n in region],
                        "ranks": sorted(p.rank for p in same), "reference": ref.rank, "differ": sorted(bad)})
    return out


class _Bytes:
    """One side's global value put together from its pieces' stored bytes (full mode), or None where a piece has
    none."""

    def __init__(self, h: Held):
        self.t = None
        reps = _reps(h)
        if not all(p.vid is not None and getattr(p.trace, "mode", None) == "full" for p in reps.values()):
            return
        try:
            got = {region: p.trace.tensor(p.vid) for region, p in reps.items()}
            first = next(iter(got.values()))
            g = first.new_empty(h.shape)
            for region, x in got.items():
                g[tuple(slice(o, o + n) for o, n in region)] = x.reshape([n for _, n in region])
        except Exception:  # (bytes that do not load are the stored-bytes check's to report)
            return
        self.t = g

    def at(self, region):
        return self.t[tuple(slice(o, o + n) for o, n in region)]

    def partial(self, region, shape) -> str:
        from divtrace.trace.hashing.tensor import tensor_partial, to_hex

        return to_hex(tensor_partial(self.at(region).contiguous(), list(shape), [o for o, _ in region]))


def _other_hash(region, h: Held, data: _Bytes, v2: bool) -> str | None:
    """The other side's partial fingerprint of `region`, or None where it cannot be told."""
    reps = _reps(h)
    if region in reps:
        return reps[region].hash
    if not v2:
        return None
    if data.t is not None:
        return data.partial(region, h.shape)
    inside = [r for r in reps if _inside(r, region)]
    if inside and _tiles(h.shape, inside, region):
        return combine_hex([reps[r].hash for r in inside])
    for dim, chunks in h.chunks or ():
        boxes = [(tuple((s, n) if d == dim else full for d, full in enumerate(_whole(h.shape))), c)
                 for s, n, c in chunks]
        inside = [(b, c) for b, c in boxes if _inside(b, region)]
        if inside and _tiles(h.shape, [b for b, _ in inside], region):
            return combine_hex([c for _, c in inside])
    return None


def global_hash(h: Held, v2: bool) -> str | None:
    reps = _reps(h)
    if len(reps) == 1:
        return next(iter(reps.values())).hash
    if not v2:
        return None
    return combine_hex([p.hash for p in reps.values()])


def compare(name: str, kind: str, ha: Held, hb: Held, v2: bool) -> dict | str | None:
    """None where the value is equal on both sides, the `differ` entry where it differs, else why it is not
    compared (a reason)."""
    fa, fb = global_hash(ha, v2), global_hash(hb, v2)
    da, db = _Bytes(ha), _Bytes(hb)
    blocks = []
    both = da.t is not None and db.t is not None
    mask = da.t.new_zeros(ha.shape, dtype=bool) if both else None  # the elements where a copy differs (full mode)
    for side, h, other, data in (("a", ha, hb, db), ("b", hb, ha, da)):
        for p in h.pieces:
            mine_t = _own_bytes(p)
            if data.t is not None and mine_t is not None:  # both sides' bytes: compared as bytes
                bad = _bad(mine_t, data.at(p.region))
                same = not bool(bad.any())
                if mask is not None:
                    mask[tuple(slice(o, o + n) for o, n in p.region)] |= bad
            else:
                got = _other_hash(p.region, other, data, v2)
                if got is None:  # (the other side cannot say what it holds there: the global sums decide)
                    continue
                same = got == p.hash
            if not same and (len(h.pieces) > 1 or h.how != "whole"):
                blocks.append({"side": side, "rank": p.rank, "offsets": [o for o, _ in p.region],
                               "block": [n for _, n in p.region]})
    if both:
        differs = bool(mask.any()) or bool(blocks)
    elif fa is None or fb is None:
        return "its blocks' fingerprints are not of a scheme whose partials sum (record both runs with this divtrace)"
    else:
        differs = fa != fb or bool(blocks)
    if not differs:
        return None
    ranks = sorted({b["rank"] for b in blocks if b["rank"] is not None})
    entry = {"name": name, "kind": kind, "dtype": ha.dtype, "shape": list(ha.shape),
             "a": {"vid": _one_vid(ha), "hash": fa}, "b": {"vid": _one_vid(hb), "hash": fb},
             "read": {"a": any(p.vid is not None for p in ha.pieces), "b": any(p.vid is not None for p in hb.pieces)},
             "mismatched": None, "global": True, "layout": {"a": describe(ha), "b": describe(hb)},
             "ranks": ranks, "blocks": blocks, "rows": None}
    if len(ranks) == 1:
        entry["rank"] = ranks[0]
    if both:
        entry["mismatched"] = int(mask.sum())
        if mask.dim() >= 1 and mask.numel():
            entry["rows"] = mask.reshape(mask.shape[0], -1).any(dim=1).nonzero().reshape(-1).tolist()[:_ROWS]
    return entry


def _bad(x, y):
    """Per element of `x`, whether its bits differ from `y`'s there (same shape)."""
    from divtrace.compare.metrics import raw_bits

    if x.dtype != y.dtype or tuple(x.shape) != tuple(y.shape):
        return x.new_ones(x.shape, dtype=bool)
    n = x.numel()
    return (raw_bits(x).reshape(n, -1) != raw_bits(y).reshape(n, -1)).any(dim=1).reshape(x.shape)


def _own_bytes(p: Piece):
    """Piece `p`'s stored bytes, shaped as its place (full mode), else None."""
    if p.vid is None or getattr(p.trace, "mode", None) != "full":
        return None
    try:
        return p.trace.tensor(p.vid).reshape([n for _, n in p.region])
    except Exception:  # (bytes that do not load are the stored-bytes check's to report)
        return None


def _one_vid(h: Held):
    return h.pieces[0].vid if len(h.pieces) == 1 else None


def describe(h: Held) -> str:
    """`whole`, `blocks of 2 ranks`, `copies on 2 ranks`."""
    if h.how == "whole":
        return "whole"
    n = len({p.rank for p in h.pieces})
    return f"blocks of {n} ranks" if h.how == "blocks" else f"copies on {n} ranks"


def where(b: dict, shape) -> str:
    """A differing block's place, said: `rows 32-63`, `cols 0-31`, `whole`."""
    parts = []
    for d, (o, n, g) in enumerate(zip(b["offsets"], b["block"], shape)):
        if n != g:
            what = "rows" if d == 0 else "cols" if d == len(shape) - 1 else f"dim {d}"
            parts.append(f"{what} {o}-{o + n - 1}")
    return ", ".join(parts) or "whole"
