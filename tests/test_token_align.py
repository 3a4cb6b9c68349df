"""Token-aligned bisect on real rollouts against real trainer recomputes (HF LlamaForCausalLM).

Each case records a rollout (generate with a KV cache over a left-padded batch) and a trainer recompute
(full-sequence forwards in right-padded micro-batches) of the same weights, with a divergence planted in one
named place of one side's real model code, and asserts that bisect names that place, the op, the token and the
rows each side's op ran over.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import divtrace
from divtrace.compare.bisect import bisect
from divtrace.errors import DivtraceError
from divtrace.trace.reader import Trace

sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
import token_cases as tc  # noqa: E402

pytest.importorskip("transformers")

FIRST_DECODED = 12  # the shorter prompt holds 12 tokens: its first generated token sits at position 12


def _record(tmp_path, name, dtype, mode, plant_rollout=None, plant_trainer=None):
    roll, train = tmp_path / f"{name}-rollout", tmp_path / f"{name}-train"
    m_roll, m_train = tc.llama(dtype), tc.llama(dtype)
    if plant_rollout:
        plant_rollout(m_roll)
    if plant_trainer:
        plant_trainer(m_train)
    seqs = tc.rollout(m_roll, roll, tc.prompts(), mode=mode)
    tc.trainer(m_train, train, seqs, mode=mode)
    return train, roll


def _cli(*args):
    p = subprocess.run([sys.executable, "-m", "divtrace", *map(str, args)], capture_output=True, text=True, timeout=300)
    return p.returncode, p.stdout, p.stderr


@pytest.fixture(scope="module")
def down_proj_traces(tmp_path_factory):
    """bf16 (whose matmuls are batch-invariant on this CPU) with a batch-size-dependent matmul planted in the
    rollout's layer-1 down_proj: split-K at decode sizes."""
    tmp = tmp_path_factory.mktemp("tok")
    return {mode: _record(tmp, f"dp-{mode}", torch.bfloat16, mode,
                          plant_rollout=lambda m: tc.batch_dependent_linear(m.model.layers[1].mlp.down_proj))
            for mode in ("full", "hash")}


@pytest.mark.parametrize("mode", ["full", "hash"])
def test_batch_dependent_matmul_is_named_with_its_rows(down_proj_traces, mode):
    train, roll = down_proj_traces[mode]
    r = bisect(train, roll)
    d = r.to_dict()
    assert r.exit_code == 1 and d["verdict"] == "diverged" and d["alignment"] == "tokens"
    f = d["first"]
    assert (f["module"], f["op"], f["op_b"], f["cause"]) == ("model.layers.1.mlp.down_proj", "aten.mm.default",
                                                              "aten.mm.default", "origin")
    # the trainer ran the matmul over both micro-batch rows (2 x 20), the decode step over the 2 sequences
    assert f["rows"] == {"a": 40, "b": 2}
    # The decode step ran another algorithm (slice, mm, mm, add: split-K), not the trainer's mm at another batch
    # size: no batch-invariance cause is stated (issue 26 snag 9); the fp32 test below, with one mm on each side, has it.
    assert "batch_invariance" not in f
    assert [r["op"] for r in f["region_a"]].count("aten.mm.default") == 1
    assert [r["op"] for r in f["region_b"]].count("aten.mm.default") == 2
    if mode == "full":  # HF's output is named logits: the logprob figures need no caveat
        assert d["final"]["kl"] is not None and d["final"]["caveat"] is None
    tok = f["token"]
    assert tok["position"] == FIRST_DECODED and tok["b"] == {"call": 1, "row": 0, "batch_row": 0, "col": 0}
    assert tok["a"]["call"] == 0 and tok["a"]["col"] == FIRST_DECODED
    assert tok["seq"]["first_ids"] == tc.prompts()[0][:8]
    # every token the rollout generated from (2 prompts of 12 and 16, 3 decode steps) is shared; the trainer
    # also recomputes the last sampled token, which the rollout never fed back
    nrc = d["tokens"].pop("not_row_compared")
    # the logprobs of every token the rollout sampled from are compared (generate's prefill returns the last
    # prompt token's logits only): 8, of which the 6 decode steps' differ; one walk per first differing module
    assert {k: d["tokens"][k] for k in ("shared", "only_a", "only_b", "differing", "final_compared",
                                        "final_differing", "walked")} == {
        "shared": 34, "only_a": 2, "only_b": 0, "differing": 6, "final_compared": 8, "final_differing": 6, "walked": 6}
    assert d["tokens"]["modules"]["model.layers.1.mlp.down_proj"] == 6 and d["absorbed"] == []
    assert nrc["a"] > 0 and nrc["b"] > 0  # the 4-D attention masks
    assert [o["module"] for o in d["origins"]] == ["model.layers.1.mlp.down_proj"] and d["origins"][0]["tokens"] == 6
    fin = d["final"]
    assert fin["tokens_compared"] == 8 and fin["tokens_differing"] == 6
    assert fin["first_differing_token"]["position"] == FIRST_DECODED
    if mode == "full":
        assert f["metrics_available"] and f["max_abs"] > 0 and f["shape"] == [128]  # one token's row
        assert fin["max_abs_logprob_diff"] > 0 and fin["kl"] >= 0 and fin["kl_k3"] >= 0
        assert fin["token_mult_prob_error"] >= 1.0 and fin["kl_direction"] == "train||rollout"


