"""`record`: module hooks plus an aten-level dispatch mode that write one run into a trace.

Module forward pre/post hooks give the call tree (path, call number, inputs, outputs). A TorchDispatchMode sees
every aten op and attributes it to the innermost recorded module call. Every tensor gets a value id when it is
produced, or when it is first seen coming from outside (parameters, model inputs), so each op input names the
record that produced it. Values are fingerprinted (and in full mode copied) at that moment, so a later in-place
op cannot change what was recorded.

Defined behaviour at the edges:
- A module call that raises gets an exit record with `error` and no outputs (the post hook is `always_call`;
  torch runs it for Exceptions). A KeyboardInterrupt or SIGTERM ends the block: its calls stay open, the trace
  is marked "interrupted"/"terminated" and `unfinished_calls` says how many. A later call of the root (the
  user caught the interrupt) first drops those stale open calls.
- Signals that arrive while the recorder does its own bookkeeping are held until it is done, so the files
  never hold a half-written flush and record indices never skip.
- Two recorders on two models may run at once; an op belongs to the recorder whose module call is innermost
  on this thread, so model B called inside model A's forward lands only in B's trace.
- Tensor subclasses: DTensor-like ones (`to_local`) are recorded through their local tensor; others, sparse,
  meta, quantized and nested tensors are skipped with a warning kept in meta.json.
- Inference tensors have no version counter, so in-place writes to them are tracked from op schemas (ops=True)
  or detected by re-fingerprinting (ops=False).
- With ops=True the dispatch mode stays pushed for the whole block, between module calls too: a mode the user
  enters inside the block sits above it, and writes between calls are counted (tests/test_record_mode_gaps.py).
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import re
import signal
import sys
import threading
import warnings

import torch
import weakref

from torch.utils._python_dispatch import TorchDispatchMode

from divtrace.errors import DivtraceError
from divtrace.trace.fingerprint import dtype_name, fingerprint
from divtrace.trace.records import ModuleEnter, ModuleExit, OpRecord, TensorValue
from divtrace.record.settings import note_grad_mode, numerics_settings, run_environment
from divtrace.trace import token_layout
from divtrace.record.token_identity import TokenTracker
from divtrace.record.rowhash import row_hashes, strided_row_hashes
from divtrace.trace.token_store import TokenStoreWriter
from divtrace.trace.writer import TraceWriter
from divtrace.trace.derived_views import DERIVABLE_VIEWS, REORDERING, VIEW_KEY, rebuildable, view_fingerprint

class _State(threading.local):
    """Per thread, shared by all recorders: while one does its own bookkeeping (busy), none records. Class-level
    defaults, so the hot paths read `_STATE.busy` without a getattr default."""

    busy = 0
    deferred = None  # a signal held while busy
    owners = None


_STATE = _State()
_ACTIVE_MODELS: set[int] = set()
_ACTIVE: list = []  # recorders inside their `with` block, any thread
_PLAIN_DISPATCH = torch.Tensor.__torch_dispatch__
_STRIDED = torch.strided
# -1 outside backward. Module calls inside backward are activation checkpointing's recompute: recorded, they
# would shift the call numbers of every later forward against a run without checkpointing.
_GRAPH_TASK = getattr(torch._C, "_current_graph_task_id", lambda: -1)
_MAX_DEPTH = 8
_SEQ = itertools.count()
# Ops that only allocate (or fill) a buffer. Kernels torch does not see (Triton launched directly, a C extension
# writing through a raw pointer) write their results into such buffers without moving the version counter, so
# a value made by one of these is re-read whenever it is used again: its bytes decide (Recorder._unsettled).
_FRESH_BUFFERS = {f"aten.{n}" for n in (
    "empty.memory_format", "empty_like.default", "empty_strided.default", "new_empty.default",
    "new_empty_strided.default", "zeros.default", "zeros_like.default", "new_zeros.default", "full.default",
    "full_like.default", "new_full.default")}
_RAW_WRITE = ("bytes of a buffer changed without a torch op (a kernel torch does not see, such as Triton launched "
              "directly, a C extension or a c10d collective, wrote into it): recorded as new values from outside, "
              "with no producing op")


class RecordingTerminated(KeyboardInterrupt):
    """Raised inside the recorded block when the process gets SIGTERM, so the trace is closed and marked. A
    KeyboardInterrupt subclass so that code (and the CLI) treating Ctrl-C as "stop" treats it the same."""


class _Busy:
    def __enter__(self):
        _STATE.busy += 1

    def __exit__(self, *exc):
        _STATE.busy -= 1
        if _STATE.busy == 0 and _STATE.deferred is not None and exc[0] is None:
            pending, _STATE.deferred = _STATE.deferred, None
            raise pending


_BUSY = _Busy()


def _busy() -> bool:
    return _STATE.busy > 0


def _owners() -> list:
    o = getattr(_STATE, "owners", None)
    if o is None:
        o = _STATE.owners = []
    return o


def flatten_tensors(obj, prefix: str, out: list, depth: int = 0) -> list:
    """(key, tensor) pairs of a nested structure: tuples, lists, dicts, HF ModelOutput, dataclasses."""
    if type(obj) is torch.Tensor or isinstance(obj, torch.Tensor):
        out.append((prefix, obj))
    elif depth >= _MAX_DEPTH or obj is None or isinstance(obj, (int, float, str, bool)):
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


def op_tensors(obj, out: list, depth: int = 0) -> list:
    """The tensors in an op's arguments or results, in order: flatten_tensors without the keys (an op runs
    this twice, so it is kept lean)."""
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (list, tuple)) and depth < _MAX_DEPTH:
        for x in obj:
            if isinstance(x, torch.Tensor):
                out.append(x)
            elif isinstance(x, (list, tuple, dict)):
                op_tensors(x, out, depth + 1)
    elif isinstance(obj, dict) and depth < _MAX_DEPTH:
        op_tensors(list(obj.values()), out, depth + 1)
    return out


def _arg_vids(enc_args, enc_kwargs) -> list[int]:
    return [a["$v"] for a in (*enc_args, *enc_kwargs.values()) if type(a) is dict and "$v" in a]


def copy_value(v: TensorValue, **changes) -> TensorValue:
    """`dataclasses.replace` for the hot path (it costs several times a plain constructor call)."""
    return TensorValue(changes.get("vid", v.vid), v.dtype, changes.get("shape", v.shape),
                       changes.get("stride", v.stride), changes.get("hash", v.hash), v.device,
                       changes.get("stats", v.stats), changes.get("producer", v.producer),
                       changes.get("blob", v.blob), changes.get("shard", v.shard), changes.get("nbytes", v.nbytes),
                       changes.get("derived", v.derived))


def _forget(d: dict, ref) -> None:
    """A tensor of the table died (its id may be reused by another). Runs as a weakref callback, wherever the
    last reference dropped: an exception raised in it is swallowed ("Exception ignored in"), so the signal
    handlers hold a signal that arrives while it runs (see Recorder._install_signals)."""
    key = ref.key
    cur = d.get(key)
    if cur is not None and cur[0] is ref:
        del d[key]


class _KeyedRef(weakref.ref):
    """A weak reference that carries its table key, so one callback per table serves every entry (no
    functools.partial per tensor)."""

    __slots__ = ("key",)

    def __new__(cls, t, callback, key):
        self = super().__new__(cls, t, callback)
        self.key = key
        return self

    def __init__(self, t, callback, key):
        super().__init__(t, callback)


class TensorTable:
    """tensor -> entry by identity, without keeping tensors alive. Does what WeakTensorKeyDictionary does at a
    fifteenth of the cost per lookup (it builds a weak reference object for every lookup)."""

    __slots__ = ("_d", "_cb")

    def __init__(self) -> None:
        self._d: dict[int, tuple] = {}
        self._cb = functools.partial(_forget, self._d)

    def get(self, t):
        e = self._d.get(id(t))
        if e is not None and e[0]() is t:
            return e[1]
        return None

    def __setitem__(self, t, entry) -> None:
        key, d = id(t), self._d
        old = d.get(key)
        if old is not None and old[0]() is t:
            d[key] = (old[0], entry)
            return

        d[key] = (_KeyedRef(t, self._cb, key), entry)


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
    dispatch mode sees the op: see Recorder.on_op)."""
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


