"""The dispatch mode and op records: every aten op run inside a recorded module call, with ops=True.

A TorchDispatchMode sees every aten op and attributes it to the innermost recorded module call on this thread
(an op of model B called inside model A's forward lands only in B's trace). Its arguments are encoded for JSON
(tensors as their value ids, `encode_constant` for the rest); its outputs become new values. The mode stays
pushed for the whole block, between module calls too: a mode the user enters inside the block sits above it,
and in-place writes between calls are counted (tests/test_record_mode_gaps.py).

In: aten ops (func, args, kwargs) from the dispatcher. Out: OpRecords to the trace writer, with the values of
their inputs and outputs (values); the writes counted per storage (values' versions).
"""
from __future__ import annotations

import math

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from divtrace.record.lifecycle import ACTIVE as _ACTIVE
from divtrace.record.lifecycle import BUSY as _BUSY
from divtrace.record.lifecycle import STATE as _STATE
from divtrace.record.lifecycle import owners as _owners
from divtrace.record.values import op_inputs, op_tensors
from divtrace.trace.records import OpRecord

_PLAIN_TYPES, _STRIDED = frozenset((torch.Tensor, torch.nn.Parameter)), torch.strided  # (dispatched as they are)
_AS_IS = frozenset((int, bool, str, type(None)))  # argument types _encode returns as they are
_NO_LOCALS: dict = {}  # (never written: an op whose tensors are all plain maps none to another)
_MUTATED: dict = {}  # op overload -> [(position, name)] of the arguments it writes to


_READS_ONLY: dict = {}


def _reads_only(func) -> bool:
    """Whether the op's schema says it writes none of its arguments (no schema: assume it may)."""
    r = _READS_ONLY.get(func)
    if r is None:
        r = _READS_ONLY[func] = getattr(func, "_schema", None) is not None and not _mutated_args(func)
    return r


def _is_custom_op(func) -> bool:
    """Whether `func` was made by torch.library.custom_op (which counts the writes to its arguments before the
    dispatch mode sees the op: see OpRecorder.on_op)."""
    from torch._library import custom_ops

    schema = getattr(func, "_schema", None)
    return schema is not None and schema.name in getattr(custom_ops, "OPDEFS", {})


def _mutated_args(func) -> list:
    m = _MUTATED.get(func)
    if m is None:
        try:
            m = [(i, a.name) for i, a in enumerate(func._schema.arguments)
                 if a.alias_info is not None and a.alias_info.is_write]
        except AttributeError:
            m = []
        _MUTATED[func] = m
    return m


