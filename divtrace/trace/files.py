"""File names of a trace directory and atomic write helpers (a crash never leaves a half-written file)."""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

META = "meta.json"
RECORDS = "records.jsonl"
CHECKSUMS = "checksums.jsonl"  # sha256 of records.jsonl after each flush (older traces: of each shard too)
SHARD_PATTERN = "tensors-{:05d}.safetensors"
SHARD_GLOB = "tensors-*.safetensors"


def atomic_write_bytes(path: Path, data: bytes, durable: bool = True) -> None:
    """Write `path` whole or not at all (a temp file renamed over it). `durable` also fsyncs it first and its
    directory after, so the new contents survive an OS crash, not only a process crash."""
    atomic_write_with(path, lambda f: f.write(data), durable)


def compact_encoder(default=None, allow_nan: bool = False, sort_keys: bool = False):
    """`json.JSONEncoder(separators=(",", ":"), ...).encode`, minus its per-call cost: encode() builds a new C
    encoder on every call, 2 us of the 6 that a record's line took. This builds it once. Same output."""
    slow = json.JSONEncoder(default=default, allow_nan=allow_nan, sort_keys=sort_keys, separators=(",", ":")).encode
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:  # a Python without the C accelerator
        return slow

    def no_default(o):
        raise TypeError(f"Object of type {type(o).__name__} is not JSON serializable")

    try:
        it = make(None, default or no_default, json.encoder.encode_basestring_ascii, None, ":", ",", sort_keys,
                  False, allow_nan)

        def fast(obj):
            return "".join(it(obj, 0))

        probe = {"b": [1, 2.5, -0.0, "x\u00e9", None, True], "a": {"k": 1e300}}
        if fast(probe) == slow(probe):
            return fast
    except Exception:  # another Python's private signature: keep the public path
        pass
    return slow


_JSON = compact_encoder(sort_keys=True)


def readable_json(obj) -> str:
    """A dict as one top-level key per line with compact values: readable in a terminal, and written by the C
    encoder (json's `indent=` takes the pure-Python one, 8x slower on a meta.json with a module tree, twice per
    recording)."""
    if not isinstance(obj, dict) or not obj:
        return _JSON(obj)
    return "{\n" + ",\n".join(f" {_JSON(str(k))}: {_JSON(v)}" for k, v in sorted(obj.items())) + "\n}"


def atomic_write_json(path: Path, obj, durable: bool = True) -> None:
    atomic_write_bytes(path, (readable_json(obj) + "\n").encode(), durable)


def temp_beside(path: Path) -> tuple[int, str]:
    """(fd, name) of a new temp file in `path`'s directory, to be renamed over `path` when whole. Hidden and
    ending in ".tmp", so `prepare_trace_dir` clears what a killed run left."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o644)
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    return fd, tmp


def atomic_write_with(path: Path, fill, durable: bool) -> None:
    """Like atomic_write_bytes, with `fill(f)` writing the contents to the open temp file."""
    fd, tmp = temp_beside(path)
    try:
        with os.fdopen(fd, "wb") as f:
            fill(f)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
        if durable:
            fsync_dir(path.parent)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def fsync_dir(path: Path) -> None:
    """Make the names in directory `path` (a rename, a new file) durable; a no-op where directories cannot be
    opened (Windows)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def sha256_file(path: Path) -> str:
    """sha256 of a file, streamed (shards can be large)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()