def test_json_doc_lists_the_token_keys(down_proj_traces):
    """docs/json.md's token tables name every key a token-aligned result emits (and nothing it does not)."""
    from test_docs_drift import ROOT, _documented_keys

    d = bisect(*down_proj_traces["full"]).to_dict()
    keys = _documented_keys(ROOT / "docs" / "json.md")
    top = keys["Top level"] | keys["Token-aligned top level"]
    assert set(d) == top
    first = next(v for k, v in keys.items() if k.startswith("`first`")) | keys["Token-aligned `first`"]
    # batch_invariance only where the sides ran the same ops (not this split-K plant: test_token_align above)
    optional = {"batch_invariance", "cause_text", "positions", "note", "reaches"}  # (only for some kinds of origin)
    assert set(d["first"]) <= first and first - set(d["first"]) <= optional, first ^ set(d["first"])
    assert set(d["origins"][0]) <= first | {"tokens"} and (first | {"tokens"}) - set(d["origins"][0]) <= optional
    # (max_abs_logprob_diff_declared only where logprobs were compared: not here, logits on both sides)
    assert set(d["final"]) == keys["Token-aligned `final`"] - {"max_abs_logprob_diff_declared"}


def test_plot_is_a_token_by_module_picture(down_proj_traces, tmp_path):
    pytest.importorskip("matplotlib")
    train, roll = down_proj_traces["hash"]
    png = tmp_path / "parting.png"
    rc, _, err = _cli("bisect", train, roll, "--plot", png)
    assert rc == 1, err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    r = bisect(train, roll)
    rank, row = r.module_rows["model.layers.1.mlp.down_proj"]
    assert sum(row.values()) == 6  # the decoded tokens, from the planted module on
    assert sum(r.module_rows["model.layers.1.mlp.up_proj"][1].values()) == 0  # before it in forward order
    rc, _, err = _cli("bisect", train, roll, "--html", tmp_path / "r.html")
    assert rc == 2 and "--html is not made for a token-aligned bisect" in err


def test_cli_names_the_token_and_the_batch_size_cause(down_proj_traces):
    train, roll = down_proj_traces["hash"]
    rc, out, err = _cli("bisect", train, roll)
    assert rc == 1, err
    text = " ".join(out.split())
    assert ("FAILED: logprobs differ on 6 of 8 tokens; first divergence originates in model.layers.1.mlp.down_proj "
            "call 0 op aten.mm.default") in text
    assert f"at token position {FIRST_DECODED}" in text and "not batch-invariant" not in text
    assert "34 shared, 2 only in a, 0 only in b, 6 differ" in text
    rc, out, _ = _cli("bisect", train, roll, "--json")
    d = json.loads(out)
    assert rc == 1 and d["alignment"] == "tokens" and d["first"]["token"]["position"] == FIRST_DECODED
    # the same traces by calls: the decode steps have no counterpart, so token alignment is what finds it
    rc, out, _ = _cli("bisect", train, roll, "--json", "--align", "calls")
    assert json.loads(out)["alignment"] == "calls"


