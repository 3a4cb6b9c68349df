"""A repro's inputs: the union of both sides' leaf inputs, one name per distinct recorded value, stored as
inputs.safetensors with the expected outputs (expected.safetensors), and, for a token-aligned repro, which input
rows are the same token's on both sides.

In: the two sides of a repro region (region.py). Out: the tensor files and the input specs the script
(writer.py, codegen.py) is written from.
"""
from __future__ import annotations

from pathlib import Path

import torch

from divtrace.repro import codegen
from divtrace.repro.region import Side, Target, _value_key, op_short

def _hint(side: Side, vid: int) -> str:
    t = side.trace
    for key, v in side.call.inputs:
        if v == vid:
            last = key.split(".")[-1]
            return f"arg{last}" if last.isdigit() else last
    for c in t.calls.values():
        for key, v in c.outputs:
            if v == vid:
                suffix = key.removeprefix("out").lstrip(".")
                return (c.module.split(".")[-1] or "model") + "_out" + suffix
    for c in t.roots():
        for key, v in c.inputs:
            if v == vid:
                return key.split(".")[-1]
    p = t.values[vid].producer
    return "param" if p is None else op_short(t.records[p].op) + "_out"


def _range(x: torch.Tensor) -> tuple[float, float]:
    if x.numel() == 0:
        return 0.0, 0.0
    if x.dtype == torch.bool:
        x = x.to(torch.uint8)
    if x.is_complex():
        x = torch.view_as_real(x)
    if x.is_floating_point():
        f = x[torch.isfinite(x)].double()
        return (float(f.min()), float(f.max())) if f.numel() else (0.0, 0.0)
    return float(x.min()), float(x.max())


class Inputs:
    """The union of both sides' leaf inputs, one name per distinct recorded value (dtype, shape, bytes)."""

    def __init__(self, sides: dict[str, Side]):
        self.by_key: dict = {}
        self.order: list = []
        taken: set = set()
        self.names: dict[str, dict[int, str]] = {"a": {}, "b": {}}
        self.first: dict = {}  # key -> (side, vid) that defines the stored value and layout
        for s, side in sides.items():
            for vid in side.leaves:
                key = _value_key(side.trace, vid)
                if key not in self.by_key:
                    self.by_key[key] = codegen.safe_ident(_hint(side, vid), taken)
                    self.order.append(key)
                    self.first[key] = (s, vid)
                self.names[s][vid] = self.by_key[key]
        self.roles = {}
        for key in self.order:
            roles = {side.roles[v] for s, side in sides.items() for v in side.leaves
                     if _value_key(side.trace, v) == key}
            self.roles[key] = "activation" if "activation" in roles else sorted(roles)[0]


def save_tensors(out: Path, traces: dict, target: Target, inp: Inputs, flat_rows: bool = False) -> tuple[dict, dict]:
    """inputs.safetensors (the leaves, as recorded) and expected.safetensors; returns (input specs, outputs)."""
    from safetensors.torch import save_file

    tensors, specs = {}, {}
    for key in inp.order:
        s, vid = inp.first[key]
        x = traces[s].tensor(vid)
        v = traces[s].values[vid]
        lo, hi = _range(x)
        name = inp.by_key[key]
        tensors[name] = x.contiguous()
        specs[name] = {"dtype": v.dtype, "shape": list(v.shape), "stride": list(v.stride), "device": v.device,
                       "role": inp.roles[key], "min": lo, "max": hi, "batch_dim": None}
    save_file(tensors, str(out / "inputs.safetensors"))
    outputs = {"a": traces["a"].tensor(target.va), "b": traces["b"].tensor(target.vb)}
    if target.row_index is not None:  # token alignment: each side returns the token's row of its output
        from divtrace.repro.codegen import select_row

        outputs = {s: select_row(x, target.row_index[s]) for s, x in outputs.items()}
        if flat_rows:  # (rows of another shape on each side are compared flat)
            outputs = {s: x.reshape(-1) for s, x in outputs.items()}
    outputs = {s: x.contiguous() for s, x in outputs.items()}
    save_file(outputs, str(out / "expected.safetensors"))
    return specs, outputs


def token_ties(target: Target, sides: dict[str, Side], inp: Inputs) -> list:
    """Token alignment: [input of b, its row index, input of a, its row index] for each activation of side b whose
    row for the token is an activation row of side a (the same token's row in each side's batch). Random trials
    draw every row anew and then copy these rows across, so both sides see the token's same input row inside
    batches that are otherwise random: a batch-invariant fix passes them, a kernel that depends on the rest of
    its batch does not."""
    from divtrace.trace import token_layout as layout

    if target.views is None:
        return []

    def rows_of(s):
        view = target.views[s]
        idx = view.tokens.index.index
        g = view.tokens.index.grids[view.root_cid]
        got = {}
        for vid in sides[s].leaves:
            e = idx.get(vid)
            if sides[s].roles.get(vid) != "activation" or e is None or e[0] != view.root_cid or e[2] < 0:
                continue
            where = layout.row_index(e[1], g.shape, view.cell)
            if where is not None:
                got.setdefault(view.vkey[vid], (inp.names[s][vid], where))
        return got

    ra, rb = rows_of("a"), rows_of("b")
    return [[nb, ib, *ra[k]] for k, (nb, ib) in rb.items() if k in ra and ra[k][0] != nb]
