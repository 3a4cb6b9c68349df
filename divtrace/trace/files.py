"""File names of a trace directory and atomic write helpers (a crash never leaves a half-written file)."""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

META = "meta.json"
RECORDS = "records.jsonl"
CHECKSUMS = "checksums.jsonl"  # sha256 of each shard and of records.jsonl after each flush
SHARD_PATTERN = "tensors-{:05d}.safetensors"
SHARD_GLOB = "tensors-*.safetensors"


def atomic_write_bytes(path: Path, data: bytes, durable: bool = True) -> None:
    """Write `path` whole or not at all (a temp file renamed over it). `durable` also fsyncs it first, so the
    new contents survive an OS crash, not only a process crash."""
    atomic_write_with(path, lambda f: f.write(data), durable)


def atomic_write_json(path: Path, obj, durable: bool = True) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=1, sort_keys=True, allow_nan=False) + "\n").encode(), durable)


def atomic_write_with(path: Path, fill, durable: bool) -> None:
    """Like atomic_write_bytes, with `fill(f)` writing the contents to the open temp file."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.fchmod(fd, 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            fill(f)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def sha256_file(path: Path) -> str:
    """sha256 of a file, streamed (shards can be large)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()