class OpRecorder:
    """The op records of one recording (ops=True): the dispatch mode's side of the recorder."""

    def __init__(self, calls, values):
        self._calls = calls  # the ModuleCalls: an op belongs to the innermost recorded call on this thread
        self._stack = calls.stack
        self._take_index = calls.take_index  # (bound once, like the values' methods: called for every op)
        self._values = values
        self._writes = values.writes
        self._plain, self._vid_of, self._produced = values.plain, values.vid_of, values.produced
        self.writer = None  # the TraceWriter, from the start of the block
        self._mode = None
        # A rank of a sharded run (divtrace.record.placements, .collectives): layouts of the values, collectives
        self.placements = None
        self.collectives = None

    def push_mode(self) -> None:
        """Push the dispatch mode, for the whole block: never popped between module calls, so a dispatch mode
        the user enters inside the block sits above it (it sees the model's ops first; divtrace records what then
        runs), and in-place writes between calls are counted (inference tensors have no version counter)."""
        self._mode = _OpMode(self)
        self._mode.__enter__()
        self._values.mode_pushed = True

    def pop_mode(self) -> None:
        if self._mode is not None:
            self._mode.__exit__(None, None, None)

    def _owns_innermost(self) -> bool:
        owners = _owners()
        return not owners or owners[-1][1] is self._calls

    def on_op(self, func, args, kwargs):
        """Run `func`, recording it when it runs inside a recorded module call."""
        info = _OP_INFO.get(func)
        if info is None:
            info = _op_info(func)
        stack = self._stack
        owner = stack[-1].call_id if stack else None
        if owner is None and stack:
            # Inside an excluded call (exclude=): its ops are its nearest recorded ancestor's own code, as the docs
            # say; outside every recorded call (include= elsewhere) there is none, and nothing is recorded.
            owner = next((f.call_id for f in reversed(stack) if f.call_id is not None), None)
        if (_STATE.busy or owner is None or self.writer.failed
                or (len(_ACTIVE) > 1 and not self._owns_innermost())):
            out = func(*args, **kwargs)
            if info[3] and not _STATE.busy:
                self._note_writes(func, args, kwargs)
            return out
        # An op that writes none of its arguments leaves them as they were: its inputs are fingerprinted after it
        # ran, so a weight streams from memory once, for the op, and is hashed from cache right after.
        after, name, is_view, mutated, written_early, collective = info
        if after:
            out = func(*args, **kwargs)
        with _BUSY:
            # A torch.library.custom_op that writes its arguments bumps their version counters *before* it reaches
            # this dispatch mode (torch/_library/custom_ops.py, adinplaceorview_impl): those arguments are read
            # here as they were, one version back (else a derived view would become a new value with no producer).
            if written_early:
                self._values.bumped = {id(y) for pos, key in mutated
                                       for y in op_tensors(args[pos] if pos < len(args) else kwargs.get(key), [])}
            tensors_in = op_inputs(args, kwargs)
            plain_in = []
            plain = True
            local = _NO_LOCALS  # id(tensor) -> its plain tensor, where that is another (a DTensor's local one)
            for t in tensors_in:
                if type(t) in _PLAIN_TYPES and t.layout is _STRIDED and not (t.is_quantized or t.is_nested or t.is_meta):
                    plain_in.append(t)  # (values.plain's common case, inline: every input of every op)
                    continue
                p = self._plain(t, func)  # (each one asked: a tensor it cannot record is a warning)
                plain_in.append(p)
                if p is not t:
                    if p is None:
                        plain = False
                    elif local is _NO_LOCALS:
                        local = {id(t): p}
                    else:
                        local[id(t)] = p
            if plain:
                values: list = []
                vids: list[int] = []
                encode = self._encode
                enc_args = [a if type(a) in _AS_IS else encode(a, values, vids, local) for a in args]
                enc_kwargs = {k: encode(v, values, vids, local) for k, v in kwargs.items()} if kwargs else {}
                if self.placements is not None:
                    self.placements.op_inputs(tensors_in, plain_in, vids)
        self._values.bumped = None
        if not after:
            out = func(*args, **kwargs)
            if mutated:
                self._note_writes(func, args, kwargs)
        got = out
        if collective is not None:  # done before its result is read (divtrace.record.collectives)
            from divtrace.record.collectives import settle

            got = settle(func, collective, out)
        if not plain:
            return out
        with _BUSY:
            outs = [got] if isinstance(got, torch.Tensor) else op_tensors(got, [])
            writes = None
            if got is None:  # returns nothing, writes its result into arguments (vLLM's _C.onednn_mm): those
                outs, writes = [], []  # are its outputs, and `out` says which arguments hold them
                for pos, arg in mutated:
                    where = pos if pos < len(args) else arg
                    got = op_tensors(args[pos] if pos < len(args) else kwargs.get(arg), [])
                    outs += got
                    writes += [where] if len(got) == 1 else [[where, k] for k in range(len(got))]
            if not outs:
                return out
            plain_out = []
            for t in outs:
                if not (type(t) in _PLAIN_TYPES and t.layout is _STRIDED
                        and not (t.is_quantized or t.is_nested or t.is_meta)):
                    t = self._plain(t, func)
                    if t is None:
                        plain = False
                plain_out.append(t)
            if not plain:
                return out
            index = self._take_index()
            pl = self.placements
            if pl is not None:
                lays = (self.collectives.outputs(func, collective, args, plain_out, index)
                        if collective is not None else None)
                pl.op_outputs(func, name, args, vids, tensors_in, plain_in, outs, plain_out, lays)
            out_vids = [self._produced(p, index, plain_in, values, name, enc_args, is_view, enc_kwargs)
                        for p in plain_out]
            if pl is not None:
                pl.bind_outputs(plain_out, out_vids)
            if writes is not None:
                enc_out = {"$writes": writes}
            elif got is outs[0] and len(outs) == 1:  # (most ops: one tensor)
                enc_out = {"$v": out_vids[0]}
            else:
                enc_out = self._encode_out(got, {id(t): v for t, v in zip(outs, out_vids)})
            rec = OpRecord(index, owner, name, enc_args, enc_kwargs, vids, out_vids, enc_out)
            self.writer.append(rec, values)
            if name == "aten.topk.default":
                self._topk_margin(owner, args, kwargs, local, vids)
        return out

    def _topk_margin(self, owner, args, kwargs, local, vids) -> None:
        """Record each row's top-k margin right after the top-k (divtrace.record.topk_margin)."""
        from divtrace.record.topk_margin import OP, topk_args, topk_margin

        x, k, dim, largest = topk_args(args, kwargs)
        m = topk_margin(x, k, dim, largest)
        if m is None or not vids:
            return
        index = self._take_index()
        values: list = []
        pl = self.placements
        if pl is not None:  # a rank of a sharded run: the scores' layout, their dim reduced away
            from divtrace.record.shard_rules import margin_layout

            lay = margin_layout(x.shape, pl.by_vid.get(vids[0]), dim)
            if lay is not None:
                pl.pending[id(m)] = lay
        mv = self._produced(m, index, [local.get(id(x), x)], values, OP, None, False, None)
        if pl is not None:
            pl.bind_outputs([m], [mv])
        rec = OpRecord(index, owner, OP, [{"$v": vids[0]}, k, dim, bool(largest)], {}, [vids[0]], [mv], {"$v": mv})
        self.writer.append(rec, values)

    def _note_writes(self, func, args, kwargs) -> None:
        """Count in-place writes per storage: inference tensors have no version counter of their own, and other
        tensors over a written storage may have one that the write did not move (`_version`)."""
        for pos, name in _mutated_args(func):
            t = args[pos] if pos < len(args) else kwargs.get(name)
            for x in (t if isinstance(t, (list, tuple)) else (t,)):
                if isinstance(x, torch.Tensor):
                    try:
                        key = x.untyped_storage().data_ptr()
                    except Exception:
                        continue
                    self._writes[key] = self._writes.get(key, 0) + 1

    def _encode(self, x, values, vids, local):
        tx = type(x)
        if tx is int or tx is bool or x is None or tx is str:  # most arguments: what encode_constant returns as is
            return x
        if tx is list and all(type(y) is int for y in x):  # sizes, dims
            return list(x)
        if isinstance(x, torch.Tensor):
            vid = self._vid_of(local.get(id(x), x), values)
            vids.append(vid)
            return {"$v": vid}
        return encode_constant(x, lambda y: self._encode(y, values, vids, local))

    def _encode_out(self, x, vid_by_id):
        if isinstance(x, torch.Tensor):
            return {"$v": vid_by_id[id(x)]}
        return encode_constant(x, lambda y: self._encode_out(y, vid_by_id))


