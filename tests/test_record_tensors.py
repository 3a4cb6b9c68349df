"""Every kind of tensor and output a real model produces records, and reads back bit for bit."""
from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
from torch import nn

import divtrace
from divtrace.record import values as recorder
from divtrace.trace.hashing.tensor import tensor_hash  # the scheme traces are written in
from divtrace.trace.check import check_trace
from divtrace.trace.reader import Trace
from test_trace_fixtures import Tiny, cli, record_tiny, tiny_input


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.detach().contiguous(), b.detach().contiguous()
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_complex():
        a, b = torch.view_as_real(a) if a.dtype != torch.complex32 else a.view(torch.float16), \
            torch.view_as_real(b) if b.dtype != torch.complex32 else b.view(torch.float16)
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


class Kinds(nn.Module):
    """Outputs of every layout and dtype, all produced by ops inside the module."""

    def forward(self, x):
        return {
            "transposed": x.t(), "noncontig": x[:, ::2], "expanded": x[:1].expand(5, -1), "view": x.view(-1)[3:9],
            "zero_d": x.sum(), "empty": x[:0], "empty2d": x.new_zeros(0, 7), "int64": torch.arange(6) * 3,
            "int8": (x * 10).to(torch.int8), "uint8": (x.abs() * 10).to(torch.uint8), "bool": x > 0,
            "complex64": torch.complex(x, -x), "complex128": torch.complex(x.double(), x.double()),
            "fp8_e4m3fn": x.to(torch.float8_e4m3fn), "fp8_e5m2": x.to(torch.float8_e5m2),
            "bf16": x.to(torch.bfloat16).t(), "fp16": x.half(), "fp64": x.double(),
            "nan_inf": x / torch.tensor([0.0, 1.0, -0.0, 1.0]).repeat(2),
        }


@pytest.mark.parametrize("mode", ["full", "hash"])
def test_every_tensor_kind_reads_back_bitwise(tmp_path, mode):
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    m = Kinds()
    with torch.no_grad(), divtrace.record(m, tmp_path / "t", mode=mode):
        live = m(x)
    t = Trace(tmp_path / "t")
    outs = dict(t.calls[0].outputs)
    assert set(outs) == {f"out.{k}" for k in live}
    for k, v in live.items():
        val = t.values[outs[f"out.{k}"]]
        assert (val.dtype, val.shape) == (str(v.dtype), list(v.shape)), k
        assert val.hash == tensor_hash(v), k
        if mode == "full":
            assert same_bits(t.tensor(outs[f"out.{k}"]), v), k
    assert check_trace(t)["ok"], check_trace(t)["problems"]
    # Every op output too, not only the module's outputs.
    if mode == "full":
        assert all(t.tensor(vid) is not None for vid in t.values)


def test_op_output_mutated_later_reads_back_as_produced(tmp_path):
    class M(nn.Module):
        def forward(self, x):
            y = x * 2
            z = y + 1
            y.mul_(3)  # after z was computed from it
            return z, y

    x = torch.randn(6)
    with torch.no_grad(), divtrace.record(M(), tmp_path / "t") as rec:
        rec.model(x)
    t = Trace(tmp_path / "t")
    mul = next(r for r in t.records if r.kind == "op" and r.op == "aten.mul.Tensor")
    assert torch.equal(t.tensor(mul.outputs[0]), x * 2)
    mul_ = next(r for r in t.records if r.kind == "op" and r.op == "aten.mul_.Tensor")
    assert torch.equal(t.tensor(mul_.outputs[0]), x * 6)


class ViewThenWrite(nn.Module):
    def __init__(self):
        super().__init__()
        self.read = nn.Identity()

    def forward(self, x):
        y = x * 2
        v = y.view(-1)
        before = self.read(v).sum()
        y.add_(1)  # writes through y; v (another tensor object) now holds other bytes
        after = self.read(v).sum()
        return before, after


@pytest.mark.parametrize("ops", [True, False])
@pytest.mark.parametrize("grad_mode", ["inference", "no_grad"])
def test_write_through_a_view_is_seen(tmp_path, ops, grad_mode):
    # Inference tensors have no version counter: without tracking writes, the second read of `v` would be
    # taken for the first one (same object, "unchanged") and record stale bytes.
    ctx = torch.inference_mode if grad_mode == "inference" else torch.no_grad
    x = torch.randn(2, 3)
    m = ViewThenWrite()
    with ctx(), divtrace.record(m, tmp_path / "t", ops=ops):
        m(x)
    t = Trace(tmp_path / "t")
    reads = [c for c in t.calls.values() if c.module == "read"]
    first, second = (t.values[c.inputs[0][1]] for c in reads)
    assert first.hash == tensor_hash((x * 2).view(-1))
    assert second.hash == tensor_hash((x * 2 + 1).view(-1))


