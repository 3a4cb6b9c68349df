"""Strided views whose fingerprint is derived from their input's, and how a reader rebuilds their bytes.

A view op (`w.t()`, a transpose, an expand, a slice) of a recorded value produces values that are a function of
the input's logical values and the op's constant arguments. Hashing such a view means gathering its bytes one
stride at a time (the transposed weights alone were a quarter of a hash recording), and storing it in full mode
means a contiguous copy and its bytes again (188 MB of a 592 MB trace of the bench model). So the recorder gives
it a fingerprint derived from the op, its constant arguments and the input's fingerprint (`view_fingerprint`),
marks it `derived`, and full mode stores no bytes for it: a reader applies the same aten op to the input's
stored bytes (`rebuild_view`) and checks the result against the derived fingerprint.

Equal derived fingerprints imply equal bytes (the same op on the same bytes), so no false "identical" can come
of it; the bytes of a view made another way on the other side compare unequal by fingerprint, which the
comparison resolves from the bytes where a trace holds them. Not `as_strided`: it reads the storage, so two
inputs with equal values in different layouts give different results.
"""
from __future__ import annotations

import hashlib
import re

from divtrace.trace.files import compact_encoder

DERIVABLE_VIEWS = frozenset(f"aten.{n}" for n in (
    "t.default", "transpose.int", "permute.default", "expand.default", "slice.Tensor", "select.int",
    "diagonal.default", "unfold.default", "unsqueeze.default", "squeeze.dim", "view.default", "numpy_T.default",
    "mT.default", "alias.default"))
# Views that only reorder elements keep their input's statistics.
REORDERING = frozenset(("t", "transpose", "permute", "numpy_T", "mT"))

# The key, as json.dumps(..., default=str, separators=(",", ":")) writes it (built once: json.dumps builds an
# encoder per call). Changing the key changes every derived fingerprint, as a new hash scheme would.
_KEY_JSON = compact_encoder(default=str, allow_nan=True)
_VID_JSON = re.compile(r'\{"\$v":\d+\}')


VIEW_KEY = "op-src-shape-2"  # in meta.json: traces whose derived fingerprints are comparable


def view_fingerprint(op: str, src_hash: str, src_dtype: str, src_shape: list, shape: list, enc_args: list,
                     enc_kwargs: dict) -> str:
    """The derived fingerprint of `op` (e.g. "aten.t.default") applied with the encoded arguments (tensors as
    {"$v": vid}; vids are per trace, so they are masked) to a value of fingerprint `src_hash`, dtype `src_dtype`
    ("torch.float32") and shape `src_shape`, giving `shape`. The source's shape is part of the key: its hash
    covers the bytes only, and the same bytes as [3, 1] and [1, 3] expand to different values."""
    memo = None
    if type(enc_kwargs) is dict and not enc_kwargs and type(enc_args) is list:  # (the recorder's views: a few plain arguments, no kwargs)
        ck = _consts_key(enc_args)
        if ck is not None:
            memo = (op, src_hash, src_dtype, tuple(src_shape), tuple(shape), ck)
            h = _MEMO.get(memo)
            if h is not None:
                return h
    consts = _VID_JSON.sub("T", _KEY_JSON([enc_args, enc_kwargs]))
    key = _KEY_JSON([VIEW_KEY, op, src_hash, src_dtype, list(src_shape), list(shape), consts])
    h = hashlib.blake2b(key.encode(), digest_size=16).hexdigest()
    if memo is not None:
        if len(_MEMO) >= 8192:
            _MEMO.clear()
        _MEMO[memo] = h
    return h


# view_fingerprint's answers (a function of its arguments alone): every forward, and every recording, takes the
# same views of the same weights (`w.t()`, HF's `to_local` views), whose source fingerprints are met again.
_MEMO: dict[tuple, str] = {}
_TENSOR, _TRUE, _FALSE = object(), object(), object()  # (True == 1 and 1.0 == 1 as keys: bools are marked)


def _consts_key(args: list):
    """A key standing for the encoded arguments exactly as the fingerprint's key reads them (tensors as one mark,
    their vids masked), or None where they are not all ints, bools, None, tensors or int lists."""
    out = []
    for a in args:
        ta = type(a)
        if ta is int or a is None:
            out.append(a)
        elif ta is bool:
            out.append(_TRUE if a else _FALSE)
        elif ta is dict and len(a) == 1 and "$v" in a:
            out.append(_TENSOR)
        elif ta is list and all(type(y) is int for y in a):
            out.append(("list", *a))
        else:
            return None
    return tuple(out)


def rebuildable(enc_args: list, enc_kwargs: dict) -> bool:
    """Whether a reader can turn these encoded arguments back into the call (ints, bools, None, int lists and
    tuples, and exactly one tensor), so full mode may store the view as "rebuild from the op"."""
    tensors = 0

    def plain(x) -> bool:
        nonlocal tensors
        if x is None or type(x) in (int, bool):
            return True
        if type(x) is list:
            return all(plain(y) for y in x)
        if type(x) is dict:
            if set(x) == {"$v"}:
                tensors += 1
                return True
            return set(x) == {"$tuple"} and type(x["$tuple"]) is list and all(plain(y) for y in x["$tuple"])
        return False

    return (type(enc_args) is list and type(enc_kwargs) is dict and all(plain(a) for a in enc_args)
            and all(plain(v) for v in enc_kwargs.values()) and tensors == 1)


def rebuild_view(op: str, enc_args: list, enc_kwargs: dict, src):
    """Apply the recorded view op to `src` (the input's tensor): the view as the recording saw it. Raises
    ValueError when the op or its arguments are not ones the recorder derives."""
    import torch

    if op not in DERIVABLE_VIEWS or not rebuildable(enc_args, enc_kwargs):
        raise ValueError(f"op {op} with these arguments is not a view divtrace rebuilds")

    def decode(x):
        if type(x) is list:
            return [decode(y) for y in x]
        if type(x) is dict:
            return src if "$v" in x else tuple(decode(y) for y in x["$tuple"])
        return x

    _, name, overload = op.split(".")
    return getattr(getattr(torch.ops.aten, name), overload)(*[decode(a) for a in enc_args],
                                                            **{k: decode(v) for k, v in enc_kwargs.items()})
