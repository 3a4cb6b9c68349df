"""Bisect localizes planted divergences exactly: module, call and the op where each side's sequence parts."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import divtrace
from divtrace.align.paths import PathMap
from divtrace.compare.metrics import Tolerance
from divtrace.errors import DivtraceError
from helpers import hf_llama, record_model, record_pair

SDPA_CPU = "aten._scaled_dot_product_flash_attention_for_cpu.default"

# variant -> (module, call, op on side a, op on side b); all bf16, each planted in exactly one place.
PLANTED = {
    "rmsnorm_cast": ("model.layers.0.input_layernorm", 0, "aten._to_copy.default", "aten.mul.Tensor"),
    "fp32_residual": ("model.layers.0", 0, "aten.add.Tensor", "aten.add.Tensor"),
    "rope_fused": ("model.layers.0.self_attn", 0, "aten.mul.Tensor", "aten.mul.Tensor"),
    "sdpa": ("model.layers.0.self_attn", 0, "aten.bmm.default", SDPA_CPU),
    "silu_fused": ("model.layers.0.mlp", 0, "aten.silu.default", "aten.silu.default"),
    "split_k": ("model.layers.0.self_attn.o_proj", 0, "aten.mm.default", "aten.mm.default"),
    "rope_cache": ("model.rotary_emb", 1, None, None),
    "lm_head_bf16_logsoftmax": ("", 0, "aten._log_softmax.default", "aten._log_softmax.default"),
    "all": ("model.layers.0.input_layernorm", 0, "aten._to_copy.default", "aten.mul.Tensor"),
}


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pairs")
    return {v: record_pair(root, v) for v in ["none", *PLANTED]}


@pytest.mark.parametrize("variant", list(PLANTED))
def test_planted_divergence_is_localized(pairs, variant):
    module, call, op_a, op_b = PLANTED[variant]
    r = divtrace.bisect(*pairs[variant])
    assert r.verdict == "diverged" and r.exit_code == 1
    f = r.first
    assert (f.module, f.call, f.cause) == (module, call, "origin")
    if op_a is not None:
        assert (f.op, f.op_b, f.kind) == (op_a, op_b, "op")
    assert f.diff is not None and not f.diff.equal
    assert f.diff.mismatched or f.diff.reason  # elements differ, or (fp32_residual) the dtype itself
    assert r.final is not None and r.final["identical"] is False and r.final["kl"] >= 0
    assert r.final["max_abs_logprob_diff"] > 0


def test_second_call_alone_diverges(pairs):
    """model.rotary_emb is called once per layer; only call 1 (the cached table) differs."""
    r = divtrace.bisect(*pairs["rope_cache"])
    assert (r.first.module, r.first.call) == ("model.rotary_emb", 1)
    assert r.first.op is not None  # side a recomputes the table in call 1
    assert r.first.op_b is None  # side b runs no op of its own there: it answers from its cache


def test_parent_own_code_not_child(pairs):
    """The residual add between children of the decoder block belongs to the block, not to the norm after it."""
    f = divtrace.bisect(*pairs["fp32_residual"]).first
    assert f.module == "model.layers.0" and f.tensor == "input args.0 of model.layers.0.post_attention_layernorm"
    assert f.op == "aten.add.Tensor" and "bfloat16" in f.dtype


def test_identical_control(pairs):
    r = divtrace.bisect(*pairs["none"])
    assert r.verdict == "identical" and r.first is None and r.exit_code == 0
    assert r.bitwise_differs == 0 and r.compared > 100
    assert r.final["identical"] is True and r.final["kl"] == 0.0 and r.final["max_abs_logprob_diff"] == 0.0
    assert r.to_dict()["first"] is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hf_llama_eager_vs_sdpa(tmp_path, dtype):
    for attn in ("eager", "sdpa"):
        model, inputs = hf_llama(attn, dtype)
        record_model(model, inputs, tmp_path / attn, label=attn)
    r = divtrace.bisect(tmp_path / "eager", tmp_path / "sdpa")
    f = r.first
    assert (r.verdict, f.module, f.call, f.cause) == ("diverged", "model.layers.0.self_attn", 0, "origin")
    assert (f.op, f.op_b) == ("aten.bmm.default", SDPA_CPU)
    ops_a = {o for _, o in f.region_a}
    assert "aten._softmax.default" in ops_a and "aten.mm.default" not in ops_a  # attention core, not projections
    assert [o for _, o in f.region_b if o == SDPA_CPU] == [SDPA_CPU]


def test_hash_mode_localizes_from_fingerprints(tmp_path):
    a, b = record_pair(tmp_path, "rmsnorm_cast", mode="hash")
    r = divtrace.bisect(a, b)
    f = r.first
    assert (f.module, f.op, f.op_b) == PLANTED["rmsnorm_cast"][0:1] + PLANTED["rmsnorm_cast"][2:]
    assert f.diff is None and r.metrics_available is False
    assert r.to_dict()["first"]["max_abs"] is None
    assert "--mode full" in r.hint and "--include" in r.hint and "input_layernorm" in r.hint
    ident = record_pair(tmp_path / "same", "none", mode="hash")
    assert divtrace.bisect(*ident).verdict == "identical"


def test_fp32_variants_that_cannot_round_are_identical(tmp_path):
    assert divtrace.bisect(*record_pair(tmp_path, "rmsnorm_cast", dtype="fp32")).verdict == "identical"
    r = divtrace.bisect(*record_pair(tmp_path, "split_k", dtype="fp32"))
    assert r.verdict == "diverged" and r.first.module == "model.layers.0.self_attn.o_proj"


def test_tolerance_is_opt_in(tmp_path):
    a, b = record_pair(tmp_path, "split_k", dtype="fp32")
    assert divtrace.bisect(a, b).verdict == "diverged"
    loose = divtrace.bisect(a, b, tol=Tolerance(atol=1e-3, rtol=1e-3))
    assert loose.verdict == "within_tolerance" and loose.exit_code == 0 and loose.bitwise_differs > 0
    tight = divtrace.bisect(a, b, tol=Tolerance(ulp=1))
    assert tight.verdict == "diverged"


class _Zero(nn.Module):
    def __init__(self, plus_zero: bool):
        super().__init__()
        self.plus_zero = plus_zero
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        y = self.proj(x) * 0.0  # negative entries give -0.0
        return y + 0.0 if self.plus_zero else y  # -0.0 + 0.0 == +0.0: same value, other bits


def test_negative_zero_is_a_divergence(tmp_path):
    torch.manual_seed(0)
    m = _Zero(False)
    x = torch.randn(3, 4)
    record_model(m, (x,), tmp_path / "a")
    m.plus_zero = True
    record_model(m, (x,), tmp_path / "b")
    r = divtrace.bisect(tmp_path / "a", tmp_path / "b")
    # Side a stops at the mul (its -0.0 output); side b, which has the same mul, goes on with the add.
    assert r.verdict == "diverged" and r.first.module == "" and r.first.op_b == "aten.add.Tensor"
    assert r.first.diff.max_abs == 0.0 and r.first.diff.max_ulp == 0 and r.first.diff.mismatched > 0


class _NanPayload(nn.Module):
    def __init__(self, payload: int):
        super().__init__()
        self.payload = payload

    def forward(self, x):
        nan = torch.tensor([0x7FC00000 | self.payload], dtype=torch.int32).view(torch.float32)
        return x * 0 + nan  # quiet NaN; payload bits differ between the runs


def test_nans_compare_by_bits(tmp_path):
    x = torch.ones(4)
    record_model(_NanPayload(1), (x,), tmp_path / "a")
    record_model(_NanPayload(1), (x,), tmp_path / "a2")
    record_model(_NanPayload(2), (x,), tmp_path / "b")
    assert divtrace.bisect(tmp_path / "a", tmp_path / "a2").verdict == "identical"
    assert divtrace.bisect(tmp_path / "a", tmp_path / "b").verdict == "diverged"


class _Norm(nn.Module):
    def __init__(self, cast_first: bool):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(64, generator=torch.Generator().manual_seed(1)))
        self.cast_first = cast_first

    def forward(self, x):
        xf = x.float()
        h = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)
        w = self.weight.to(torch.bfloat16)
        return w * h.to(torch.bfloat16) if self.cast_first else (w.float() * h).to(torch.bfloat16)


class _Trainer(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.ModuleDict({"norm": _Norm(True), "proj": nn.Linear(64, 64)})])

    def forward(self, x):
        return self.layers[0]["proj"](self.layers[0]["norm"](x).float())


class _Engine(nn.Module):
    """The same model as _Trainer, named the way an inference engine might name it."""

    def __init__(self, trainer: _Trainer):
        super().__init__()
        self.blocks = nn.ModuleList([nn.ModuleDict({"ln": _Norm(False), "linear": trainer.layers[0]["proj"]})])
        self.blocks[0]["ln"].weight = trainer.layers[0]["norm"].weight

    def forward(self, x):
        return self.blocks[0]["linear"](self.blocks[0]["ln"](x).float())


def test_map_renames_module_paths(tmp_path):
    trainer = _Trainer()
    engine = _Engine(trainer)
    x = torch.randn(8, 64).to(torch.bfloat16)
    record_model(trainer, (x,), tmp_path / "train")
    record_model(engine, (x,), tmp_path / "engine")
    with pytest.raises(DivtraceError, match="unrelated models"):
        divtrace.bisect(tmp_path / "train", tmp_path / "engine")
    names = tmp_path / "names.yaml"
    names.write_text("b:\n  '^blocks\\.': 'layers.'\n  '\\.ln$': '.norm'\n  '\\.linear$': '.proj'\n")
    r = divtrace.bisect(tmp_path / "train", tmp_path / "engine", path_map=PathMap.from_file(names))
    assert r.first.module == "layers.0.norm" and r.first.module_b == "blocks.0.ln"
    assert (r.first.op, r.first.op_b) == ("aten._to_copy.default", "aten.mul.Tensor")
    assert r.unmatched == {"a": 0, "b": 0}


def test_settings_that_differ_are_reported(tmp_path):
    a, _ = record_pair(tmp_path, "none")
    old = torch.get_num_threads()
    torch.set_num_threads(1 if old != 1 else 2)
    try:
        _, b = record_pair(tmp_path / "other", "none")
    finally:
        torch.set_num_threads(old)
    r = divtrace.bisect(a, b)
    assert any(s["name"] == "num_threads" for s in r.settings)


@pytest.mark.parametrize("narrow_side", ["a", "b"])
def test_whole_trace_against_narrowed_trace(tmp_path, narrow_side):
    """One side re-recorded with include= (as the hash-mode hint suggests) still localizes, never crashes."""
    from helpers import load_example

    ex = load_example()
    inc = r"^model\.layers\.0\.self_attn$"
    kw_a = {"include": inc} if narrow_side == "a" else {}
    kw_b = {"include": inc} if narrow_side == "b" else {}
    record_model(*ex.training(dtype="bf16"), tmp_path / "a", **kw_a)
    record_model(*ex.inference(dtype="bf16", variant="sdpa"), tmp_path / "b", **kw_b)
    r = divtrace.bisect(tmp_path / "a", tmp_path / "b")
    assert r.verdict == "diverged"
    assert (r.first.module, r.first.op, r.first.op_b) == PLANTED["sdpa"][:1] + PLANTED["sdpa"][2:]
    assert r.unmatched[narrow_side] == 0 and r.unmatched["b" if narrow_side == "a" else "a"] > 0


class _Chain(nn.Module):
    """One module whose own code is a chain of thousands of ops (a long decode loop, say)."""

    def __init__(self, bump: float, n: int = 3000):
        super().__init__()
        self.bump, self.n = bump, n

    def forward(self, x):
        for _ in range(self.n):
            x = x + 1.0
        return x * (1.0 + self.bump)


def test_long_op_chain_does_not_recurse(tmp_path):
    """Regression: localizing inside a call with a 3000-op dependency chain hit Python's recursion limit."""
    x = torch.zeros(4)
    record_model(_Chain(0.0), (x,), tmp_path / "a", mode="hash")
    record_model(_Chain(1e-3), (x,), tmp_path / "b", mode="hash")
    r = divtrace.bisect(tmp_path / "a", tmp_path / "b")
    assert r.verdict == "diverged" and r.first.module == "" and r.first.op == "aten.mul.Tensor"