@pytest.mark.parametrize("grad_mode", ["no_grad", "inference", "grad"])
def test_grad_modes_record_the_same_values(tmp_path, grad_mode):
    ctx = {"no_grad": torch.no_grad, "inference": torch.inference_mode, "grad": torch.enable_grad}[grad_mode]
    m = Tiny()
    with ctx(), divtrace.record(m, tmp_path / grad_mode):
        out = m(tiny_input())
    assert out.requires_grad == (grad_mode == "grad")
    ref = record_tiny(tmp_path / "ref")
    code, _, err = cli("bisect", tmp_path / grad_mode, ref)
    assert code == 0, err
    t = Trace(tmp_path / grad_mode)
    assert same_bits(t.tensor(t.calls[0].outputs[0][1]), out)


@dataclasses.dataclass
class Pair:
    left: torch.Tensor
    right: torch.Tensor | None = None


class Structured(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.tup = nn.Identity()

    def forward(self, x):
        from transformers.modeling_outputs import BaseModelOutput

        h = self.lin(x)
        return {"tuple": (h, h * 2), "dc": Pair(h + 1), "hf": BaseModelOutput(last_hidden_state=h - 1),
                "none": None, "nested": [[h.sum()]]}


def test_structured_outputs(tmp_path):
    m = Structured()
    with torch.no_grad(), divtrace.record(m, tmp_path / "t"):
        live = m(torch.randn(2, 4))
    t = Trace(tmp_path / "t")
    outs = dict(t.calls[0].outputs)
    assert set(outs) == {"out.tuple.0", "out.tuple.1", "out.dc.left", "out.hf.last_hidden_state", "out.nested.0.0"}
    assert same_bits(t.tensor(outs["out.dc.left"]), live["dc"].left)
    assert same_bits(t.tensor(outs["out.hf.last_hidden_state"]), live["hf"].last_hidden_state)


class NoneOut(nn.Module):
    def forward(self, x):
        return None


def test_module_returning_none(tmp_path):
    m = nn.Sequential()
    m.add_module("n", NoneOut())
    with torch.no_grad(), divtrace.record(m, tmp_path / "t"):
        m(torch.randn(2))
    t = Trace(tmp_path / "t")
    assert t.calls[1].module == "n" and t.calls[1].outputs == [] and t.complete


class Shared(nn.Module):
    """One module called from two places, a tied module under two names, a kwargs-only forward."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(4)
        self.first = nn.Linear(4, 4)
        self.second = self.first  # tied: same module object under two names
        self.scale = KwOnly()

    def forward(self, x):
        x = self.norm(x)
        x = self.second(self.first(x))
        x = self.norm(x)
        return self.scale(x=x, factor=0.5)


class KwOnly(nn.Module):
    def forward(self, *, x, factor):
        return x * factor


def test_shared_tied_and_kwargs_only_modules(tmp_path):
    m = Shared()
    with torch.no_grad(), divtrace.record(m, tmp_path / "t"):
        live = m(torch.randn(3, 4))
    t = Trace(tmp_path / "t")
    keys = sorted((c.module, c.call) for c in t.calls.values())
    # named_modules() names the tied module once ("first"): its two calls are call 0 and call 1.
    assert keys == [("", 0), ("first", 0), ("first", 1), ("norm", 0), ("norm", 1), ("scale", 0)]
    scale = next(c for c in t.calls.values() if c.module == "scale")
    assert [k for k, _ in scale.inputs] == ["kwargs.x"]
    assert same_bits(t.tensor(scale.outputs[0][1]), live)
    assert len(m.first._forward_hooks) == 0  # recording removed its hooks, once each


def test_model_with_hooks_of_its_own(tmp_path):
    m = Tiny()
    x = tiny_input()
    seen = []
    m.lin.register_forward_pre_hook(lambda mod, args: (args[0] * 2,))
    m.lin.register_forward_hook(lambda mod, args, out: out + 1)
    m.out.register_forward_hook(lambda mod, args, out: seen.append(out.clone()))
    with torch.no_grad():
        expected = m(x)
    with torch.no_grad(), divtrace.record(m, tmp_path / "t"):
        got = m(x)
    assert torch.equal(got, expected) and len(seen) == 2
    t = Trace(tmp_path / "t")
    lin = next(c for c in t.calls.values() if c.module == "lin")
    act = next(c for c in t.calls.values() if c.module == "act")
    # The call spans the module's own hooks: input as the caller passed it, output as the caller got it.
    assert same_bits(t.tensor(lin.inputs[0][1]), x)
    assert lin.outputs[0][1] == act.inputs[0][1]
    assert len(m.lin._forward_hooks) == 1 and len(m.lin._forward_pre_hooks) == 1


class Wrapper(torch.Tensor):
    """A __torch_dispatch__ wrapper subclass with no local tensor to record."""

    @staticmethod
    def __new__(cls, elem):
        return torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype, device=elem.device)

    def __init__(self, elem):
        self.elem = elem

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = lambda t: t.elem if isinstance(t, Wrapper) else t
        out = func(*torch.utils._pytree.tree_map(unwrap, args), **torch.utils._pytree.tree_map(unwrap, kwargs or {}))
        return torch.utils._pytree.tree_map(lambda t: Wrapper(t) if isinstance(t, torch.Tensor) else t, out)


class UsesWrapper(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Identity()

    def forward(self, x):
        w = self.inner(Wrapper(x))
        return (w * 2).elem + x


def test_tensor_subclass_without_local_tensor_is_skipped_with_a_warning(tmp_path):
    m = UsesWrapper()
    x = torch.randn(3)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad(), divtrace.record(m, tmp_path / "t"):
        warnings.simplefilter("always")
        out = m(x)
    assert torch.equal(out, x * 3)
    t = Trace(tmp_path / "t")
    assert t.complete and any("Wrapper not recorded" in w for w in t.meta["warnings"])
    assert any("Wrapper not recorded" in str(w.message) for w in caught)
    assert same_bits(t.tensor(t.calls[0].outputs[0][1]), out)


def test_dtensor_records_its_local_tensor(tmp_path):
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available():
        pytest.skip("torch.distributed not built")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))

        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(4, 4)

            def forward(self, x):
                d = distribute_tensor(x, mesh, [Shard(0)])
                w = distribute_tensor(self.lin.weight.detach(), mesh, [Replicate()])
                return torch.relu(d @ w.t()) * 2

        m = M()
        x = torch.randn(4, 4)
        with torch.no_grad(), divtrace.record(m, tmp_path / "t"):
            out = m(x)
        # a process group of one whose model holds no DTensor parameter records a plain trace (docs/sharded.md:
        # vLLM's worker initializes such a group); the DTensors made in forward record their local tensors
        t = Trace(tmp_path / "t")
        assert not (tmp_path / "t" / "rank-0").exists() and divtrace.open_trace(tmp_path / "t").complete
        # distribute_tensor scatters through c10d into a buffer from empty_like, which no aten op writes: where
        # the buffer's old bytes were not already those, that write is recorded as a value from outside, with
        # the raw-write warning (tests/test_raw_writes.py); nothing else may be warned about.
        assert t.complete and set(t.meta["warnings"]) <= {recorder._RAW_WRITE}
        assert {"aten.mm.default", "aten.relu.default"} <= {r.op for r in t.records if r.kind == "op"}
        assert same_bits(t.tensor(t.calls[0].outputs[0][1]), out.to_local())
    finally:
        dist.destroy_process_group()


class _Proj(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 4, bias=False)  # its weight was initialised in place: version > 0

    def forward(self, x):
        return self.lin(x)


@pytest.mark.parametrize("mode", ["hash", "full"])
def test_view_of_a_modified_parameter_links_to_its_producer(tmp_path, mode):
    # Inside the dispatch mode a view's version counter still reads 0; it becomes its base's only after the op
    # returns. Recorded as 0, the transposed weight looked changed at its next read: it was hashed again and
    # entered the trace as a new value from outside, cutting the data flow from `t` to `mm`.
    m = _Proj()
    assert m.lin.weight._version > 0
    with torch.no_grad(), divtrace.record(m, tmp_path / "t", mode=mode):
        m(torch.randn(3, 8))
    t = Trace(tmp_path / "t")
    ops = {r.op: r for r in t.records if r.kind == "op"}
    assert ops["aten.mm.default"].inputs[1] == ops["aten.t.default"].outputs[0]
    assert sum(1 for v in t.values.values() if v.producer is None and v.shape == [8, 4]) == 0


class _InPlaceThenUse(nn.Module):
    def forward(self, x):
        y = x * 2
        y.add_(1)  # the version moves after the op returns; the next read must see the same value
        w = x * 1
        v = w.t()
        w.mul_(3)  # through the base: the view's bytes change
        return y * 3, v + 0


@pytest.mark.parametrize("mode", ["hash", "full"])
def test_in_place_results_keep_their_producer_and_changes_through_a_base_are_seen(tmp_path, mode):
    m = _InPlaceThenUse()
    x = torch.randn(2, 3)
    with torch.no_grad(), divtrace.record(m, tmp_path / "t", mode=mode):
        m(x)
    t = Trace(tmp_path / "t")
    ops = [r for r in t.records if r.kind == "op"]
    add_ = next(r for r in ops if r.op == "aten.add_.Tensor")
    mul3 = next(r for r in ops if r.op == "aten.mul.Tensor" and r.args[1] == 3)
    assert mul3.inputs[0] == add_.outputs[0]
    assert t.values[add_.outputs[0]].hash == tensor_hash(x * 2 + 1)
    plus = next(r for r in ops if r.op == "aten.add.Tensor")
    assert t.values[plus.inputs[0]].hash == tensor_hash((x * 3).t())  # not the stale (x * 1).t()


class _AsStrided(nn.Module):
    def __init__(self, transposed_copy: bool):
        super().__init__()
        self.transposed_copy = transposed_copy

    def forward(self, x):
        y = x.t().contiguous().t() if self.transposed_copy else x.clone()  # same values, other layout
        return torch.as_strided(y, (2, 2), (1, 4)) * 1  # reads storage (a strided view): the sides differ here


def test_as_strided_is_fingerprinted_by_its_bytes(tmp_path):
    # A strided view's fingerprint may be derived from its input's, which is sound only when the view's values
    # follow from the input's values. as_strided reads the storage: a derived fingerprint would call the two
    # sides' different bytes equal.
    x = torch.randn(3, 4)
    for name, flag in (("a", False), ("b", True)):
        m = _AsStrided(flag)
        with torch.no_grad(), divtrace.record(m, tmp_path / name, mode="hash"):
            m(x)
    hashes = []
    for name, flag in (("a", False), ("b", True)):
        t = Trace(tmp_path / name)
        r = next(r for r in t.records if r.kind == "op" and r.op == "aten.as_strided.default")
        y = x.t().contiguous().t() if flag else x.clone()
        assert t.values[r.outputs[0]].hash == tensor_hash(torch.as_strided(y, (2, 2), (1, 4)))
        hashes.append(t.values[r.outputs[0]].hash)
    assert hashes[0] != hashes[1]
    r = divtrace.bisect(tmp_path / "a", tmp_path / "b")
    assert r.verdict == "diverged" and r.first.module == ""


def test_shards_are_plain_safetensors(tmp_path):
    # The writer streams shards itself (safetensors.save built each whole file in memory first): the files must
    # stay what any safetensors reader loads, and the size it returns must be the file's.
    import json as _json

    from safetensors.torch import load_file

    from divtrace.trace.shards import write_shard

    g = torch.Generator().manual_seed(0)
    tensors = {"f32": torch.randn(7, generator=g), "bf16": torch.randn(5, generator=g).bfloat16(),
               "i64": torch.arange(3), "bool": torch.tensor([True, False, True]), "empty": torch.zeros(0),
               "c128": torch.randn(2, generator=g, dtype=torch.float64).to(torch.complex128),
               "fp8": torch.randn(9, generator=g).to(torch.float8_e4m3fn)}
    size = write_shard(tmp_path / "s.safetensors", tensors)
    raw = (tmp_path / "s.safetensors").read_bytes()
    assert size == len(raw)
    n = int.from_bytes(raw[:8], "little")
    assert n % 8 == 0 and _json.loads(raw[8:8 + n])["c128"]["dtype"] == "U8"  # no safetensors dtype: raw bytes
    back = load_file(tmp_path / "s.safetensors")
    for k, t in tensors.items():
        got = back[k].view(t.dtype) if k == "c128" else back[k]
        assert got.dtype == t.dtype and same_bits(got, t), k


class _Conj(nn.Module):
    def forward(self, z):
        return z.conj(), torch.conj_physical(z), z.conj().imag  # a lazy conjugate, a real one, a lazy negation


@pytest.mark.parametrize("mode", ["hash", "full"])
def test_lazy_conjugate_and_negative_views_record_their_values(tmp_path, mode):
    # Views with the conjugate (or negative) bit set used to raise inside the recorder (view_as_real refuses
    # them): the user's forward failed. Their fingerprint is that of the values they stand for.
    z = torch.randn(3, 4, dtype=torch.complex64, generator=torch.Generator().manual_seed(0))
    m = _Conj()
    with torch.no_grad(), divtrace.record(m, tmp_path / "t", mode=mode):
        lazy, real, imag = m(z)
    assert lazy.is_conj() and imag.is_neg()
    t = Trace(tmp_path / "t")
    outs = dict(t.calls[0].outputs)
    assert t.values[outs["out.0"]].hash == t.values[outs["out.1"]].hash == tensor_hash(real)
    assert t.values[outs["out.2"]].hash == tensor_hash(-z.imag)
    if mode == "full":
        assert same_bits(t.tensor(outs["out.0"]), real) and same_bits(t.tensor(outs["out.2"]), -z.imag)
