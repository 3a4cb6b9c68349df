"""A small Llama-style causal LM with a "training" and an "inference" implementation that differ on purpose.

The training side always behaves like HF eager Llama (bf16 weights and activations, fp32 only where HF uses it).
The inference side is the same model with exactly one documented numeric difference switched on (or all of
them, for the demo). The ids (C1...) refer to the catalogue of known causes that ships with divtrace:
divtrace/skill/divtrace/references/causes.md (`cat "$(divtrace skill path)/references/causes.md"`). The "origin" is
the module whose inputs still agree bitwise but whose output doesn't; "own code" means the module's own ops, not
a child's.

  none                     control: inference runs the training code, so the results are bitwise identical.
  rmsnorm_cast (C1)        RMSNorm `(w.float() * x_hat).to(dtype)` instead of HF's `w * x_hat.to(dtype)`, in every
                           norm. Origin: model.layers.0.input_layernorm. Identical in fp32.
  fp32_residual (C3)       the attention-branch residual add is done in fp32, and the unrounded sum goes into
                           post_attention_layernorm; the rounded sum is still the residual. Origin: the own code
                           of model.layers.0 (the add). Identical in fp32, where there is nothing to round.
  rope_fused (C4)          RoPE `q*cos + rotate_half(q)*sin` computed in fp32 with one rounding (a fused rotary
                           kernel) instead of three bf16 roundings. Origin: model.layers.0.self_attn (own code).
                           Identical in fp32.
  sdpa (C7)                F.scaled_dot_product_attention(is_causal=True) instead of eager attention (bf16
                           scores, scale after the matmul, fp32 softmax). Origin: model.layers.0.self_attn (own
                           code). Differs in fp32 too.
  silu_fused (C21)         `(silu(g.float()) * u.float()).to(dtype)` (one rounding, as Inductor fuses it) instead of
                           `silu(g) * u`. Origin: model.layers.0.mlp (own code). Identical in fp32.
  split_k (C11)            o_proj as a sum of K-chunks of 32 columns, each partial product and partial sum rounded to
                           the model dtype (SplitKLinear). Origin: model.layers.0.self_attn.o_proj. Differs in fp32
                           too (accumulation order).
  rope_cache (C5)          the shared rotary module answers its first call like training, but also builds a cache
                           whose angles were computed in float16, and answers every later call of the same forward
                           from it. Origin: model.rotary_emb, call 1 (layer 1); call 0 agrees. Differs in fp32 too.
  lm_head_bf16_logsoftmax  (C19; C17 is the neighbouring lm_head-precision cause: both sides keep a model-dtype
                           lm_head) log_softmax in the model dtype, `logits.to(dtype).log_softmax(-1).float()`,
                           instead of on fp32 logits. Origin: the root module's own code (""). Identical in fp32.
  all                      every difference above at once. The first origin is model.layers.0.input_layernorm.

CLI: `divtrace record examples/llama_pair.py:training --out DIR --arg dtype=bf16` and the same with
`:inference --arg variant=sdpa`. Same seed => bitwise identical weights and inputs on both sides.
"""
# no `from __future__ import annotations`: the dataclass must work even when a loader skips sys.modules
import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

VARIANTS = ("none", "rmsnorm_cast", "fp32_residual", "rope_fused", "sdpa", "silu_fused", "split_k", "rope_cache",
            "lm_head_bf16_logsoftmax", "all")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
IMPLS = ("training", "inference")
SPLIT_K_CHUNK = 32


@dataclasses.dataclass(frozen=True)
class PairConfig:
    vocab: int = 256
    hidden: int = 128
    layers: int = 2
    heads: int = 4
    intermediate: int = 344
    seq: int = 16
    batch: int = 2
    rope_theta: float = 10000.0
    eps: float = 1e-6

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def make_config(**cfg: Any) -> PairConfig:
    """A PairConfig from keyword values; strings (as the CLI's --arg gives them) are converted to the field type."""
    fields = {f.name: f for f in dataclasses.fields(PairConfig)}
    unknown = sorted(set(cfg) - set(fields))
    if unknown:
        raise ValueError(f"unknown config field(s) {unknown}; allowed: {sorted(fields)}")
    defaults = PairConfig()
    c = PairConfig(**{k: type(getattr(defaults, k))(v) for k, v in cfg.items()})
    if c.hidden < 128 or c.layers < 2 or c.hidden % c.heads or c.head_dim % 2:
        raise ValueError(f"need hidden >= 128, layers >= 2 and an even head_dim dividing hidden; got {c}")
    return c


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float, cast_weight_first: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps, self.cast_weight_first = eps, cast_weight_first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = self.weight.dtype  # the model dtype, also when the input is an fp32 residual (fp32_residual)
        xf = x.float()
        x_hat = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.cast_weight_first:  # C1, TransformerEngine/Megatron order
            return (self.weight.float() * x_hat).to(dtype)
        return self.weight * x_hat.to(dtype)  # HF Llama order


