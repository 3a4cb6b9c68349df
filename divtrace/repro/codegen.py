"""Python source for repro.py: each side's region as `torch.ops.<ns>.<op>.<overload>(...)` calls.

Everything that comes from a trace (module and op names, labels, string constants) reaches the source only as
an `ascii()` literal or as a checked identifier, so a name with quotes or newlines can never become code.
Identifiers (input names, op attribute paths) are generated here or validated against a strict pattern.
"""
from __future__ import annotations

import builtins
import keyword
import math
import re
from dataclasses import dataclass, field

import torch

from divtrace.repro.harness import CRASH_GUARD, HARNESS
from divtrace.repro.region import Side, op_short

_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# size-list arguments that carry the batch dim: op -> position of the size list
SIZE_ARG = {"view": 1, "_unsafe_view": 1, "reshape": 1, "_reshape_alias": 1, "expand": 1, "view_copy": 1,
            "expand_copy": 1, "new_empty": 1, "new_zeros": 1, "new_ones": 1, "new_full": 1, "new_empty_strided": 1}
CREATION_SIZE_ARG = {"full": 0, "zeros": 0, "ones": 0, "empty": 0, "empty_strided": 0, "rand": 0, "randn": 0}
# names the script defines or imports at module level, or uses inside the sides (B): never an input's name
BUILTIN_NAMES = {"torch", "B", "S", "DEVICE", "RECORDED_DEVICE", "HERE", "sys", "json", "math", "argparse", "load_file",
                 "Path", "importlib"}


class Unreplayable(Exception):
    pass


def safe_ident(hint: str, taken: set) -> str:
    """A fresh, valid, non-keyword identifier derived from `hint` (letters, digits and _ only)."""
    base = re.sub(r"[^A-Za-z0-9_]+", "_", hint.encode("ascii", "ignore").decode()).strip("_")[:40] or "x"
    if base[0].isdigit():
        base = "x" + base
    if (keyword.iskeyword(base) or base in BUILTIN_NAMES or hasattr(builtins, base)
            or re.fullmatch(r"t\d+|_.*", base)):
        base = "in_" + base
    name, k = base, 2
    while name in taken or keyword.iskeyword(name):
        name, k = f"{base}_{k}", k + 1
    assert _IDENT.match(name) and not keyword.iskeyword(name)
    taken.add(name)
    return name


def pylit(x) -> str:
    """A Python literal for JSON-like data (dict/list/str/number/bool/None); strings only as ascii() literals."""
    if x is None or isinstance(x, bool):
        return repr(x)
    if isinstance(x, int):
        return repr(int(x))
    if isinstance(x, float):
        return repr(x) if math.isfinite(x) else f"float({ascii(repr(x))})"
    if isinstance(x, str):
        return ascii(x)
    if isinstance(x, (list, tuple)):
        inner = ", ".join(pylit(y) for y in x)
        return f"[{inner}]" if isinstance(x, list) else f"({inner}{',' if len(x) == 1 else ''})"
    if isinstance(x, dict):
        return "{" + ", ".join(f"{pylit(str(k))}: {pylit(v)}" for k, v in x.items()) + "}"
    raise TypeError(f"not literal data: {type(x).__name__}")


def op_expr(op: str) -> str:
    parts = op.split(".")
    if len(parts) != 3 or not all(parts):
        raise Unreplayable(f"op name {op!r} is not namespace.name.overload")
    if all(_IDENT.match(p) and not keyword.iskeyword(p) for p in parts):
        return "torch.ops." + op
    ns, name, ov = (ascii(p) for p in parts)
    return f"getattr(getattr(getattr(torch.ops, {ns}), {name}), {ov})"


def _torch_attr(name: str, kind) -> str:
    attr = name.removeprefix("torch.") if isinstance(name, str) else ""
    if not (name.startswith("torch.") and _IDENT.match(attr) and isinstance(getattr(torch, attr, None), kind)):
        raise Unreplayable(f"unknown {kind.__name__} {name!r}")
    return f"torch.{attr}"


