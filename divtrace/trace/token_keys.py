"""Token keys: a token's identity is a 64-bit fold of the ids of its sequence at positions 0..p (`next_key`), never
a batch slot, request id, micro-batch, padding side or decode step. The recorder folds them as it sees tokens
(divtrace.record.token_identity); the reader re-folds every stored key from the stored ids to check the token files
(`check_keys`), so an id, position, sequence or key changed on disk cannot pass as another token."""
from __future__ import annotations

MASK64 = (1 << 64) - 1
ROOT_KEY = 0x243F6A8885A308D3  # the key of the empty prefix
_GOLD, _M1, _M2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def next_key(prev: int, token_id: int) -> int:
    """The key of a prefix extended by one token id (splitmix64 of the previous key and the id); never 0, which
    marks a row that is not a token (padding)."""
    x = (prev * _GOLD + token_id + 1) & MASK64
    x = ((x ^ (x >> 30)) * _M1) & MASK64
    x = ((x ^ (x >> 27)) * _M2) & MASK64
    x ^= x >> 31
    return x or 1


def next_keys(prev, ids):
    """`next_key` over numpy arrays: `prev` uint64, `ids` int64 (wrapped mod 2**64 as Python's ints are)."""
    import numpy as np

    with np.errstate(over="ignore"):
        x = prev * np.uint64(_GOLD) + ids.astype(np.uint64) + np.uint64(1)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(_M1)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(_M2)
        x ^= x >> np.uint64(31)
    x[x == 0] = 1
    return x
