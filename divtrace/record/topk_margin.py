"""The top-k margin: for every row a top-k runs over, the gap between its last chosen and first unchosen score.

An MoE router picks each token's experts with a top-k over its scores; where the k-th and the (k+1)-th score are
equal (a bf16 softmax makes such ties) or close, a tiny difference upstream flips the choice. The recorder keeps
the gap as a value of its own, made right after each `aten.topk` (a record `divtrace.topk_margin.default` whose
input is the top-k's input), so it is fingerprinted (hash mode), stored (full mode) and given token rows like any
value, and `divtrace.compare.routing` can say whether a flipped expert choice was a tie. Device ops only (a second
top-k over k + 1 and a subtraction): no host read. The gap is taken in a wider dtype than the scores' (float32 for
16-bit scores, float64 for float32 ones), where the subtraction of two scores is exact: 0 means a tie in the dtype
the top-k saw.

In: an aten.topk call's arguments. Out: the margin tensor (one element per row of the top-k), or None.
"""
from __future__ import annotations

OP = "divtrace.topk_margin.default"


def topk_args(args, kwargs) -> tuple:
    """(scores, k, dim, largest) of an aten.topk.default call."""
    names = ("self", "k", "dim", "largest", "sorted")
    got = dict(zip(names, args))
    got.update(kwargs)
    return got.get("self"), got.get("k"), got.get("dim", -1), got.get("largest", True)


def topk_margin(x, k, dim=-1, largest=True):
    """Per row of `x` along `dim`: last chosen score minus first unchosen (for largest=False the other way round),
    in a dtype where that subtraction is exact; None where there is no unchosen score or no float scores."""
    import torch  # (this module's OP is read by bisect, which never imports torch for hash traces)

    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() == 0 or type(k) is not int:
        return None
    n = x.shape[dim]
    if k < 1 or k >= n:
        return None
    if x.dtype == torch.float64 or (x.dtype == torch.float32 and x.device.type != "mps"):
        wide = torch.float64
    else:
        wide = torch.float32
    v = torch.topk(x, k + 1, dim, largest, True).values
    last, first_out = v.select(dim, k - 1).to(wide), v.select(dim, k).to(wide)
    return last - first_out if largest else first_out - last
