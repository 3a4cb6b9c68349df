"""Declared layouts: where plain tensors of a hand-sharded model sit in their global values (docs/sharded.md,
"Declared layouts").

Megatron-style code holds plain local tensors (a column-parallel Linear is an `nn.Linear` of `out/tp` rows), so no
DTensor or tensor-parallel style says what a value is a piece of. The user says it:

    divtrace.record(model, "runs/tp2", mesh={"tp": tp_group},
                    layouts={r"layers\\.\\d+\\.fc1": "S(-1)@tp",            # a module's output: a block of its last dim
                             r"layers\\.\\d+\\.fc2": "P@tp",                # a partial sum, reduced later
                             r"layers\\.\\d+\\.fc1\\.weight": "S(0)@tp",     # a parameter: a block of its rows
                             r"embed": {"input": "R@tp", "output": "R@tp"}})

Grammar of a spec (one placement over one named process group):

    spec      := placement [ "@" name ]
    placement := "R"                  replicated: every rank of the group holds the whole value
               | "P"                  a partial sum over the group (summed by a collective later)
               | "S(" dim [ "," global size ] ")"
                                      a block of dim `dim` (negative counts from the end): rank i of the group holds
                                      the i-th of equal blocks; the global size, when given, is checked
               | "T"                  routed rows (expert parallelism): each row of this rank's tensor is one
                                      (token, slot) of the global value [tokens * top_k, ...], as the routing
                                      declared for the tensor says (`divtrace.routed`: record/routing.py)

`name` is a key of `mesh` (`{name: process group, or a list of global ranks}`); without `mesh` the one group is the
whole world, named `world`, and a spec without `@name` means the only group. Each regex must match a whole module
path (the spec of its output, or a dict with "output" and/or "input": the first positional input; "outputs":
every tensor of a tuple output, a router's (logits, weights, ids), where nothing else gave it a layout) or a whole
parameter name (`re.fullmatch`). A spec that cannot be parsed, names an unknown group, matches nothing, or does not
fit its tensor is a DivtraceError of one line naming the path and the spec (the CLI's exit 2): the first three
when `record(...)` is called, a module's tensor when the module first runs.

In: `record`'s `layouts` and `mesh`, the model, this rank. Out: each declared module's and parameter's layout
builder (placements.Placements turns them into layout lines, `src: "declared"`).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from divtrace.errors import DivtraceError

_SPEC = re.compile(r"^(?:(?P<kind>[RPT])|S\((?P<dim>[+-]?\d+)(?:,(?P<size>\d+))?\))(?:@(?P<name>[A-Za-z_]\w*))?$")
_SIDES = {"output": "out", "input": "in", "outputs": "outs"}


@dataclass(frozen=True)
class Spec:
    """One parsed spec: `kind` "S", "R" or "P"; `dim` and `size` for a block; the group's name."""

    text: str
    kind: str
    dim: int | None
    size: int | None
    name: str


@dataclass(frozen=True)
class Group:
    name: str
    ranks: tuple  # global ranks, in the group's order


def parse_spec(text, where: str, groups: dict) -> Spec:
    """`text` as a Spec over one of `groups`; DivtraceError (naming `where`) when it is not one."""
    if not isinstance(text, str):
        raise DivtraceError(f"layouts[{where!r}]: a spec is a string such as 'S(-1)@tp', got {type(text).__name__}")
    m = _SPEC.match(text.replace(" ", ""))
    if m is None:
        raise DivtraceError(f"layouts[{where!r}]: cannot parse {text!r}: expected R, P or S(dim[,global size]), "
                            "then @group (e.g. 'S(-1)@tp', 'P@tp', 'R'; routed rows: 'T@ep')")
    name = m.group("name")
    if name is None:
        if len(groups) != 1:
            raise DivtraceError(f"layouts[{where!r}]: {text!r} names no group and the mesh has "
                                f"{len(groups)} ({', '.join(groups)}): add @name")
        name = next(iter(groups))
    elif name not in groups:
        raise DivtraceError(f"layouts[{where!r}]: {text!r} names the group {name!r}, which the mesh does not have "
                            f"(it has: {', '.join(groups)}; pass mesh={{{name!r}: process group}})")
    dim, size = m.group("dim"), m.group("size")
    return Spec(text, "S" if dim is not None else m.group("kind"), int(dim) if dim is not None else None,
                int(size) if size is not None else None, name)


def resolve_mesh(mesh) -> dict:
    """`record`'s `mesh` as {name: Group}: a process group, a list of global ranks, or None (the whole world)."""
    import torch.distributed as dist

    if mesh is None:
        return {"world": Group("world", tuple(range(dist.get_world_size())))}
    if not isinstance(mesh, dict) or not mesh:
        raise DivtraceError(f"mesh must be a dict {{name: process group or list of ranks}}, got {mesh!r}")
    out = {}
    for name, g in mesh.items():
        if not isinstance(name, str) or not name.isidentifier():
            raise DivtraceError(f"mesh: the group name {name!r} is not an identifier")
        if g is None:
            ranks = tuple(range(dist.get_world_size()))
        elif isinstance(g, (list, tuple)) and all(isinstance(r, int) for r in g):
            ranks = tuple(g)
        else:
            try:
                ranks = tuple(dist.get_process_group_ranks(g))
            except Exception as e:
                raise DivtraceError(f"mesh[{name!r}]: not a process group or a list of ranks "
                                    f"({type(e).__name__}: {e})".splitlines()[0]) from None
        if not ranks or len(set(ranks)) != len(ranks):
            raise DivtraceError(f"mesh[{name!r}]: the ranks {list(ranks)} are empty or repeated")
        out[name] = Group(name, ranks)
    return out


