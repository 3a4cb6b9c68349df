"""The plain record types that record, trace, bisect, repro and verify pass around.

A trace is a sequence of events in execution order. Every tensor value gets a value id (`vid`) the moment it
is produced or first seen; records refer to values by vid, so an op's inputs point at the record that
produced them, or at a value that came from outside (a parameter, a model input).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from json.encoder import encode_basestring_ascii as _json_str

from divtrace.trace.files import compact_encoder

FORMAT_VERSION = 2  # 2: full-mode values may be derived views ("r") with no bytes of their own


def json_safe(x):
    """`x` with non-finite floats as their repr ("nan", "inf") and tuples as lists: strict JSON can hold it."""
    if isinstance(x, float) and (x != x or x in (float("inf"), float("-inf"))):
        return repr(x)
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    return x


@dataclass(slots=True)
class TensorValue:
    """One tensor value as it was when produced: layout, bit-exact fingerprint, stats, where its bytes are."""

    vid: int
    dtype: str
    shape: list[int]
    stride: list[int]
    hash: str
    device: str = "cpu"
    stats: dict = field(default_factory=dict)
    producer: int | None = None  # index of the op record that produced it; None: came from outside
    blob: str | None = None  # safetensors key (full mode), content-addressed: equal bytes share a blob
    shard: str | None = None
    nbytes: int = 0
    derived: bool = False  # `hash` is derived from the producing view op's input (divtrace.trace.derived_views): no bytes of its own

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def same_bits(self, other: "TensorValue") -> bool:
        """Bitwise equality from fingerprints: dtype, shape and the raw bytes' 128-bit hash."""
        return self.dtype == other.dtype and self.shape == other.shape and self.hash == other.hash


@dataclass(slots=True)
class ModuleEnter:
    """A module call starts; its inputs are taken here, before its code runs."""

    index: int
    call_id: int
    module: str
    call: int
    parent: int | None
    inputs: list[tuple[str, int]]  # (key, vid): "args.0", "kwargs.attention_mask"
    kind: str = "enter"


@dataclass(slots=True)
class ModuleExit:
    index: int
    call_id: int
    outputs: list[tuple[str, int]]  # (key, vid): "out", "out.0", "out.logits"
    error: str | None = None
    kind: str = "exit"


@dataclass(slots=True)
class OpRecord:
    """One aten (or custom) op run inside a module call, attributed to the innermost recorded call."""

    index: int
    call_id: int
    op: str  # "aten.mm.default"
    args: list  # encoded: tensors as {"$v": vid}; see encode_value in recorder
    kwargs: dict
    inputs: list[int]  # vids of tensor inputs, in argument order
    outputs: list[int]  # vids of tensor outputs, in pytree order
    out: object = None  # encoded output structure (tensors as {"$v": vid})
    kind: str = "op"


RECORD_TYPES = {"enter": ModuleEnter, "exit": ModuleExit, "op": OpRecord}


@dataclass(slots=True)
class ModuleCall:
    """A module call reassembled from its enter/exit records (what bisect walks)."""

    call_id: int
    module: str
    call: int
    parent: int | None
    enter_index: int
    inputs: list[tuple[str, int]]
    exit_index: int | None = None  # None: the call never returned (crash or interrupt)
    outputs: list[tuple[str, int]] = field(default_factory=list)
    children: list[int] = field(default_factory=list)  # call_ids, in execution order
    ops: list[int] = field(default_factory=list)  # op record indices of the call's own code

    @property
    def key(self) -> tuple[str, int]:
        return (self.module, self.call)


# -- compact on-disk form ------------------------------------------------------------------------------------
# A hash-mode record must stay small (issue 2: at most 300 bytes), so records.jsonl uses short keys, omits
# what can be derived (nbytes from shape and dtype; a contiguous stride; absmax from min/max) and rounds the summary stats
# (informational only: equality is decided by the hash): min/max to 9 significant digits, mean to 7.


def contiguous_stride(shape) -> list[int]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(s, 1)
    return stride[::-1]


_CONTIGUOUS: dict[tuple, list[int]] = {}  # shape -> its contiguous stride, for the writer's hot path (read only)


def _is_contiguous_stride(shape: list[int], stride: list[int]) -> bool:
    key = tuple(shape)
    c = _CONTIGUOUS.get(key)
    if c is None:
        c = contiguous_stride(shape)
        if len(_CONTIGUOUS) < 65536:
            _CONTIGUOUS[key] = c
    return stride == c


def _short_stats(st: dict) -> list:
    """[min, max, mean, nan, inf] with min/max to 9 significant digits and mean to 7. Spelled out per field:
    a loop over the keys with a nested format spec cost 3.6 us a value, this 1.5 us."""
    lo, hi, mean = st["min"], st["max"], st["mean"]
    return [float("%.9g" % lo) if type(lo) is float else lo, float("%.9g" % hi) if type(hi) is float else hi,
            float("%.7g" % mean) if type(mean) is float else mean, st["nan"], st["inf"]]


