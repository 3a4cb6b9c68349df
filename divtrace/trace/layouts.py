"""The shard layouts beside a rank's trace (`layouts.jsonl`): which piece of which global value each recorded
value is, the device meshes and process groups they refer to, and the collectives the rank ran.

Written by divtrace.record.placements (a recording inside an initialized process group, one trace per rank:
docs/sharded.md); read by divtrace.trace.run and unsharded by divtrace.align.shards. One JSON object per line:

- `{"M": id, "shape": [..], "dims": [name or null, ..], "ranks": [global ranks, row-major]}`: a device mesh (or a
  process group, as a 1-D mesh named by its group: `"group": name`), before the first line that uses it;
- `{"v": vid, "M": mesh, "p": [placement per mesh dim], "g": global shape, "o": this rank's offsets,
  "src": where the layout came from, "h": partial fingerprint, "rp": 1}`: value `vid` is this rank's piece of a
  value of global shape `g`. Placements: `"S<d>"` (a block of dim d), `"R"` (a whole replica), `"P"` (a partial
  sum, `"P:<op>"` for another reduction). `h` (only where a placement is `S`) is the value's partial fingerprint
  at its global offsets (docs/trace-format.md, "Fingerprint schemes"): the partials of the pieces sum to the
  global value's fingerprint. `rp` says the value's token rows in rows.bin are partials of the global rows too.
  `src`: `dtensor` (a DTensor's placements), `param` (a DTensor parameter's local tensor), `style` (a
  tensor-parallel style at a module boundary: `why` names it), `declared` (record's `layouts=`, a plain tensor's
  declared layout: `why` is the spec), `collective` (a collective's result), `rule`
  (carried through a plain op from its inputs' layouts: `why` names the rule);
  routed rows (expert parallelism, placement `["T"]`: record/routing.py) add `k` (top-k), `rt` (per local row
  `[token, slot]` or `[token, slot, expert]`: the row's place `token * k + slot` in the global value `g`) and `rh`
  (per local row its whole-row fingerprint, 16 hex digits); `h` is then the rows' partial at their global rows;
  a declared block of dim 0 (`S0`, src `declared`) has `rh` too (its rows are whole rows, from global row `o[0]`);
- `{"c": record index, "kind": "all_reduce", "group": name, "M": mesh, "seq": n, "op": "sum"}`: a collective op
  record: its kind, the group it ran on (as a mesh), and its place among the collectives this rank ran on that
  group (`seq`, from 0).

Lines are written with the trace's records, under the same checksums (divtrace.trace.side_files: meta.json's
`file_checksums` names the file), so a killed recording leaves lines only for records that reached the disk; a
reader cuts the file back to what the checksums vouch for and takes nothing in it on trust (a line that is not
whole and well formed is a damaged trace). Lines about values or records the trace does not hold are ignored.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from divtrace.trace.files import compact_encoder

LAYOUTS = "layouts.jsonl"
PLACEMENT_KINDS = ("S", "R", "P", "T")


@dataclass
class Mesh:
    """A device mesh (or a process group as a 1-D mesh): its shape, dim names and the global rank at each place."""

    id: int
    shape: list[int]
    dims: list
    ranks: list[int]
    group: str | None = None

    def coords(self, rank: int) -> tuple[int, ...] | None:
        """The place of global rank `rank` in the mesh (row-major), or None when it is not in it."""
        try:
            i = self.ranks.index(rank)
        except ValueError:
            return None
        out = []
        for n in reversed(self.shape):
            out.append(i % n)
            i //= n
        return tuple(reversed(out))

    def to_json(self) -> dict:
        d = {"M": self.id, "shape": self.shape, "dims": self.dims, "ranks": self.ranks}
        if self.group is not None:
            d["group"] = self.group
        return d


@dataclass
class Layout:
    """One value's layout on one rank (see the module docstring)."""

    vid: int
    mesh: int
    placements: list[str]
    global_shape: list[int]
    offsets: list[int]
    src: str
    partial: str | None = None  # hex partial fingerprint, for S placements
    row_partials: bool = False
    why: str | None = None
    top_k: int | None = None  # routed rows ("T"): top-k, the routing table and each row's fingerprint
    routing: list | None = None
    row_hashes: list | None = None

    @property
    def routed(self) -> bool:
        return self.placements == ["T"]

    def global_rows(self) -> list[int]:
        """Routed rows: the global row of each local row (token * k + slot)."""
        return [r[0] * self.top_k + r[1] for r in self.routing]

    @property
    def sharded(self) -> bool:
        return any(p.startswith("S") for p in self.placements)

    @property
    def pending(self) -> bool:
        """A partial sum not yet reduced."""
        return any(p.startswith("P") for p in self.placements)

    def shard_dims(self) -> list[int]:
        return [int(p[1:]) for p in self.placements if p.startswith("S")]

    def to_json(self) -> dict:
        d = {"v": self.vid, "M": self.mesh, "p": self.placements, "g": self.global_shape, "o": self.offsets,
             "src": self.src}
        if self.partial is not None:
            d["h"] = self.partial
        if self.row_partials:
            d["rp"] = 1
        if self.why:
            d["why"] = self.why
        if self.routing is not None:
            d.update(k=self.top_k, rt=self.routing)
        if self.row_hashes is not None:
            d["rh"] = self.row_hashes
        return d


