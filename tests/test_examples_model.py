"""examples/llama_pair.py: the training/inference pair diverges exactly where each variant says it does.

Plain forward hooks (no divtrace) record every module call's inputs and outputs on both sides; the origin of a
variant is the module call whose inputs agree bitwise while its output doesn't.
"""
from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest
import torch

_PATH = pathlib.Path(__file__).resolve().parents[1] / "examples" / "llama_pair.py"
_spec = importlib.util.spec_from_file_location("llama_pair", _PATH)
lp = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("llama_pair", lp)
_spec.loader.exec_module(lp)

_INT = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}

ORIGIN = {  # variant -> (module path, call number) of the first divergence in bf16
    "rmsnorm_cast": ("model.layers.0.input_layernorm", 0),
    "fp32_residual": ("model.layers.0", 0),
    "rope_fused": ("model.layers.0.self_attn", 0),
    "sdpa": ("model.layers.0.self_attn", 0),
    "silu_fused": ("model.layers.0.mlp", 0),
    "split_k": ("model.layers.0.self_attn.o_proj", 0),
    "rope_cache": ("model.rotary_emb", 1),
    "lm_head_bf16_logsoftmax": ("", 0),
    "all": ("model.layers.0.input_layernorm", 0),
}
DIFFERS_IN_FP32 = {"sdpa", "split_k", "rope_cache", "all"}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny matmuls: intra-op threads only add contention (20x slower on a busy 2-core box). Both sides of a
    comparison run under the same setting, so this doesn't change what is compared."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def same(a, b) -> bool:
    """Bitwise equality of tensors or (nested) tuples of tensors, dtype and shape included."""
    if isinstance(a, (tuple, list)) or isinstance(b, (tuple, list)):
        return (isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)) and len(a) == len(b)
                and all(same(x, y) for x, y in zip(a, b)))
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    it = _INT.get(a.dtype)
    if it is None:
        return torch.equal(a, b)
    return torch.equal(a.contiguous().view(it), b.contiguous().view(it))


def _snap(x):
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, (tuple, list)):
        return tuple(_snap(v) for v in x)
    return None


def run_hooked(model, ids):
    """(output, calls, order): calls[(path, n)] = (inputs, output); order lists ("enter"|"exit", key)."""
    calls, order, counts, stack, handles = {}, [], {}, [], []

    def pre(name):
        def hook(mod, args):
            key = (name, counts.get(name, 0))
            counts[name] = key[1] + 1
            stack.append(key)
            order.append(("enter", key))
            calls[key] = (_snap(args), None)
        return hook

    def post(name):
        def hook(mod, args, out):
            key = stack.pop()
            assert key[0] == name
            order.append(("exit", key))
            calls[key] = (calls[key][0], _snap(out))
        return hook

    for name, m in model.named_modules():
        handles += [m.register_forward_pre_hook(pre(name)), m.register_forward_hook(post(name))]
    try:
        with torch.no_grad():
            out = model(ids)
    finally:
        for h in handles:
            h.remove()
    return out, calls, order


def pair(variant, dtype="bf16", seed=0):
    mt, (ids,) = lp.training(dtype=dtype, seed=seed)
    mi, (ids_i,) = lp.inference(dtype=dtype, variant=variant, seed=seed)
    assert torch.equal(ids, ids_i)
    return run_hooked(mt, ids), run_hooked(mi, ids)


def children(key, calls, order):
    """Keys of the calls made while `key` was running (its descendants), in entry order."""
    start, end = order.index(("enter", key)), order.index(("exit", key))
    return [k for ev, k in order[start + 1:end] if ev == "enter"]


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_weights_and_inputs_identical_on_both_sides(dtype):
    mt, (a,) = lp.training(dtype=dtype, seed=3)
    mi, (b,) = lp.inference(dtype=dtype, variant="all", seed=3)
    assert torch.equal(a, b) and a.shape == (2, 16)
    st, si = mt.state_dict(), mi.state_dict()
    assert st.keys() == si.keys()
    assert all(same(st[k], si[k]) and st[k].dtype == lp.DTYPES[dtype] for k in st)
    norm_w = st["model.layers.0.input_layernorm.weight"].float()
    assert 0.01 < norm_w.std() < 0.5 and abs(norm_w.mean() - 1) < 0.1
    assert 0.01 < st["model.layers.0.self_attn.q_proj.weight"].float().std() < 0.03
    assert not torch.equal(st["lm_head.weight"], lp.build("training", dtype, seed=4).state_dict()["lm_head.weight"])