@dataclass
class Ctx:
    ref: dict  # vid -> variable name
    device: str  # the trace's device: device constants equal to it are written as DEVICE


def literal(x, ctx: Ctx) -> str:
    """Source for one encoded op argument (see divtrace.record.op_records.encode_constant)."""
    if x is None or isinstance(x, (bool, int, float, str)):
        return pylit(x)
    if isinstance(x, list):
        return "[" + ", ".join(literal(y, ctx) for y in x) + "]"
    if isinstance(x, dict):
        if set(x) == {"$v"}:
            if x["$v"] not in ctx.ref:
                raise Unreplayable(f"tensor value {x['$v']} is neither an input nor computed before")
            return ctx.ref[x["$v"]]
        if set(x) == {"$tuple"} and isinstance(x["$tuple"], list):
            items = [literal(y, ctx) for y in x["$tuple"]]
            return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"
        if set(x) == {"$float"} and x["$float"] in ("inf", "-inf", "nan"):
            return f"float({ascii(x['$float'])})"
        if set(x) == {"$complex"} and isinstance(x["$complex"], list) and len(x["$complex"]) == 2:
            return f"complex({literal(x['$complex'][0], ctx)}, {literal(x['$complex'][1], ctx)})"
        if set(x) == {"$dict"} and isinstance(x["$dict"], list):
            return "{" + ", ".join(f"{pylit(str(k))}: {literal(v, ctx)}" for k, v in x["$dict"]) + "}"
        if set(x) == {"$dtype"}:
            return _torch_attr(x["$dtype"], torch.dtype)
        if set(x) == {"$layout"}:
            return _torch_attr(x["$layout"], torch.layout)
        if set(x) == {"$memory_format"}:
            return _torch_attr(x["$memory_format"], torch.memory_format)
        if set(x) == {"$device"} and isinstance(x["$device"], str):
            return "DEVICE" if x["$device"] == ctx.device else f"torch.device({ascii(x['$device'])})"
        if "$repr" in x:
            raise Unreplayable(f"argument {x.get('$type', '?')} {str(x['$repr'])[:80]!r} was recorded only as text")
    raise Unreplayable(f"argument {str(x)[:80]!r} cannot be written as Python")


def _size_literal(size, batch: int | None, seq: int | None = None) -> str:
    """A size list with its leading entry in terms of the runtime batch `B` (recorded `batch`; None: kept) and
    the entries equal to the recorded sequence length `seq` as `S` (None: kept)."""
    items = []
    for j, s in enumerate(size):
        if j == 0 and batch is not None:
            k = s // batch
            items.append("B" if k == 1 else "B * S" if seq is not None and k == seq else f"B * {k}")
        elif seq is not None and type(s) is int and s == seq:
            items.append("S")
        else:
            items.append(literal(s, Ctx({}, "")))
    return "[" + ", ".join(items) + "]"


def seq_sites(side: Side, seq: int) -> set[int]:
    """Region ops with a size argument (views, expands, tensor creation) that holds the recorded sequence length,
    and `arange(seq)`."""
    sites = set()
    for i in side.ops:
        rec = side.trace.records[i]
        name = op_short(rec.op)
        if name == "arange" and rec.args and type(rec.args[0]) is int and rec.args[0] == seq:
            sites.add(i)
            continue
        pos = SIZE_ARG.get(name, CREATION_SIZE_ARG.get(name))
        if pos is None or pos >= len(rec.args):
            continue
        size = rec.args[pos]
        if isinstance(size, list) and all(type(s) is int for s in size) and seq in size:
            sites.add(i)
    return sites


def symbolic_sites(side: Side, batch: int, creation: bool) -> set[int]:
    """Region ops whose size argument's leading entry is a multiple of the recorded batch."""
    sites = set()
    for i in side.ops:
        rec = side.trace.records[i]
        name = op_short(rec.op)
        pos = SIZE_ARG.get(name, CREATION_SIZE_ARG.get(name) if creation else None)
        if pos is None or pos >= len(rec.args):
            continue
        size = rec.args[pos]
        if (isinstance(size, list) and size and all(type(s) is int for s in size) and size[0] > 0
                and size[0] % batch == 0):
            sites.add(i)
    return sites


