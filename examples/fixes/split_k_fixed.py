"""The split_k (C11) inference side with the fix in place: every SplitKLinear (o_proj as a sum of bf16 K-chunk
partials) computes one full-K matmul, as nn.Linear on the training side does. Instances are patched, not the class.

  divtrace verify --runs examples/llama_pair.py:training examples/fixes/split_k_fixed.py:inference
"""
import types

import torch
import torch.nn.functional as F

from _pair import llama_pair


def one_matmul_forward(self, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, self.weight)


def inference(dtype: str = "bf16", variant: str = "split_k", seed: int = 0, **cfg):
    lp = llama_pair()
    model, inputs = lp.inference(dtype=dtype, variant=variant, seed=seed, **cfg)
    fixed = 0
    for m in model.modules():
        if isinstance(m, lp.SplitKLinear):
            m.forward = types.MethodType(one_matmul_forward, m)
            fixed += 1
    if not fixed:
        raise ValueError("no SplitKLinear module found to fix")
    return model, inputs