def test_fp32_rollout_against_trainer_on_this_cpu(tmp_path):
    """No plant: fp32 matmuls on this CPU give another row at M=2 than at M=40. Where they do, bisect must say
    q_proj (the first matmul of the first layer on a decode step) and the batch-size cause; where the CPU's
    kernels are batch-invariant, it must say identical."""
    for mode in ("full", "hash"):
        train, roll = _record(tmp_path, f"fp32-{mode}", torch.float32, mode)
        d = bisect(train, roll).to_dict()
        if d["verdict"] == "identical":
            pytest.skip("this CPU's fp32 matmuls are batch-invariant")
        f = d["first"]
        assert (f["module"], f["op"], f["cause"]) == ("model.layers.0.self_attn.q_proj", "aten.mm.default", "origin")
        assert f["rows"] == {"a": 40, "b": 2} and f["batch_invariance"]["batch_invariant"] is False
        assert f["token"]["position"] == FIRST_DECODED


@pytest.mark.parametrize("mode", ["full", "hash"])
def test_rmsnorm_cast_order_in_bf16_rollout(tmp_path, mode):
    def plant(m):
        for x in m.modules():
            if type(x).__name__ == "LlamaRMSNorm":
                tc.rmsnorm_cast_after_weight(x)

    train, roll = _record(tmp_path, "rms", torch.bfloat16, mode, plant_rollout=plant)
    d = bisect(train, roll).to_dict()
    f = d["first"]
    assert d["verdict"] == "diverged" and f["module"] == "model.layers.0.input_layernorm" and f["cause"] == "origin"
    assert (f["op"], f["op_b"]) == ("aten._to_copy.default", "aten.mul.Tensor")
    assert "batch_invariance" not in f  # another op on each side: another computation, not a batch-size effect
    # every token's norm output differs from the first prompt token on; the first whose logprob both sides
    # computed is the last prompt token (generate's prefill returns its logits only)
    assert d["tokens"]["modules"]["model.layers.0.input_layernorm"] == 34
    assert f["token"]["position"] == len(tc.prompts()[0]) - 1 and f["tokens"] == 8


@pytest.mark.parametrize("mode", ["full", "hash"])
def test_decode_attention_against_full_sequence_attention(tmp_path, mode):
    train, roll = _record(tmp_path, "splitkv", torch.bfloat16, mode, plant_rollout=tc.split_kv_decode_attention)
    d = bisect(train, roll).to_dict()
    f = d["first"]
    assert d["verdict"] == "diverged" and f["module"] == "model.layers.0.self_attn" and f["cause"] == "origin"
    assert f["op"] == "aten._scaled_dot_product_flash_attention_for_cpu.default" and f["op_b"] == "aten.bmm.default"
    assert f["token"]["position"] >= FIRST_DECODED and f["token"]["b"]["call"] >= 1  # only decode steps differ
    assert d["tokens"]["differing"] == 6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_left_padded_prefill_against_right_padded_batch_is_identical(tmp_path, dtype):
    m = tc.llama(dtype)
    for name, pad in (("left", tc.left_padded), ("right", tc.right_padded)):
        ids, mask = pad(tc.prompts())
        with torch.no_grad(), divtrace.record(m, tmp_path / name, mode="hash", label=name):
            m(input_ids=ids, attention_mask=mask, position_ids=tc.positions(mask))
    rc, out, err = _cli("bisect", tmp_path / "left", tmp_path / "right", "--json")
    d = json.loads(out)
    assert rc == 0, err
    assert d["verdict"] == "identical" and d["alignment"] == "tokens" and d["first"] is None
    assert d["tokens"]["shared"] == 28 and d["tokens"]["final_compared"] == 28 and d["tokens"]["differing"] == 0
    rc, out, _ = _cli("bisect", tmp_path / "left", tmp_path / "right")
    assert rc == 0 and "PASSED: identical: logprobs bitwise identical on 28/28 tokens; 28 shared tokens" in \
        " ".join(out.split())


# -- explicit declarations and the alignment self-check ----------------------------------------------------------

