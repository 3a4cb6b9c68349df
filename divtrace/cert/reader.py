"""Reading a ledger folder, also while it is written (docs/cert.md).

A segment's last line without its newline is a write in progress: in a ledger without an END marker it is cut
back; in a finished ledger it is damage. Any other line that does not parse, or whose payload is missing or fails
its CRC, is damage: a DivtraceError naming the file and line (exit 2).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from divtrace.cert import format as fmt
from divtrace.errors import DivtraceError


@dataclass
class Sequence:
    """One sequence's logprobs on one side of a step, as written."""
    label: object
    prompt_key: str
    prompt_len: int
    ids: tuple
    values: list  # raw little-endian bytes of each logprob
    dtype: str
    version: object
    temperature: float
    where: str  # "segment.jsonl line N"

    @property
    def content(self) -> tuple:
        return (self.prompt_key, self.prompt_len, self.ids)


@dataclass
class Weights:
    params: dict
    version: object
    scheme: str
    where: str


@dataclass
class Segment:
    name: str
    rank: int | None = None
    host: str | None = None
    pid: int | None = None
    closed: bool = False
    status: str | None = None
    error: str | None = None
    torn: bool = False  # a partial last line was cut back


@dataclass
class LedgerData:
    path: Path
    end: dict | None  # the END marker, None while the run is in progress
    segments: list = field(default_factory=list)
    seqs: dict = field(default_factory=dict)  # (step, side, kind) -> [Sequence]
    weights: dict = field(default_factory=dict)  # (step, side) -> [Weights]
    replays: dict = field(default_factory=dict)  # step -> {"dir", "command"}
    schemes: set = field(default_factory=set)

    @property
    def steps(self) -> list[int]:
        return sorted({k[0] for k in self.seqs} | {k[0] for k in self.weights})


def read_ledger(path) -> LedgerData:
    path = Path(path)
    if not path.is_dir():
        raise DivtraceError(f"{path}: not a ledger folder (no such directory)")
    meta_path = path / fmt.META_FILE
    try:
        meta = json.loads(meta_path.read_text())
    except FileNotFoundError:
        raise DivtraceError(f"{path}: not a ledger (no {fmt.META_FILE}); write one with divtrace.cert.ledger(...)") from None
    except (OSError, ValueError) as e:
        raise DivtraceError(f"{meta_path}: cannot be read as JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != fmt.FORMAT:
        raise DivtraceError(f"{meta_path}: not a divtrace ledger (format {meta.get('format') if isinstance(meta, dict) else None!r})")
    if int(meta.get("format_version", 0)) > fmt.FORMAT_VERSION:
        raise DivtraceError(f"{meta_path}: written by a newer divtrace (ledger format_version "
                            f"{meta.get('format_version')}); upgrade divtrace")
    end = None
    end_path = path / fmt.END_FILE
    if end_path.exists():
        try:
            end = json.loads(end_path.read_text())
            if not isinstance(end, dict):
                raise ValueError("not an object")
        except (OSError, ValueError) as e:
            raise DivtraceError(f"{end_path}: the end marker is damaged ({e})") from None
    data = LedgerData(path, end)
    for seg_path in sorted(path.glob(f"{fmt.SEGMENT_PREFIX}*.jsonl")):
        _read_segment(data, seg_path, finished=end is not None)
    return data


def _read_segment(data: LedgerData, seg_path: Path, finished: bool) -> None:
    seg = Segment(seg_path.stem)
    data.segments.append(seg)
    raw = seg_path.read_bytes()
    lines = raw.split(b"\n")
    tail = lines.pop()  # after the last newline: empty, or a line being written
    if tail:
        if finished:
            raise DivtraceError(f"{seg_path} line {len(lines) + 1}: cut off (no newline) in a finished ledger: "
                                "the segment is damaged")
        seg.torn = True
    bin_path = seg_path.with_suffix(".bin")
    blob = None
    for n, line in enumerate(lines, 1):
        where = f"{seg_path} line {n}"
        try:
            obj = json.loads(line)
            kind = obj["k"]
        except (ValueError, KeyError, TypeError):
            raise DivtraceError(f"{where}: not a ledger record (unparseable JSON): the segment is damaged") from None
        try:
            if kind == "head":
                seg.rank, seg.host, seg.pid = obj.get("rank"), obj.get("host"), obj.get("pid")
                data.schemes.add(obj.get("weight_hash_scheme"))
            elif kind == "lp":
                if blob is None:
                    try:
                        blob = bin_path.read_bytes()
                    except OSError as e:
                        raise DivtraceError(f"{bin_path}: cannot be read ({e}); {where} points into it") from None
                _add_logprobs(data, obj, blob, f"{seg_path.name} line {n}", where)
            elif kind == "w":
                data.weights.setdefault((int(obj["step"]), obj["side"]), []).append(
                    Weights(obj["params"], obj.get("version"), obj.get("scheme"), f"{seg_path.name} line {n}"))
            elif kind == "replay":
                data.replays.setdefault(int(obj["step"]), {"dir": obj["dir"], "command": obj.get("command")})
            elif kind == "end":
                seg.closed, seg.status, seg.error = True, obj.get("status"), obj.get("error")
        except DivtraceError:
            raise
        except (KeyError, TypeError, ValueError) as e:
            raise DivtraceError(f"{where}: a {kind!r} record lacks or garbles {e}: the segment is damaged") from None


def _add_logprobs(data: LedgerData, obj: dict, blob: bytes, short: str, where: str) -> None:
    off, length, dtype = int(obj["off"]), int(obj["len"]), obj["dtype"]
    if dtype not in fmt.DTYPE_SIZES:
        raise DivtraceError(f"{where}: dtype {dtype!r} is not a ledger logprob dtype")
    payload = blob[off:off + length]
    if len(payload) != length:
        raise DivtraceError(f"{where}: its payload (bytes {off}..{off + length}) is missing from the .bin "
                            f"({len(blob)} bytes): the segment is damaged")
    if fmt.crc(payload) != int(obj["crc"]):
        raise DivtraceError(f"{where}: its payload fails its CRC: the segment is damaged")
    seqs = obj["seqs"]
    n_tokens = sum(int(s[3]) for s in seqs)
    if length != n_tokens * (4 + fmt.DTYPE_SIZES[dtype]):
        raise DivtraceError(f"{where}: payload of {length} bytes for {n_tokens} tokens of {dtype}: damaged")
    ids, values = fmt.decode_payload(payload, n_tokens, dtype)
    key = (int(obj["step"]), obj["side"], obj["kind"])
    out = data.seqs.setdefault(key, [])
    i = 0
    for label, pkey, plen, n in seqs:
        n = int(n)
        out.append(Sequence(label, pkey, int(plen), tuple(int(x) for x in ids[i:i + n]), values[i:i + n], dtype,
                            obj.get("version"), float(obj.get("temperature", 1.0)), short))
        i += n
