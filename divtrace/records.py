"""The plain record types that record, trace, bisect, repro and verify pass around.

A trace is a sequence of events in execution order. Every tensor value gets a value id (`vid`) the moment it
is produced or first seen; records refer to values by vid, so an op's inputs point at the record that
produced them, or at a value that came from outside (a parameter, a model input).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

FORMAT_VERSION = 1


@dataclass
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

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def same_bits(self, other: "TensorValue") -> bool:
        """Bitwise equality from fingerprints: dtype, shape and the raw bytes' 128-bit hash."""
        return self.dtype == other.dtype and self.shape == other.shape and self.hash == other.hash


@dataclass
class ModuleEnter:
    """A module call starts; its inputs are taken here, before its code runs."""

    index: int
    call_id: int
    module: str
    call: int
    parent: int | None
    inputs: list[tuple[str, int]]  # (key, vid): "args.0", "kwargs.attention_mask"
    kind: str = "enter"


@dataclass
class ModuleExit:
    index: int
    call_id: int
    outputs: list[tuple[str, int]]  # (key, vid): "out", "out.0", "out.logits"
    error: str | None = None
    kind: str = "exit"


@dataclass
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


def record_to_json(rec, values: list[TensorValue]) -> dict:
    d = asdict(rec)
    if values:
        d["values"] = [asdict(v) for v in values]
    return d


@dataclass
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
