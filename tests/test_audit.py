"""divtrace audit on real HF Llama traces and on planted ops: a row reduction whose order depends on the batch
size (a split-K kernel) and an index_add_ whose order changes call to call (atomics), each in a small custom
module inside the model; a dropout (random) must be listed as not audited, never as clean."""
from __future__ import annotations

import json
from contextlib import contextmanager

import pytest
import torch
from torch import nn

from divtrace.audit import audit
from divtrace.cli.app import main
from helpers import record_model

# -- planted ops ---------------------------------------------------------------------------------------------
_MODE = {"invariant": False}


@torch.library.custom_op("divtrace_audit_test::row_sumsq", mutates_args=())
def row_sumsq(x: torch.Tensor) -> torch.Tensor:
    """Sum of squares over the last dim. Like a split-K kernel, the summation order depends on how many rows
    the call holds: from 4 rows on, each row is summed in two halves (unless the invariant mode is on)."""
    sq = x * x
    rows = x.numel() // x.shape[-1]
    if _MODE["invariant"] or rows < 4:
        return sq.sum(-1, keepdim=True)
    k = x.shape[-1] // 2
    return sq[..., :k].sum(-1, keepdim=True) + sq[..., k:].sum(-1, keepdim=True)


@row_sumsq.register_fake
def _(x):
    return x.new_empty(x.shape[:-1] + (1,))


@torch.library.custom_op("divtrace_audit_test::scatter_rows", mutates_args=())
def scatter_rows(src: torch.Tensor, index: torch.Tensor, n: int) -> torch.Tensor:
    """index_add_ of src's rows into n buckets, the rows taken in a new random order at each call (the order
    atomics land in on a GPU): with duplicate indices the float sums differ from call to call."""
    perm = torch.randperm(index.numel())
    return src.new_zeros((n,) + tuple(src.shape[1:])).index_add_(0, index[perm], src[perm])


@scatter_rows.register_fake
def _(src, index, n):
    return src.new_empty((n,) + tuple(src.shape[1:]))


@contextmanager
def invariant_mode():
    """The --under factory of the tests: the split-K row reduction sums every batch size the same way."""
    old = _MODE["invariant"]
    _MODE["invariant"] = True
    try:
        yield
    finally:
        _MODE["invariant"] = old


class SplitKRMSNorm(nn.Module):
    """Llama's RMSNorm with its variance from the batch-size-dependent row reduction."""

    def __init__(self, norm):
        super().__init__()
        self.weight, self.eps = norm.weight, norm.variance_epsilon

    def forward(self, h):
        var = torch.ops.divtrace_audit_test.row_sumsq(h.float()) / h.shape[-1]
        return self.weight * (h.float() * torch.rsqrt(var + self.eps)).to(h.dtype)


class BucketMix(nn.Module):
    """An MLP whose output gets a per-bucket sum of its rows added back (an MoE-style combine)."""

    def __init__(self, mlp):
        super().__init__()
        self.mlp = mlp

    def forward(self, x):
        y = self.mlp(x)
        flat = y.reshape(-1, y.shape[-1])
        idx = torch.arange(flat.shape[0]) % 4  # duplicate indices: 4 buckets
        pooled = torch.ops.divtrace_audit_test.scatter_rows(flat, idx, 4)
        return y + pooled.index_select(0, idx).reshape(y.shape)


class DropoutMLP(nn.Module):
    def __init__(self, mlp):
        super().__init__()
        self.mlp = mlp

    def forward(self, x):
        return nn.functional.dropout(self.mlp(x), 0.1, training=True)


def tiny_llama(dtype=torch.float32, seq=32):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg).to(dtype).eval()
    ids = torch.randint(0, 128, (1, seq), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids, "use_cache": False}


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # recorded with one thread: the audit replays with the recorded count
    try:
        yield _record_all(tmp_path_factory.mktemp("audit"))
    finally:
        torch.set_num_threads(threads)


def _record_all(d):
    model, inputs = tiny_llama(torch.float32)
    record_model(model, inputs, d / "fp32", mode="full")
    model, inputs = tiny_llama(torch.bfloat16)
    record_model(model, inputs, d / "bf16", mode="full")
    model, inputs = tiny_llama(torch.float32)
    model.model.norm = SplitKRMSNorm(model.model.norm)
    model.model.layers[0].mlp = BucketMix(model.model.layers[0].mlp)
    model.model.layers[1].mlp = DropoutMLP(model.model.layers[1].mlp)
    record_model(model, inputs, d / "planted", mode="full")
    model, inputs = tiny_llama(torch.float32)
    record_model(model, inputs, d / "hash", mode="hash")
    return d


