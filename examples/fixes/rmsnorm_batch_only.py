"""A false victory, for trying `verify` on: the rmsnorm_cast fix applied only when the batch is the recorded 2.

It agrees end to end at the example's batch size and diverges at any other (`--arg-b batch=3`).
"""
import types

import torch

from _pair import llama_pair
from rmsnorm_fixed import training_order_forward


def _batch_only_forward(self, x: torch.Tensor) -> torch.Tensor:
    if x.shape[0] == 2:
        return training_order_forward(self, x)
    return type(self).forward(self, x)  # the unfixed cast order


def inference(dtype: str = "bf16", variant: str = "rmsnorm_cast", seed: int = 0, **cfg):
    lp = llama_pair()
    model, inputs = lp.inference(dtype=dtype, variant=variant, seed=seed, **cfg)
    for m in model.modules():
        if isinstance(m, lp.RMSNorm):
            m.forward = types.MethodType(_batch_only_forward, m)
    return model, inputs
