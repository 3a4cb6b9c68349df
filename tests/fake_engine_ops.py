"""An engine's kernels for the engine-cut repro tests, registered as custom ops (as vLLM registers its own).

`rotary_` rotates query and key in place and returns nothing, as vLLM's `_C.rotary_embedding` does, with one
rounding (fp64 inside) where HF's rotate-half arithmetic rounds three times: a real difference in the last bits.
`attention` stands for an engine's attention kernel; a trace can declare it unreplayable outside the engine
(meta.json `engine.unreplayable_ops`, as vLLM's adapter does for `vllm.unified_attention_with_output`).
`engine_side(model)` plugs both into an HF Llama for the duration of a `with` block.
"""
from __future__ import annotations

import contextlib

import torch


@torch.library.custom_op("divtrace_fake_engine::rotary_", mutates_args=("query", "key"))
def rotary_(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    c, s = cos.double().unsqueeze(1), sin.double().unsqueeze(1)
    for x in (query, key):
        x64 = x.double()
        half = x.shape[-1] // 2
        rot = torch.cat((-x64[..., half:], x64[..., :half]), dim=-1)
        x.copy_((x64 * c + rot * s).to(x.dtype))


@torch.library.custom_op("divtrace_fake_engine::attention", mutates_args=())
def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scale)


@torch.library.custom_op("divtrace_fake_engine::attention_fp64", mutates_args=())
def attention_fp64(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
    out = torch.nn.functional.scaled_dot_product_attention(query.double(), key.double(), value.double(),
                                                           is_causal=True, scale=scale)
    return out.to(query.dtype)  # one rounding at the end: another attention kernel


UNREPLAYABLE = {"divtrace_fake_engine.attention.default": "reads the engine's KV cache (a test stand-in)",
                "divtrace_fake_engine.attention_fp64.default": "reads the engine's KV cache (a test stand-in)"}


def _attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = _ATTENTION[0](query, key, value, scale)
    return out.transpose(1, 2).contiguous(), None


_ATTENTION = [torch.ops.divtrace_fake_engine.attention]


def _apply_rotary(q, k, cos, sin, *args, **kwargs):
    torch.ops.divtrace_fake_engine.rotary_(q, k, cos, sin)
    return q, k


@contextlib.contextmanager
def engine_side(model, rope: bool = True, attention: str = "attention"):
    """The model runs this engine's attention kernel (`attention`: "attention", or "attention_fp64", which rounds
    otherwise) and, with `rope`, its RoPE kernel, inside the block (unpadded sequences only)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
    from transformers.models.llama import modeling_llama

    AttentionInterface.register("divtrace_fake_engine", _attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register("divtrace_fake_engine", sdpa_mask)
    configs = {id(m.config): m.config for m in model.modules() if hasattr(m, "config")}
    before = {k: c._attn_implementation for k, c in configs.items()}
    hf_rope = modeling_llama.apply_rotary_pos_emb
    for c in configs.values():
        c._attn_implementation = "divtrace_fake_engine"
    _ATTENTION[0] = getattr(torch.ops.divtrace_fake_engine, attention)
    if rope:
        modeling_llama.apply_rotary_pos_emb = _apply_rotary
    try:
        yield model
    finally:
        modeling_llama.apply_rotary_pos_emb = hf_rope
        for k, c in configs.items():
            c._attn_implementation = before[k]