@pytest.fixture(scope="module")
def fp32(traces):
    return audit(traces / "fp32")


@pytest.fixture(scope="module")
def planted(traces):
    return audit(traces / "planted").to_dict()


def _ops(r, short):
    return [o for o in r.ops if o.op == f"aten.{short}"]


def test_fp32_llama_every_linear_matmul_is_not_batch_invariant(fp32):
    mms = _ops(fp32, "mm.default")
    assert len(mms) == 2 * 7 + 1  # q k v o gate up down per layer, and lm_head
    for o in mms:
        assert o.audited and o.deterministic is True
        assert o.batch_invariant is False, (o.module, o.why)
        assert 1 in o.rows_differ_at and o.max_ulp > 0  # a row alone (M=1) differs from the row in the batch
        assert o.module_class == "Linear"
    # every finding of the fp32 forward is a matmul or attention: on this CPU elementwise ops are invariant
    d = fp32.to_dict()
    assert {f["op"] for f in d["findings"]} <= {"aten.mm.default",
                                                "aten._scaled_dot_product_flash_attention_for_cpu.default"}
    assert sum(f["count"] for f in d["findings"] if f["op"] == "aten.mm.default") == 15


def test_fp32_llama_elementwise_and_embedding_are_invariant(fp32):
    for short in ("add.Tensor", "mul.Tensor", "silu.default", "embedding.default", "rsqrt.default", "mean.dim"):
        ops = _ops(fp32, short)
        assert ops, short
        for o in ops:
            assert o.audited and o.deterministic is True and not o.finding, (short, o.module, o.why)
            if not o.constant:
                assert o.batch_invariant is True and o.rows_differ_at == [] and 1 in o.rows_checked_at
    emb = _ops(fp32, "embedding.default")[0]
    assert emb.family == "embedding" and emb.n_rows == 32 and emb.rows_checked_at == [1, 16, 31, 65]
    clean = {c["op"] for c in fp32.to_dict()["clean"]}
    assert {"aten.add.Tensor", "aten.mul.Tensor", "aten.silu.default", "aten.embedding.default"} <= clean


def test_json_contract_and_exit_code(traces, capsys):
    capsys.readouterr()
    assert main(["audit", str(traces / "fp32"), "--json"]) == 1
    d = json.loads(capsys.readouterr().out)
    assert d["verdict"] == "findings"
    assert d["ops"] == d["audited"] + d["not_audited"] and d["ops"] > 0
    first = d["findings"][0]
    for key, kind in (("module", str), ("op", str), ("count", int), ("batch_invariant", bool),
                      ("deterministic", bool), ("rows_differ_at", list), ("max_ulp", int), ("time_share", float)):
        assert isinstance(first[key], kind), key
    # grouped by (module class, op, shapes): the 8 square projections of 2 layers are one line, first occurrence
    q = d["findings"][0]
    assert (q["module"], q["op"], q["count"]) == ("model.layers.0.self_attn.q_proj", "aten.mm.default", 8)
    # per token: the 32 rows of the matmul are the 32 tokens of the one sequence
    assert q["tokens"][:2] == [{"row": 0, "seq": 0, "slot": 0, "position": 0},
                               {"row": 1, "seq": 0, "slot": 1, "position": 1}] and len(q["tokens"]) == 32
    assert [f["record"] for f in d["findings"]] == sorted(f["record"] for f in d["findings"])
    assert 0 < sum(f["time_share"] for f in d["findings"]) <= 1


def test_text_report_first_line(traces, capsys):
    capsys.readouterr()
    assert main(["audit", str(traces / "fp32")]) == 1
    out = capsys.readouterr().out
    first = out.splitlines()[0]
    assert first.startswith("AUDIT: ") and "not batch-invariant" in first and "not deterministic" in first
    assert "NOT BATCH-INVARIANT: aten.mm.default in model.layers.0.self_attn.q_proj (Linear) x8" in out
    assert "FAILED: findings" in out