def _out_paths(enc, path=()):
    if isinstance(enc, dict) and set(enc) == {"$v"}:
        yield path, enc["$v"]
    elif isinstance(enc, dict) and set(enc) == {"$tuple"}:
        for i, y in enumerate(enc["$tuple"]):
            yield from _out_paths(y, path + (i,))
    elif isinstance(enc, list):
        for i, y in enumerate(enc):
            yield from _out_paths(y, path + (i,))


@dataclass
class SideCode:
    source: str
    ops: list[str]
    custom_ops: list[str] = field(default_factory=list)
    unreplayable: list[str] = field(default_factory=list)
    symbolic: bool = False
    seq_symbolic: bool = False  # some size is written in terms of S


def op_call(i: int, rec, ctx: Ctx, code: SideCode, arg=None, who: str = "") -> str:
    """The source of op record `i`'s call, each positional argument by `arg(j, a)` (default `literal`); where it
    cannot be written as Python, an `_unreplayable(...)` call, noted in `code.unreplayable`."""
    try:
        args = [arg(j, a) if arg is not None else literal(a, ctx) for j, a in enumerate(rec.args)]
        bad = [k for k in rec.kwargs if not _IDENT.match(str(k)) or keyword.iskeyword(str(k))]
        if bad:
            raise Unreplayable(f"keyword argument name {str(bad[0])[:40]!r} is not an identifier")
        args += [f"{k}={literal(v, ctx)}" for k, v in rec.kwargs.items()]
        return f"{op_expr(rec.op)}({', '.join(args)})"
    except Unreplayable as e:
        msg = f"record {i} ({rec.op}){who}: {e}"
        code.unreplayable.append(msg)
        return f"_unreplayable({ascii(msg)})"


def _written_arg(rec, where) -> int | None:
    """The vid passed at `where` (a position, a keyword, or [either, k] for element k of a list argument)."""
    k = None
    if isinstance(where, list) and len(where) == 2 and type(where[1]) is int:
        where, k = where
    if type(where) is int:
        x = rec.args[where] if 0 <= where < len(rec.args) else None
    elif type(where) is str:
        x = rec.kwargs.get(where)
    else:
        return None
    if k is not None:
        x = x[k] if isinstance(x, list) and 0 <= k < len(x) else None
    return x["$v"] if isinstance(x, dict) and set(x) == {"$v"} else None


def select_row(x, index: list):
    """x[index] with ":" for a whole dim (Side.row_index)."""
    return x[tuple(slice(None) if i == ":" else i for i in index)]


