"""Where each recorded value sits in its global value, on one rank of a sharded run (docs/sharded.md).

A value's layout (record/shard_rules.Lay) comes, in this order, from:
- a DTensor: its placements and mesh (op arguments and results, module inputs and outputs);
- a DTensor parameter: the local tensor that HF's TP inference path (and any code calling `to_local()`) runs on,
  found by its storage;
- a declared layout (record's `layouts=`: record/declared.py) of a module's input or output, or a parameter;
- a tensor-parallel style at a module boundary (`ColwiseParallel`: input replicated, output a block of its last
  dim; `RowwiseParallel`: input a block of its last dim, output replicated), HF's or torch's `parallelize_module`;
- a collective's result (record/collectives.py);
- a rule that carries a plain op's inputs' layouts to its outputs (record/shard_rules.py).

A value that is a block of a global value (`S` placement) also gets its partial fingerprint at its global offsets,
and its token rows are fingerprinted as partials of the global rows, so hash mode unshards with no bytes moved.
Layouts go to the rank's layouts.jsonl (divtrace.trace.layouts).

In: tensors at module boundaries and op arguments and results, with the value ids the recorder gives them. Out:
layout lines; token rows of blocks as partials (`shard_rows`).
"""
from __future__ import annotations

import torch

from divtrace.errors import DivtraceError
from divtrace.record.routing import Routes, routed_gshape, routed_partial, row_hexes
from divtrace.record.shard_rules import Lay, ruled_layouts
from divtrace.trace.hashing.rows import (heads_row_fingerprints, row_fingerprints, row_runs, rows_bytes,
                                         strided_row_fingerprints)
from divtrace.trace.hashing.rows import row_dims as hashing_row_dims
from divtrace.record.partials import Partials, has_block, _readable  # noqa: F401 (_readable: tests)
from divtrace.trace.hashing.tensor import tensor_partial, to_hex
from divtrace.trace.layouts import Layout, LayoutWriter, Mesh
from divtrace.trace.memo import bounded_put


def _placement_code(p, ndim: int) -> str | None:
    kind = type(p).__name__
    if p.is_shard() and kind == "Shard":
        return f"S{p.dim % ndim if ndim else 0}"
    if p.is_replicate():
        return "R"
    if p.is_partial():
        op = str(getattr(p, "reduce_op", "sum"))
        return "P" if op == "sum" else f"P:{op}"
    return None  # _StridedShard and other placements: not unsharded (no layout)