def encode_constant(x, recurse):
    """JSON form of a non-tensor op argument; repro code turns it back into a Python literal."""
    if x is None or isinstance(x, (bool, int, str)):
        return x
    if isinstance(x, float):
        return x if math.isfinite(x) else {"$float": repr(x)}
    if isinstance(x, complex):
        return {"$complex": [encode_constant(x.real, recurse), encode_constant(x.imag, recurse)]}
    if isinstance(x, (list, tuple)):
        return {"$tuple": [recurse(y) for y in x]} if isinstance(x, tuple) else [recurse(y) for y in x]
    if isinstance(x, dict):
        return {"$dict": [[str(k), recurse(v)] for k, v in x.items()]}
    if isinstance(x, torch.dtype):
        return {"$dtype": str(x)}
    if isinstance(x, torch.device):
        return {"$device": str(x)}
    if isinstance(x, torch.layout):
        return {"$layout": str(x)}
    if isinstance(x, torch.memory_format):
        return {"$memory_format": str(x)}
    if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return {"$repr": str(x)}
    return {"$repr": repr(x)[:200], "$type": type(x).__name__}


_OP_NAMES: dict = {}
_OP_INFO: dict = {}  # op overload -> (_reads_only, _op_name, is_view, _mutated_args, a custom op that writes,
# a collective's kind): one lookup per op call


def _op_info(func) -> tuple:
    from divtrace.record.collectives import kind_of

    collective = kind_of(func)
    if collective is not None:  # c10d's schemas do not mark the argument they write: its inputs are read first
        pos = collective[1]
        mutated = [] if pos is None else [(pos, func._schema.arguments[pos].name)]
        info = _OP_INFO[func] = (False, _op_name(func), False, mutated, False, collective)
        return info
    mutated = _mutated_args(func)
    info = _OP_INFO[func] = (_reads_only(func), _op_name(func), getattr(func, "is_view", False), mutated,
                             bool(mutated) and _is_custom_op(func), None)
    return info


def _op_name(func) -> str:
    name = _OP_NAMES.get(func)
    if name is None:
        try:
            name = f"{func.namespace}.{func._opname}.{func._overloadname}"
        except AttributeError:
            name = str(func)
        _OP_NAMES[func] = name
    return name


class _OpMode(TorchDispatchMode):
    def __init__(self, recorder: OpRecorder):
        super().__init__()
        self.recorder = recorder

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.recorder.on_op(func, args, kwargs or {})