class RotaryEmbedding(nn.Module):
    """(cos, sin) for the positions, computed in fp32 and cast to the activation dtype, as HF does."""

    def __init__(self, cfg: PairConfig, fp16_cache: bool = False):
        super().__init__()
        d = cfg.head_dim
        # a plain attribute, not a buffer, so model.to(bf16) can't round it
        self.inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
        self.fp16_cache = fp16_cache
        self._cache: tuple[torch.Tensor, torch.Tensor] | None = None

    def clear_cache(self) -> None:
        self._cache = None

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self._cache is not None:  # only ever set on the rope_cache inference side
            return self._cache
        inv = self.inv_freq.to(x.device)
        freqs = (inv[None, :, None] @ position_ids[:, None, :].float()).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        out = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        if self.fp16_cache:  # C5: a table built once, with the angles in float16
            ang = position_ids.half()[..., None] * inv.half()
            ang = torch.cat((ang, ang), dim=-1).float()
            self._cache = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
        return out


class SplitKLinear(nn.Linear):
    """A bias-free Linear computed as a sum over K-chunks, each partial and each partial sum in the input dtype."""

    def __init__(self, in_features: int, out_features: int, chunk: int = SPLIT_K_CHUNK):
        super().__init__(in_features, out_features, bias=False)
        self.chunk = chunk

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = None
        for j in range(0, self.in_features, self.chunk):
            part = F.linear(x[..., j:j + self.chunk], self.weight[:, j:j + self.chunk])
            out = part if out is None else out + part
        return out


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: PairConfig, rotary: RotaryEmbedding, diffs: frozenset):
        super().__init__()
        h = cfg.hidden
        self.heads, self.head_dim, self.scale = cfg.heads, cfg.head_dim, cfg.head_dim ** -0.5
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(h, h, bias=False) for _ in range(3))
        self.o_proj = SplitKLinear(h, h) if "split_k" in diffs else nn.Linear(h, h, bias=False)
        self._rotary = (rotary,)  # shared, and kept out of named_modules so its only name is model.rotary_emb
        self.rope_fused, self.sdpa = "rope_fused" in diffs, "sdpa" in diffs

    def rope(self, t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.rope_fused:  # C4: fp32 math on the model-dtype table, one rounding
            return (t.float() * cos.float() + rotate_half(t).float() * sin.float()).to(t.dtype)
        return t * cos + rotate_half(t) * sin  # HF apply_rotary_pos_emb

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        shape = (b, t, self.heads, self.head_dim)
        q, k, v = (p(x).view(shape).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        cos, sin = self._rotary[0](x, position_ids)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q, k = self.rope(q, cos, sin), self.rope(k, cos, sin)
        if self.sdpa:  # C7
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # HF eager_attention_forward
            mask = torch.full((t, t), torch.finfo(x.dtype).min, dtype=x.dtype, device=x.device).triu(1)
            scores = (q @ k.transpose(-1, -2)) * self.scale + mask
            o = torch.softmax(scores, dim=-1, dtype=torch.float32).to(x.dtype) @ v
        return self.o_proj(o.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: PairConfig, diffs: frozenset):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden, cfg.intermediate, bias=False)
        self.up_proj = nn.Linear(cfg.hidden, cfg.intermediate, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate, cfg.hidden, bias=False)
        self.silu_fused = "silu_fused" in diffs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, u = self.gate_proj(x), self.up_proj(x)
        if self.silu_fused:  # C21: one rounding
            return self.down_proj((F.silu(g.float()) * u.float()).to(x.dtype))
        return self.down_proj(F.silu(g) * u)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: PairConfig, rotary: RotaryEmbedding, diffs: frozenset):
        super().__init__()
        cast = "rmsnorm_cast" in diffs
        self.input_layernorm = RMSNorm(cfg.hidden, cfg.eps, cast)
        self.self_attn = Attention(cfg, rotary, diffs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden, cfg.eps, cast)
        self.mlp = MLP(cfg, diffs)
        self.fp32_residual = "fp32_residual" in diffs

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        a = self.self_attn(self.input_layernorm(x), position_ids)
        if self.fp32_residual:  # C3: the norm sees the unrounded fp32 sum; the residual stream is rounded
            s = x.float() + a.float()
            h, normed = s.to(x.dtype), self.post_attention_layernorm(s)
        else:
            h = x + a
            normed = self.post_attention_layernorm(h)
        return h + self.mlp(normed)


