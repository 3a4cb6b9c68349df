"""Patches for side b of the repro `divtrace repro` writes for the rmsnorm_cast variant (C1).

The region is the end of model.layers.0.input_layernorm: `mul_out` is the fp32 x_hat, `param` the bf16 weight.
Side a (training, HF order) rounds x_hat to bf16 and multiplies in bf16; side b multiplies in fp32 and rounds once.

  divtrace verify REPRO --patch examples/fixes/rmsnorm_cast_patch.py:side_b --side b              # passes
  divtrace verify REPRO --patch examples/fixes/rmsnorm_cast_patch.py:side_b_batch_only --side b   # the sweep fails it
"""


def side_b(mul_out, param):
    """The fix: the training cast order, `w * x_hat.to(bf16)`."""
    return param * mul_out.to(param.dtype)


def side_b_batch_only(mul_out, param):
    """A false victory: the training order at the recorded batch size 2 only, the old order at any other."""
    if mul_out.shape[0] == 2:
        return param * mul_out.to(param.dtype)
    return (param.float() * mul_out).to(param.dtype)