class Placements:
    """The layouts of one rank's recording (one per Recorder inside a process group)."""

    def __init__(self, model, writer, warnings_out: list, declared=None, values=None):
        self.model = model
        self.values = values  # the recording's ValueIdentity, or None
        self.declared = declared  # record/declared.Declared, or None
        self.warnings = warnings_out
        self.out = LayoutWriter(writer)  # (written with the trace's records: trace/side_files.py)
        self.by_vid: dict[int, Lay] = {}
        self.pending: dict[int, Lay] = {}  # id(tensor about to get a vid) -> its layout
        self.stack: list = []  # the module calls' frames (module_calls), set by ranks.attach
        self.row_partials: set[int] = set()  # ids of tensors whose rows were fingerprinted as partials
        self.kept_rows: dict[int, tuple] = {}  # vid -> (where its rows' bytes lie in the global rows, rows.bin bytes)
        self._meshes: dict = {}  # key -> Mesh
        self._mesh_of: dict[int, int] = {}  # id(DeviceMesh) -> mesh id
        self._params: dict[tuple, Lay] = {}  # storage key of a DTensor parameter's local tensor -> its layout
        self._param_shapes: set[tuple] = set()  # their shapes (most tensors met are none: no storage key made)
        self._styles: dict[int, tuple] = {}  # id(module) -> (kind, mesh id, in layout fn, out layout fn)
        self._style_lays: dict[tuple, Lay | None] = {}  # (style, mesh id, its layout, local shape) -> _style_lay's
        self._dtensor_lays: dict[tuple, Lay | None] = {}  # (id(mesh), shape, placements, local shape, src) -> layout
        self.partials = Partials(values, writer, self.out)  # the blocks' partial fingerprints
        self.routes = Routes()  # routings declared by divtrace.routed (record/routing.py)
        self._routing: dict[int, object] = {}  # id(tensor about to be bound with a T layout) -> its Routing
        self._scan(model)

    # -- meshes -------------------------------------------------------------------------------------------------
    def _add_mesh(self, shape, dims, ranks, group=None) -> int:
        key = (tuple(shape), tuple(dims), tuple(ranks), group)
        m = self._meshes.get(key)
        if m is None:
            m = self._meshes[key] = Mesh(len(self._meshes), list(shape), list(dims), list(ranks), group)
            self.out.add(m.to_json())
        return m.id

    def mesh_id(self, mesh) -> int:
        mid = self._mesh_of.get(id(mesh))
        if mid is None:
            t = mesh.mesh
            dims = list(mesh.mesh_dim_names) if mesh.mesh_dim_names else [None] * t.ndim
            mid = self._mesh_of[id(mesh)] = self._add_mesh(list(t.shape), dims, [int(r) for r in t.reshape(-1).tolist()])
        return mid

    def group_mesh(self, name: str, ranks: list[int]) -> int:
        return self._add_mesh([len(ranks)], [None], ranks, group=name)

    def mesh(self, mid: int) -> Mesh:
        return next(m for m in self._meshes.values() if m.id == mid)

    @property
    def meshes(self) -> list[dict]:
        return [m.to_json() for m in self._meshes.values()]

    # -- layouts of DTensors, parameters and styles -------------------------------------------------------------
    def dtensor_lay(self, t, src: str = "dtensor") -> Lay | None:
        spec = getattr(t, "_spec", None)
        mesh = getattr(t, "device_mesh", None)
        if spec is None or mesh is None:
            return None
        shape = tuple(t.shape)
        loc = getattr(t, "_local_tensor", None)
        key = (id(mesh), shape, spec.placements, None if loc is None else tuple(loc.shape), src)
        try:
            lay = self._dtensor_lays.get(key, False)
        except TypeError:  # (a placement that cannot be a key)
            return _dtensor_layout(t, mesh, shape, src, self.mesh_id, self._warn)
        if lay is False:  # (a function of these: the same few come back every layer; each costs torch ops)
            lay = self._dtensor_lays[key] = _dtensor_layout(t, mesh, shape, src, self.mesh_id, self._warn)
        return lay

    def _scan(self, model) -> None:
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if hasattr(p, "_local_tensor") and hasattr(p, "placements"):
                lay = self.dtensor_lay(p, "param")
                if lay is not None:
                    self._params[_storage_key(p._local_tensor)] = lay._replace(why=name)
        if self.declared is not None:
            for name, p, spec in self.declared.params:
                self._params[_storage_key(p.detach())] = self._declared_lay(spec, p, name)
        self._param_shapes = {k[2] for k in self._params if k is not None}
        for path, m in model.named_modules():
            style = _style_of(m)
            if style is not None:
                kind, mesh, in_lay, out_lay = style
                try:
                    self._styles[id(m)] = (kind, self.mesh_id(mesh), in_lay, out_lay, mesh)
                except Exception:
                    continue

    def _declared_lay(self, spec, t, where: str) -> Lay:
        group, placements, gshape, offsets = self.declared.lay(spec, t, where)
        mid = self._add_mesh([len(group.ranks)], [group.name], list(group.ranks), group=group.name)
        return Lay(mid, placements, gshape, offsets, "declared", spec.text)

    def _module_declared(self, module, side: str, t, key: str = "out") -> Lay | None:
        d = self.declared.modules.get(id(module))
        if d is None or not isinstance(t, torch.Tensor):
            return None
        spec = d[1].get(side) if key in ("args.0", "out", "out.0") else None
        if side == "out" and spec is None and "outs" in d[1]:  # "outputs": every tensor of the output
            spec = d[1]["outs"]
            where = f"{d[0]} (output {key.removeprefix('out').removeprefix('.') or 0})"
        else:
            where = f"{d[0]} ({'output' if side == 'out' else 'input'})"
        if spec is None:
            return None
        if spec.kind == "T":
            return self._routed_lay(spec, t, module, side, where)
        return self._declared_lay(spec, t, where)

    def _routed_lay(self, spec, t, module, side: str, where: str) -> Lay:
        """Routed rows: laid out by the routing declared for `t` (or, for an output, its module's routed input's)."""
        routing = self.routes.of(t, module, side)
        if routing is None:
            raise DivtraceError(f"{where}: layout {spec.text!r}: no routing was declared for this tensor of "
                                f"{list(t.shape)} (call divtrace.routed(rows, tokens=..., slots=..., n_tokens=..., "
                                "top_k=...) before the module runs)")
        if len(routing.tokens) != t.shape[0]:
            raise DivtraceError(f"{where}: layout {spec.text!r}: the routing names {len(routing.tokens)} rows, the "
                                f"tensor holds {t.shape[0]}")
        group = self.declared.groups[spec.name]
        if self.declared.rank not in group.ranks:
            raise DivtraceError(f"{where}: layout {spec.text!r}: rank {self.declared.rank} is not in the group "
                                f"{spec.name!r} (ranks {list(group.ranks)})")
        mid = self._add_mesh([len(group.ranks)], [group.name], list(group.ranks), group=group.name)
        self._routing[id(t)] = routing
        return Lay(mid, ("T",), routed_gshape(t, routing), (0,) * t.dim(), "declared", spec.text)

    def defer_rows(self, stack, t) -> bool:
        """Whether value `t`, made now with no layout, waits for its module's exit for its token rows: the
        innermost open call's module declares a block as its output (token_rows.TokenRows.defer_rows). A value
        that is not the output then has no rows (it has no layout: each rank's own, or replicated and compared
        whole)."""
        if id(t) in self.pending:
            return False
        d = self.declared.modules.get(id(stack[-1].module)) if stack else None
        return d is not None and any(s in d[1] and d[1][s].kind == "S" for s in ("out", "outs"))

    def _rows_here(self) -> bool:
        """Whether the innermost open module call declares a block of dim 0 (whole token rows) as its output: the
        blocks of dim 0 made inside it (an EP router's scores, ids, weights) get their rows' fingerprints too."""
        st = self.stack
        d = self.declared.modules.get(id(st[-1].module)) if st and self.declared is not None else None
        specs = [d[1].get(s) for s in ("out", "outs")] if d is not None else []
        return any(x is not None and x.kind == "S" and x.dim == 0 for x in specs)

    def _style_lay(self, module, side: str, t) -> Lay | None:
        st = self._styles.get(id(module))
        if st is None or not isinstance(t, torch.Tensor) or t.dim() == 0:
            return None
        kind, mid, in_lay, out_lay, mesh = st
        want = in_lay if side == "in" else out_lay
        if want is None:
            return None
        if want == "R":
            return Lay(mid, ("R",), tuple(t.shape), (0,) * t.dim(), "style", kind)
        key = (kind, mid, want, tuple(t.shape))
        if key in self._style_lays:  # (a function of the style, its mesh and the shapes: every layer, every call)
            return self._style_lays[key]
        last = want  # the global size of the last dim
        shape = tuple(t.shape[:-1]) + (last,)
        lay = None
        try:
            from torch.distributed.tensor import Shard
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

            local, offsets = compute_local_shape_and_global_offset(shape, mesh, [Shard(t.dim() - 1)])
            if tuple(local) == tuple(t.shape):
                lay = Lay(mid, (f"S{t.dim() - 1}",), shape, tuple(offsets), "style", kind)
        except Exception:
            pass
        self._style_lays[key] = lay
        return lay

    # -- hooks ----------------------------------------------------------------------------------------------
    def before_value(self, t, plain, module=None, side: str | None = None, key: str = "") -> None:
        """A module's input or output is about to get its value id: note its layout, if it has one (a style
        speaks of the module's first input and its output only)."""
        lay = self.dtensor_lay(t) if t is not plain else None
        if lay is None and module is not None and (key in ("args.0", "out", "out.0") or key.startswith("out.")):
            if self.declared is not None:
                lay = self._module_declared(module, side, plain, key)
            if lay is None and key in ("args.0", "out"):
                lay = self._style_lay(module, side, plain)
        if lay is None and plain.shape in self._param_shapes:
            lay = self._params.get(_storage_key(plain))
        if lay is not None:
            self.pending[id(plain)] = lay

    def block_fp(self, t):
        """(hex, stats) of op result `t`, about to get its value id (values.ValueIdentity.produced), where its
        layout is a block and the C kernel reads it: taken from the same read as its partial
        (record/partials.Partials.block_fp). None otherwise (the writer fingerprints `t`)."""
        lay = self.pending.get(id(t))
        return None if lay is None else self.partials.block_fp(t, lay)

    def after_value(self, plain, vid: int) -> None:
        lay = self.pending.pop(id(plain), None)
        partial = self.partials.take_pair(plain, lay)  # (taken now whether it binds or not)
        if lay is not None and vid not in self.by_vid:
            self._bind(plain, vid, lay, partial)
        self.row_partials.discard(id(plain))

    def op_inputs(self, tensors_in, plain_in, vids) -> None:
        """Op arguments: DTensors and DTensor parameters' local tensors give their values a layout."""
        for t, p, vid in zip(tensors_in, plain_in, vids):
            if vid in self.by_vid:
                continue
            lay = self.dtensor_lay(t) if t is not p else None
            if lay is None and p.shape in self._param_shapes:
                lay = self._params.get(_storage_key(p))
            if lay is not None:
                self._bind(p, vid, lay)

    def op_outputs(self, func, name: str, args, vids_in, tensors_in, plain_in, outs, plain_out,
                   collective_lays=None) -> None:
        """An op's results, before they get their value ids: their layouts (a DTensor result's placements, a
        collective's, else the rules'), pending until `bind_outputs`."""
        if self.partials.pairs:  # (left by an op that failed before its results were bound: stale)
            self.partials.pairs.clear()
        lays = [self.dtensor_lay(t) if t is not p else None for t, p in zip(outs, plain_out)]
        if collective_lays is not None:
            lays = [a or b for a, b in zip(lays, collective_lays)]
        elif not all(lays):
            by_vid = self.by_vid
            ins = tuple((p.shape, by_vid.get(v)) for p, v in zip(plain_in, vids_in))
            if any(x[1] is not None for x in ins):  # (no input with a layout: none to carry)
                ruled = ruled_layouts(func, name, args, ins, tensors_in, plain_in, vids_in, by_vid, plain_out)
                if ruled is not None:
                    lays = [a or b for a, b in zip(lays, ruled)]
        for p, lay in zip(plain_out, lays):
            if lay is not None:
                self.pending[id(p)] = lay

    def bind_outputs(self, plain_out, out_vids) -> None:
        for p, vid in zip(plain_out, out_vids):
            self.after_value(p, vid)

    def shard_rows(self, t, code: str, vid: int | None = None, same_as: int | None = None) -> bytes | None:
        """rows.bin's bytes for the token rows of `t` (layout `code`, value `vid`) when `t` is a block of a global value
        cut along its row dims only: each row's partial of the global row. None otherwise (its rows are whole).
        `same_as`: a value whose rows hold `t`'s bytes row by row (a reshape of it: token_layout.same_rows)."""
        lay = self.pending.get(id(t))
        got = None if lay is None else _block_row_bytes(t, lay, code, self.kept_rows, vid, same_as)
        if got is not None:
            self.row_partials.add(id(t))
        return got

    # -- lines ----------------------------------------------------------------------------------------------
    def _bind(self, t, vid: int, lay: Lay, partial: str | None = None) -> None:
        """Bind value `vid` (tensor `t`) to layout `lay`, and queue its layout line; `partial`: its hex partial
        when block_fp took it with its fingerprint."""
        self.by_vid[vid] = lay
        routing = self._routing.pop(id(t), None) if lay.placements == ("T",) else None
        if routing is not None:
            self.out.add(Layout(vid, lay.mesh, ["T"], list(lay.gshape), list(lay.offsets), lay.src,
                                to_hex(routed_partial(t, routing)), False, lay.why, routing.top_k, routing.table(),
                                row_hexes(t)).to_json())
            return
        if has_block(lay.placements):
            try:
                partial = self.partials.of(t, vid, lay, partial)
            except Exception as e:  # a shape the layout does not fit: no layout rather than a wrong one
                self._warn(f"a shard layout did not fit its tensor ({type(e).__name__}: {e}); recorded as the rank's own")
                del self.by_vid[vid]
                return
        rows = None
        if lay.placements == ("S0",) and t.dim() >= 1 and (lay.src == "declared" or lay.why == "topk_margin"
                                                            or self._rows_here()):
            # (whole rows of a declared block, a top-k margin, a value made inside a module declared S(0) (a
            # router's scores, ids, weights): which rows differ, hash mode too)
            rows = row_hexes(t)
        self.out.add(Layout(vid, lay.mesh, list(lay.placements), list(lay.gshape), list(lay.offsets), lay.src,
                            partial, id(t) in self.row_partials, lay.why, row_hashes=rows).to_json())

    def add_line(self, line: dict) -> None:
        self.out.add(line)

    def _warn(self, msg: str) -> None:
        if msg not in self.warnings and len(self.warnings) < 100:
            self.warnings.append(msg)