@dataclass
class Collective:
    """A collective op record of one rank."""

    index: int
    kind: str
    group: str
    mesh: int
    seq: int
    op: str | None = None

    def to_json(self) -> dict:
        d = {"c": self.index, "kind": self.kind, "group": self.group, "M": self.mesh, "seq": self.seq}
        if self.op is not None:
            d["op"] = self.op
        return d


@dataclass
class RankLayouts:
    """What one rank's layouts.jsonl holds, read back."""

    meshes: dict[int, Mesh] = field(default_factory=dict)
    values: dict[int, Layout] = field(default_factory=dict)
    collectives: dict[int, Collective] = field(default_factory=dict)


def _valid_layout(d: dict) -> bool:
    p, g, o = d.get("p"), d.get("g"), d.get("o")
    return bool(_is_int(d.get("v")) and _is_int(d.get("M")) and isinstance(p, list) and p
                and all(isinstance(x, str) and x[:1] in PLACEMENT_KINDS for x in p)
                and isinstance(g, list) and isinstance(o, list) and len(g) == len(o)
                and all(_is_int(x) and x >= 0 for x in g + o))


def read_layouts(trace) -> RankLayouts:
    """The layouts.jsonl of one rank's trace (a Trace; empty when there is none), read as untrusted: the bytes
    against the trace's checksums, cut back to what they vouch for (a killed recording), and every line a whole
    layout, mesh or collective line. A file that does not match its checksums, or a line that is not one of
    these, is a damaged trace: DivtraceError naming the file (and the line). A trace written without these
    checksums (none on disk vouches for the file) has a torn last line of a killed recording cut off."""
    from divtrace.errors import DivtraceError
    from divtrace.trace.token_checks import json_lines, side_file_bytes

    out = RankLayouts()
    data = side_file_bytes(trace, LAYOUTS)
    where = trace.path / LAYOUTS
    for n, d in json_lines(data, where):
        what = _read_line(d, out)
        if what is not None:
            raise DivtraceError(f"damaged trace: {where}:{n}: {what}")
    return out


def _read_line(d, out: RankLayouts) -> str | None:
    """Add one parsed line to `out`; what is wrong with it, or None."""
    if not isinstance(d, dict):
        return "not a layout line (a JSON object)"
    if "v" in d:
        if not _valid_layout(d):
            return "a value's layout whose vid, mesh, placements, global shape or offsets are malformed"
        h, why = d.get("h"), d.get("why")
        if not (h is None or isinstance(h, str)) or not (why is None or isinstance(why, str)):
            return f"the layout of value {d['v']} has a malformed partial fingerprint or reason"
        routed = _routed_fields(d)
        if isinstance(routed, str):
            return routed
        out.values.setdefault(d["v"], Layout(d["v"], d["M"], d["p"], d["g"], d["o"], str(d.get("src", "?")),
                                             h, bool(d.get("rp")), why, *routed))
    elif "c" in d:
        if not (all(_is_int(d.get(k)) for k in ("c", "M", "seq")) and isinstance(d.get("kind"), str)
                and isinstance(d.get("group"), str) and (d.get("op") is None or isinstance(d["op"], str))):
            return "a collective line whose record, kind, group, mesh, order or op is malformed"
        out.collectives[d["c"]] = Collective(d["c"], d["kind"], d["group"], d["M"], d["seq"], d.get("op"))
    elif "M" in d:
        shape, dims, ranks = d.get("shape"), d.get("dims"), d.get("ranks")
        if not (_is_int(d["M"]) and isinstance(shape, list) and isinstance(dims, list) and isinstance(ranks, list)
                and all(_is_int(x) and x > 0 for x in shape) and len(dims) == len(shape)
                and all(x is None or isinstance(x, str) for x in dims)
                and all(_is_int(x) and x >= 0 for x in ranks) and len(ranks) == _prod(shape)
                and (d.get("group") is None or isinstance(d["group"], str))):
            return "a mesh line whose shape, dim names or ranks are malformed"
        out.meshes[d["M"]] = Mesh(d["M"], shape, dims, ranks, d.get("group"))
    else:
        return "not a layout, mesh or collective line"
    return None


