"""Fingerprint scheme v2: bit-exact fingerprints that shard.

Two schemes, named in meta.json and defined in docs/trace-format.md ("Fingerprint schemes"):
- TENSOR_SCHEME ("lane-gsum128-v2"), the 128-bit fingerprint of a whole value (`hashing.tensor`);
- ROW_SCHEME ("row-gsum64-v2"), the 64-bit fingerprint of each token row (`hashing.rows`).

Both are sums over 32-bit lanes numbered by their position in the GLOBAL value, with odd weights that depend only
on that position. So a shard of a value (a box of its global shape at some offsets, as DTensor's Shard(d) and
torch.chunk make) gives a partial fingerprint from its own bytes and its place alone, and the partials of all
shards sum (mod 2**64, per 64-bit half) to the fingerprint of the whole value, with no tensor bytes moved.

Modules: `spec` the plain-Python definition (slow; the tests' reference); `tensor` and `rows` the API, computing
the same numbers with the C kernel (divtrace._native) on CPU tensors and with torch ops elsewhere (any device, no
host sync: they return int64 tensors on the tensor's device, turned into hex or rows.bin bytes later, in
batches); `boxes` where a shard's bytes sit in the global value; `lanes` and `weights` the torch side; `base` what
this and the old scheme (divtrace.trace.fingerprint) share.

This package does not import torch until one of its modules is imported.
"""
TENSOR_SCHEME = "lane-gsum128-v2"
ROW_SCHEME = "row-gsum64-v2"
