"""Patches for side b of the repro `divtrace repro` writes for the split_k variant (C11).

The region is model.layers.0.self_attn.o_proj: `arg0` is its bf16 input, `param` the full transposed weight (what
side a's one mm uses) and `param_2`..`param_5` the four 32-column K-chunks side b multiplies and sums in bf16.

  divtrace verify REPRO --patch examples/fixes/split_k_patch.py:side_b --side b              # passes
  divtrace verify REPRO --patch examples/fixes/split_k_patch.py:side_b_batch_only --side b   # the sweep fails it
"""


def _one_matmul(arg0, param):
    return (arg0.reshape(-1, arg0.shape[-1]) @ param).reshape(*arg0.shape[:-1], param.shape[-1])


def side_b(arg0, param, param_2, param_3, param_4, param_5):
    """The fix: one full-K matmul, as the training side's nn.Linear does."""
    return _one_matmul(arg0, param)


def side_b_batch_only(arg0, param, param_2, param_3, param_4, param_5):
    """A false victory: one matmul at the recorded batch size 2, the bf16 split-K partial sums at any other."""
    if arg0.shape[0] == 2:
        return _one_matmul(arg0, param)
    out = None
    for w in (param_2, param_3, param_4, param_5):
        k = w.shape[0]
        j = 0 if out is None else j + k
        part = _one_matmul(arg0[..., j:j + k], w)
        out = part if out is None else out + part
    return out