_ROW_PLANS: dict[tuple, tuple | None] = {}  # (code, layout, shape, dtype) -> _row_plan's answer


def _block_row_bytes(t, lay: Lay, code: str, kept: dict | None = None, vid: int | None = None,
                     same_as: int | None = None) -> bytes | None:
    """`Placements.shard_rows` for a value with layout `lay`: the partials of its token rows, or None. `kept` (vid ->
    (where the rows' bytes lie in the global rows, their partials)) takes value `vid`'s, and gives `same_as`'s
    where its rows' bytes lie where `t`'s do: the same bytes at the same global places, so the same partials (a
    reshape of a block, such as a matmul's [B*T, N] result viewed as [B, T, N], is not read again)."""
    key = (code, lay, t.shape, t.dtype)
    plan = _ROW_PLANS.get(key, False)
    if plan is False:  # (a function of the layout and the shape: every layer's values repeat a few)
        plan = _row_plan(t.shape, lay, code, t.element_size())
        bounded_put(_ROW_PLANS, key, plan)
    if plan is None:
        return None
    if kept is None:
        return _plan_row_bytes(t, code, plan)
    where = plan[3]
    got = kept.get(same_as) if same_as is not None else None
    got = got[1] if got is not None and where is not None and got[0] == where else _plan_row_bytes(t, code, plan)
    if vid is not None and got is not None and where is not None:
        # (a value's reshapes come right after it: older ones are seldom asked for)
        bounded_put(kept, vid, (where, got), limit=512)
    return got


