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
  tensor-parallel style at a module boundary: `why` names it), `collective` (a collective's result), `rule`
  (carried through a plain op from its inputs' layouts: `why` names the rule);
- `{"c": record index, "kind": "all_reduce", "group": name, "M": mesh, "seq": n, "op": "sum"}`: a collective op
  record: its kind, the group it ran on (as a mesh), and its place among the collectives this rank ran on that
  group (`seq`, from 0).

Lines are appended as the recording goes (with the first layout after each flush of the trace's records, and
at close); a line cut by a crash ends what is read, and lines about values or records the trace does not hold
are ignored.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

LAYOUTS = "layouts.jsonl"
PLACEMENT_KINDS = ("S", "R", "P")


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
    return (isinstance(d.get("v"), int) and isinstance(d.get("M"), int) and isinstance(p, list) and p
            and all(isinstance(x, str) and x[:1] in PLACEMENT_KINDS for x in p)
            and isinstance(g, list) and isinstance(o, list) and len(g) == len(o)
            and all(isinstance(x, int) and x >= 0 for x in g + o))


def read_layouts(trace_path) -> RankLayouts:
    """The layouts.jsonl of one rank's trace (empty when there is none). A line cut by a crash, or one that is not
    a layout line, ends what is read (the lines before it stand)."""
    out = RankLayouts()
    try:
        data = (Path(trace_path) / LAYOUTS).read_bytes()
    except (FileNotFoundError, NotADirectoryError):
        return out
    except OSError as e:
        from divtrace.errors import DivtraceError

        raise DivtraceError(f"{Path(trace_path) / LAYOUTS}: cannot read the shard layouts: {e.strerror or e}") from None
    for line in data.split(b"\n"):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
        except ValueError:
            break
        if not isinstance(d, dict):
            break
        if "v" in d:
            if not _valid_layout(d):
                break
            out.values.setdefault(d["v"], Layout(d["v"], d["M"], d["p"], d["g"], d["o"], str(d.get("src", "?")),
                                                 d.get("h"), bool(d.get("rp")), d.get("why")))
        elif "c" in d:
            try:
                out.collectives[d["c"]] = Collective(int(d["c"]), str(d["kind"]), str(d["group"]), int(d["M"]),
                                                     int(d["seq"]), d.get("op"))
            except (KeyError, TypeError, ValueError):
                break
        elif "M" in d:
            try:
                out.meshes[int(d["M"])] = Mesh(int(d["M"]), list(d["shape"]), list(d["dims"]), list(d["ranks"]),
                                               d.get("group"))
            except (KeyError, TypeError, ValueError):
                break
        else:
            break
    return out


class LayoutWriter:
    """Appends layout lines to a rank's layouts.jsonl: buffered, written whole lines at a time (a crash leaves at
    most a cut last line). Opened (truncated) at the start of the recording."""

    def __init__(self, trace_path) -> None:
        self.path = Path(trace_path) / LAYOUTS
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
        self._lines: list[str] = []
        self.failed = False

    def add(self, line: dict) -> None:
        """Queue a line. Its `h` may still be an int64 [2] tensor on a device: read to the host at the next flush,
        all of them in one read (a partial fingerprint taken on a GPU never makes the host wait where it is taken)."""
        self._lines.append(line)

    @property
    def buffered(self) -> int:
        return len(self._lines)

    def flush(self) -> None:
        if not self._lines or self.failed:
            return
        pending = [d for d in self._lines if "h" in d and not isinstance(d["h"], str)]
        if pending:
            import torch

            from divtrace.trace.hashing.tensor import hexes

            for d, h in zip(pending, hexes(torch.stack([d["h"] for d in pending]))):
                d["h"] = h
        data = ("\n".join(json.dumps(d, separators=(",", ":")) for d in self._lines) + "\n").encode()
        self._lines.clear()
        try:
            os.write(self._fd, data)
        except OSError:
            self.failed = True  # the trace's own writer reports the disk; the layouts stop here
            raise

    def close(self) -> None:
        try:
            self.flush()
        finally:
            os.close(self._fd)