class FlatEngine(torch.nn.Module):
    """An engine-style model over flattened tokens [N]: embedding, RMSNorm, a projection, logits. With
    `sorts_rows` it processes the rows in another order than it was given them (a scheduler that reorders
    requests) and puts the outputs back: the declared token order then does not match the rows inside."""

    def __init__(self, sorts_rows: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(tc.VOCAB, 64)
        self.norm = torch.nn.RMSNorm(64)
        self.proj = torch.nn.Linear(64, 64)
        self.head = torch.nn.Linear(64, tc.VOCAB, bias=False)
        self.sorts_rows = sorts_rows

    def forward(self, input_ids, positions):
        order = torch.arange(input_ids.shape[0])
        if self.sorts_rows:
            order = order.flip(0)
            input_ids = input_ids[order]
        h = self.proj(self.norm(self.embed(input_ids)))
        logits = self.head(h)
        return logits[order.argsort()] if self.sorts_rows else logits


def _engine_trace(path, engine, seqs):
    ids = [t for s in seqs for t in s]
    pos = [p for s in seqs for p in range(len(s))]
    handles = [f"req-{i}" for i, s in enumerate(seqs) for _ in s]
    with torch.no_grad(), divtrace.record(engine, path, mode="hash") as rec:
        rec.tokens(ids, pos, seqs=handles)
        engine(torch.tensor(ids), torch.tensor(pos))


def test_misaligned_rows_are_refused_not_explained(tmp_path):
    seqs = tc.prompts((5, 7))
    _engine_trace(tmp_path / "good", FlatEngine(), seqs)
    _engine_trace(tmp_path / "sorted", FlatEngine(sorts_rows=True), seqs)
    rc, out, err = _cli("bisect", tmp_path / "good", tmp_path / "sorted", "--align", "tokens")
    assert rc == 2 and out == ""
    assert err.startswith("divtrace: error: token alignment is wrong: layout: the embedding lookup gives different rows")
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    with pytest.raises(DivtraceError, match="token alignment is wrong"):
        bisect(tmp_path / "good", tmp_path / "sorted", align="tokens")
    # the same engine twice: aligned and identical
    _engine_trace(tmp_path / "good2", FlatEngine(), seqs)
    assert bisect(tmp_path / "good", tmp_path / "good2", align="tokens").verdict == "identical"


def test_different_position_ids_for_the_same_token_are_a_cause(tmp_path):
    """The same tokens fed other position ids: not an alignment error (the tokens are the same content), but the
    cause of their difference, named before any op (issue 28)."""
    m = tc.llama(torch.float32, layers=1)
    ids, mask = tc.right_padded(tc.prompts())
    for name, shift in (("a", 0), ("b", 1)):
        with torch.no_grad(), divtrace.record(m, tmp_path / name, mode="hash"):
            m(input_ids=ids, attention_mask=mask, position_ids=tc.positions(mask) + shift)
    d = bisect(tmp_path / "a", tmp_path / "b", align="tokens").to_dict()
    assert d["verdict"] == "diverged" and d["first"]["kind"] == "positions"
    assert d["first"]["cause_text"].startswith("position ids differ on 28 tokens: a 0.., b 1..")


def test_declared_tokens_match_the_automatic_ones(tmp_path):
    """A hand-written decode loop that declares its tokens with rec.tokens (request ids chain the steps) gives
    the same token keys as HF-style identity read from generate's own calls."""
    m = tc.llama(torch.float32, layers=1)
    prompt = tc.prompts((9,))[0]
    tc.rollout(m, tmp_path / "auto", [prompt], new_tokens=3, mode="hash")
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.no_grad(), divtrace.record(m, tmp_path / "declared", mode="hash") as rec:
        ids = list(prompt)
        rec.tokens(ids, list(range(len(ids))), seqs=["r0"] * len(ids))
        out = m(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True, logits_to_keep=1)
        for _ in range(2):
            nxt = int(out.logits[0, -1].argmax())
            rec.tokens([nxt], [len(ids)], seqs=["r0"])
            out = m(input_ids=torch.tensor([[nxt]]), past_key_values=cache, use_cache=True,
                    position_ids=torch.tensor([[len(ids)]]))
            ids.append(nxt)

    def keys(p):
        return sorted(k for g in Trace(p).token_index().grids.values() for k in g.keys if k)
    assert keys(tmp_path / "auto") == keys(tmp_path / "declared") and len(keys(tmp_path / "auto")) == 11


# -- bad input ---------------------------------------------------------------------------------------------------

def test_declarations_that_do_not_fit_are_one_line_errors(tmp_path):
    e = FlatEngine()
    with pytest.raises(DivtraceError, match="3 ids but 2 positions"):
        with divtrace.record(e, tmp_path / "x1", mode="hash") as rec:
            rec.tokens([1, 2, 3], [0, 1])
    with pytest.raises(DivtraceError, match=r"declared 3 token rows but root call 0 of FlatEngine takes \[4\] token ids"):
        with torch.no_grad(), divtrace.record(e, tmp_path / "x2", mode="hash") as rec:
            rec.tokens([1, 2, 3], [0, 1, 2])
            e(torch.tensor([1, 2, 3, 4]), torch.tensor([0, 1, 2, 3]))
    with pytest.raises(DivtraceError, match="row 1 declares token id 9 but root call 0 of FlatEngine takes id 2"):
        with torch.no_grad(), divtrace.record(e, tmp_path / "x3", mode="hash") as rec:
            rec.tokens([1, 9, 3], [0, 1, 2])
            e(torch.tensor([1, 2, 3]), torch.tensor([0, 1, 2]))
    with pytest.raises(DivtraceError, match="pass seqs="):
        with torch.no_grad(), divtrace.record(e, tmp_path / "x4", mode="hash") as rec:
            rec.tokens([1, 2], [0, 0])
            e(torch.tensor([1, 2]), torch.tensor([0, 0]))
            rec.tokens([5], [1])  # two sequences hold 1 token: which one does this continue?
            e(torch.tensor([5]), torch.tensor([1]))


def test_traces_that_share_no_token(tmp_path):
    _engine_trace(tmp_path / "a", FlatEngine(), [[1, 2, 3]])
    _engine_trace(tmp_path / "b", FlatEngine(), [[4, 5, 6]])
    rc, out, err = _cli("bisect", tmp_path / "a", tmp_path / "b", "--align", "tokens")
    assert rc == 2 and "share no token" in err and "a holds 3 tokens in 1 sequences" in err
    assert "b holds 3 tokens in 1 sequences" in err


def test_align_tokens_on_a_trace_without_tokens(tmp_path):
    e = FlatEngine()
    for name in ("a", "b"):
        with torch.no_grad(), divtrace.record(e.norm, tmp_path / name, mode="hash"):
            e.norm(torch.randn(3, 64, generator=torch.Generator().manual_seed(0)))
    rc, _, err = _cli("bisect", tmp_path / "a", tmp_path / "b", "--align", "tokens")
    assert rc == 2 and "carries no token identity" in err and "rec.tokens" in err
    rc, _, err = _cli("bisect", tmp_path / "a", tmp_path / "b")  # auto: by calls
    assert rc == 0, err


def test_a_stopped_trainer_is_never_identical(tmp_path):
    """The trainer's second micro-batch never ran: nothing shared differs, but the tokens it would have
    recomputed were not seen, and the trace is incomplete: never 'identical'."""
    m = tc.llama(torch.bfloat16)
    seqs = tc.rollout(m, tmp_path / "roll", tc.prompts(), mode="hash")
    with pytest.raises(RuntimeError):
        with torch.no_grad(), divtrace.record(m, tmp_path / "train", mode="hash"):
            ids, mask = tc.right_padded(seqs[:1])
            m(input_ids=ids, attention_mask=mask, position_ids=tc.positions(mask))
            raise RuntimeError("preempted")
    r = bisect(tmp_path / "train", tmp_path / "roll")
    assert r.verdict != "identical" and r.exit_code != 0


def test_layout_inference_and_overrides(tmp_path):
    from divtrace.trace import token_layout as layout

    g = [2, 5]
    assert layout.infer((2, 5, 8), g, 5) == "bt" and layout.infer((10, 8), g, 5) == "n"
    assert layout.infer((2, 4, 5, 8), g, 5) == "bht" and layout.infer((2, 4, 5, 5), g, 5) == "x"
    assert layout.infer((2, 5, 5, 8), g, 5) == "?"  # heads == T: [B, H, T, d] or [B, T, H, d]?
    assert layout.infer((2, 1, 8), g, 5) is None and layout.infer((2, 1, 8), g, 5, root_output=True) == "last1"
    assert layout.infer((2, 1, 8), [2, 1], 7) == "bt" and layout.infer((2, 4, 1, 8), [2, 1], 7) == "bht"
    assert layout.infer((2, 1, 1, 7), [2, 1], 7) == "x"  # a decode step's 4-D mask
    e = FlatEngine()
    with pytest.raises(DivtraceError, match=r"token_layouts\['proj'\] = 'bt' does not fit a tensor of shape \[3, 64\]"):
        with torch.no_grad(), divtrace.record(e, tmp_path / "o1", mode="hash", token_layouts={"proj": "bt"}) as rec:
            rec.tokens([1, 2, 3], [0, 1, 2])
            e(torch.tensor([1, 2, 3]), torch.tensor([0, 1, 2]))
    with pytest.raises(DivtraceError, match="'xy' is not a layout"):
        divtrace.record(e, tmp_path / "o2", token_layouts={"proj": "xy"})
    with torch.no_grad(), divtrace.record(e, tmp_path / "o3", mode="hash", token_layouts={"^proj$": "none"}) as rec:
        rec.tokens([1, 2, 3], [0, 1, 2])
        e(torch.tensor([1, 2, 3]), torch.tensor([0, 1, 2]))
    from divtrace.trace.reader import Trace

    t = Trace(tmp_path / "o3")
    idx = t.token_index().index
    proj = next(c for c in t.calls.values() if c.module == "proj")
    norm = next(c for c in t.calls.values() if c.module == "norm")
    assert proj.outputs[0][1] not in idx and norm.outputs[0][1] in idx
    with torch.no_grad(), divtrace.record(e, tmp_path / "o4", mode="hash", tokens=False) as rec:
        e(torch.tensor([1, 2, 3]), torch.tensor([0, 1, 2]))
    assert not (tmp_path / "o4" / "tokens.jsonl").exists()


def _torch_row_hashes(x):
    """row_hashes by the torch path (GPUs, machines without a compiler), whatever this machine built."""
    from divtrace.record import rowhash

    native, rowhash._native_rows = rowhash._native_rows, None
    try:
        return rowhash.row_hashes(x)
    finally:
        rowhash._native_rows = native


def test_row_fingerprints_c_and_torch_agree_and_see_every_bit():
    from divtrace.record import rowhash

    if rowhash._native_rows is None:
        pytest.skip("the C kernel is not built here")
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.bool, torch.float64):
        for cols in (1, 13, 14, 16, 1030):
            x = (torch.randn(5, cols, generator=g) * 50).to(dtype)
            assert (rowhash.row_hashes(x) == _torch_row_hashes(x)).all(), (dtype, cols)
    # a [16, 1] column with stride 16 on its size-1 dim (found on a GPU, where the torch path runs): both agree
    col = torch.arange(32).reshape(2, 16).t()[:, :1]
    assert col.stride() == (1, 16)
    assert (rowhash.row_hashes(col) == _torch_row_hashes(col)).all()
    odd = torch.randn(40, generator=g).to(torch.bfloat16)[1:37].reshape(3, 12)  # starts 2 bytes into a 4-byte lane
    assert (rowhash.row_hashes(odd) == _torch_row_hashes(odd)).all()
    x = torch.zeros(3, 4)
    y = x.clone()
    y[1, 2] = -0.0  # one bit: the sign of a zero
    hx, hy = rowhash.row_hashes(x), rowhash.row_hashes(y)
    assert hx[0] == hy[0] and hx[2] == hy[2] and hx[1] != hy[1]
    nan1 = torch.tensor([[float("nan")]]).view(torch.int32)
    nan2 = (nan1 | 1).view(torch.float32)  # another NaN payload: another row
    assert rowhash.row_hashes(nan1.view(torch.float32))[0] != rowhash.row_hashes(nan2)[0]


