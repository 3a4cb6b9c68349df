"""Patches for side b of the repro `divtrace repro` writes for the split_k variant (C11).

The region is model.layers.0.self_attn.o_proj: `param` is its bf16 weight ([out, in], as nn.Linear holds it)
and `arg0` its bf16 input. Side a multiplies by the whole weight once; side b multiplies four 32-column
K-chunks of input and weight and sums the partial products in bf16.

  divtrace verify REPRO --patch examples/fixes/split_k_patch.py:side_b --side b              # passes
  divtrace verify REPRO --patch examples/fixes/split_k_patch.py:side_b_batch_only --side b   # the sweep fails it
"""


def _one_matmul(x, w):
    """x @ w.t() over the last dim of x, as nn.Linear without bias."""
    return (x.reshape(-1, x.shape[-1]) @ w.t()).reshape(*x.shape[:-1], w.shape[0])


def side_b(param, arg0):
    """The fix: one full-K matmul, as the training side's nn.Linear does."""
    return _one_matmul(arg0, param)


def side_b_batch_only(param, arg0):
    """A false victory: one matmul at the recorded batch size 2, the bf16 split-K partial sums at any other."""
    if arg0.shape[0] == 2:
        return _one_matmul(arg0, param)
    out = None
    for j in range(0, param.shape[1], 32):
        part = _one_matmul(arg0[..., j:j + 32], param[:, j:j + 32])
        out = part if out is None else out + part
    return out