class _Frame:
    """One module call on the recorder's stack."""

    __slots__ = ("call_id", "module", "excluded", "exc", "token")

    def __init__(self, call_id, module, excluded, exc, token):
        self.call_id, self.module, self.excluded, self.exc, self.token = call_id, module, excluded, exc, token


class Recorder:
    """The context manager returned by `divtrace.record`."""

    def __init__(self, model, path, *, mode="full", ops=None, label=None, include=None, exclude=None,
                 overwrite=False, shard_bytes=128 << 20, extra_meta=None, flush_records=4096, durable=False,
                 tokens=True, token_layouts=None, compiled=None):
        if not isinstance(model, torch.nn.Module):
            raise DivtraceError(f"record() needs a torch.nn.Module (or a vllm.LLM), got {type(model).__name__}")
        if mode not in ("full", "hash"):
            raise DivtraceError(f"mode must be 'full' or 'hash', got {mode!r}")
        from divtrace.record.compiled.session import resolve  # torch.compile: divtrace/record/compiled, docs/compiled.md

        self.compiled, ops, self._regions = resolve(model, compiled, ops)
        self._session = None
        self.model, self.path, self.mode, self.ops, self.label = model, path, mode, ops, label
        try:
            self._include = re.compile(include) if include else None
            self._exclude = re.compile(exclude) if exclude else None
        except re.error as e:
            raise DivtraceError(f"bad include/exclude regex: {e}") from None
        self._include_src, self._exclude_src = include, exclude
        self._overwrite, self._shard_bytes, self._flush_records = overwrite, shard_bytes, flush_records
        self._durable = durable
        self._extra_meta = dict(extra_meta or {})
        self._handles: list = []
        self._hooked: list = []  # (path, module, pre hook id): checked at exit for pre hooks prepended since
        self._backward_calls = 0  # module calls skipped because they ran inside backward
        self._stack: list[_Frame] = []
        self._excluded_depth = 0
        self._calls: dict[str, int] = {}
        self._next_call_id = 0
        self._index = 0
        self._tensors = TensorTable()  # tensor -> (vid, version, value)
        self._derived: set[int] = set()  # vids whose fingerprint is derived from a view's input (_derived_view)
        self._view_children: dict[int, list] = {}  # derived vid -> views derived from it: (value, op, args, kwargs)
        self._unsettled: set[int] = set()  # vids of fresh buffers (and their views): re-read when used again
        self._writes: dict[int, int] = {}  # storage address -> in-place writes seen (with ops=True)
        self._bumped: set | None = None  # ids of the arguments the running custom op writes (see on_op)
        self._mode_obj = None
        self._my_handlers: dict = {}
        self._tokens_on = bool(tokens)
        self._token_layouts = token_layout.compile_overrides(token_layouts)
        self._call_paths: dict[int, str] = {}  # call id -> module path (for token_layouts)
        self._boundary_path: str | None = None  # the module whose inputs or outputs are being recorded
        self._token_tracker = TokenTracker()
        self._grid = None  # the token grid of the root call in progress (divtrace.record.token_identity.TokenGrid)
        self._token_store: TokenStoreWriter | None = None
        self._rowed: set[int] = set()  # vids whose token rows were looked at (the current root call's)
        self._layout_grid = None  # the grid _layouts holds the inferred layouts of: (shape, root output) -> code
        self._layouts: dict = {}
        self._root_calls = 0  # calls of the recorded model seen (the first sets the grad-mode settings)
        self.warnings: list[str] = []
        self.writer: TraceWriter | None = None

    # context ----------------------------------------------------------------------------------------------
    def __enter__(self):
        if id(self.model) in _ACTIVE_MODELS:
            raise DivtraceError("this model is already being recorded; nested record() on one model is not supported")
        first = next(self.model.parameters(), None)  # not list(): that walks every parameter of a big model
        device = str(first.device) if first is not None else "cpu"
        from divtrace.record.compiled.paths import recorded_modules
        from divtrace.record.compiled.session import CompiledSession

        modules = recorded_modules(self.model)  # torch.compile's `_orig_mod.` wrappers left out of the paths
        self._root = modules[0][1]
        self._session = CompiledSession(self, modules, self._regions, self.compiled)
        meta = {"label": self.label, "ops": self.ops, "include": self._include_src, "exclude": self._exclude_src,
                "model_class": type(self.model).__name__, "settings": numerics_settings(), "view_key": VIEW_KEY,
                "module_tree": [[name, type(m).__name__] for name, m in modules],
                **run_environment(device), **self._session.start_meta(), **self._extra_meta}
        meta["settings"].update(self._session.settings())
        self.writer = TraceWriter(self.path, mode=self.mode, meta=meta, overwrite=self._overwrite,
                                  shard_bytes=self._shard_bytes, flush_records=self._flush_records,
                                  durable=self._durable)
        self._token_store = TokenStoreWriter(self.writer.path)
        _ACTIVE_MODELS.add(id(self.model))
        _ACTIVE.append(self)
        if self._regions:
            self.warnings.append("the model is torch.compile'd: " + (
                "recorded at module boundaries inside the compiled code (compiled=True); aten ops inside it are not "
                "visible" if self.compiled else "recorded with compiled=False, so torch.compile was set to "
                "force_eager inside the block: this trace is of the eager computation, not of the compiled kernels"))
        for name, m in ([] if self.compiled else modules):  # compiled: the session's taps instead
            # Pre hook first and post hook last: the call spans the module's own hooks, its inputs are what the
            # caller passed and its outputs what the caller receives.
            post = m.register_forward_hook(self._make_post(name), with_kwargs=True, always_call=True)
            pre = m.register_forward_pre_hook(self._make_pre(name, post.id), with_kwargs=True, prepend=True)
            self._handles += (pre, post)
            self._hooked.append((name, m, pre.id))
        if self.ops:
            # Pushed for the whole block, never popped between module calls: a dispatch mode the user enters
            # inside the block must sit above it (it sees the model's ops first; divtrace records what then runs),
            # and in-place writes between calls are counted (inference tensors have no version counter).
            self._mode_obj = _OpMode(self)
            self._mode_obj.__enter__()
        self._session.start()
        self._install_signals()
        return self

    def tokens(self, ids, positions, seqs=None) -> None:
        """Declare the token rows of the next root call of the recorded model, in the order the call lays its
        tokens out (flattened for `[N, ...]` inputs, row-major for `[B, T]`): `ids` and `positions` hold one
        entry per row, `seqs` (optional) a sequence handle per row, such as a request id, that chains decode
        steps to their sequence; without it a sequence starts where a position is 0. Engines and custom loops
        call this before each forward; HF-style calls (`input_ids`, `attention_mask`, `position_ids`, a cache)
        need no declaration.

        Example::

            with divtrace.record(model, "runs/rollout", mode="hash") as rec:
                rec.tokens(ids=[5, 9, 2, 7], positions=[0, 1, 2, 3], seqs=["req-0"] * 4)
                model(input_ids, positions)
        """
        self._token_tracker.declare(ids, positions, seqs)

    def _token_rows(self, vid: int, t: torch.Tensor, root_output: bool = False, alias=None) -> None:
        """Fingerprint each token row of a value made in the current root call (see divtrace.trace.token_layout). A
        view whose rows hold the same bytes as its source's rows (`alias`: a reshape of a row-major layout, or the
        [B, T, H, d] <-> [B, H, T, d] transpose) points at the source's fingerprints instead of hashing again."""
        g = self._grid
        self._rowed.add(vid)
        if g is not self._layout_grid:  # the layout of a shape is the same all through one grid's call
            self._layout_grid, self._layouts = g, {}
        shape = t.shape
        code = self._layouts.get((shape, root_output), False)
        if code is False:
            code = self._layouts[(shape, root_output)] = token_layout.infer(shape, g.shape, g.kv_len, root_output)
        if self._token_layouts:
            path = self._boundary_path
            if path is None:
                path = self._call_paths.get(self._stack[-1].call_id, "") if self._stack else ""
            code = token_layout.override(self._token_layouts, path, t.shape, g.shape, code)
        if code is None:
            return
        if code in (token_layout.AMBIGUOUS, token_layout.CROSS):
            self._token_store.add_rows(vid, g.call_id, code, None)
            return
        if alias is not None:
            ref = self._token_store.current.get(alias[0])
            if ref is not None and token_layout.same_rows(ref[0], code, alias[1], t, g.shape):
                self._token_store.add_rows_ref(vid, g.call_id, code, ref[1])
                return
        hashes = strided_row_hashes(t, code, token_layout.row_count(code, g.shape))
        if hashes is None:
            hashes = row_hashes(token_layout.rows_2d(t, code))
        self._token_store.add_rows(vid, g.call_id, code, hashes)

    def _closing_warnings(self) -> None:
        """A pre hook prepended inside the block runs before divtrace's: the inputs recorded for that module
        are then not what its caller passed. Say so in the trace. (Forward hooks registered inside the block
        are moved behind divtrace's at each call, so they cannot do the same to outputs.)"""
        late = []
        for name, m, pre in self._hooked:
            try:
                moved = next(iter(m._forward_pre_hooks)) != pre
            except (AttributeError, StopIteration, TypeError):  # another torch's private layout: cannot tell
                moved = False
            if moved:
                late.append(name or "<root>")
        self._hooked.clear()
        if self._backward_calls:
            self.warnings.append(f"{self._backward_calls} module calls ran inside backward (activation "
                                 "checkpointing's recompute) and were not recorded")
        if late:
            self.warnings.append(
                f"forward pre hooks were prepended on {len(late)} module(s) while recording "
                f"({', '.join(late[:5])}" + (", ..." if len(late) > 5 else "") + "): they ran before divtrace's, "
                "so the inputs recorded there may differ from what the caller passed; register hooks before "
                "divtrace.record")

    def _install_signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        writer = self.writer

        def handler(exc_type):
            def on_signal(signum, frame):
                exc = exc_type("SIGTERM" if signum == signal.SIGTERM else "")
                if _busy() or (frame is not None and frame.f_code is _forget.__code__):
                    _STATE.deferred = exc  # raised when the bookkeeping in progress (or the next) is done
                elif writer.critical:
                    writer.deferred = exc
                else:
                    raise exc
            on_signal.divtrace_handler = True
            return on_signal

        # Only where Python's own handling is in place (or a recorder this one is nested in put its own): a
        # trainer's handler (finish the step, checkpoint on preemption) keeps its signal, and the recording then
        # ends however that handler has it end.
        for sig, default, exc_type in ((signal.SIGTERM, signal.SIG_DFL, RecordingTerminated),
                                       (signal.SIGINT, signal.default_int_handler, KeyboardInterrupt)):
            current = signal.getsignal(sig)
            if current == default or getattr(current, "divtrace_handler", False):
                mine = handler(exc_type)
                mine.divtrace_active, mine.divtrace_old = True, current
                signal.signal(sig, mine)
                self._my_handlers[sig] = mine

    def __exit__(self, exc_type, exc, tb):
        try:
            if self._mode_obj is not None:
                self._mode_obj.__exit__(None, None, None)
        finally:
            self._closing_warnings()
            compiled_meta = self._session.stop() if self._session is not None else {}
            for h in self._handles:
                h.remove()
            self._handles.clear()
            _ACTIVE_MODELS.discard(id(self.model))
            if self in _ACTIVE:
                _ACTIVE.remove(self)
            owners = _owners()
            for f in self._stack:
                if f.token in owners:
                    owners.remove(f.token)
            if exc_type is None:
                status, error = "complete", None
            elif issubclass(exc_type, RecordingTerminated):
                status, error = "terminated", "SIGTERM"
            elif issubclass(exc_type, KeyboardInterrupt):
                status, error = "interrupted", "KeyboardInterrupt"
            else:
                status, error = "error", f"{exc_type.__name__}: {exc}".splitlines()[0][:500]
            # A signal held while an exception was already on its way out is settled here, not later.
            held, _STATE.deferred = _STATE.deferred, None
            tokens = None
            try:
                tokens = self._token_store.close() if self._token_store is not None else None
            except OSError as e:
                self.warnings.append(f"token files could not be written: {e.strerror or e}")
            self.warnings.extend(w for w in self._token_tracker.warnings if w not in self.warnings)
            extra = {"tokens": tokens} if tokens and tokens["grids"] else {}
            try:
                self.writer.close(status, error, warnings=self.warnings,
                                  unfinished_calls=sum(1 for f in self._stack if f.call_id is not None), **extra,
                                  **compiled_meta)
            finally:
                for sig, mine in self._my_handlers.items():
                    mine.divtrace_active = False
                    if signal.getsignal(sig) is mine:  # else a handler set inside the block: it stays
                        old = mine.divtrace_old
                        while getattr(old, "divtrace_handler", False) and not old.divtrace_active:
                            old = old.divtrace_old  # a recorder entered before this one and exited already
                        signal.signal(sig, old)
                self._my_handlers.clear()
            if held is not None and exc_type is None:
                raise held
        why = self._session.compile_failure(exc) if self._session is not None and exc is not None else None
        if why:
            raise DivtraceError(why) from None  # (the trace is closed and marked as failed)
        return False

    # values -----------------------------------------------------------------------------------------------
    def _version(self, t: torch.Tensor):
        # Inference tensors (everything vLLM makes: it runs under inference_mode) have no version counter: count
        # in-place writes ourselves. Asked first, since reading `_version` of one raises, at ~50 us a time.
        if not t.is_inference():
            try:
                v = t._version
            except Exception:
                pass
            else:
                # Writes through another tensor over the same storage with a counter of its own (`.data`, an
                # EMA or weight-sync update between forwards) do not move this one: the writes counted per
                # storage do (ops=True; high bits, so versions stay ints).
                if self._writes:
                    try:
                        v += self._writes.get(t.untyped_storage().data_ptr(), 0) << 32
                    except Exception:
                        pass
                return v
        try:
            return ("w", self._writes.get(t.untyped_storage().data_ptr(), 0))
        except Exception:
            return None

    def _vid_of(self, t: torch.Tensor, new_values: list, boundary: bool = False, root_output: bool = False) -> int:
        """The value id of `t` as it is now; a tensor never seen (or changed behind our back) is new."""
        entry = self._tensors.get(t)
        version = self._version(t)
        if self._bumped and id(t) in self._bumped and type(version) is int and entry is not None \
                and entry[1] == version - 1:
            return entry[0]  # (a custom op's argument it is about to write: torch counted the write already)
        if boundary and entry is not None and entry[1] == version and self._derived:
            entry = self._real_hash(t, entry)
        fp = None
        unsettled = False
        if entry is not None:
            unsettled = bool(self._unsettled) and entry[0] in self._unsettled
            if (entry[1] == version and not (self._mode_obj is None and isinstance(version, tuple))
                    and not unsettled):
                return entry[0]
            # The version moved (an in-place op: torch bumps the counter only after the op has returned
            # through the dispatch mode, so its output is first read here), or it cannot be known (ops=False
            # and an inference tensor): the bytes decide. Unchanged bytes keep their value and its producer.
            v = entry[2]
            if v.vid not in self._derived:
                fp = fingerprint(t)
                if (fp[0] == v.hash and dtype_name(t.dtype) == v.dtype and list(t.shape) == v.shape
                        and list(t.stride()) == v.stride):
                    self._tensors[t] = (entry[0], version, v)
                    return entry[0]
        v = self.writer.new_value(t, producer=None, fp=fp)
        new_values.append(v)
        self._tensors[t] = (v.vid, version, v)
        if boundary and self._grid is not None:  # (op inputs from outside are parameters and buffers: no rows)
            self._token_rows(v.vid, t, root_output)
        if unsettled and entry[1] == version:  # changed, and no torch op wrote it: it may be again
            self._unsettled.add(v.vid)
            self._skip(_RAW_WRITE)
        return v.vid

    def _produced(self, t: torch.Tensor, producer: int, inputs: list, new_values: list, op: str = "",
                  enc_args=None, is_view: bool = False, enc_kwargs=None) -> int:
        # A view's version counter is tied to its base's only after the op has returned through the dispatch
        # mode: here it still reads 0. What the view will read from then on is its base's version now.
        version = self._version(t)
        base = None
        alias = None  # (vid, tensor) of an input `t` reads the same bytes of: its token rows may serve `t` too
        if is_view:
            base = self._alias_source(t, inputs)
            if base is not None:
                version = self._version(base)
        v = None
        # An alias that reads the same bytes in the same logical order as an input (view, reshape, detach,
        # alias) has the input's fingerprint: reuse it instead of hashing again.
        ptr, n = t.data_ptr(), t.numel()
        for src in inputs:
            if src is t or src.data_ptr() != ptr or src.dtype != t.dtype or src.numel() != n or src.device != t.device:
                continue
            if src.is_conj() != t.is_conj() or src.is_neg() != t.is_neg():
                break  # same bytes, other values (conj(), a lazy negation): hash them
            if (t.is_contiguous() and src.is_contiguous()) or (src.shape == t.shape and src.stride() == t.stride()):
                e = self._tensors.get(src)
                # (an alias of a derived view is derived again from its own op, or hashed: it has no bytes to share)
                if e is not None and e[1] == self._version(src) and e[0] not in self._derived:
                    v = copy_value(e[2], vid=self.writer.take_vid(), producer=producer, shape=list(t.shape),
                                   stride=list(t.stride()))
                    alias = (e[0], src)
                break
        if v is None and op in DERIVABLE_VIEWS and not t.is_contiguous():
            v = self._derived_view(t, producer, inputs, op, enc_args, enc_kwargs or {})
            if v is not None and self._grid is not None:
                src = self._alias_source(t, inputs)
                e = self._tensors.get(src) if src is not None else None
                alias = (e[0], src) if e is not None else None
        if v is None:
            v = self.writer.new_value(t, producer=producer)
        new_values.append(v)
        self._tensors[t] = (v.vid, version, v)
        if self._grid is not None:
            self._token_rows(v.vid, t, alias=alias)
        if op in _FRESH_BUFFERS:
            self._unsettled.add(v.vid)
        elif self._unsettled and base is not None:  # a view of such a buffer sees what is written into it
            e = self._tensors.get(base)
            if e is not None and e[0] in self._unsettled:
                self._unsettled.add(v.vid)
        return v.vid

    @staticmethod
    def _alias_source(t, inputs):
        """The input whose storage `t` views (same storage, dtype and device), or None."""
        try:
            ptr = t.untyped_storage().data_ptr()
        except Exception:
            return None
        for x in inputs:
            try:
                if x.untyped_storage().data_ptr() == ptr and x.dtype == t.dtype and x.device == t.device:
                    return x
            except Exception:
                continue
        return None

    def _derived_view(self, t, producer, inputs, op, enc_args, enc_kwargs):
        """A strided view (w.t(), a transpose, an expand) of a known value: a fingerprint derived from the op, its
        arguments and the input's fingerprint (divtrace.trace.derived_views), instead of a copy and a hash of its bytes; in
        full mode no bytes either (a reader rebuilds them from the op). A value that reaches a module boundary
        is hashed (and stored) for real there (`_real_hash`), where the other side may hold the same bytes
        made another way."""
        src = self._alias_source(t, inputs)
        e = self._tensors.get(src) if src is not None else None
        if e is None or e[1] != self._version(src) or (self._unsettled and e[0] in self._unsettled):
            return None  # (a fresh buffer may be written behind torch's back: its views' bytes are hashed)
        if self.mode == "full" and not (rebuildable(enc_args, enc_kwargs)
                                        and e[0] in _arg_vids(enc_args, enc_kwargs)):
            return None  # a reader could not rebuild it from the op: store its bytes
        h = view_fingerprint(op, e[2].hash, e[2].dtype, e[2].shape, list(t.shape), enc_args, enc_kwargs)
        stats = e[2].stats if op.split(".")[1] in REORDERING else {}
        v = copy_value(e[2], vid=self.writer.take_vid(), producer=producer, shape=list(t.shape),
                       stride=list(t.stride()), hash=h, stats=stats, blob=None, shard=None, derived=True,
                       nbytes=t.numel() * t.element_size())
        self._derived.add(v.vid)
        if e[0] in self._derived:  # a view of a view: re-derived if its parent gets its real fingerprint
            self._view_children.setdefault(e[0], []).append((v, op, enc_args, enc_kwargs))
        return v

    def _rederive_children(self, parent: TensorValue) -> None:
        """`parent`'s fingerprint changed (it got its real one, in place): the views derived from it, still
        buffered like it (their vids are larger), get theirs derived again, so a reader can check them."""
        todo = [parent]  # a loop, not recursion: chains of views can be long
        while todo:
            p = todo.pop()
            for child, op, args, kwargs in self._view_children.pop(p.vid, ()):
                if child.derived:  # not already given its real fingerprint at a boundary of its own
                    child.hash = view_fingerprint(op, p.hash, p.dtype, p.shape, child.shape, args, kwargs)
                    todo.append(child)

    def _real_hash(self, t, entry):
        """Give a derived-view value its real fingerprint (and in full mode its bytes) before a module boundary
        compares it, in place when its record is still buffered; else a fresh value (the bytes are the same,
        only its producer is lost)."""
        v = entry[2]
        if v.vid not in self._derived:
            return entry
        self._derived.discard(v.vid)
        if self.writer.is_buffered(v.vid):
            fresh = self.writer.new_value(t, producer=v.producer)
            v.hash, v.stats, v.blob, v.shard, v.derived = fresh.hash, fresh.stats, fresh.blob, fresh.shard, False
            self._rederive_children(v)
            return entry
        return None

    def _plain(self, t: torch.Tensor, where: str):
        """The tensor to fingerprint for `t`, or None (skipped, with a warning) when it has no plain bytes."""
        if ((type(t) is torch.Tensor or type(t).__torch_dispatch__ is _PLAIN_DISPATCH) and t.layout is _STRIDED
                and not (t.is_quantized or t.is_nested or t.is_meta)):
            return t  # (the common case, in one test; the rest says what is wrong with the others)
        if type(t).__torch_dispatch__ is not _PLAIN_DISPATCH:
            local = getattr(t, "_local_tensor", None)  # DTensor keeps its shard here; to_local() may wrap it
            if not isinstance(local, torch.Tensor):
                to_local = getattr(t, "to_local", None)
                try:
                    local = to_local() if callable(to_local) else None
                except Exception:
                    local = None
            if isinstance(local, torch.Tensor) and type(local).__torch_dispatch__ is _PLAIN_DISPATCH:
                return self._plain(local, where)
            return self._skip(f"{where}: tensor subclass {type(t).__name__} not recorded")
        if t.layout != torch.strided or t.is_quantized or t.is_nested or t.is_meta:
            kind = "meta" if t.device.type == "meta" else "quantized" if t.is_quantized else \
                "nested" if t.is_nested else str(t.layout).removeprefix("torch.")
            return self._skip(f"{where}: {kind} tensor not recorded")
        return t

    def _skip(self, msg: str):
        if msg not in self.warnings and len(self.warnings) < 100:
            self.warnings.append(msg)
            warnings.warn(f"divtrace: {msg}", stacklevel=4)
        return None

    # module hooks -----------------------------------------------------------------------------------------
    def _make_pre(self, path: str, post_id: int):
        def pre(module, args, kwargs):
            if _busy() or self.writer.failed:
                return None
            # A forward hook registered since (a temperature on the logits; transformers' output capture)
            # would run after the post hook: moved last again, the recorded outputs are what the caller gets.
            try:
                hooks = module._forward_hooks
                if next(reversed(hooks)) != post_id:
                    hooks.move_to_end(post_id)
            except (AttributeError, StopIteration, KeyError, TypeError):  # another torch's private layout
                pass
            if _GRAPH_TASK() != -1:
                self._backward_calls += 1  # its post hook finds no frame and returns
                return None
            with _BUSY:
                self._enter(path, module, args, kwargs)
            return None
        return pre

    def _make_post(self, path: str):
        def post(module, args, kwargs, output):
            if _busy() or self.writer.failed:
                return None
            with _BUSY:
                self._exit(module, output)
            return None
        return post

    def _recorded_parent(self):
        for f in reversed(self._stack):
            if f.call_id is not None:
                return f.call_id
        return None

    def _push(self, call_id, module, excluded):
        token = (next(_SEQ), self)
        _owners().append(token)
        self._stack.append(_Frame(call_id, module, excluded, sys.exc_info()[1], token))

    def _tap_enter(self, path, module, flat) -> None:
        """A module call seen by a compiled-code tap (divtrace.record.compiled): `flat` is its inputs' (key, tensor)."""
        if not _busy() and not self.writer.failed:
            with _BUSY:
                self._enter(path, module, None, None, flat)

    def _tap_exit(self, module, flat) -> None:
        if not _busy() and not self.writer.failed:
            with _BUSY:
                self._exit(module, None, flat)

    def _enter(self, path, module, args, kwargs, flat=None):
        if module is self._root:
            note_grad_mode(self.writer.meta.setdefault("settings", {}), first=not self._root_calls)
            self._root_calls += 1
        if module is self._root and self._stack:
            # A new call of the root while calls are open: they were left by an interrupt the caller caught.
            while self._stack:
                self._pop()
        inside_recorded = bool(self._stack) and self._stack[-1].call_id is not None
        if self._exclude is not None and self._exclude.search(path):
            self._excluded_depth += 1
            self._push(None, module, True)
            return
        if self._excluded_depth or (self._include is not None and not inside_recorded
                                    and not self._include.search(path)):
            self._push(None, module, False)
            return
        call = self._calls.get(path, 0)
        if module is self._root and self._tokens_on and args is not None:  # (compiled taps: no token rows)
            # (before the call is counted: a declaration that does not fit the call is the caller's error)
            self._grid = self._token_tracker.on_root_call(self._next_call_id, call, args, kwargs,
                                                          f"root call {call} of {type(module).__name__}")
            if self._grid is not None:
                self._token_store.add_grid(self._grid)
        self._calls[path] = call + 1
        call_id = self._next_call_id
        self._next_call_id += 1
        values: list = []
        pairs = []
        if self._token_layouts:
            self._call_paths[call_id] = self._boundary_path = path
        try:
            if flat is None:
                flat = flatten_tensors(args, "args", []) + flatten_tensors(kwargs, "kwargs", [])
            for key, t in flat:
                t = self._plain(t, path or "<root>")
                if t is not None:
                    pairs.append((key, self._vid_of(t, values, boundary=True)))
        finally:
            self._boundary_path = None
        rec = ModuleEnter(self._take_index(), call_id, path, call, self._recorded_parent(), pairs)
        self._push(call_id, module, False)
        self.writer.append(rec, values)

    def _exit(self, module, output, flat=None):
        stack = self._stack
        if stack and stack[-1].module is module:  # (the usual case: the innermost call ends)
            depth = len(stack) - 1
        else:
            depth = next((i for i in range(len(stack) - 1, -1, -1) if stack[i].module is module), None)
        if depth is None:
            return  # its pre hook did not run (the call began before recording, or while busy)
        # Pop to this module's frame: calls that raised inside and were caught left theirs.
        while len(self._stack) > depth + 1:
            self._pop()
        frame = self._pop()
        if frame.call_id is None:
            return
        root = module is self._root and self._grid is not None
        try:
            self._exit_call(frame, output, root, flat)
        finally:
            if root:
                self._grid = None
                self._rowed.clear()
                try:
                    self._token_store.end_call()
                except OSError as e:  # the trace's own write path reports the disk; tokens stop here, said once
                    self._tokens_on = False
                    self.warnings.append(f"token files could not be written ({e.strerror or e}): token identity "
                                         "stops at this root call, and bisect cannot align the rest by tokens")

    def _exit_call(self, frame, output, root: bool, flat=None) -> None:
        current = sys.exc_info()[1]
        if current is not None and current is not frame.exc:
            # torch runs always_call hooks from its `except Exception:`: the forward raised.
            err = f"{type(current).__name__}: {current}".splitlines()[0][:300] if str(current) else type(current).__name__
            self.writer.append(ModuleExit(self._take_index(), frame.call_id, [], error=err), [])
            return
        values: list = []
        pairs = []
        if self._token_layouts:
            self._boundary_path = self._call_paths.get(frame.call_id, "")
        try:
            for key, t in (flatten_tensors(output, "out", []) if flat is None else flat):
                t = self._plain(t, "output")
                if t is not None:
                    vid = self._vid_of(t, values, boundary=True, root_output=root)
                    if root and vid not in self._rowed:  # made by an op before it was known to be the output
                        self._token_rows(vid, t, root_output=True)
                    pairs.append((key, vid))
        finally:
            self._boundary_path = None
        self.writer.append(ModuleExit(self._take_index(), frame.call_id, pairs), values)

    def _pop(self) -> _Frame:
        frame = self._stack.pop()
        if frame.excluded:
            self._excluded_depth -= 1
        owners = _owners()
        if owners and owners[-1] is frame.token:
            owners.pop()
        elif frame.token in owners:
            owners.remove(frame.token)
        return frame

    def _take_index(self) -> int:
        i = self._index
        self._index += 1
        return i

    # ops --------------------------------------------------------------------------------------------------
    def _owns_innermost(self) -> bool:
        owners = _owners()
        return not owners or owners[-1][1] is self

    def on_op(self, func, args, kwargs):
        """Run `func`, recording it when it runs inside a recorded module call."""
        info = _OP_INFO.get(func)
        if info is None:
            info = _op_info(func)
        stack = self._stack
        if (_STATE.busy or not stack or stack[-1].call_id is None or self.writer.failed
                or (len(_ACTIVE) > 1 and not self._owns_innermost())):
            out = func(*args, **kwargs)
            if info[3] and not _STATE.busy:
                self._note_writes(func, args, kwargs)
            return out
        # An op that writes none of its arguments leaves them as they were: its inputs are fingerprinted after it
        # ran, so a weight streams from memory once, for the op, and is hashed from cache right after.
        after, name, is_view, mutated, written_early = info
        if after:
            out = func(*args, **kwargs)
        with _BUSY:
            # A torch.library.custom_op that writes its arguments bumps their version counters *before* it reaches
            # this dispatch mode (torch/_library/custom_ops.py, adinplaceorview_impl): those arguments are read
            # here as they were, one version back (else a derived view would become a new value with no producer).
            if written_early:
                self._bumped = {id(y) for pos, key in mutated
                                for y in op_tensors(args[pos] if pos < len(args) else kwargs.get(key), [])}
            tensors_in = op_tensors((args, kwargs), [])
            plain_in = [self._plain(t, func) for t in tensors_in]
            plain = all(p is not None for p in plain_in)  # not `None in`: that runs Tensor.__eq__
            if plain:
                values: list = []
                vids: list[int] = []
                local = {id(t): p for t, p in zip(tensors_in, plain_in)}
                enc_args = [self._encode(a, values, vids, local) for a in args]
                enc_kwargs = {k: self._encode(v, values, vids, local) for k, v in kwargs.items()}
        self._bumped = None
        if not after:
            out = func(*args, **kwargs)
            if mutated:
                self._note_writes(func, args, kwargs)
        if not plain:
            return out
        with _BUSY:
            outs = op_tensors(out, [])
            writes = None
            if out is None:  # returns nothing, writes its result into arguments (vLLM's _C.onednn_mm): those
                outs, writes = [], []  # are its outputs, and `out` says which arguments hold them
                for pos, arg in mutated:
                    where = pos if pos < len(args) else arg
                    got = op_tensors(args[pos] if pos < len(args) else kwargs.get(arg), [])
                    outs += got
                    writes += [where] if len(got) == 1 else [[where, k] for k in range(len(got))]
            plain_out = [self._plain(t, func) for t in outs]
            if not outs or any(p is None for p in plain_out):
                return out
            index = self._take_index()
            out_vids = [self._produced(p, index, plain_in, values, name, enc_args, is_view, enc_kwargs)
                        for p in plain_out]
            vid_by_id = {id(t): v for t, v in zip(outs, out_vids)}
            enc_out = self._encode_out(out, vid_by_id) if writes is None else {"$writes": writes}
            rec = OpRecord(index, self._stack[-1].call_id, name, enc_args, enc_kwargs, vids, out_vids, enc_out)
            self.writer.append(rec, values)
        return out

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
_OP_INFO: dict = {}  # op overload -> (_reads_only, _op_name, is_view, _mutated_args, a custom op that writes):
# one lookup per op call


def _op_info(func) -> tuple:
    mutated = _mutated_args(func)
    info = _OP_INFO[func] = (_reads_only(func), _op_name(func), getattr(func, "is_view", False), mutated,
                             bool(mutated) and _is_custom_op(func))
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
    def __init__(self, recorder: Recorder):
        super().__init__()
        self.recorder = recorder

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.recorder.on_op(func, args, kwargs or {})