def stats_from_compact(d: dict) -> dict:
    """The stats dict of an on-disk value: its "m" list (what _short_stats wrote, absmax derived) or "M"."""
    m = d.get("m")
    if m is None:
        return d.get("M", {})
    lo, hi, mean, nan, inf = m
    absmax = max(abs(lo), abs(hi)) if type(lo) in (int, float) and type(hi) in (int, float) else "nan"
    return {"min": lo, "max": hi, "mean": mean, "absmax": absmax, "nan": nan, "inf": inf}


def _value_compact(v: TensorValue) -> dict:
    d = {"v": v.vid, "d": v.dtype.removeprefix("torch."), "s": v.shape, "h": v.hash}
    if v.producer is not None:
        d["p"] = v.producer
    if not _is_contiguous_stride(v.shape, v.stride):
        d["t"] = v.stride
    if v.device != "cpu":
        d["dev"] = v.device
    st = v.stats
    if st:
        if set(st) == {"min", "max", "mean", "absmax", "nan", "inf"}:
            # min/max keep 9 digits (exact for fp32 and narrower: repro draws inputs in that range)
            d["m"] = _short_stats(st)
        else:
            d["M"] = st
    if v.blob is not None:
        d["b"] = v.blob
        d["f"] = v.shard
    if v.derived:
        d["r"] = 1
    return d


def record_compact(rec, values: list[TensorValue]) -> dict:
    """The JSON object written to records.jsonl for one record."""
    if isinstance(rec, ModuleEnter):
        d = {"k": "e", "i": rec.index, "c": rec.call_id, "m": rec.module, "n": rec.call, "in": rec.inputs}
        if rec.parent is not None:
            d["p"] = rec.parent
    elif isinstance(rec, ModuleExit):
        d = {"k": "x", "i": rec.index, "c": rec.call_id, "out": rec.outputs}
        if rec.error is not None:
            d["err"] = rec.error
    else:
        d = {"k": "o", "i": rec.index, "c": rec.call_id, "op": rec.op, "a": rec.args, "o": rec.out}
        if rec.kwargs:
            d["kw"] = rec.kwargs
        d["in"] = rec.inputs
        d["out"] = rec.outputs
    if values:
        d["V"] = [_value_compact(v) for v in values]
    return d


# -- a record's line (records.jsonl), written as text ---------------------------------------------------------
# encode_line(record_compact(rec, values)) byte for byte, with each value's part written straight as text (a dict
# built per value and walked by the C encoder cost ~3.5 us a value; this ~2 us). The record's own fields still go
# through the C encoder (their args are free-form); a value whose fields are not the plain kinds this writes
# (stats other than the six numbers, a non-finite or non-float min/max/mean, ...) takes the dict path.
_ENC = compact_encoder()
_STATS_KEYS = frozenset(("min", "max", "mean", "absmax", "nan", "inf"))
_SHAPE_TEXT: dict[tuple, tuple[str, list[int]]] = {}  # shape -> (its JSON text, its contiguous stride)
_STRIDE_TEXT: dict[tuple, str] = {}  # a stride that is not the contiguous one -> its JSON text
_DTYPE_TEXT: dict[str, str] = {}  # "torch.float32" -> '"float32"'


def _encode(d) -> str:
    try:
        return _ENC(d)
    except ValueError:  # a non-finite float (json_safe maps part by part, so this equals encoding the whole)
        return _ENC(json_safe(d))


def _num_text(x, spec: str) -> str | None:
    """A stat rounded as _short_stats rounds it, as the encoder writes it; None where the dict path must decide."""
    if type(x) is float:
        if x - x:  # inf or nan (inf - inf is nan): the encoder refuses those
            return None
        s = spec % x
        if "e" in s:
            x = float(s)
            return None if x - x else repr(x)
        # Without an exponent, repr(float(s)) is s itself (".0" added to a whole number): s's digits (at most 9, no
        # trailing zero) are the only ones of their length or shorter that read back as float(s), and both write
        # fixed notation for a decimal exponent from -4 up to 8.
        return s if "." in s else s + ".0"
    return str(x) if type(x) is int else None


def _stats_text(st: dict) -> str | None:
    """The "m" list's text (_short_stats as the encoder writes it), or None where the dict path must decide."""
    if st.keys() != _STATS_KEYS or type(st["nan"]) is not int or type(st["inf"]) is not int:
        return None
    lo, hi, mean = st["min"], st["max"], st["mean"]
    if type(lo) is float and type(hi) is float and type(mean) is float:
        s = "%.9g,%.9g,%.7g" % (lo, hi, mean)
        if "e" not in s and "n" not in s:  # all three finite, in fixed notation (see _num_text): the common case
            lo, hi, mean = s.split(",")
            return (f'[{lo if "." in lo else lo + ".0"},{hi if "." in hi else hi + ".0"},'
                    f'{mean if "." in mean else mean + ".0"},{st["nan"]},{st["inf"]}]')
    lo, hi, mean = _num_text(lo, "%.9g"), _num_text(hi, "%.9g"), _num_text(mean, "%.7g")
    if lo is None or hi is None or mean is None:
        return None
    return f'[{lo},{hi},{mean},{st["nan"]},{st["inf"]}]'