class LlamaInner(nn.Module):
    def __init__(self, cfg: PairConfig, diffs: frozenset):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab, cfg.hidden)
        self.rotary_emb = RotaryEmbedding(cfg, fp16_cache="rope_cache" in diffs)
        self.layers = nn.ModuleList(DecoderLayer(cfg, self.rotary_emb, diffs) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden, cfg.eps, "rmsnorm_cast" in diffs)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        self.rotary_emb.clear_cache()  # a rope cache lives for one forward (one request)
        position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand(input_ids.shape[0], -1)
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, position_ids)
        return self.norm(x)


class LlamaPairModel(nn.Module):
    def __init__(self, cfg: PairConfig, impl: str = "training", variant: str = "none"):
        super().__init__()
        _check(impl=impl, variant=variant)
        diffs = frozenset() if impl == "training" or variant == "none" else (
            frozenset(VARIANTS[1:-1]) if variant == "all" else frozenset({variant}))
        self.cfg, self.impl, self.variant, self.diffs = cfg, impl, variant, diffs
        self.model = LlamaInner(cfg, diffs)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        self.lm_head_low = "lm_head_bf16_logsoftmax" in diffs

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self.model(input_ids))
        if self.lm_head_low:  # C19: log_softmax in the model dtype
            return logits.to(self.lm_head.weight.dtype).log_softmax(-1).float()
        return logits.float().log_softmax(-1)


def _check(**given: str) -> None:
    allowed = {"impl": IMPLS, "variant": VARIANTS, "dtype": tuple(DTYPES)}
    for name, value in given.items():
        if value not in allowed[name]:
            raise ValueError(f"unknown {name} {value!r}; allowed: {', '.join(allowed[name])}")


def build(impl: str, dtype: str = "bf16", variant: str = "none", seed: int = 0, **cfg: Any) -> LlamaPairModel:
    """One side of the pair, in eval mode, with weights that depend only on the seed and the config."""
    _check(impl=impl, dtype=dtype, variant=variant)
    c = make_config(**cfg)
    with torch.random.fork_rng(devices=[]):  # the default nn init must not move the caller's global RNG
        model = LlamaPairModel(c, impl, variant)
    gen = torch.Generator(device="cpu").manual_seed(int(seed))
    with torch.no_grad():
        for _, p in model.named_parameters():  # same names, same order on both sides
            r = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            p.copy_(1.0 + 0.1 * r if p.dim() == 1 else 0.02 * r)  # norm weights 1 + 0.1*randn: cast order matters
    return model.to(DTYPES[dtype]).eval()


def make_inputs(cfg: PairConfig, seed: int) -> torch.Tensor:
    gen = torch.Generator(device="cpu").manual_seed(int(seed) + 1_000_003)
    return torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq), generator=gen, dtype=torch.int64)


def training(dtype: str = "bf16", seed: int = 0, **cfg: Any) -> tuple[nn.Module, tuple]:
    model = build("training", dtype, "none", seed, **cfg)
    return model, (make_inputs(model.cfg, seed),)


def inference(dtype: str = "bf16", variant: str = "all", seed: int = 0, **cfg: Any) -> tuple[nn.Module, tuple]:
    model = build("inference", dtype, variant, seed, **cfg)
    return model, (make_inputs(model.cfg, seed),)


def inference_compiled(dtype: str = "bf16", variant: str = "none", seed: int = 0,
                       **cfg: Any) -> tuple[nn.Module, tuple]:
    """The inference side under torch.compile (Inductor), for `divtrace record --compiled` (docs/compiled.md). With
    the default variant `none` the only difference from `training` is the compiler."""
    model, inputs = inference(dtype, variant, seed, **cfg)
    return torch.compile(model), inputs


if __name__ == "__main__":
    for dt in DTYPES:
        for var in VARIANTS:
            (mt, (ids,)), (mi, _) = training(dt), inference(dt, var)
            with torch.no_grad():
                a, b = mt(ids), mi(ids)
            print(f"{dt:5s} {var:24s} differ={(a != b).float().mean().item():.4f} "
                  f"max={(a - b).abs().max().item():.3g}")
