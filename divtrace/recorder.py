"""`record`: module hooks plus an aten-level dispatch mode that write one run into a trace.

Module forward pre/post hooks give the call tree (path, call number, inputs, outputs). A TorchDispatchMode sees
every aten op and attributes it to the innermost recorded module call. Every tensor gets a value id when it is
produced, or when it is first seen coming from outside (parameters, model inputs), so each op input names the
record that produced it. Values are fingerprinted (and in full mode copied) at that moment, so a later in-place
op cannot change what was recorded.
"""
from __future__ import annotations

import dataclasses
import math
import re
import signal
import threading
import warnings

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakTensorKeyDictionary

from divtrace.errors import DivtraceError
from divtrace.records import ModuleEnter, ModuleExit, OpRecord
from divtrace.settings import numerics_settings, run_environment
from divtrace.trace.writer import TraceWriter

_STATE = threading.local()  # shared by all recorders: while one does its own bookkeeping, none records
_ACTIVE_MODELS: set[int] = set()
_PLAIN = (torch.Tensor, torch.nn.Parameter, torch.nn.Buffer) if hasattr(torch.nn, "Buffer") else (torch.Tensor, torch.nn.Parameter)
_MAX_DEPTH = 8


class RecordingTerminated(BaseException):
    """Raised inside the recorded block when the process gets SIGTERM, so the trace is closed and marked."""


class _Busy:
    def __enter__(self):
        _STATE.busy = getattr(_STATE, "busy", 0) + 1

    def __exit__(self, *exc):
        _STATE.busy -= 1


_BUSY = _Busy()


def _busy() -> bool:
    return getattr(_STATE, "busy", 0) > 0


def flatten_tensors(obj, prefix: str, out: list, depth: int = 0) -> list:
    """(key, tensor) pairs of a nested structure: tuples, lists, dicts, HF ModelOutput, dataclasses."""
    if isinstance(obj, torch.Tensor):
        out.append((prefix, obj))
    elif depth >= _MAX_DEPTH:
        pass
    elif isinstance(obj, dict):
        for k, v in obj.items():
            flatten_tensors(v, f"{prefix}.{k}", out, depth + 1)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            flatten_tensors(v, f"{prefix}.{i}", out, depth + 1)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            flatten_tensors(getattr(obj, f.name, None), f"{prefix}.{f.name}", out, depth + 1)
    return out


def _version(t: torch.Tensor):
    try:
        return t._version
    except Exception:  # inference-mode tensors have no version counter
        return None


