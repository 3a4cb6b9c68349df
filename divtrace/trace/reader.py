"""Reading a trace back: metadata and records eagerly and validated, tensor bytes lazily and checked.

Nothing here trusts the files: a trace may be truncated, hand-edited, corrupted or written by another
version. Every problem is a DivtraceError naming the file (and line). records.jsonl is verified against its
sha256 before it is parsed (from meta.json when the recording closed, else from checksums.jsonl, which also
covers what a killed run left). Tensor bytes are checked against their fingerprint on every load, and
`verify_shards()` checks every stored tensor (what bisect needs before "identical"). Traces written before
shards lost their sha256 (see trace/shards.write_shard) still have their shards checked against it.

`Trace` is put together from one module per job, each a mixin over the state `Trace.__init__`/`_reset` set up:

- divtrace/trace/meta.py: the trace directory and meta.json, read and validated;
- divtrace/trace/index.py: which reader builds the compact index; the C reader's glue (divtrace/_index.c) and
  the fast Python reader;
- divtrace/trace/reference.py: the reference reader (record by record, names the first bad line);
- divtrace/trace/integrity.py: records.jsonl against its sha256 (meta.json, checksums.jsonl), shards and stored
  tensors against their digests;
- divtrace/trace/record_views.py: `records` and `values`, objects built from the verified bytes when asked for;
- divtrace/trace/tensors.py: value access, where a value's bytes are read (`tensor(vid)`) and derived views are
  rebuilt;
- divtrace/trace/fields.py: dtype names and item sizes (`itemsize`, `torch_dtype`), shard names.
"""
from __future__ import annotations

from pathlib import Path

from divtrace.trace.records import ModuleCall, TensorValue
from divtrace.trace.index import IndexBuilding
from divtrace.trace.integrity import Integrity
from divtrace.trace.meta import check_trace_dir, read_meta
from divtrace.trace.record_views import RecordViews
from divtrace.trace.reference import ReferenceReader
from divtrace.trace.tensors import TensorAccess

# Re-exported from where they now live: other modules and tests import them from here.
from divtrace.trace.fields import (_CORE_DTYPES, _DTYPE_INFO, _OPTIONAL_DTYPES, _SHARD_NAME,  # noqa: F401,E402
                                   _dtype_full, _dtype_info, itemsize, torch_dtype)
from divtrace.trace.index import _native_index_records, gc_paused  # noqa: F401,E402
from divtrace.trace.meta import _SCHEMES_KNOWN_WITHOUT_TORCH, _hasher, _scheme_known  # noqa: F401,E402
from divtrace.trace.record_views import _Records, _Values  # noqa: F401,E402

__all__ = ["Trace", "gc_paused", "itemsize", "open_trace", "torch_dtype"]


class Trace(IndexBuilding, ReferenceReader, Integrity, RecordViews, TensorAccess):
    """A trace directory opened for reading. Tensors are loaded only when asked for (`tensor(vid)`).

    `records` (a sequence of ModuleEnter/ModuleExit/OpRecord) and `values` (vid -> TensorValue) build their
    objects from the verified bytes the first time each is asked for; `calls` are built when reading. What
    bisect reads at scale is the compact index, filled for every record when the trace is opened:

    - `vkey[vid]`: (dtype, shape, hash), the shape a tuple; two values are bitwise equal iff their keys are
      equal;
    - `vprod[vid]`: for a value an op produced, that op's record index (`producer(vid)`), which is also the
      record that defines it; `vsrc[vid]`: for any other value, the record that defines it;
    - per record: `rcall` (its call_id); for op records `rop` (op name), `rin` (input vids) and `rout` (output
      vids), tuples, None for module enter/exit records (which of the two: `calls[rcall[i]].enter_index == i`);
    - `vblob[vid]`: (blob, shard) of each value with stored bytes (full mode);
    - `vderived`: values whose hash is derived from their producing view op's input (divtrace.trace.derived_views); in full
      mode their bytes are rebuilt from that op.

    Every field of every record is validated when the trace is opened, whichever reader builds this. The index
    is tuples of ints and strings, which the cyclic GC stops scanning (the C reader untracks them as it builds
    them; CPython untracks the Python readers' in its first collections), so no later collection in the
    process walks a million of them.
    """

    def __init__(self, path):
        self.path = Path(path)
        check_trace_dir(self.path)
        self.meta = read_meta(self.path)
        self._full = self.meta["mode"] == "full"
        self.torn_tail = False  # bytes after the last whole, verified flush were dropped
        self.verified = True  # records.jsonl matched a recorded sha256
        self.read_fast = False  # the fast reader built the index (see _read_fast)
        self.read_native = False  # ... and it was the C one
        self.warnings: list[str] = []
        self.file_problems: list[str] = []  # files of the trace that cannot be read but are not needed to read it
        self._shard_sums: dict[str, str] = {}
        # name -> (bytes, sha256) of each file appended beside records.jsonl (the token files) that the checksums
        # vouch for; None: the trace predates those checksums, or its checkpoints are missing (read unverified)
        self.file_sums: dict[str, tuple[int, str]] | None = None
        self._token_index = None
        self._reset()
        self._read_records()
        self.check_meta()  # meta.json against what the records show: a mismatch is a damaged trace
        self._shards: dict[str, object] = {}
        self._shards_verified = False

    def _reset(self) -> None:
        # The fast reader's records and values are built when asked for, into these caches, through views
        # (_Records, _Values) made on each access: a view refers to the trace, the trace not to its views, so
        # a trace nobody refers to is freed at once (the index is kept out of the cyclic GC, see _read_records).
        self._record_cache: dict[int, object] = {}
        self._value_cache: dict[int, TensorValue] = {}
        self._records_list: list | None = None  # the reference reader's records and values, built whole
        self._values_dict: dict | None = None
        self.calls: dict[int, ModuleCall] = {}
        self.vkey: dict[int, tuple] = {}
        self.vprod: dict[int, int] = {}
        self.vsrc: dict[int, int] = {}
        self.vblob: dict[int, tuple[str, str]] = {}
        self.vderived: set[int] = set()
        self._real_keys: dict[int, tuple] = {}
        self.rcall: list[int] = []
        self.rop: list = []
        self.rin: list = []
        self.rout: list = []
        self._open: set[int] = set()  # calls entered and not exited
        self._call_counts: dict[str, int] = {}
        self._body = b""  # the verified whole lines of records.jsonl, which records and values are built from
        self._chunks: list[tuple[int, int]] = []  # (first record, byte offset) of each chunk parsed (verified)
        self._line_starts = None  # offset of each line in _body (unverified: parsed line by line)

    # queries ----------------------------------------------------------------------------------------------
    @property
    def complete(self) -> bool:
        return bool(self.meta.get("complete")) and not self.torn_tail

    @property
    def status(self) -> str:
        """meta's status, spelled out when the recording never closed (killed, or still running)."""
        s = self.meta.get("status", "?")
        if s == "running":
            return "running (never closed: the recording process was killed or is still running)"
        return s

    @property
    def mode(self) -> str:
        return self.meta["mode"]

    @property
    def label(self) -> str:
        return self.meta.get("label") or self.path.name

    @property
    def hash_scheme(self) -> str:
        return self.meta["hash_scheme"]

    def roots(self) -> list[ModuleCall]:
        return [c for c in self.calls.values() if c.parent is None]

    def producer(self, vid: int) -> int | None:
        """Index of the op record that produced value `vid`; None when it came from outside."""
        if vid not in self.vkey:
            raise KeyError(vid)
        return self.vprod.get(vid)


def open_trace(path) -> Trace:
    return Trace(path)