def _plan_row_bytes(t, code: str, plan: tuple) -> bytes | None:
    g, o, n_rows, _ = plan
    if t.is_cpu:  # read in place by the C kernel (same bytes as below, no torch ops: these run inside the mode)
        got = strided_row_fingerprints(t, code, n_rows, g, o)
        if got is not None:
            return got
        if code == "bht":  # rows not in place ([B, H, T, d] of local heads): each head's part read in place, else
            got = heads_row_fingerprints(t, n_rows, g, o)  # (where the kernel cannot) one copy in [B, T, H, d] order
            if got is None:
                got = strided_row_fingerprints(t.transpose(1, 2).contiguous(), "bt", n_rows, g, o)
            if got is not None:
                return got
    if code == "bht":
        x = t.transpose(1, 2)
        rows = x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])
    elif code == "bt":
        rows = t.reshape(t.shape[0] * t.shape[1], *t.shape[2:])
    else:
        rows = t
    return rows_bytes(row_fingerprints(rows, g, o))


def _row_plan(shape, lay: Lay, code: str, itemsize: int) -> tuple | None:
    """(global row dims, the block's offsets in them, number of token rows, where a row's bytes lie in the global
    row: (run bytes, global byte starts)) where a value of `shape` with layout `lay` is cut along its row dims only
    (each token row a block of the global row), else None."""
    if not has_block(lay.placements):
        return None
    nd = len(shape)
    token_dims = {"bt": (0, 1), "bht": (0, 2), "n": (0,)}.get(code)
    if token_dims is None or len(lay.gshape) != nd:
        return None
    if any(lay.gshape[d] != shape[d] or lay.offsets[d] for d in token_dims):
        return None
    row_dims = [d for d in range(nd) if d not in token_dims]
    g, o = [lay.gshape[d] for d in row_dims], [lay.offsets[d] for d in row_dims]
    try:
        runs, starts = row_runs(hashing_row_dims(shape, code), g, o, itemsize)
        where = (runs.run * itemsize, starts)
    except Exception:  # (a block that does not fit its layout: said where its rows are read)
        where = None
    return g, o, shape[0] * (shape[token_dims[1]] if code != "n" else 1), where