def test_module_names_like_hf_llama():
    names = dict(lp.build("inference", "bf16", "all").named_modules())
    for n in ["", "model.embed_tokens", "model.rotary_emb", "model.norm", "lm_head", "model.layers.1.mlp.down_proj",
              "model.layers.0.input_layernorm", "model.layers.0.post_attention_layernorm",
              "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj",
              "model.layers.0.self_attn.v_proj", "model.layers.0.self_attn.o_proj",
              "model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"]:
        assert n in names, n
    assert not any(n.endswith("self_attn.rotary_emb") for n in names)
    assert isinstance(names["model.layers.0.self_attn.o_proj"], lp.SplitKLinear)
    assert type(dict(lp.build("training").named_modules())["model.layers.0.self_attn.o_proj"]) is torch.nn.Linear


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_none_is_bitwise_identical(dtype):
    (a, ca, _), (b, cb, _) = pair("none", dtype)
    assert a.dtype == torch.float32 and a.shape == (2, 16, 256)
    assert same(a, b)
    assert ca.keys() == cb.keys() and all(same(ca[k][1], cb[k][1]) for k in ca)
    assert ("model.rotary_emb", 1) in ca and ("model.rotary_emb", 2) not in ca  # once per layer


@pytest.mark.parametrize("variant", sorted(ORIGIN))
def test_variant_origin_bf16(variant):
    (a, ct, order), (b, ci, _) = pair(variant, "bf16")
    assert not same(a, b)
    key = ORIGIN[variant]
    assert same(ct[key][0], ci[key][0]), f"{key}: inputs should agree"
    assert not same(ct[key][1], ci[key][1]), f"{key}: output should differ"
    # every call that finished before the origin started agrees
    start = order.index(("enter", key))
    for ev, k in order[:start]:
        if ev == "exit":
            assert same(ct[k][1], ci[k][1]), f"{k} diverged before {key}"
    # the origin's own code diverges: no child call is itself an origin (equal inputs -> equal output)
    for k in children(key, ct, order):
        assert not same(ct[k][0], ci[k][0]) or same(ct[k][1], ci[k][1]), f"{k} is an earlier origin than {key}"


def test_fp32_residual_diverges_at_the_layers_own_add():
    (_, ct, order), (_, ci, _) = pair("fp32_residual", "bf16")
    layer0 = ("model.layers.0", 0)
    kids = children(layer0, ct, order)
    post = ("model.layers.0.post_attention_layernorm", 0)
    for k in kids[:kids.index(post)]:  # input_layernorm, self_attn and everything inside it, rotary_emb call 0
        assert same(ct[k][0], ci[k][0]) and same(ct[k][1], ci[k][1]), k
    assert not same(ct[post][0], ci[post][0])
    assert ci[post][0][0].dtype == torch.float32 and ci[post][1].dtype == torch.bfloat16
    assert ct[layer0][1].dtype == ci[layer0][1].dtype == torch.bfloat16  # the residual stream stays rounded


def test_rope_cache_second_call_only():
    (_, ct, _), (_, ci, _) = pair("rope_cache", "bf16")
    r0, r1 = ("model.rotary_emb", 0), ("model.rotary_emb", 1)
    assert same(ct[r0], ci[r0])
    assert same(ct[r1][0], ci[r1][0]) and not same(ct[r1][1], ci[r1][1])
    assert same(ct[("model.layers.0", 0)][1], ci[("model.layers.0", 0)][1])


def test_rope_cache_is_per_forward():
    model, (ids,) = lp.inference("bf16", "rope_cache")
    with torch.no_grad():
        assert same(model(ids), model(ids))


@pytest.mark.parametrize("variant", lp.VARIANTS[1:])
def test_fp32(variant):
    (a, _, _), (b, _, _) = pair(variant, "fp32")
    assert a.dtype == torch.float32 and torch.isfinite(a).all()
    assert same(a, b) != (variant in DIFFERS_IN_FP32)


def test_every_variant_has_an_origin():
    assert set(lp.VARIANTS) == set(ORIGIN) | {"none"}


def test_bad_arguments():
    with pytest.raises(ValueError, match="sdpa"):
        lp.inference(variant="flash")
    with pytest.raises(ValueError, match="bf16"):
        lp.training(dtype="fp16")
    with pytest.raises(ValueError, match="inference"):
        lp.build("eval")
    with pytest.raises(ValueError, match="hidden"):
        lp.training(widht=3)
    with pytest.raises(ValueError):
        lp.training(layers=1)


def test_cli_style_string_args():
    model, (ids,) = lp.training(dtype="bf16", seed="1", layers="3", seq="8")
    assert len(model.model.layers) == 3 and ids.shape == (2, 8)
    with torch.no_grad():
        assert model(ids).shape == (2, 8, 256)