def gen_side(letter: str, side: Side, names: dict[int, str], params: list[str], relayout: dict[int, tuple],
             device: str, batch: int | None, sites: set[int], batch_input: str | None, seq: int | None = None,
             seq_input: tuple[str, int] | None = None) -> SideCode:
    """`def side_<letter>(<params>):` replaying the region's ops in record order."""
    t = side.trace
    ref = dict(names)
    needed = {side.output}
    for i in side.ops:
        needed.update(t.records[i].inputs)
    lines = [f"def side_{letter}({', '.join(params)}):"]
    lines.append(f"    # {len(side.ops)} recorded ops of trace {letter} ({ascii(str(t.label))}), in record order")
    code = SideCode("", [], [], [])
    use_sym = bool(sites) and batch is not None and batch_input is not None
    s_sites = seq_sites(side, seq) if seq is not None and seq_input is not None else set()
    if use_sym:
        lines.append(f"    B = {batch_input}.shape[0]  # the batch size (recorded: {batch})")
        code.symbolic = True
    head = len(lines)  # the DEVICE line goes here when an op needs it
    if relayout:  # a local copy of the harness's helper: the function stays self-contained (copy it into a patch)
        lines += ["    " + x if x else x for x in _WITH_LAYOUT.splitlines()]
    for vid, (shape, stride) in relayout.items():
        lines.append(f"    {names[vid]} = _with_layout({names[vid]}, {pylit(list(shape))}, {pylit(list(stride))})"
                     f"  # this side received it in this memory layout")
    n = 0
    for i in side.ops:
        rec = t.records[i]
        code.ops.append(op_short(rec.op))
        ns = rec.op.split(".")[0]
        if ns not in ("aten", "prims", "prim") and rec.op not in code.custom_ops:
            code.custom_ops.append(rec.op)
        ctx = Ctx(ref, device)
        name = op_short(rec.op)
        pos = SIZE_ARG.get(name, CREATION_SIZE_ARG.get(name))
        b_site, s_site = use_sym and i in sites, i in s_sites

        def arg(j, a, ctx=ctx, name=name, pos=pos, b_site=b_site, s_site=s_site):
            if j == pos and (b_site or s_site):
                return _size_literal(a, batch if b_site else None, seq if s_site else None)
            if s_site and name == "arange" and j == 0:
                return "S"
            return literal(a, ctx)
        call = op_call(i, rec, ctx, code, arg)
        module = t.calls[rec.call_id].module
        comment = f"  # record {i}, {ascii(module or '<root>')}"
        if isinstance(rec.out, dict) and set(rec.out) == {"$writes"}:
            # Returns nothing and writes its results into its arguments (vLLM's _C.rotary_embedding rotates query
            # and key in place): after the call, each output is the variable passed at that argument.
            lines.append(f"    {call}{comment}")
            for where, vid in zip(rec.out["$writes"], rec.outputs):
                arg = _written_arg(rec, where)
                if arg is None or arg not in ref:
                    code.unreplayable.append(f"record {i} ({rec.op}): writes its result into an argument that "
                                             "is not a recorded tensor")
                    break
                ref[vid] = ref[arg]
            continue
        outs = (list(_out_paths(rec.out)) if rec.out is not None else
                [((), rec.outputs[0])] if len(rec.outputs) == 1 else [((k,), v) for k, v in enumerate(rec.outputs)])
        if len(outs) == 1 and outs[0][0] == ():
            var = f"t{n}"
            n += 1
            ref[outs[0][1]] = var
            lines.append(f"    {var} = {call}{comment}")
            continue
        lines.append(f"    _r = {call}{comment}")
        for path, vid in outs:
            if vid in needed and vid not in ref:
                var = f"t{n}"
                n += 1
                ref[vid] = var
                lines.append(f"    {var} = _r{''.join(f'[{k}]' for k in path)}")
    if side.row_index is not None:  # token alignment: the token's row of this side's output (its batch is its own)
        idx = ", ".join(":" if i == ":" else str(i) for i in side.row_index)
        flat = ".reshape(-1)" if side.flat_row else ""  # (rows of another shape on the other side: compared flat)
        lines.append(f"    return {ref[side.output]}[{idx}]{flat}  # the token's row of a [{', '.join(map(str, t.values[side.output].shape))}] output")
    else:
        lines.append(f"    return {ref[side.output]}")
    if s_sites and any(re.search(r"\bS\b", x) for x in lines[head:]):
        lines.insert(head, f"    S = {seq_input[0]}.shape[{seq_input[1]}]  # the sequence length (recorded: {seq})")
        code.seq_symbolic = True
    if any(re.search(r"\bDEVICE\b", x) for x in lines[head:]):
        # Local, not the script's global: a side copied into a patch file must run as it is. The device is that
        # of an input that lived on the recorded device, so `repro.py --device` and verify move it along.
        on_dev = next((names[v] for v in side.leaves if v in names and str(t.values[v].device) == device), None)
        lines.insert(head, f"    DEVICE = {on_dev}.device  # where the sides run (the recorded {ascii(device)} "
                           "unless moved)" if on_dev else f"    DEVICE = torch.device({ascii(device)})")
    code.source = "\n".join(lines) + "\n"
    return code


# harness._with_layout, for sides that re-lay out an input themselves (they define it locally)
_WITH_LAYOUT = HARNESS[HARNESS.index("def _with_layout("):HARNESS.index("\n\n\ndef _device(")].strip("\n")


