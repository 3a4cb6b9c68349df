"""The parameter names beside a trace (`params.jsonl`): which parameter or buffer of the recorded model each value
from outside the root call is, so bisect can compare the two runs' weights by name (divtrace.compare.params).

Written by divtrace.record.param_names; one JSON object per line:

- `{"v": vid, "name": "model.embed_tokens.weight", "kind": "parameter"}`: value `vid` (defined by the op record
  that first read it, as any value from outside) is that parameter (or `"kind": "buffer"`) as it was when an op of
  the recording read it. A parameter written in place during the recording and read again has a line per value.
- `{"name": ..., "kind": ..., "dtype": "torch.float32", "shape": [..], "h": fingerprint}`: a parameter or buffer
  that no recorded op read, fingerprinted when the block ended (record's `params="all"`): no value, no bytes (in
  full mode too), only its fingerprint, in the trace's scheme. A DTensor parameter's line adds `"lay": {"p":
  [placement per mesh dim], "g": global shape, "o": this rank's offsets, "h": partial fingerprint}` (as a value's
  layout in layouts.jsonl: divtrace.trace.layouts), so its block is put together with the other ranks' blocks.
- `{"name": ..., "kind": ..., "ch": [[dim, [[start, length, partial], ..]], ..]}` (record's `params="blocks"` only:
  a parameter that is not a DTensor and that an op read, at the block's end, in hash mode; one no op read has `ch`
  on its fingerprint line, in both modes): the partial fingerprints of its chunks along `dim` at their global
  offsets (the lane-gsum128-v2 scheme: they sum to its fingerprint), so a rank's block of another run's layout
  (rows 32-63 of a TP=2 run's vocab block) is compared with the same rows of this whole weight with no bytes.

Names are `named_parameters()` / `named_buffers()` names relative to the recorded model, torch.compile's `_orig_mod.`
left out; a tied weight (one tensor under two names) has the first name torch gives it. A DTensor parameter's line
names its local tensor (the block this rank holds).

The lines are written with the trace's records, under the same checksums (divtrace.trace.side_files: meta.json's
`file_checksums` names the file from the start), so a killed recording leaves lines a checkpoint vouches for and a
reader cuts the file back to them; a line that is not whole and well formed is a damaged trace. Lines about values
the trace does not hold (its record was never written) are ignored. A trace whose `file_checksums` does not name
the file was recorded before parameters were named: it holds no names (`read_param_names` returns None).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from divtrace.trace.files import compact_encoder
from divtrace.trace.hashing.spec import combine_hex

PARAMS = "params.jsonl"
KINDS = ("parameter", "buffer")
_LINE = compact_encoder()


@dataclass
class NamedValue:
    """One value a name held in a recording: its value id (None: fingerprinted unread at the block's end) and key
    (dtype, shape as a tuple, fingerprint), as Trace.vkey holds keys."""

    vid: int | None
    key: tuple
    layout: object = None  # (a fingerprint line's "lay": a divtrace.trace.layouts.Layout with vid -1)
    chunks: list | None = None  # [(dim, [(start, length, partial)])] where the name held this value only


@dataclass
class ParamNames:
    """name -> the values it held, in recording order; kind per name."""

    values: dict[str, list[NamedValue]] = field(default_factory=dict)
    kinds: dict[str, str] = field(default_factory=dict)
    chunks: dict[str, list] = field(default_factory=dict)  # name -> its "ch" line's chunks
    _by_vid: dict | None = field(default=None, repr=False, compare=False)

    def name_of(self, vid: int) -> tuple[str, str] | None:
        """(kind, name) of the value `vid`, where a name held it."""
        if self._by_vid is None:
            self._by_vid = {v.vid: (self.kinds.get(n, "parameter"), n) for n, vals in self.values.items()
                            for v in vals if v.vid is not None}
        return self._by_vid.get(vid)


class ParamNameWriter:
    """Queues the name lines and hands them to the trace writer's checksummed files before each flush of the records
    (the values they name are defined by records of the same flush or an earlier one). On the device path
    (trace/device_writer.py) they go out on its writer thread, as a job before the records of the same flush."""

    def __init__(self, writer) -> None:
        self._writer = writer
        self._lines: list[str] = []
        writer.before_flush.append(self.hand_over)

    def add(self, line: dict) -> None:
        self._lines.append(_LINE(line))

    def hand_over(self) -> None:
        files = self._writer.files
        if not self._lines or files is None:
            return
        data = ("\n".join(self._lines) + "\n").encode()
        self._lines = []
        device = getattr(self._writer, "device", None)  # (attached after the writer was made: asked here)
        if device is not None:
            device.submit(lambda settled: files.add(PARAMS, data))
        else:
            files.add(PARAMS, data)


def read_param_names(trace) -> ParamNames | None:
    """The parameter names of one trace (a Trace, not a run view), or None when it holds none (recorded before
    divtrace named parameters). Read as untrusted, as layouts.jsonl: the bytes against the trace's checksums, cut
    back to what they vouch for; a line that is not a name line is a damaged trace (DivtraceError naming it)."""
    from divtrace.errors import DivtraceError
    from divtrace.trace.token_checks import json_lines, side_file_bytes

    if PARAMS not in (trace.meta.get("file_checksums") or {}):
        return None
    got = getattr(trace, "_param_names", None)  # (an open trace's file is read and checked once: bisect compares
    if got is not None:  # the names, then names an origin's input from them)
        return got
    data = side_file_bytes(trace, PARAMS)
    out = ParamNames()
    where = trace.path / PARAMS
    for n, d in json_lines(data, where):
        what = _read_line(d, trace, out)
        if what is not None:
            raise DivtraceError(f"damaged trace: {where}:{n}: {what}")
    for name, ch in out.chunks.items():
        vals = out.values.get(name)
        if vals is not None and len(vals) == 1 and _chunks_fit(ch, vals[0].key):
            vals[0].chunks = ch
    try:
        trace._param_names = out
    except AttributeError:
        pass
    return out


def _read_line(d, trace, out: ParamNames) -> str | None:
    if not isinstance(d, dict) or not isinstance(d.get("name"), str) or not d["name"] or d.get("kind") not in KINDS:
        return "not a parameter name line (a JSON object with a name and a kind)"
    name = d["name"]
    if "ch" in d:
        ch = d["ch"]
        if not (isinstance(ch, list) and all(
                isinstance(c, list) and len(c) == 2 and type(c[0]) is int and isinstance(c[1], list)
                and all(isinstance(x, list) and len(x) == 3 and type(x[0]) is int and type(x[1]) is int
                        and isinstance(x[2], str) and len(x[2]) == 32 for x in c[1]) for c in ch)):
            return f"the chunk fingerprints of {name} are malformed"
        out.chunks[name] = [(c[0], [tuple(x) for x in c[1]]) for c in ch]
        if "v" not in d and "h" not in d:  # (a line of chunks only: a parameter an op read, hash mode)
            return None
    if "v" in d:
        if type(d["v"]) is not int:
            return f"the value id of {name} is malformed"
        key = trace.vkey.get(d["v"])
        if key is None:
            return None  # (a value whose record was never written: ignored)
        nv = NamedValue(d["v"], key)
    else:
        shape, h, dtype = d.get("shape"), d.get("h"), d.get("dtype")
        if not (isinstance(dtype, str) and isinstance(shape, list) and all(type(x) is int and x >= 0 for x in shape)
                and isinstance(h, str) and len(h) == 32):
            return f"the fingerprint line of {name} has a malformed dtype, shape or fingerprint"
        lay = d.get("lay")
        if lay is not None:
            from divtrace.trace.layouts import Layout, _valid_layout

            if not (isinstance(lay, dict) and _valid_layout({**lay, "v": -1, "M": -1})
                    and (lay.get("h") is None or isinstance(lay["h"], str))):
                return f"the layout of {name} is malformed"
            lay = Layout(-1, -1, lay["p"], lay["g"], lay["o"], "param", lay.get("h"))
        nv = NamedValue(None, (dtype, tuple(shape), h), lay)
    out.values.setdefault(name, []).append(nv)
    out.kinds.setdefault(name, d["kind"])
    return None


def _chunks_fit(chunks, key) -> bool:
    """Whether each dim's chunks tile the value of `key` along that dim and sum to its fingerprint."""
    shape = key[1]
    for dim, ch in chunks:
        if not 0 <= dim < len(shape) or [(s, n) for s, n, _ in ch] != _spans(ch, shape[dim]):
            return False
        if combine_hex([h for _, _, h in ch]) != key[2]:
            return False
    return True


def _spans(ch, n: int) -> list:
    out, at = [], 0
    for s, k, _ in ch:
        out.append((at, k))
        at += k
    return out if at == n else []
