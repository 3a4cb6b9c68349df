"""One recorded op as a Python call the audit can run again, on the recorded tensors or on slices of them.

The op and its constant arguments are turned into Python by the repro generator (divtrace.repro.codegen:
`op_expr` for the op, `literal` for each encoded argument), the one place that turns a recorded op into code;
here each argument's source is evaluated at once instead of written into a script. Tensors stay placeholders
(`Slot`) until a call fills them in, so the same recorded call runs on the whole batch, on rows of it, or on a
padded batch.
"""
from __future__ import annotations

import keyword
import re
from dataclasses import dataclass, field

import torch
from torch.utils._pytree import tree_flatten

from divtrace.trace.records import OpRecord
from divtrace.repro.codegen import Ctx, Unreplayable, literal, op_expr
from divtrace.repro.region import RANDOM_OPS, op_short

_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# outputs of the aten attention kernels that are not the attention: RNG state, workspaces, debug masks
NOT_RESULTS = {"rng_state", "unused", "philox_seed", "philox_offset", "debug_attn_mask", "cum_seq_q", "cum_seq_k"}
COLLECTIVE_NAMESPACES = {"c10d", "_c10d_functional", "_c10d_functional_autograd", "c10d_functional", "_dtensor"}


@dataclass(frozen=True)
class Slot:
    """A tensor argument of the recorded call: the value id it had."""

    vid: int


@dataclass
class RecordedCall:
    """A recorded op, ready to run: `run({vid: tensor})` calls it with those tensors in the recorded places."""

    op: str
    fn: object  # the torch.ops OpOverload
    args: list
    kwargs: dict
    written: set = field(default_factory=set)  # vids the op writes into (in-place / out=): copied before each run

    def compared(self, n: int) -> list[int]:
        """Which of the op's n tensor outputs carry its result: not the RNG state, workspace or debug outputs of
        the attention kernels (uninitialized or per-call bytes, not part of what the op computes)."""
        s = self.schema
        if s is None:
            return list(range(n))
        names = [r.name for r in s.returns if str(r.type) in ("Tensor", "Tensor?")]
        if len(names) != n:
            return list(range(n))
        return [i for i, name in enumerate(names) if name not in NOT_RESULTS]

    @property
    def schema(self):
        return getattr(self.fn, "_schema", None)

    def arg(self, name: str, default=None):
        """The recorded value of the schema argument `name` (positional or keyword)."""
        pos = self.arg_position(name)
        if pos is not None and pos < len(self.args):
            return self.args[pos]
        if name in self.kwargs:
            return self.kwargs[name]
        for a in (self.schema.arguments if self.schema is not None else ()):
            if a.name == name and a.has_default_value():
                return a.default_value
        return default

    def arg_position(self, name: str) -> int | None:
        s = self.schema
        if s is None:
            return None
        for i, a in enumerate(s.arguments):
            if a.name == name:
                return i if not a.kwarg_only else None
        return None

    def run(self, tensors: dict, overrides: dict | None = None):
        """The op's flattened tensor outputs, called with `tensors` (vid -> tensor) in the recorded places and
        `overrides` (schema argument name -> value) replacing recorded arguments."""
        args, kwargs = list(self.args), dict(self.kwargs)
        for name, v in (overrides or {}).items():
            pos = self.arg_position(name)
            if pos is not None and pos < len(args):
                args[pos] = v
            else:
                kwargs[name] = v
        copies = {vid: tensors[vid].clone() for vid in self.written if vid in tensors}

        def fill(x):  # not torch's tree_map: this runs for every row of every op
            tx = type(x)
            if tx is Slot:
                t = copies.get(x.vid)
                return tensors[x.vid] if t is None else t
            if tx is list:
                return [fill(y) for y in x]
            if tx is tuple:
                return tuple(fill(y) for y in x)
            if tx is dict:
                return {k: fill(v) for k, v in x.items()}
            return x

        out = self.fn(*[fill(a) for a in args], **{k: fill(v) for k, v in kwargs.items()})
        return _tensors(out)


