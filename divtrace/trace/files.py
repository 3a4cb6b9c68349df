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


def atomic_write_bytes(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.fchmod(fd, 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def atomic_write_json(path: Path, obj) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=1, sort_keys=True, allow_nan=False) + "\n").encode())


def sha256_file(path: Path) -> str:
    """sha256 of a file, streamed (shards can be large)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()