def test_bf16_attention_is_a_finding(traces):
    r = audit(traces / "bf16")
    attn = [g for g in r.to_dict()["findings"] if "scaled_dot_product" in g["op"]]
    assert attn and attn[0]["batch_invariant"] is False and attn[0]["deterministic"] is True
    assert attn[0]["module"] == "model.layers.0.self_attn" and attn[0]["count"] == 2
    assert 1 in attn[0]["rows_differ_at"]  # decoding a token alone against its prefix differs from prefill


def test_planted_row_reduction_is_found_and_named(planted):
    d = planted
    f = [g for g in d["findings"] if g["op"] == "divtrace_audit_test.row_sumsq.default"]
    assert len(f) == 1
    f = f[0]
    assert f["module"] == "model.norm" and f["module_class"] == "SplitKRMSNorm"
    assert f["batch_invariant"] is False and f["deterministic"] is True
    assert f["rows_differ_at"] == [1]  # below 4 rows it sums the other way; 16, 31 and 65 rows agree
    assert f["family"] == "leading dim (assumed)" and f["n_rows"] == 32


def test_under_a_mode_clears_the_planted_row_reduction(traces):
    r = audit(traces / "planted", under="test_audit:invariant_mode")
    ops = [o for o in r.ops if o.op == "divtrace_audit_test.row_sumsq.default"]
    assert len(ops) == 1 and ops[0].batch_invariant is True and not ops[0].finding
    assert _MODE["invariant"] is False  # left as it was
    assert r.to_dict()["under"] == "test_audit:invariant_mode"


def test_planted_nondeterministic_op_is_found_and_named(planted):
    d = planted
    f = [g for g in d["findings"] if g["op"] == "divtrace_audit_test.scatter_rows.default"]
    assert len(f) == 1
    f = f[0]
    assert f["deterministic"] is False and f["module"] == "model.layers.0.mlp"
    assert f["batch_invariant"] is None  # not compared across batches: the same batch already differs
    assert d["not_deterministic"] >= 1 and "1 not deterministic" in d["headline"]


def test_random_op_is_not_audited_never_clean(planted):
    d = planted
    # eager dropout is empty_like + bernoulli_ (the random mask) + div_ + mul
    drop = [n for n in d["not_audited_ops"] if n["op"] == "aten.bernoulli_.float"]
    assert drop and drop[0]["module"] == "model.layers.1.mlp" and "random" in drop[0]["why"]
    assert drop[0]["deterministic"] is None  # not run at all
    assert not any("bernoulli" in c["op"] for c in d["clean"])
    assert d["not_audited"] >= 1 and d["ops"] == d["audited"] + d["not_audited"]