def test_repro_and_verify_of_a_token_divergence(down_proj_traces, tmp_path):
    """repro cuts the op out at each side's real batch (the trainer's [2, 20] micro-batch, the decode step's
    [2, 1]) and compares the token's row; random trials keep the token's input row equal on both sides inside
    otherwise random batches, so verify passes a batch-invariant fix and fails the split-K kernel."""
    train, roll = down_proj_traces["full"]
    out = tmp_path / "repro"
    rc, stdout, err = _cli("repro", train, roll, "--out", out, "--json")
    assert rc == 0, err
    m = json.loads(stdout)
    assert m["token_rows"] == {"a": [0, FIRST_DECODED], "b": [0, 0]}
    assert m["output"]["a"]["shape"] == [128] and m["output"]["b"]["shape"] == [128]
    shapes = {i["name"]: i["shape"] for i in m["inputs"] if i["role"] == "activation"}
    assert sorted(shapes.values()) == [[2, 1, 256], [2, 20, 256]]
    assert len(m["token_ties"]) == 1
    src = (out / "repro.py").read_text()
    assert "import divtrace" not in src and f"[0, {FIRST_DECODED}]  # the token's row" in src
    p = subprocess.run([sys.executable, str(out / "repro.py"), "--trials", "2"], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 1 and "FAILED: side_a and side_b differ on 3 of 3 input sets" in p.stdout
    fix = tmp_path / "fix.py"
    params = ", ".join(m2["name"] for m2 in m["inputs"])
    act_b = next(n for n, s in shapes.items() if s == [2, 1, 256])
    weight = next(i["name"] for i in m["inputs"] if i["role"] == "parameter")
    fix.write_text(f"import torch\n\ndef side_b({params}):\n"
                   f"    return torch.nn.functional.linear({act_b}, {weight})[0, 0]\n")
    rc, stdout, err = _cli("verify", out, "--patch", f"{fix}:side_b", "--side", "b")
    assert rc == 0, stdout + err
    assert "PASSED: trials: 20 of 20 random trials bitwise equal" in " ".join(stdout.split())
    rc, stdout, _ = _cli("verify", out)
    assert rc == 1 and "FAILED: trials: 0 of 20" in " ".join(stdout.split())


def test_every_stored_row_fingerprint_is_the_row_of_the_stored_tensor(down_proj_traces):
    """Rows written once and shared by views (reshapes, the heads transpose) and rows hashed anew: each stored
    fingerprint equals the fingerprint of that row of the tensor the full-mode trace holds."""
    import json as _json

    import numpy as np

    from divtrace.trace import hashing
    from divtrace.trace.hashing.rows import row_fingerprints
    from divtrace.trace import token_layout as layout
    from divtrace.trace.reader import Trace

    for path in down_proj_traces["full"]:
        t = Trace(path)
        idx = t.token_index()
        meta = _json.loads((path / "meta.json").read_text())["tokens"]
        assert meta["values_sharing_rows"] > 0 and meta["row_scheme"] == hashing.ROW_SCHEME
        checked = 0
        for vid, (cid, code, off) in idx.index.items():
            if off < 0 or not t.has_bytes(vid):
                continue
            g = idx.grids[cid]
            want = row_fingerprints(layout.rows_2d(t.tensor(vid), code)).numpy().view(np.uint64)
            got = idx.bin[off:off + layout.row_count(code, g.shape)]
            assert (want == got).all(), (path.name, vid, code)
            checked += 1
        assert checked > 100


def test_packed_rows_hold_one_sequence_per_position_restart():
    """A trainer row packing two sequences (position ids restarting at 0) holds the same tokens as the two
    sequences in rows of their own, right-padded."""
    from divtrace.record.token_identity import TokenTracker

    s1, s2 = [5, 6, 7], [8, 9]
    packed = TokenTracker().on_root_call(0, 0, (), {"input_ids": torch.tensor([s1 + s2]),
                                                    "position_ids": torch.tensor([[0, 1, 2, 0, 1]])}, "packed")
    ids, mask = tc.right_padded([s1, s2])
    rows = TokenTracker().on_root_call(0, 0, (), {"input_ids": ids, "attention_mask": mask,
                                                  "position_ids": tc.positions(mask)}, "rows")
    assert sorted(packed.keys) == sorted(k for k in rows.keys if k)
    assert packed.pos == [0, 1, 2, 0, 1] and len(set(packed.seq)) == 2
    # the same ids in another order are other tokens: identity is the prefix, not the bag of ids
    other = TokenTracker().on_root_call(0, 0, (), {"input_ids": torch.tensor([[6, 5, 7]])}, "other")
    assert other.keys[2] != packed.keys[2] and other.keys[0] != packed.keys[0]