def _value_text(v: TensorValue) -> str | None:
    """_ENC(_value_compact(v)), or None for the values it does not write (the caller takes the dict path)."""
    dt = _DTYPE_TEXT.get(v.dtype)
    if dt is None:
        dt = _DTYPE_TEXT[v.dtype] = _ENC(v.dtype.removeprefix("torch."))
    if type(v.hash) is not str or type(v.vid) is not int or (v.producer is not None and type(v.producer) is not int):
        return None
    for n in v.shape:  # (every time: True == 1, so a list holding a bool would meet the ints' text)
        if type(n) is not int:
            return None
    key = tuple(v.shape)
    shape = _SHAPE_TEXT.get(key)
    if shape is None:
        shape = (_ENC(v.shape), contiguous_stride(v.shape))
        if len(_SHAPE_TEXT) < 65536:
            _SHAPE_TEXT[key] = shape
    text = f'{{"v":{v.vid},"d":{dt},"s":{shape[0]},"h":{_json_str(v.hash)}'
    if v.producer is not None:
        text += f',"p":{v.producer}'
    if v.stride != shape[1]:
        for n in v.stride:
            if type(n) is not int:
                return None
        key = tuple(v.stride)
        stride = _STRIDE_TEXT.get(key)
        if stride is None:
            stride = _ENC(v.stride)
            if len(_STRIDE_TEXT) < 65536:
                _STRIDE_TEXT[key] = stride
        text += f',"t":{stride}'
    if v.device != "cpu":
        if type(v.device) is not str:
            return None
        text += f',"dev":{_json_str(v.device)}'
    if v.stats:
        st = _stats_text(v.stats)
        if st is None:
            return None
        text += f',"m":{st}'
    if v.blob is not None:
        if type(v.blob) is not str or type(v.shard) is not str:
            return None
        text += f',"b":{_json_str(v.blob)},"f":{_json_str(v.shard)}'
    if v.derived:
        text += ',"r":1'
    return text + "}"


_KEY_TEXT: dict[str, str] = {}  # a module input's or output's key -> '["key",'
_MODULE_TEXT: dict[str, str] = {}  # a module path -> its JSON text


def _keyed_text(pairs) -> str | None:
    """The JSON text of a module record's [(key, vid), ...], or None for anything else."""
    parts = []
    for pair in pairs:
        if type(pair) is not tuple or len(pair) != 2 or type(pair[0]) is not str or type(pair[1]) is not int:
            return None
        key = _KEY_TEXT.get(pair[0])
        if key is None:
            key = _KEY_TEXT[pair[0]] = f"[{_json_str(pair[0])},"
        parts.append(f"{key}{pair[1]}]")
    return f'[{",".join(parts)}]'


def _head_text(rec) -> str | None:
    """The JSON text of a module record without its values (record_compact's dict, encoded), or None (an op record,
    or fields of other kinds: the dict path)."""
    kind = type(rec)
    if kind is ModuleEnter:
        if type(rec.index) is not int or type(rec.call_id) is not int or type(rec.call) is not int or (
                type(rec.module) is not str) or (rec.parent is not None and type(rec.parent) is not int):
            return None
        inputs = _keyed_text(rec.inputs)
        if inputs is None:
            return None
        module = _MODULE_TEXT.get(rec.module)
        if module is None:
            module = _MODULE_TEXT[rec.module] = _json_str(rec.module)
        parent = "" if rec.parent is None else f',"p":{rec.parent}'
        return f'{{"k":"e","i":{rec.index},"c":{rec.call_id},"m":{module},"n":{rec.call},"in":{inputs}{parent}}}'
    if kind is ModuleExit:
        if type(rec.index) is not int or type(rec.call_id) is not int or (
                rec.error is not None and type(rec.error) is not str):
            return None
        outputs = _keyed_text(rec.outputs)
        if outputs is None:
            return None
        error = "" if rec.error is None else f',"err":{_json_str(rec.error)}'
        return f'{{"k":"x","i":{rec.index},"c":{rec.call_id},"out":{outputs}{error}}}'
    return None


def record_line(rec, values: list[TensorValue]) -> str:
    """The line records.jsonl holds for one record: what encoding record_compact(rec, values) writes."""
    head = _head_text(rec)
    if head is None:
        head = _encode(record_compact(rec, ()))
    if not values:
        return head
    texts = []
    for v in values:
        text = _value_text(v)
        texts.append(text if text is not None else _encode(_value_compact(v)))
    return f'{head[:-1]},"V":[{",".join(texts)}]}}'