def test_hash_trace_is_bad_input_with_the_command(traces, capsys):
    capsys.readouterr()
    assert main(["audit", str(traces / "hash")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "hash mode" in err[0] and "--mode full" in err[0] and "divtrace record" in err[0]


def test_trace_without_computing_ops_is_an_error(tmp_path, capsys):
    model = nn.Flatten()
    record_model(model, (torch.randn(2, 3, 4),), tmp_path / "t", mode="full")
    capsys.readouterr()
    assert main(["audit", str(tmp_path / "t")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no computing ops" in err[0]


def test_plot(traces, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "audit.png"
    assert main(["audit", str(traces / "bf16"), "--plot", str(out)]) == 1
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_moe_grouped_matmul_is_not_audited_never_cut(tmp_path):
    """Regression: the MoE experts' _grouped_mm takes group offsets; cutting its rows without them made false
    findings. Indexing and grouped ops are not audited (with why); the router and attention still are."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    cfg = MixtralConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)
    model = MixtralForCausalLM(cfg).eval()
    ids = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(1))
    record_model(model, {"input_ids": ids, "use_cache": False}, tmp_path / "moe", mode="full")
    threads, prec = torch.get_num_threads(), torch.get_float32_matmul_precision()
    d = audit(tmp_path / "moe").to_dict()
    assert (torch.get_num_threads(), torch.get_float32_matmul_precision()) == (threads, prec)  # restored
    assert not any(f["op"] in ("aten._grouped_mm.default", "aten.index.Tensor") for f in d["findings"])
    na = {n["op"]: n["why"] for n in d["not_audited_ops"]}
    if "aten._grouped_mm.default" in {o for o in na}:  # transformers versions without grouped experts loop instead
        assert "no row rule" in na["aten._grouped_mm.default"]
    assert not any(c["op"] == "aten._grouped_mm.default" for c in d["clean"])
    assert any(f["module_class"] == "MixtralTopKRouter" or f["module"].endswith(".gate") for f in d["findings"]
               if f["op"] == "aten.mm.default")


def test_every_op_replays_its_recorded_output(fp32, traces):
    """The replay is the recording's computation: each op re-run from its recorded inputs (recorded layouts,
    device and dtype constants decoded by the repro generator's code) gives the recorded bytes."""
    for r in (fp32, audit(traces / "bf16")):
        assert r.ops and all(o.audited for o in r.ops), [(o.op, o.why) for o in r.ops if not o.audited]
        assert all(o.replays_record is True for o in r.ops), [o.op for o in r.ops if not o.replays_record]
        assert not any(o.notes for o in r.ops if o.family != "attention")


def test_trace_without_ops_is_bad_input(tmp_path, capsys):
    record_model(nn.Linear(8, 8), (torch.randn(4, 8),), tmp_path / "t", mode="full", ops=False)
    capsys.readouterr()
    assert main(["audit", str(tmp_path / "t")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "without ops" in err[0] and "--mode full" in err[0]


def test_linear_with_bias_layer_norm_softmax_rows(tmp_path):
    """addmm's bias is shared by every row, layer_norm and softmax work along the last dim: each gets a row
    plan over the 12 tokens, none is left unaudited."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.Softmax(dim=-1))
    record_model(model, (torch.randn(3, 4, 16),), tmp_path / "t", mode="full")
    r = audit(tmp_path / "t")
    fam = {o.op: (o.family, o.n_rows) for o in r.ops}
    assert fam["aten.addmm.default"] == ("matmul", 12)
    assert fam["aten.native_layer_norm.default"] == ("norm", 4)  # T of [B, T, H]: the dim before the norm's
    assert fam["aten._softmax.default"] == ("along a dim", 4)
    assert all(o.audited and o.deterministic for o in r.ops)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_bf16_llama(tmp_path):
    """On a GPU: the SDPA kernels' RNG state, workspaces and debug outputs are not taken for nondeterminism,
    every op replays its recorded bytes, and attention is audited (a flash kernel that takes no mask runs
    single rows only, with a note). Written without a GPU at hand: it has not run yet."""
    model, inputs = tiny_llama(torch.bfloat16)
    model = model.cuda()
    inputs = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    record_model(model, inputs, tmp_path / "t", mode="full")
    r = audit(tmp_path / "t")
    attn = [o for o in r.ops if "scaled_dot_product" in o.op]
    assert attn and all(o.deterministic is True and o.audited for o in attn), [(o.op, o.why) for o in attn]
    assert all(o.replays_record for o in r.ops if o.audited), [o.op for o in r.ops if o.audited and not o.replays_record]
    assert r.device.startswith("cuda")


def test_rows_cut_from_the_middle_dim_are_packed(tmp_path):
    """Regression: tokens of a [B, T, H] activation cut as a strided view sent CPU gelu down its
    non-vectorized path, a false finding (the view differs, not the batch). Cut rows are laid out densely."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), nn.GELU())
    record_model(model, (torch.randn(2, 16, 32),), tmp_path / "t", mode="full")
    gelu = [o for o in audit(tmp_path / "t").ops if o.op == "aten.gelu.default"]
    assert len(gelu) == 1 and gelu[0].n_rows == 16  # T, not B
    assert gelu[0].batch_invariant is True, gelu[0].rows_differ_at


def test_tokens_from_the_recorded_grid_padding_has_no_position(tmp_path):
    """The per-token view reads the trace's token grid: with left padding, a padded slot is no token
    (position None) and the first real token of the padded sequence is position 0."""
    model, inputs = tiny_llama(torch.float32, seq=8)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    record_model(model, {"input_ids": ids, "attention_mask": mask, "use_cache": False}, tmp_path / "t", mode="full")
    r = audit(tmp_path / "t")
    mm = next(o for o in r.ops if o.op == "aten.mm.default" and o.module.endswith("q_proj"))
    assert mm.batch_invariant is False and mm.n_rows == 16
    by_row = {x["row"]: x for x in mm.tokens}
    assert by_row[0]["position"] is None and by_row[0]["seq"] is None  # a padded slot
    assert by_row[3]["position"] == 0 and by_row[3]["seq"] is not None
    assert by_row[8]["position"] == 0 and by_row[15]["position"] == 7
    assert by_row[3]["seq"] != by_row[8]["seq"]
