"""Value identity and versions: which value (vid) a tensor holds each time the recording meets it.

Every tensor gets a value id when it is produced, or when it is first seen coming from outside (parameters,
model inputs), so each op input names the record that produced it. Values are fingerprinted (and in full mode
copied) at that moment (through the trace writer), so a later in-place op cannot change what was recorded. A
tensor seen again keeps its value while its version counter (or, for inference tensors, the writes counted per
storage) has not moved, and while its bytes are unchanged where no torch op could have written it (fresh
buffers). Strided views of a known value get a fingerprint derived from their op (divtrace.trace.derived_views),
made real where they reach a module boundary.

In: tensors met at module boundaries and as op inputs and outputs (module_calls, op_records). Out: value ids, and
the new TensorValues that go with the record about to be written; the token rows of values made in a root call
(through token_rows).
"""
from __future__ import annotations

import dataclasses
import functools
import warnings
import weakref

import torch

from divtrace.trace.derived_views import DERIVABLE_VIEWS, REORDERING, rebuildable, view_fingerprint
from divtrace.trace.device_results import PendingDerived
from divtrace.trace.fingerprint import dtype_name
from divtrace.trace.hashing.tensor import hash_with_stats as fingerprint
from divtrace.trace.records import TensorValue

_PLAIN_DISPATCH = torch.Tensor.__torch_dispatch__
_STRIDED = torch.strided
_MAX_DEPTH = 8
# Ops that only allocate (or fill) a buffer. Kernels torch does not see (Triton launched directly, a C extension
# writing through a raw pointer) write their results into such buffers without moving the version counter, so
# a value made by one of these is re-read whenever it is used again: its bytes decide (ValueIdentity._unsettled).
_FRESH_BUFFERS = {f"aten.{n}" for n in (
    "empty.memory_format", "empty_like.default", "empty_strided.default", "new_empty.default",
    "new_empty_strided.default", "zeros.default", "zeros_like.default", "new_zeros.default", "full.default",
    "full_like.default", "new_full.default")}
# Ops that hand back the very tensor they were given, untouched (their schema writes nothing): the functional
# collectives' wait (the recorder already waited where the collective ran, and read its result then) and the
# autograd wrapper DTensor puts around a collective's result. Their output is their input's value: not read again.
_RETURNS_INPUT = {"_c10d_functional.wait_tensor.default", "_c10d_functional._wrap_tensor_autograd.default"}
_RAW_WRITE = ("bytes of a buffer changed without a torch op (a kernel torch does not see, such as Triton launched "
              "directly, a C extension or a c10d collective, wrote into it): recorded as new values from outside, "
              "with no producing op")


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


def op_inputs(args, kwargs: dict) -> list:
    """op_tensors((args, kwargs), []) without building the pair and walking the dict through a list: an op's input
    tensors, in the same order (and to the same nesting depth)."""
    out: list = []
    for x in args:
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, (list, tuple, dict)):
            op_tensors(x, out, 2)
    if kwargs:
        for x in kwargs.values():
            if isinstance(x, torch.Tensor):
                out.append(x)
            elif isinstance(x, (list, tuple, dict)):
                op_tensors(x, out, 3)
    return out


def _arg_vids(enc_args, enc_kwargs) -> list[int]:
    return [a["$v"] for a in (*enc_args, *enc_kwargs.values()) if type(a) is dict and "$v" in a]