class _ViewOut(nn.Module):
    """Returns the same bytes either as a strided view (w.t() of a parameter) or as a contiguous copy."""

    def __init__(self, copy: bool):
        super().__init__()
        self.w = nn.Parameter(torch.arange(12.0).reshape(3, 4))
        self.copy = copy

    def forward(self, x):
        wt = self.w.t()
        return (wt.contiguous() if self.copy else wt), x @ wt


@pytest.mark.parametrize("mode", ["hash", "full"])
def test_view_outputs_compare_by_bytes_at_module_boundaries(tmp_path, mode):
    """Hash mode derives fingerprints of strided views from their input; a module output is still compared by
    its real bytes, so a view and a contiguous copy of the same values are identical, and a changed weight
    is not."""
    x = torch.randn(2, 4)
    record_model(_ViewOut(False), (x,), tmp_path / "view", mode=mode)
    record_model(_ViewOut(True), (x,), tmp_path / "copy", mode=mode)
    assert divtrace.bisect(tmp_path / "view", tmp_path / "copy").verdict == "identical"
    other = _ViewOut(False)
    with torch.no_grad():
        other.w[1, 2] += 1.0
    record_model(other, (x,), tmp_path / "other", mode=mode)
    r = divtrace.bisect(tmp_path / "view", tmp_path / "other")
    # The first differing value is the transpose of the changed parameter, linked to the op that made it
    # (a view's version counter is its base's once the op returns: see test_view_of_a_modified_parameter...).
    assert r.verdict == "diverged" and r.first.module == "" and r.first.op == "aten.t.default"
    assert r.first.tensor == "output of aten.t.default"