def _tensors(out) -> list:
    """The tensors of an op's output, in pytree order (what the recording numbered as its outputs)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        res = []
        for y in out:
            res += _tensors(y)
        return res
    return []


def _decode(x, env: dict, ctx: Ctx):
    """The runtime value of one encoded argument: codegen's Python source for it, evaluated."""
    src = literal(x, ctx)
    try:
        return eval(src, env)  # noqa: S307 - codegen writes only literals, checked identifiers and torch attributes
    except Exception as e:
        raise Unreplayable(f"argument {src[:80]!r} does not evaluate ({type(e).__name__}: {e})") from None


def resolve(op: str):
    """The torch.ops overload named `op` ("aten.mm.default"), through codegen's expression for it."""
    expr = op_expr(op)
    try:
        return eval(expr, {"torch": torch, "getattr": getattr})  # noqa: S307 - see op_expr
    except (AttributeError, RuntimeError) as e:
        ns = op.split(".")[0]
        hint = "" if ns == "aten" else (f": the module that registers torch.ops.{ns} is not imported (import it "
                                        "in the factory passed to --under)")
        raise Unreplayable(f"op {op} is not available in this torch{hint} ({type(e).__name__})") from None


def recorded_call(rec: OpRecord, recorded_device: str, device: str | None = None) -> RecordedCall:
    """`rec` as a RecordedCall, its device arguments that named the recording's device moved to `device`.
    Raises Unreplayable with the reason when it cannot be run again."""
    fn = resolve(rec.op)
    ref = {vid: f"_v{vid}" for vid in rec.inputs}
    env = {"torch": torch, "DEVICE": torch.device(device or recorded_device), "float": float, "complex": complex,
           **{name: Slot(vid) for vid, name in ref.items()}}
    ctx = Ctx(ref, recorded_device)
    args = [_decode(a, env, ctx) for a in rec.args]
    bad = [k for k in rec.kwargs if not _IDENT.match(str(k)) or keyword.iskeyword(str(k))]
    if bad:
        raise Unreplayable(f"keyword argument name {str(bad[0])[:40]!r} is not an identifier")
    kwargs = {k: _decode(v, env, ctx) for k, v in rec.kwargs.items()}
    call = RecordedCall(rec.op, fn, args, kwargs)
    schema = call.schema
    if schema is not None:
        for i, a in enumerate(schema.arguments):
            if a.alias_info is not None and a.alias_info.is_write:
                v = args[i] if (i < len(args) and not a.kwarg_only) else kwargs.get(a.name)
                for s in tree_flatten(v)[0]:
                    if isinstance(s, Slot):
                        call.written.add(s.vid)
    return call


def why_not_replayable(rec: OpRecord, fn) -> str | None:
    """Why an op must not be re-run and judged (random, a collective, side effects only), or None."""
    ns = rec.op.split(".")[0]
    name = op_short(rec.op)
    if ns in COLLECTIVE_NAMESPACES or "all_reduce" in name or "all_gather" in name or "reduce_scatter" in name:
        return "a collective: its result depends on other ranks"
    if name in RANDOM_OPS:
        return "a random op: each call draws new numbers"
    tags = getattr(fn, "tags", ()) or ()
    if torch.Tag.nondeterministic_seeded in tags and not _rng_unused(rec, fn):
        return "a random op (draws from the RNG: dropout or sampling)"
    if not rec.outputs:
        return "no tensor output (a scalar read, or side effects only)"
    return None


def _rng_unused(rec: OpRecord, fn) -> bool:
    """Ops tagged as drawing random numbers that do not here: attention and dropout with p = 0 or train=False."""
    schema = getattr(fn, "_schema", None)
    if schema is None:
        return False
    found = False
    for i, a in enumerate(schema.arguments):
        if a.name not in ("dropout_p", "p", "train"):
            continue
        v = rec.args[i] if (i < len(rec.args) and not a.kwarg_only) else rec.kwargs.get(a.name, a.default_value)
        if a.name == "train":
            if v is False:
                return True
            continue
        if v is None or (isinstance(v, (int, float)) and float(v) == 0.0):
            found = True
        else:
            return False
    return found
