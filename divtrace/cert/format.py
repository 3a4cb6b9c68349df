"""The ledger on disk (docs/cert.md): names, record kinds, and the encoding of one record's token payload.

A ledger is a folder:

    LEDGER/
      ledger.json                      {"format": "divtrace-ledger", "format_version": 1}
      seg-<label>-r<rank>-<host>-<pid>.jsonl   one per writing process or rank: JSON lines, append-only
      seg-<label>-r<rank>-<host>-<pid>.bin     the token payloads those lines point at (ids, logprob bits)
      END                              the end marker: written once, when the run is over
      replay/step-NNNNNN/              what is needed to replay a step (the first parting one), when saved

The payload of a logprob record is the token ids (int32, little-endian) of every sequence in order, then the
logprobs' raw bytes in their dtype (little-endian), one per id; `crc` is the zlib CRC-32 of those bytes.
"""
from __future__ import annotations

import hashlib
import socket
import zlib

import numpy as np

FORMAT = "divtrace-ledger"
FORMAT_VERSION = 1
META_FILE = "ledger.json"
END_FILE = "END"
SEGMENT_PREFIX = "seg-"
REPLAY_DIR = "replay"
SIDES = ("rollout", "trainer")
KINDS = ("logprobs", "processed")  # processed: after the engine's sampling settings (temperature, top-p, top-k)
TOKEN_KEY = "blake2b64-int64"  # how a prompt's ids are folded into its key (prompt_key below)

# dtypes a logprob may have on disk, by name (numpy has no bfloat16: those are moved as raw 16-bit words)
DTYPE_SIZES = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2}


def prompt_key(ids) -> str:
    """16 hex digits identifying a prompt by content: blake2b-64 of its token ids as little-endian int64."""
    a = np.asarray(ids, dtype="<i8")
    return hashlib.blake2b(a.tobytes(), digest_size=8).hexdigest()


def host_name() -> str:
    """This machine's name as segments carry it (letters, digits, '-' and '.', at most 40)."""
    return "".join(c for c in socket.gethostname() if c.isalnum() or c in "-.")[:40] or "host"


def crc(data: bytes) -> int:
    return zlib.crc32(data) & 0xFFFFFFFF


def weights_digest(params: dict) -> str:
    """One fingerprint of a whole weights listing (names, dtypes, shapes, hashes), order-independent."""
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(params):
        d, shape, hx = params[name]
        h.update(f"{name}\0{d}\0{list(shape)}\0{hx}\n".encode())
    return h.hexdigest()


def decode_payload(data: bytes, n_tokens: int, dtype: str) -> tuple[np.ndarray, list[bytes]]:
    """(ids as int32 array, one raw little-endian bytes object per logprob) from a payload."""
    size = DTYPE_SIZES[dtype]
    ids = np.frombuffer(data, dtype="<i4", count=n_tokens)
    raw = data[4 * n_tokens:]
    return ids, [raw[i * size:(i + 1) * size] for i in range(n_tokens)]


def bits_to_float(b: bytes, dtype: str) -> float:
    """The value of one logprob's raw bytes (bfloat16 widened exactly through float32)."""
    if dtype == "bfloat16":
        return float(np.frombuffer(b"\0\0" + b, dtype="<f4")[0])
    return float(np.frombuffer(b, dtype={"float32": "<f4", "float64": "<f8", "float16": "<f2"}[dtype])[0])


def bits_hex(b: bytes) -> str:
    """The raw bits of a little-endian value, as the usual big-endian hex ("0x3e5f")."""
    return "0x" + b[::-1].hex()