def _routed_fields(d: dict):
    """(top_k, routing, row hashes) of a layout line (Nones unless its placements are ["T"]), or what is wrong."""
    if "T" not in d["p"]:
        rh = d.get("rh")
        if rh is not None and not (d["p"] == ["S0"] and isinstance(rh, list)
                                   and all(isinstance(x, str) and len(x) == 16 for x in rh)):
            return f"the row fingerprints of value {d['v']} are malformed"
        return None, None, rh
    k, rt, rh, g = d.get("k"), d.get("rt"), d.get("rh"), d["g"]
    if not (d["p"] == ["T"] and _is_int(k) and k > 0 and isinstance(rt, list) and isinstance(rh, list)
            and len(rh) == len(rt) and isinstance(d.get("h"), str) and g and g[0] % k == 0
            and all(isinstance(r, list) and len(r) in (2, 3) and all(_is_int(x) and x >= 0 for x in r)
                    and r[1] < k and r[0] * k + r[1] < g[0] for r in rt)
            and all(isinstance(x, str) and len(x) == 16 for x in rh)):
        return f"the routed rows of value {d['v']} have a malformed top-k, routing table or row fingerprints"
    return k, rt, rh


def _is_int(x) -> bool:
    return type(x) is int


def _prod(xs) -> int:
    n = 1
    for x in xs:
        n *= x
    return n


_LINE = compact_encoder(allow_nan=True)  # json.dumps(d, separators=(",", ":")), its C encoder built once


class LayoutWriter:
    """Queues a rank's layout lines and hands them to the trace writer's checksummed files before each flush of its
    records (so layouts.jsonl is written in step with records.jsonl, under its checksums: trace/side_files.py). On
    the device path (trace/device_writer.py) the lines go out on its writer thread, as a job before the records of
    the same flush, once the partial fingerprints they hold have landed on the host."""

    def __init__(self, writer) -> None:
        self.files = writer.files
        self.device = getattr(writer, "device", None)
        self._lines: list[dict] = []
        writer.before_flush.append(self.hand_over)

    def add(self, line: dict) -> None:
        """Queue a line. Its `h` may still be on its way from a device: a slot of the device path's batches (read on
        its writer thread), or an int64 [2] tensor on a device (read to the host at the next flush, all of them in
        one read, where there is no device path)."""
        self._lines.append(line)

    def hand_over(self) -> None:
        if not self._lines or self.files is None:
            return
        lines, self._lines = self._lines, []
        if self.device is not None:  # (the writer thread: after the batches holding the partials landed)
            self.device.submit(lambda settled: self._write(lines))
        else:
            self._write(lines)

    def _write(self, lines: list[dict]) -> None:
        pending = [d for d in lines if "h" in d and not isinstance(d["h"], str)]
        slots = [d for d in pending if hasattr(d["h"], "words")]
        if slots:
            from divtrace.trace.hashing.spec import to_hex

            for d in slots:
                w = d["h"].words()
                d["h"] = to_hex(int(w[0]), int(w[1]))
        tensors = [d for d in pending if not isinstance(d["h"], str)]
        if tensors:
            import torch

            from divtrace.trace.hashing.tensor import hexes

            for d, h in zip(tensors, hexes(torch.stack([d["h"] for d in tensors]))):
                d["h"] = h
        data = ("\n".join(_LINE(d) for d in lines) + "\n").encode()
        self.files.add(LAYOUTS, data)