def _dtensor_layout(t, mesh, shape: tuple, src: str, mesh_id, warn) -> Lay | None:
    """The layout of DTensor `t` (global `shape`) on `mesh`, or None where divtrace does not unshard it."""
    codes = [_placement_code(p, len(shape)) for p in t.placements]
    if None in codes:
        warn(f"a DTensor placement {t.placements} is not unsharded by divtrace (recorded as the rank's own)")
        return None
    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        local, offsets = compute_local_shape_and_global_offset(shape, mesh, t.placements)
    except Exception:
        return None
    if tuple(local) != tuple(t._local_tensor.shape):
        return None
    return Lay(mesh_id(mesh), tuple(codes), shape, tuple(offsets), src)


def _storage_key(t) -> tuple | None:
    try:
        return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
    except Exception:
        return None


def _style_of(module):
    """(style name, mesh, input layout, output layout) of a tensor-parallel style on `module` (HF's
    TensorParallelLayer in its forward, or torch's parallelize_module hooks), or None. A layout is "R"
    (replicated) or the global size of the last dim (a block of it); None where the style says nothing."""
    style, mesh, parts = None, None, {}
    fwd = module.__dict__.get("forward")
    for cell in getattr(fwd, "__closure__", None) or ():
        try:
            x = cell.cell_contents
        except ValueError:
            continue
        name = type(x).__name__
        if name in ("ColwiseParallel", "RowwiseParallel") and type(x).__module__.startswith("transformers"):
            style = name
            parts = {"in": (getattr(x, "input_layouts", None),), "out": (getattr(x, "output_layouts", None),
                                                                         getattr(x, "use_local_output", True))}
        elif name == "DeviceMesh":
            mesh = x
    if style is None:  # torch's parallelize_module: hooks over partials of the style's _prepare_*_fn
        for hooks in (module._forward_pre_hooks, module._forward_hooks):
            for h in hooks.values():
                for cell in getattr(h, "__closure__", None) or ():
                    try:
                        x = cell.cell_contents
                    except ValueError:
                        continue
                    fn = getattr(x, "func", None)
                    owner, _, fname = getattr(fn, "__qualname__", "").partition(".")
                    if owner in ("ColwiseParallel", "RowwiseParallel") and fname.startswith("_prepare_"):
                        style = owner
                        parts["in" if "input" in fname else "out"] = tuple(getattr(x, "args", ()))
                    elif type(x).__name__ == "DeviceMesh":
                        mesh = x
    if style is None or mesh is None or mesh.ndim != 1:
        return None
    inp_layout = _first(parts.get("in", (None,))[0])
    out_args = parts.get("out", (None, True))
    out_layout, use_local = _first(out_args[0]), (out_args[1] if len(out_args) > 1 else True)
    if style == "ColwiseParallel":
        out = getattr(module, "out_features", None) if use_local and _is_last_shard(out_layout) else None
        return style, mesh, ("R" if _is_replicate(inp_layout) else None), out
    inp = getattr(module, "in_features", None) if _is_last_shard(inp_layout) else None
    return style, mesh, inp, ("R" if use_local and _is_replicate(out_layout) else None)


def _first(p):
    return p[0] if isinstance(p, (list, tuple)) and p else p


def _is_last_shard(p) -> bool:
    return p is None or (type(p).__name__ == "Shard" and p.dim == -1)


def _is_replicate(p) -> bool:
    return p is None or type(p).__name__ == "Replicate"