HEADER = '''"""divtrace repro: both sides of one divergence as plain torch code, on the tensors they were recorded with.

    python repro.py              run both sides on the recorded inputs, compare bitwise (exit 1 while they differ;
                                 exit 2 when the script itself fails: no torch, a missing module, the wrong python)
    python repro.py --trials 5   also on 5 random inputs of the same shapes, dtypes and value ranges
    python repro.py --fidelity   check that each side still reproduces its own recorded output bitwise

side_a and side_b take the same inputs (INPUT_NAMES); a fix replaces one of them with a function of the same
signature. Needs only torch and safetensors (and, where listed below, the module that defines a custom op).
Generated by divtrace; edit freely.
"""
import argparse
import json
import math
import os
import sys
from pathlib import Path
''' + CRASH_GUARD + '''
import torch
from safetensors.torch import load_file
'''


def render(*, device: str, origin: dict, input_names: list[str], specs: dict, batch: int | None, settings: dict,
           side_codes: dict[str, SideCode], custom_imports: list[tuple[str, str, str | None]], counts: dict,
           token_ties: list | None = None, keep_recorded: list | None = None, block_ties: list | None = None) -> str:
    """The whole script. custom_imports: (op, module, directory it was found in or None)."""
    out = [HEADER]
    if custom_imports:
        out.append("# Custom ops (not aten): the sides call ops that these modules register; import them first.")
        out.append("import importlib")
        for op, mod, where in custom_imports:
            out.append(f"# torch.ops.{op} is defined in module {ascii(mod)}")
            if where:
                out.append("try:")
                out.append(f"    importlib.import_module({ascii(mod)})")
                out.append("except ImportError:  # not installed: try where it was found when this repro was written")
                out.append(f"    sys.path.append({ascii(where)})")
                out.append(f"    importlib.import_module({ascii(mod)})")
            else:
                out.append(f"importlib.import_module({ascii(mod)})")
        out.append("")
    out.append("HERE = Path(__file__).resolve().parent")
    out.append(f"RECORDED_DEVICE = {ascii(device)}  # where the traces were recorded")
    out.append("DEVICE = torch.device(RECORDED_DEVICE)  # where the sides run (python repro.py --device ...)")
    out.append(f"ORIGIN = {pylit(origin)}")
    out.append(f"OPS = {pylit(counts)}")
    out.append(f"INPUT_NAMES = {pylit(input_names)}")
    out.append("# per input: dtype, shape, stride and device as recorded, role, value range, batch dim")
    out.append("INPUT_SPECS = {")
    for k in input_names:
        out.append(f"    {pylit(k)}: {pylit(specs[k])},")
    out.append("}")
    out.append(f"BATCH = {pylit(batch)}  # the recorded batch size (leading dim of the batched inputs)")
    out.append(f"SETTINGS_A = {pylit(settings['a'])}")
    out.append(f"SETTINGS_B = {pylit(settings['b'])}")
    if token_ties:
        out.append("# Token alignment: each side runs the token at its own batch and returns the token's row. These")
        out.append("# [input of b, row, input of a, row] hold the same token's input row: random trials copy it across.")
        out.append(f"TOKEN_TIES = {pylit(token_ties)}")
    if keep_recorded:
        out.append("# The two sides hold these in different forms (a cos/sin table against an engine's cache and")
        out.append("# positions): no row of one equals a row of the other, so random trials keep their recorded values.")
        out.append(f"KEEP_RECORDED = {pylit(keep_recorded)}")
    if block_ties:
        out.append("# A sharded run's side (simulated ranks): [input, global input of the other side, [start, stop) per")
        out.append("# dim]: random trials give each rank its block of the other side's drawn global value.")
        out.append(f"BLOCK_TIES = {pylit(block_ties)}")
    out.append("")
    for letter in ("a", "b"):
        out.append("")
        out.append(side_codes[letter].source)
    out.append(HARNESS)
    return "\n".join(out)