def derive(op: str, src: TensorValue, shape: list, enc_args, enc_kwargs):
    """The derived fingerprint of view `op` of `src` (divtrace.trace.derived_views); pending while `src`'s own
    fingerprint is still on its device (the device path: resolved by the trace writer's thread)."""
    if type(src.hash) is str:
        return view_fingerprint(op, src.hash, src.dtype, src.shape, shape, enc_args, enc_kwargs)
    return PendingDerived(src.hash, op, src.dtype, src.shape, shape, enc_args, enc_kwargs)


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
    handlers hold a signal that arrives while it runs (see divtrace.record.lifecycle)."""
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


class ValueIdentity:
    """Value ids of the tensors one recording meets, and the versions they were seen at (one per Recorder)."""

    block_fp = None  # a rank's Placements.block_fp: an op result's (hash, stats) taken with its partial, or None
    names = None  # the recording's ParamNames (record/param_names.py): values from outside that are parameters

    def __init__(self, mode: str, tokens, warnings_out: list):
        self.mode = mode  # "full" or "hash"
        self._tokens = tokens  # the recording's TokenRows: the grid of the root call in progress, row fingerprints
        self.warnings = warnings_out  # the recording's warnings (meta.json)
        self.writer = None  # the TraceWriter, from the start of the block
        self._tensors = TensorTable()  # tensor -> (vid, version, value)
        self._derived: set[int] = set()  # vids whose fingerprint is derived from a view's input (_derived_view)
        self._view_children: dict[int, list] = {}  # derived vid -> views derived from it: (value, op, args, kwargs)
        self._unsettled: set[int] = set()  # vids of fresh buffers (and their views): re-read when used again
        self.writes: dict[int, int] = {}  # storage address -> in-place writes seen (with ops=True: op_records)
        self.bumped: set | None = None  # ids of the arguments the running custom op writes (see OpRecorder.on_op)
        self.mode_pushed = False  # the dispatch mode is pushed (ops=True): in-place writes are counted

    def version(self, t: torch.Tensor):
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
                if self.writes:
                    try:
                        v += self.writes.get(t.untyped_storage().data_ptr(), 0) << 32
                    except Exception:
                        pass
                return v
        try:
            return ("w", self.writes.get(t.untyped_storage().data_ptr(), 0))
        except Exception:
            return None

    def known(self, t: torch.Tensor, vid: int):
        """The TensorValue the table holds for `t`, when it is value `vid` (else None)."""
        e = self._tensors.get(t)
        return e[2] if e is not None and e[0] == vid else None

    def vid_of(self, t: torch.Tensor, new_values: list, boundary: bool = False, root_output: bool = False) -> int:
        """The value id of `t` as it is now; a tensor never seen (or changed behind our back) is new."""
        entry = self._tensors.get(t)
        version = self.version(t)
        if self.bumped and id(t) in self.bumped and type(version) is int and entry is not None \
                and entry[1] == version - 1:
            return entry[0]  # (a custom op's argument it is about to write: torch counted the write already)
        if boundary and entry is not None and entry[1] == version and self._derived:
            entry = self._real_hash(t, entry)
        fp = None
        unsettled = False
        if entry is not None:
            unsettled = bool(self._unsettled) and entry[0] in self._unsettled
            if (entry[1] == version and (self.mode_pushed or not isinstance(version, tuple))
                    and not unsettled):
                return entry[0]
            # The version moved (an in-place op: torch bumps the counter only after the op has returned
            # through the dispatch mode, so its output is first read here), or it cannot be known (ops=False
            # and an inference tensor): the bytes decide. Unchanged bytes keep their value and its producer.
            v = entry[2]
            device = self.writer.device
            if device is not None and (device.forced or not t.is_cpu) and v.vid not in self._derived:
                return self._provisional(t, entry, version, new_values, boundary, root_output, unsettled)
            if v.vid not in self._derived:
                fp = fingerprint(t)
                if (fp[0] == v.hash and dtype_name(t.dtype) == v.dtype and list(t.shape) == v.shape
                        and list(t.stride()) == v.stride):
                    self._tensors[t] = (entry[0], version, v)
                    return entry[0]
        v = self.writer.new_value(t, producer=None, fp=fp)
        new_values.append(v)
        self._tensors[t] = (v.vid, version, v)
        if self.names is not None:  # a parameter or buffer of the model: its name (record/param_names.py)
            self.names.seen(t, v.vid)
        if self._tokens.grid is not None and (boundary or _had_rows(self._tokens, entry)):
            # (op inputs from outside are parameters and buffers: no rows. A value with rows that an op rewrote
            # through a view (vLLM's linears write into an empty buffer's reshape, and the buffer is the module's
            # output) keeps rows: else its module output has none and is never compared)
            self._tokens.rows(v.vid, t, root_output)
        if unsettled and entry[1] == version:  # changed, and no torch op wrote it: it may be again
            self._unsettled.add(v.vid)
            self.skip(_RAW_WRITE)
        return v.vid

    def _provisional(self, t, entry, version, new_values, boundary, root_output, unsettled) -> int:
        """vid_of on the device path, where the bytes decide: a new value that the trace writer's thread drops again
        when its fingerprint is the old value's (divtrace.trace.device_writer), so nothing waits for the device
        here. Different dtype, shape or stride need no bytes: a new value at once, as on the CPU path."""
        old = entry[2]
        raw = unsettled and entry[1] == version  # no torch op wrote it: if it changed, a raw write did
        tokens = self._tokens
        if dtype_name(t.dtype) == old.dtype and list(t.shape) == old.shape and list(t.stride()) == old.stride:
            v = self.writer.device.provisional_value(t, old, _RAW_WRITE if raw else None)
            if boundary and tokens.grid is not None:  # the rows the CPU path keeps when the bytes are old's
                tokens.store.provisional(v.vid, old.vid, keep=root_output and (old.vid not in tokens.rowed
                                                                          or old.vid in tokens.unrowed))
            settled = False
        else:
            v = self.writer.new_value(t, producer=None)
            settled = True
        new_values.append(v)
        self._tensors[t] = (v.vid, version, v)
        if self.names is not None:  # (a line for a value the writer thread drops again is ignored when read)
            self.names.seen(t, v.vid)
        if tokens.grid is not None and (boundary or _had_rows(tokens, entry)):
            tokens.rows(v.vid, t, root_output)
        # Unsettled stays unsettled (when the bytes turn out old's, the old value was too: re-read all the same).
        if raw or (unsettled and not settled):
            self._unsettled.add(v.vid)
        if raw and settled:
            self.skip(_RAW_WRITE)
        return v.vid

    def produced(self, t: torch.Tensor, producer: int, inputs: list, new_values: list, op: str = "",
                  enc_args=None, is_view: bool = False, enc_kwargs=None) -> int:
        # A view's version counter is tied to its base's only after the op has returned through the dispatch
        # mode: here it still reads 0. What the view will read from then on is its base's version now.
        base = self._alias_source(t, inputs) if is_view else None
        # (the source's entry now: an aliasing op may hand back the source itself, `t is base`, whose entry the
        # table then gives to the new value)
        base_entry = self._tensors.get(base) if base is not None else None
        version = self.version(t if base is None else base)
        alias = None  # (vid, tensor) of an input `t` reads the same bytes of: its token rows may serve `t` too
        v = None
        # An alias that reads the same bytes in the same logical order as an input (view, reshape, detach,
        # alias) has the input's fingerprint: reuse it instead of hashing again.
        ptr, n = t.data_ptr(), t.numel()
        for src in inputs:
            if src is t and op in _RETURNS_INPUT:
                e = self._tensors.get(src)
                if e is not None and e[1] == version and e[0] not in self._derived \
                        and not (self._unsettled and e[0] in self._unsettled):
                    v = copy_value(e[2], vid=self.writer.take_vid(), producer=producer)
                    alias = (e[0], src)
                break
            if src is t or src.data_ptr() != ptr or src.dtype != t.dtype or src.numel() != n or src.device != t.device:
                continue
            if src.is_conj() != t.is_conj() or src.is_neg() != t.is_neg():
                break  # same bytes, other values (conj(), a lazy negation): hash them
            if (t.is_contiguous() and src.is_contiguous()) or (src.shape == t.shape and src.stride() == t.stride()):
                e = self._tensors.get(src)
                # (an alias of a derived view is derived again from its own op, or hashed: it has no bytes to share)
                if e is not None and e[1] == (version if src is base else self.version(src)) \
                        and e[0] not in self._derived:
                    v = copy_value(e[2], vid=self.writer.take_vid(), producer=producer, shape=list(t.shape),
                                   stride=list(t.stride()))
                    alias = (e[0], src)
                break
        if v is None and op in DERIVABLE_VIEWS and not t.is_contiguous():
            src = base if is_view else self._alias_source(t, inputs)
            e = self._tensors.get(src) if src is not None else None
            if e is not None:
                v = self._derived_view(t, producer, src, e, version if src is base else self.version(src), op,
                                       enc_args, enc_kwargs or {})
                if v is not None and self._tokens.grid is not None:
                    alias = (e[0], src)
        if v is None:
            v = self.writer.new_value(t, producer=producer, fp=self.block_fp(t) if self.block_fp is not None else None)
        new_values.append(v)
        self._tensors[t] = (v.vid, version, v)
        tokens = self._tokens
        if tokens.grid is not None:
            # A view of what came from outside this call with no token rows (a weight, its local block, a buffer)
            # has none either: a weight's rows are not tokens, though its first dim may equal the token count.
            if base_entry is None or base_entry[0] in tokens.rowed:
                tokens.rows(v.vid, t, alias=alias, made_by=(op, enc_args, inputs, self._tensors))
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

    def _derived_view(self, t, producer, src, e, src_version, op, enc_args, enc_kwargs):
        """A strided view (w.t(), a transpose, an expand) of a known value: a fingerprint derived from the op, its
        arguments and the input's fingerprint (divtrace.trace.derived_views), instead of a copy and a hash of its bytes; in
        full mode no bytes either (a reader rebuilds them from the op). A value that reaches a module boundary
        is hashed (and stored) for real there (`_real_hash`), where the other side may hold the same bytes
        made another way. `src` is the input `t` views (`_alias_source`), `e` its table entry, `src_version` its
        version now."""
        if e[1] != src_version or (self._unsettled and e[0] in self._unsettled):
            return None  # (a fresh buffer may be written behind torch's back: its views' bytes are hashed)
        if self.mode == "full" and not (rebuildable(enc_args, enc_kwargs)
                                        and e[0] in _arg_vids(enc_args, enc_kwargs)):
            return None  # a reader could not rebuild it from the op: store its bytes
        h = derive(op, e[2], list(t.shape), enc_args, enc_kwargs)
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
                    child.hash = derive(op, p, child.shape, args, kwargs)
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

    def plain(self, t: torch.Tensor, where: str):
        """The tensor to fingerprint for `t`, or None (skipped, with a warning) when it has no plain bytes."""
        if ((type(t) is torch.Tensor or type(t).__torch_dispatch__ is _PLAIN_DISPATCH) and t.layout is _STRIDED
                and not (t.is_quantized or t.is_nested or t.is_meta)):
            return t  # (the common case, in one test; the rest says what is wrong with the others)
        if type(t).__torch_dispatch__ is not _PLAIN_DISPATCH:
            local = getattr(t, "_local_tensor", None)  # DTensor keeps its shard here; to_local() may wrap it
            if local is None and type(t).__name__ == "AsyncCollectiveTensor":  # a functional collective's result
                local = getattr(t, "elem", None)  # (recorded once the collective is done: record/collectives.py)
            if not isinstance(local, torch.Tensor):
                to_local = getattr(t, "to_local", None)
                try:
                    local = to_local() if callable(to_local) else None
                except Exception:
                    local = None
            if isinstance(local, torch.Tensor) and type(local).__torch_dispatch__ is _PLAIN_DISPATCH:
                return self.plain(local, where)
            return self.skip(f"{where}: tensor subclass {type(t).__name__} not recorded")
        if t.layout != torch.strided or t.is_quantized or t.is_nested or t.is_meta:
            kind = "meta" if t.device.type == "meta" else "quantized" if t.is_quantized else \
                "nested" if t.is_nested else str(t.layout).removeprefix("torch.")
            return self.skip(f"{where}: {kind} tensor not recorded")
        return t

    def skip(self, msg: str):
        if msg not in self.warnings and len(self.warnings) < 100:
            self.warnings.append(msg)
            warnings.warn(f"divtrace: {msg}", stacklevel=4)
        return None


def _had_rows(tokens, entry) -> bool:
    """Whether the tensor's value before this one (`entry` of the table, or None: never seen) had token rows."""
    return entry is not None and entry[0] in tokens.rowed and entry[0] not in tokens.unrowed