class Recorder:
    """The context manager returned by `divtrace.record`."""

    def __init__(self, model, path, *, mode="full", ops=True, label=None, include=None, exclude=None,
                 overwrite=False, shard_bytes=128 << 20, extra_meta=None):
        if not isinstance(model, torch.nn.Module):
            raise DivtraceError(f"record() needs a torch.nn.Module, got {type(model).__name__}")
        if mode not in ("full", "hash"):
            raise DivtraceError(f"mode must be 'full' or 'hash', got {mode!r}")
        self.model, self.path, self.mode, self.ops, self.label = model, path, mode, ops, label
        try:
            self._include = re.compile(include) if include else None
            self._exclude = re.compile(exclude) if exclude else None
        except re.error as e:
            raise DivtraceError(f"bad include/exclude regex: {e}") from None
        self._include_src, self._exclude_src = include, exclude
        self._overwrite, self._shard_bytes = overwrite, shard_bytes
        self._extra_meta = dict(extra_meta or {})
        self._handles: list = []
        self._stack: list = []  # (call_id | None, module): None marks an unrecorded (excluded) call
        self._excluded_depth = 0
        self._calls: dict[str, int] = {}
        self._next_call_id = 0
        self._index = 0
        self._tensors = WeakTensorKeyDictionary()  # tensor -> (vid, version, value)
        self._mode_obj = None
        self._old_sigterm = None
        self.warnings: list[str] = []
        self.writer: TraceWriter | None = None

    # context ----------------------------------------------------------------------------------------------
    def __enter__(self):
        if id(self.model) in _ACTIVE_MODELS:
            raise DivtraceError("this model is already being recorded; nested record() on one model is not supported")
        params = list(self.model.parameters())
        device = str(params[0].device) if params else "cpu"
        meta = {"label": self.label, "ops": self.ops, "include": self._include_src, "exclude": self._exclude_src,
                "model_class": type(self.model).__name__, "settings": numerics_settings(),
                "module_tree": [[name, type(m).__name__] for name, m in self.model.named_modules()],
                **run_environment(device), **self._extra_meta}
        self.writer = TraceWriter(self.path, mode=self.mode, meta=meta, overwrite=self._overwrite,
                                  shard_bytes=self._shard_bytes)
        _ACTIVE_MODELS.add(id(self.model))
        for name, m in self.model.named_modules():
            self._handles.append(m.register_forward_pre_hook(self._make_pre(name), with_kwargs=True))
            self._handles.append(m.register_forward_hook(self._make_post(name), with_kwargs=True, prepend=True))
        if self.ops:
            self._mode_obj = _OpMode(self)
            self._mode_obj.__enter__()
        if threading.current_thread() is threading.main_thread():
            def on_sigterm(signum, frame):
                raise RecordingTerminated("SIGTERM")
            self._old_sigterm = signal.signal(signal.SIGTERM, on_sigterm)
        return self

    def __exit__(self, exc_type, exc, tb):
        try:
            if self._mode_obj is not None:
                self._mode_obj.__exit__(None, None, None)
        finally:
            for h in self._handles:
                h.remove()
            self._handles.clear()
            _ACTIVE_MODELS.discard(id(self.model))
            if self._old_sigterm is not None:
                signal.signal(signal.SIGTERM, self._old_sigterm)
            if exc_type is None:
                status, error = "complete", None
            elif issubclass(exc_type, KeyboardInterrupt):
                status, error = "interrupted", "KeyboardInterrupt"
            elif issubclass(exc_type, RecordingTerminated):
                status, error = "terminated", "SIGTERM"
            else:
                status, error = "error", f"{exc_type.__name__}: {exc}"
            self.writer.close(status, error, warnings=self.warnings, unfinished_calls=len(self._stack))
        return False

    # values -----------------------------------------------------------------------------------------------
    def _vid_of(self, t: torch.Tensor, new_values: list) -> int:
        """The value id of `t` as it is now; a tensor never seen (or changed behind our back) is new."""
        entry = self._tensors.get(t)
        if entry is not None and entry[1] == _version(t):
            return entry[0]
        v = self.writer.new_value(t, producer=None)
        new_values.append(v)
        self._tensors[t] = (v.vid, _version(t), v)
        return v.vid

    def _produced(self, t: torch.Tensor, producer: int, inputs: list, new_values: list) -> int:
        v = None
        if t.is_contiguous():
            # A contiguous alias of a contiguous input (view, reshape, detach, ...) has the input's bytes: reuse
            # its fingerprint instead of hashing again.
            for src in inputs:
                if (src.dtype == t.dtype and src.numel() == t.numel() and src.is_contiguous()
                        and src.data_ptr() == t.data_ptr() and src is not t and src.device == t.device):
                    e = self._tensors.get(src)
                    if e is not None and e[1] == _version(src):
                        v = dataclasses.replace(e[2], vid=self.writer.take_vid(), producer=producer,
                                                shape=list(t.shape), stride=list(t.stride()))
                    break
        if v is None:
            v = self.writer.new_value(t, producer=producer)
        new_values.append(v)
        self._tensors[t] = (v.vid, _version(t), v)
        return v.vid

    def _plain(self, t: torch.Tensor, where: str):
        if type(t) in _PLAIN:
            return t
        to_local = getattr(t, "to_local", None)
        if callable(to_local):
            return to_local()
        msg = f"{where}: tensor subclass {type(t).__name__} not recorded"
        if msg not in self.warnings:
            self.warnings.append(msg)
            warnings.warn(f"divtrace: {msg}", stacklevel=3)
        return None

    # module hooks -----------------------------------------------------------------------------------------
    def _make_pre(self, path: str):
        def pre(module, args, kwargs):
            if _busy():
                return None
            with _BUSY:
                self._enter(path, module, args, kwargs)
            return None
        return pre

    def _make_post(self, path: str):
        def post(module, args, kwargs, output):
            if _busy():
                return None
            with _BUSY:
                self._exit(module, output)
            return None
        return post

    def _recorded_parent(self):
        for cid, _, _ in reversed(self._stack):
            if cid is not None:
                return cid
        return None

    def _enter(self, path, module, args, kwargs):
        inside_recorded = bool(self._stack) and self._stack[-1][0] is not None
        if self._exclude is not None and self._exclude.search(path):
            self._excluded_depth += 1
            self._stack.append((None, module, True))
            return
        if self._excluded_depth or (self._include is not None and not inside_recorded
                                    and not self._include.search(path)):
            self._stack.append((None, module, False))
            return
        call = self._calls.get(path, 0)
        self._calls[path] = call + 1
        call_id = self._next_call_id
        self._next_call_id += 1
        values: list = []
        pairs = []
        for key, t in flatten_tensors(args, "args", []) + flatten_tensors(kwargs, "kwargs", []):
            t = self._plain(t, path or "<root>")
            if t is not None:
                pairs.append((key, self._vid_of(t, values)))
        rec = ModuleEnter(self._take_index(), call_id, path, call, self._recorded_parent(), pairs)
        self._stack.append((call_id, module, False))
        self.writer.append(rec, values)

    def _exit(self, module, output):
        # Pop to this module's entry: calls that raised inside and were caught never ran their post hook.
        while self._stack and self._stack[-1][1] is not module:
            self._pop()
        if not self._stack:
            return
        call_id, _, excluded = self._pop()
        if call_id is None:
            return
        values: list = []
        pairs = []
        for key, t in flatten_tensors(output, "out", []):
            t = self._plain(t, "output")
            if t is not None:
                pairs.append((key, self._vid_of(t, values)))
        self.writer.append(ModuleExit(self._take_index(), call_id, pairs), values)

    def _pop(self):
        entry = self._stack.pop()
        if entry[2]:
            self._excluded_depth -= 1
        return entry

    def _take_index(self) -> int:
        i = self._index
        self._index += 1
        return i

    # ops --------------------------------------------------------------------------------------------------
    def on_op(self, func, args, kwargs):
        """Run `func`, recording it when it runs inside a recorded module call."""
        if _busy() or not self._stack or self._stack[-1][0] is None:
            return func(*args, **kwargs)
        with _BUSY:
            tensors_in = flatten_tensors((args, kwargs), "", [])
            if any(self._plain(t, str(func)) is None for _, t in tensors_in):
                plain = False
            else:
                plain = True
                values: list = []
                vids: list[int] = []
                enc_args = [self._encode(a, values, vids) for a in args]
                enc_kwargs = {k: self._encode(v, values, vids) for k, v in kwargs.items()}
        out = func(*args, **kwargs)
        if not plain:
            return out
        with _BUSY:
            outs = [t for _, t in flatten_tensors(out, "", [])]
            if not outs:
                return out
            index = self._take_index()
            ins = [t for _, t in tensors_in]
            out_vids = [self._produced(t, index, ins, values) for t in outs]
            vid_by_id = {id(t): v for t, v in zip(outs, out_vids)}
            enc_out = self._encode_out(out, vid_by_id)
            rec = OpRecord(index, self._stack[-1][0], _op_name(func), enc_args, enc_kwargs, vids, out_vids, enc_out)
            self.writer.append(rec, values)
        return out

    def _encode(self, x, values, vids):
        if isinstance(x, torch.Tensor):
            vid = self._vid_of(x, values)
            vids.append(vid)
            return {"$v": vid}
        return encode_constant(x, lambda y: self._encode(y, values, vids))

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


def _op_name(func) -> str:
    try:
        return f"{func.namespace}.{func._opname}.{func._overloadname}"
    except AttributeError:
        return str(func)


class _OpMode(TorchDispatchMode):
    def __init__(self, recorder: Recorder):
        super().__init__()
        self.recorder = recorder

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.recorder.on_op(func, args, kwargs or {})


def record(model, path, *, mode="full", ops=True, label=None, include=None, exclude=None, overwrite=False,
           shard_bytes=128 << 20, extra_meta=None) -> Recorder:
    """Record every module call (and, with ops=True, every aten op) of `model` run inside the block into `path`.

    Example::

        with divtrace.record(model, "runs/train", mode="hash", label="train"):
            model(input_ids)
    """
    return Recorder(model, path, mode=mode, ops=ops, label=label, include=include, exclude=exclude,
                    overwrite=overwrite, shard_bytes=shard_bytes, extra_meta=extra_meta)