def check_outside(layouts, mesh) -> bool:
    """Outside a process group: the specs are checked (parsed, their groups named) and then ignored. True when
    there are some."""
    if not isinstance(layouts, dict):
        raise DivtraceError(f"layouts must be a dict {{path regex: spec}}, got {type(layouts).__name__}")
    groups = dict.fromkeys(mesh) if isinstance(mesh, dict) and mesh else {"world": None}
    for pattern, value in layouts.items():
        _specs(pattern, value, groups)
    return bool(layouts)


def declares_routed(layouts) -> bool:
    """Whether `layouts` declares routed rows (`T`) anywhere: such a recording in a process group of one process
    is a run of one rank (the 1-rank side of an expert-parallel comparison), whose routed values are keyed as
    global values."""
    if not isinstance(layouts, dict):
        return False
    for value in layouts.values():
        for v in (value.values() if isinstance(value, dict) else (value,)):
            if isinstance(v, str) and v.replace(" ", "").startswith("T"):
                return True
    return False


def _specs(pattern, value, groups) -> dict:
    """One regex's value (a spec, or a dict of "output" and/or "input" specs) as {"out"/"in": Spec}."""
    sides = value if isinstance(value, dict) else {"output": value}
    bad = [k for k in sides if k not in _SIDES]
    if bad or not sides:
        raise DivtraceError(f"layouts[{pattern!r}]: a dict spec has 'output' and/or 'input', got "
                            f"{sorted(map(str, sides))} (or 'outputs': every tensor of a tuple output)")
    return {_SIDES[k]: parse_spec(v, pattern, groups) for k, v in sides.items()}


class Declared:
    """The declared layouts of one rank's recording: modules (by id) and parameters matched by the user's regexes."""

    def __init__(self, model, layouts: dict, mesh, rank: int):
        if not isinstance(layouts, dict):
            raise DivtraceError(f"layouts must be a dict {{path regex: spec}}, got {type(layouts).__name__}")
        self.rank = rank
        self.groups = resolve_mesh(mesh)
        self.modules: dict[int, tuple] = {}  # id(module) -> (path, {"in"/"out": Spec})
        self.params: list[tuple] = []  # (name, local tensor, Spec)
        mods = list(model.named_modules())
        params = list(model.named_parameters())
        for pattern, value in layouts.items():
            try:
                rx = re.compile(pattern)
            except (re.error, TypeError) as e:
                raise DivtraceError(f"layouts: bad regex {pattern!r}: {e}") from None
            specs = _specs(pattern, value, self.groups)
            hit = False
            for path, m in mods:
                if path and rx.fullmatch(path):
                    self.modules.setdefault(id(m), (path, {}))[1].update(specs)
                    hit = True
            for name, p in params:
                if rx.fullmatch(name):
                    if "out" not in specs or len(specs) > 1 or specs["out"].kind == "T":
                        raise DivtraceError(f"layouts[{pattern!r}]: {name} is a parameter: its spec is one string "
                                            "(R, P or S(dim); routed rows are a module's)")
                    if not hasattr(p, "_local_tensor"):  # (a DTensor parameter has its own placements)
                        self.params.append((name, p, specs["out"]))
                        self.lay(specs["out"], p, name)  # (a spec that does not fit: an error now)
                    hit = True
            if not hit:
                raise DivtraceError(f"layouts[{pattern!r}]: the regex matches no module path or parameter name "
                                    "of the model (it must match the whole path, e.g. r'layers\\.\\d+\\.fc1')")

    def lay(self, spec: Spec, t, where: str):
        """The layout `spec` gives tensor `t` (local) on this rank, as (Group, placements, global shape, offsets);
        DivtraceError naming `where` and the spec when it does not fit."""
        group = self.groups[spec.name]
        shape = tuple(t.shape)
        head = f"{where}: layout {spec.text!r} does not fit its tensor {list(shape)}"
        if self.rank not in group.ranks:
            raise DivtraceError(f"{where}: layout {spec.text!r}: rank {self.rank} is not in the group "
                                f"{spec.name!r} (ranks {list(group.ranks)})")
        if not shape:
            raise DivtraceError(f"{head}: a 0-dim tensor has no layout to declare")
        if spec.kind == "T":
            raise DivtraceError(f"{where}: layout {spec.text!r}: routed rows are laid out by their routing "
                                "(placements.Placements.routed_lay), not by the spec alone")
        if spec.kind != "S":
            return group, (spec.kind,), shape, (0,) * len(shape)
        nd, n = len(shape), len(group.ranks)
        if not -nd <= spec.dim < nd:
            raise DivtraceError(f"{head}: dim {spec.dim} is out of range for {nd} dims")
        d = spec.dim % nd
        local = shape[d]
        if spec.size is not None:
            if spec.size % n:
                raise DivtraceError(f"{head}: the global size {spec.size} of dim {spec.dim} is not divisible by "
                                    f"the {n} ranks of {spec.name!r}")
            if spec.size // n != local:
                raise DivtraceError(f"{head}: dim {spec.dim} holds {local}, while the global size {spec.size} over "
                                    f"{n} ranks of {spec.name!r} gives blocks of {spec.size // n}")
        i = group.ranks.index(self.rank)
        gshape = shape[:d] + (local * n,) + shape[d + 1:]
        offsets = (0,) * d + (local * i,) + (0,) * (nd - d - 1)
        return group, (f"S{d}",), gshape, offsets
