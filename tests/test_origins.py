"""The origin that explains the logprobs (issue 28): the final outputs are always compared and lead the verdict;
an origin is a difference that reaches a differing final output; absorbed differences are listed apart (exit 4
when nothing else differs); origins come with true counts, in execution order; causes are claimed only when
proven.

Every case records real model code (HF Llama, a vLLM-style engine in plain torch) with divtrace and watches the
same runs with plain forward hooks (origin_cases / origin_truth): the expected modules, tokens and counts come
from the hooks, never from divtrace's own output.
"""
from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import divtrace

sys.path.insert(0, str(Path(__file__).parent))
import engine_model as em  # noqa: E402
import origin_cases as oc  # noqa: E402
import token_cases as tc  # noqa: E402

pytest.importorskip("transformers")

ENGINE_MAP = Path(__file__).parent / "maps" / "engine-hf.yaml"


def _engine_bisect(train, eng):
    """bisect of HF against the test engine, with the map its user writes (tests/maps/engine-hf.yaml)."""
    from divtrace.align.paths import PathMap

    return divtrace.bisect(train.path, eng.path, path_map=PathMap.from_file(ENGINE_MAP))


def _cli(*args):
    p = subprocess.run([sys.executable, "-m", "divtrace", *map(str, args)], capture_output=True, text=True,
                       timeout=300)
    return p.returncode, p.stdout, p.stderr


def _tok(origin: dict):
    """(sequence number, position) of an origin's or finding's representative token."""
    t = origin["token"]
    return t["seq"]["number"], t["position"]


def _plant_prefill_logit(model):
    """The rollout's lm_head changes one logit of its first call (the prefill, logits_to_keep=1): row 0's logit 1."""
    head = model.lm_head
    real = type(head).forward

    def forward(self, x):
        y = real(self, x)
        if not getattr(self, "_planted", False):
            self._planted = True
            y = y.clone()
            y[0, -1, 1] *= 1.01
        return y

    head.forward = types.MethodType(forward, head)


# -- 1. the final output is always compared, and the verdict leads with it --------------------------------------
@pytest.mark.parametrize("mode", ["hash", "full"])
def test_a_prefill_logit_planted_under_generate_is_never_identical(tmp_path, mode):
    """generate's prefill returns logits for the last position only ([B, 1, V]): the logits behind the first
    sampled token of every sequence. They are compared like every other token's."""
    ps = tc.prompts()
    clean = oc.rollout(oc.llama(), tmp_path / "clean", ps, mode=mode)
    m = oc.llama()
    _plant_prefill_logit(m)
    planted = oc.rollout(m, tmp_path / "planted", ps, mode=mode)
    truth = oc.truth(clean, planted)
    assert len(truth.final_compared) == 8 and truth.final_differs == {(0, len(ps[0]) - 1)}
    for a, b in ((clean, planted), (planted, clean)):
        r = divtrace.bisect(a.path, b.path, align="tokens")
        d = r.to_dict()
        assert r.verdict == "diverged" and r.exit_code == 1
        assert d["final"]["tokens_compared"] == 8 and d["final"]["tokens_differing"] == 1
        f = d["first"]
        assert f["module"] == "lm_head" and _tok(f) == (0, len(ps[0]) - 1)
        assert [o["tokens"] for o in d["origins"]] == [1]


def test_the_report_leads_with_the_logprobs(tmp_path):
    ps = tc.prompts()
    clean = oc.rollout(oc.llama(), tmp_path / "clean", ps, mode="full")
    m = oc.llama()
    _plant_prefill_logit(m)
    planted = oc.rollout(m, tmp_path / "planted", ps, mode="full")
    rc, out, err = _cli("bisect", clean.path, planted.path, "--align", "tokens")
    assert rc == 1, err
    lines = [x for x in out.splitlines() if x.strip()]
    assert lines[0].startswith("FAILED: logprobs differ on 1 of 8 tokens; first divergence originates in lm_head"), \
        lines[0]
    rc, out, _ = _cli("bisect", clean.path, clean.path, "--align", "tokens")
    assert rc == 0 and out.splitlines()[0].startswith("PASSED: identical: logprobs bitwise identical on 8/8 tokens")


# -- 2. an origin is a difference that reaches the output --------------------------------------------------------
def _norm_eps(norm, factor: float = 1 + 2 ** -14):
    """Plant an RMSNorm whose fp32 variance differs in its last bits (another epsilon: the same ops, another
    scalar), as a batch-variant mean does on a GPU: in bf16 the rounding after it absorbs the difference for
    almost every element. The plain hooks say for which tokens it does not."""
    norm.variance_epsilon = norm.variance_epsilon * factor


def _bf16_pair(tmp_path, mode, plant=None):
    """bf16 HF Llama, rollout against trainer (bf16 matmuls and attention are batch-invariant at this size on this
    CPU); the rollout's layer-0 input_layernorm gets `_norm_eps`, and `plant` a real difference on top."""
    ps = tc.prompts()
    m = oc.llama(dtype=torch.bfloat16)
    _norm_eps(m.model.layers[0].input_layernorm)
    if plant:
        plant(m)
    roll = oc.rollout(m, tmp_path / f"roll-{mode}", ps, mode=mode)
    train = oc.trainer(oc.llama(dtype=torch.bfloat16), tmp_path / f"train-{mode}", roll.seqs, mode=mode)
    return train, roll


@pytest.mark.parametrize("mode", ["hash", "full"])
def test_an_absorbed_norm_difference_is_not_an_origin(tmp_path, mode):
    train, roll = _bf16_pair(tmp_path, mode)
    truth = oc.truth(train, roll)
    r = divtrace.bisect(train.path, roll.path)
    d = r.to_dict()
    norm = "model.layers.0.input_layernorm"
    if truth.final_differs:  # (on another machine the rounding may not absorb it everywhere: then it is an origin)
        assert r.verdict == "diverged" and {o["module"]: o["tokens"] for o in d["origins"]} == truth.origins()
        return
    assert not truth.module_counts()  # every module output equal on every token: the difference is absorbed
    assert r.verdict == "absorbed" and r.exit_code == 4 and d["first"] is None and d["origins"] == []
    assert [(a["module"], a["kind"], a["op"]) for a in d["absorbed"]] == [(norm, "op", "aten.add.Tensor")], \
        d["absorbed"]
    assert d["absorbed"][0]["tokens"] == len(truth.final_compared) + 26  # every shared token's row (prompts too)
    rc, out, _ = _cli("bisect", train.path, roll.path)
    assert rc == 4
    assert out.splitlines()[0].startswith(
        f"PASSED: final outputs identical on {len(truth.final_compared)}/{len(truth.final_compared)} tokens; "
        "1 internal differences absorbed")


@pytest.mark.parametrize("mode", ["hash", "full"])
def test_an_absorbed_difference_then_a_real_one(tmp_path, mode):
    """The absorbed norm difference at layer 0 comes first in forward order; the real origin (a batch-size-dependent
    matmul in the rollout's layer-1 down_proj) is `first`, and the absorbed one is listed apart."""
    train, roll = _bf16_pair(tmp_path, mode, plant=lambda m: tc.batch_dependent_linear(m.model.layers[1].mlp.down_proj))
    truth = oc.truth(train, roll)
    expected = truth.origins()
    assert truth.final_differs and "model.layers.1.mlp.down_proj" in expected
    d = divtrace.bisect(train.path, roll.path).to_dict()
    assert d["verdict"] == "diverged"
    assert d["first"]["module"] == min(expected, key=truth.order.__getitem__)
    assert {o["module"]: o["tokens"] for o in d["origins"]} == expected
    if "model.layers.0.input_layernorm" not in expected:  # absorbed: listed apart, never first
        assert [a["module"] for a in d["absorbed"]] == ["model.layers.0.input_layernorm"]
    assert d["tokens"]["modules"]["model.layers.1.mlp.down_proj"] == truth.module_counts()["model.layers.1.mlp.down_proj"]


@pytest.mark.parametrize("mode", ["hash", "full"])
def test_the_first_origin_is_the_first_module_output_that_differs(tmp_path, mode):
    """bf16, hidden 512 (the issue's H200 case in miniature): the decode step's attention kernel differs from the
    full sequence's for some token, and differences it leaves in later norms' fp32 means are absorbed. `first` is
    the first module output the hooks see differ, and every module's count is the hooks'."""
    ps = tc.prompts()
    m = oc.llama(hidden=512, dtype=torch.bfloat16)
    roll = oc.rollout(m, tmp_path / "roll", ps, mode=mode)
    train = oc.trainer(m, tmp_path / "train", roll.seqs, mode=mode)
    truth = oc.truth(train, roll)
    expected = truth.origins()
    d = divtrace.bisect(train.path, roll.path).to_dict()
    if not truth.final_differs:
        assert d["verdict"] in ("identical", "absorbed")
        return
    assert d["verdict"] == "diverged"
    assert {o["module"]: o["tokens"] for o in d["origins"]} == expected
    assert d["first"]["module"] == min(expected, key=truth.order.__getitem__)
    for mod, n in truth.module_counts().items():
        assert d["tokens"]["modules"].get(mod) == n, mod


def test_two_origins_where_the_later_walked_one_ran_first(tmp_path):
    """The rollout's layer-1 o_proj differs on prefill rows only (low positions, walked first by position) and
    its layer-0 down_proj on decode rows only (high positions): layer 0's op runs earlier in the forward, so it is
    `first`, and each origin counts the tokens the hooks say it explains."""
    ps = tc.prompts()

    def plant(m):
        tc.batch_dependent_linear(m.model.layers[0].mlp.down_proj)  # split-K at <= 4 rows: the decode steps

        o = m.model.layers[1].self_attn.o_proj
        real = type(o).forward

        def prefill_only(self, x):
            y = real(self, x)
            return y * (1 + 2 ** -6) if x.reshape(-1, x.shape[-1]).shape[0] > 4 else y

        o.forward = types.MethodType(prefill_only, o)

    # bf16: its matmuls are batch-invariant on this CPU, so only the planted differences part the runs
    m = oc.llama(dtype=torch.bfloat16)
    plant(m)
    roll = oc.rollout(m, tmp_path / "roll", ps, mode="hash")
    train = oc.trainer(oc.llama(dtype=torch.bfloat16), tmp_path / "train", roll.seqs, mode="hash")
    truth = oc.truth(train, roll)
    expected = truth.origins()
    assert set(expected) == {"model.layers.0.mlp.down_proj", "model.layers.1.self_attn.o_proj"}
    d = divtrace.bisect(train.path, roll.path).to_dict()
    assert {o["module"]: o["tokens"] for o in d["origins"]} == expected
    assert d["first"]["module"] == "model.layers.0.mlp.down_proj"
    assert [o["module"] for o in d["origins"]][0] == "model.layers.0.mlp.down_proj"


def test_next_rows_never_call_an_ancestor_an_origin(tmp_path):
    ps = tc.prompts()
    m = oc.llama()
    tc.batch_dependent_linear(m.model.layers[1].mlp.down_proj)
    roll = oc.rollout(m, tmp_path / "roll", ps, mode="hash")
    train = oc.trainer(oc.llama(), tmp_path / "train", roll.seqs, mode="hash")
    d = divtrace.bisect(train.path, roll.path).to_dict()
    origins = {o["module"] for o in d["origins"]}
    for n in d.get("next") or []:
        if n["cause"] == "origin":
            assert not any(o.startswith(n["module"] + ".") or n["module"] == "" for o in origins), n


# -- 3. causes claimed only when proven; positions --------------------------------------------------------------
@pytest.mark.parametrize("mode", ["hash", "full"])
def test_positions_shifted_by_left_padding_are_the_cause(tmp_path, mode):
    """TRL's recompute passes no position_ids over left-padded prompts, so HF numbers positions from the padding:
    the shorter sequence's tokens are computed at shifted positions. That is the cause, said as such (exit 1),
    never a RoPE multiply that is "not batch-invariant"."""
    ps = tc.prompts()
    m = oc.llama(dtype=torch.bfloat16)  # (bf16: its matmuls are batch-invariant on this CPU; the positions part it)
    roll = oc.rollout(m, tmp_path / "roll", ps, mode=mode)
    train = oc.trainer(m, tmp_path / "train", roll.seqs, mode=mode, positions=False, left_pad=True)
    truth = oc.truth(train, roll)
    assert truth.final_differs
    shifted = max(map(len, roll.seqs)) - min(map(len, roll.seqs))  # the padding of the shorter sequence
    n_short = min(map(len, roll.seqs)) - 1  # its tokens both sides fed (the rollout never feeds its last one)
    d = divtrace.bisect(train.path, roll.path).to_dict()
    assert d["verdict"] == "diverged"
    f = d["first"]
    assert f["kind"] == "positions" and f["tokens"] == n_short, f
    assert f"position ids differ on {n_short} tokens: a {shifted}.., b 0.." in f["cause_text"], f
    assert [o["kind"] for o in d["origins"]] == ["positions"], d["origins"]
    assert d["origins"][0]["tokens"] == n_short
    rc, out, _ = _cli("bisect", train.path, roll.path)
    assert rc == 1 and "FAILED: logprobs differ on" in out and "first: position ids differ on" in out, out
    assert "not batch-invariant" not in out


def test_not_batch_invariant_is_said_only_when_every_input_was_compared(tmp_path):
    """HF's RoPE multiplies q by a broadcast cos [1, T, d]: that input has no token rows. With the positions equal
    and cos/sin equal by value, a planted difference in the multiply is named, but "not batch-invariant" needs
    every input compared; the broadcast input is compared by its rows of the shared positions."""
    ps = tc.prompts()
    m = oc.llama()
    roll = oc.rollout(m, tmp_path / "roll", ps, mode="full")
    train = oc.trainer(oc.llama(), tmp_path / "train", roll.seqs, mode="full")
    d = divtrace.bisect(train.path, roll.path).to_dict()
    for o in d["origins"]:
        bi = o.get("batch_invariance")
        if bi and bi.get("batch_invariant") is False:
            assert o.get("inputs_compared") == "all", o


# -- the engine: lm_head on the last rows, fused add+norm, extra submodules ---------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_fixed_engine_is_never_called_diverged(tmp_path, dtype):
    """With every real cause fixed the engine's logprobs are bitwise HF's on every token: the fused add+norm's
    inputs (attention out and residual apart, where HF's norm gets their sum) differ by construction and never
    reach the output, so the verdict is not "diverged"; the logprobs are compared although the engine computes
    lm_head on the last row of each sequence only (declared with rec.final)."""
    ps = tc.prompts()
    hf = oc.llama(dtype=dtype)
    with em.batch_invariant(hf):
        eng = oc.engine(hf, tmp_path / "engine", ps, mode="hash")
        train = oc.trainer(hf, tmp_path / "train", eng.seqs, mode="hash")
    truth = oc.truth(train, eng)
    assert len(truth.final_compared) == 8 and not truth.final_differs
    r = _engine_bisect(train, eng)
    d = r.to_dict()
    assert r.verdict == "absorbed" and r.exit_code == 4, d["reason"]
    assert d["final"]["tokens_compared"] == 8 and d["final"]["tokens_differing"] == 0
    # the fused add+norm's inputs (attention out, where HF's norm gets the residual stream) differ by construction
    assert {(a["module"].split(".")[-1], a["kind"]) for a in d["absorbed"]} <= {
        ("post_attention_layernorm", "inputs"), ("input_layernorm", "inputs"), ("norm", "inputs")}, d["absorbed"]
    # without a map: never diverged, and never an input the engine did not pass (HF's attention_mask)
    r = divtrace.bisect(train.path, eng.path)
    d = r.to_dict()
    assert r.verdict != "diverged" and "attention_mask" not in json.dumps(d), d["reason"]


@pytest.mark.parametrize("cause,module", [("norm_cast", "model.layers.0.input_layernorm"),
                                          ("rope_fp64", "model.layers.0.self_attn"),
                                          ("plain_matmul", "model.layers.0.self_attn")])
def test_each_engine_cause_is_found_at_its_module(tmp_path, cause, module):
    ps = tc.prompts()
    hf = oc.llama(dtype=torch.bfloat16 if cause == "norm_cast" else torch.float32)
    with em.batch_invariant(hf):
        eng = oc.engine(hf, tmp_path / "engine", ps, causes=(cause,), mode="full")
        train = oc.trainer(hf, tmp_path / "train", eng.seqs, mode="full")
    truth = oc.truth(train, eng)
    assert truth.final_differs
    d = _engine_bisect(train, eng).to_dict()
    assert d["verdict"] == "diverged"
    assert d["first"]["module"] == module, d["first"]
    assert d["final"]["tokens_compared"] == 8
    if cause == "rope_fp64" and d["first"]["inputs_compared"] != "all":
        # the people's output says so too: never "inputs bitwise equal" where some were not compared (regression:
        # said of vLLM's fused add + norm, whose inputs HF's add has no counterpart for)
        rc, out, err = _cli("bisect", train.path, eng.path, "--map", ENGINE_MAP)
        assert rc == 1, err
        assert "inputs bitwise equal" not in out and "inputs not compared" in out, out


def test_a_linear_that_writes_into_a_view_of_its_output_buffer_is_compared(tmp_path):
    """vLLM's CPU linears (`_C.weight_packed_linear` on AVX-512 machines) write into a reshape of an empty buffer and
    return the buffer, which an op reads before the module returns it. Regression: that buffer, read back changed,
    got no token rows, so the linear's output was never compared and bisect (vLLM against HF, bf16) named the next
    op with no counterpart, HF's residual add, "inputs bitwise equal", for the tokens whose RoPE differed. Here the
    rollout's down projections do the same, and layer 0's scales its output (planted): the hooks' origins are
    bisect's, and every input of the parting op was compared."""
    ps = tc.prompts()
    m_roll, m_train = oc.llama(), oc.llama()  # (the same seed: the same weights)

    def into_buffer(lin, plant):
        def forward(x):
            y = torch.nn.functional.linear(x, lin.weight, lin.bias)
            if plant:
                y = y * (1 + 2 ** -6)
            buf = torch.empty_like(y)
            buf.view(-1, y.shape[-1]).copy_(y.reshape(-1, y.shape[-1]))  # written through a view of the buffer
            buf.detach()  # an op reads the buffer before the module returns it
            return buf
        return forward

    for i, layer in enumerate(m_roll.model.layers):
        layer.mlp.down_proj.forward = into_buffer(layer.mlp.down_proj, plant=i == 0)
    roll = oc.rollout(m_roll, tmp_path / "roll", ps, mode="hash")
    train = oc.trainer(m_train, tmp_path / "train", roll.seqs, mode="hash")
    truth = oc.truth(train, roll)
    expected = truth.origins()
    # (other origins may come with it: this CPU's matmuls may part on the rollout's batch sizes)
    assert truth.final_differs and "model.layers.0.mlp.down_proj" in expected, expected
    d = divtrace.bisect(train.path, roll.path).to_dict()
    assert d["verdict"] == "diverged"
    assert {o["module"]: o["tokens"] for o in d["origins"]} == expected, d["origins"]
    assert all(o["inputs_compared"] == "all" for o in d["origins"]), [(o["module"], o["op"], o.get("op_b"), o["inputs_compared"]) for o in d["origins"]]


def test_lm_head_on_the_last_rows_only_without_a_declaration_is_not_identical(tmp_path):
    """An engine that never declares its final rows: its logits rows belong to no token divtrace knows, so the
    final outputs are not compared and the verdict cannot be identical."""
    ps = tc.prompts()
    hf = oc.llama()
    with em.batch_invariant(hf):
        eng = oc.engine(hf, tmp_path / "engine", ps, mode="hash", declare_final=False)
        train = oc.trainer(hf, tmp_path / "train", eng.seqs, mode="hash")
    r = divtrace.bisect(train.path, eng.path)
    assert r.verdict == "inconclusive" and r.exit_code == 3
    assert "rec.final" in r.reason


# -- a fused head returning logprobs --------------------------------------------------------------------------
def test_a_fused_head_returning_logprobs_is_compared_against_logits(tmp_path):
    """The trainer returns log_probs [B, T-1] and no logits. divtrace derives the rollout's logprobs from its
    logits (fp32 log_softmax, then gather) and compares like with like: a logits row at position p against the
    logprob of token p + 1."""
    ps = tc.prompts()
    m = oc.llama()
    roll = oc.rollout(m, tmp_path / "roll", ps, mode="full")
    head = oc.fused_head(m, tmp_path / "train", roll.seqs, micro_batch=1, mode="full")
    d = divtrace.bisect(head.path, roll.path).to_dict()
    assert d["verdict"] != "inconclusive", d["reason"]
    fin = d["final"]
    # every sampled token: the last prompt token's logits (generate's prefill) and the three decode steps', per sequence
    assert fin["derived"] and fin["tokens_compared"] == 8



@pytest.mark.parametrize("mode", ["full", "hash"])
def test_a_grpo_group_one_prompt_several_completions_compares_each_continuations_logprob(tmp_path, mode):
    """A GRPO group samples several completions of one prompt: the prompt's last token is one token (one key, one
    logits row) with a logprob per continuation. Each side's logprob of each continuation is compared with the
    other side's of the same continuation, whatever the batch order (regression: one value per key compared the
    first continuation of a against the first of b, another token's logprob)."""
    p = tc.prompts()[0]
    seqs = [p + [5, 6, 7], p + [8, 9, 10], p + [11, 12, 13]]
    m = oc.llama()
    a = oc.fused_head(m, tmp_path / "a", seqs, micro_batch=3, mode=mode)
    b = oc.fused_head(m, tmp_path / "b", seqs[::-1], micro_batch=3, mode=mode)
    # ground truth: each sequence's logprobs on both sides, from the model itself
    head = oc.FusedHead(m)
    with torch.no_grad():
        la = head(*tc.right_padded(seqs))
        lb = head(*tc.right_padded(seqs[::-1])).flip(0)
    same = la.shape == lb.shape and torch.equal(la.view(torch.int32), lb.view(torch.int32))
    d = divtrace.bisect(a.path, b.path).to_dict()
    fin = d["final"]
    assert fin["tokens_compared"] == len(p) - 1 + 3 + 3 * 2  # the prompt predicts its own; its last token 3 completions
    assert fin["identical"] == same and (d["verdict"] == "identical") == same, (same, d["reason"])
    if same:
        assert fin["tokens_differing"] == 0 and fin["not_compared"] == 0


# -- 5. folding: a submodule on one side is the other side's inline code ------------------------------------------
class _Block(torch.nn.Module):
    def __init__(self, inline: bool, eps: float):
        super().__init__()
        torch.manual_seed(0)
        self.up = torch.nn.Linear(32, 64)
        self.down = torch.nn.Linear(64, 32)
        self.inline, self.eps = inline, eps
        if inline:
            self.weight = torch.nn.Parameter(torch.ones(64) + 0.1 * torch.randn(64))
            self.bias = torch.nn.Parameter(0.1 * torch.randn(64))
        else:
            self.norm = torch.nn.LayerNorm(64, eps=eps)
            with torch.no_grad():
                self.norm.weight.copy_(torch.ones(64) + 0.1 * torch.randn(64))
                self.norm.bias.copy_(0.1 * torch.randn(64))

    def forward(self, x):
        h = self.up(x)
        if self.inline:
            h = torch.nn.functional.layer_norm(h, (64,), self.weight, self.bias, self.eps)
        else:
            h = self.norm(h)
        return self.down(torch.nn.functional.gelu(h))


def test_inline_layer_norm_against_a_layer_norm_module(tmp_path):
    """One side calls nn.LayerNorm, the other inlines F.layer_norm with another eps: the module that only one
    side has counts as its parent's own code, so bisect names the layer_norm op on both sides (not gelu against
    a copy)."""
    x = torch.randn(4, 32)
    for name, inline, eps in (("a", False, 1e-5), ("b", True, 1e-3)):
        m = _Block(inline, eps).eval()
        with torch.no_grad(), divtrace.record(m, tmp_path / name, mode="full"):
            m(x)
    d = divtrace.bisect(tmp_path / "a", tmp_path / "b").to_dict()
    assert d["verdict"] == "diverged"
    f = d["first"]
    assert f["module"] == "" and "layer_norm" in (f["op"] or "") and "layer_norm" in (f["op_b"] or ""), f


def _scale_prefill_rows(linear):
    """Plant: the linear's output scaled by 1 + 2**-6 on calls over more than 4 rows (the prefill's), only."""
    real = type(linear).forward

    def prefill_only(self, x):
        y = real(self, x)
        return y * (1 + 2 ** -6) if x.reshape(-1, x.shape[-1]).shape[0] > 4 else y

    linear.forward = types.MethodType(prefill_only, linear)


def _two_origins(tmp_path):
    """bf16 (batch-invariant matmuls here): the rollout's layer-0 down_proj splits K on decode rows only, and its
    layer-1 o_proj scales prefill rows only."""
    m = oc.llama(dtype=torch.bfloat16)
    tc.batch_dependent_linear(m.model.layers[0].mlp.down_proj)
    _scale_prefill_rows(m.model.layers[1].self_attn.o_proj)
    roll = oc.rollout(m, tmp_path / "roll", tc.prompts(), mode="full")
    train = oc.trainer(oc.llama(dtype=torch.bfloat16), tmp_path / "train", roll.seqs, mode="full")
    return train, roll


def test_repro_at_cuts_each_token_aligned_origin(tmp_path):
    """`repro --at RECORD` takes any origin bisect lists (its `index`), not only the first: each repro holds that
    origin's module and fails while the sides differ."""
    train, roll = _two_origins(tmp_path)
    d = divtrace.bisect(train.path, roll.path).to_dict()
    assert [o["module"] for o in d["origins"]] == ["model.layers.0.mlp.down_proj", "model.layers.1.self_attn.o_proj"]
    for o in d["origins"]:
        out = tmp_path / f"repro-{o['index']}"
        rc, stdout, err = _cli("repro", train.path, roll.path, "--at", o["index"], "--out", out)
        assert rc == 0, err
        man = json.loads((out / "manifest.json").read_text())
        assert man["origin"]["module"] == o["module"], man["origin"]
        p = subprocess.run([sys.executable, str(out / "repro.py")], capture_output=True, text=True, timeout=300)
        assert p.returncode == 1 and "FAILED" in p.stdout, p.stdout + p.stderr
    rc, _, err = _cli("repro", train.path, roll.path, "--at", 3, "--out", tmp_path / "nope")
    assert rc == 2 and "is the record of no origin" in err and str(d["origins"][0]["index"]) in err


def test_a_kv_difference_reaches_later_tokens_through_attention(tmp_path):
    """The rollout's layer-1 k_proj differs on prefill rows only: the prompt tokens' keys. A decoded token's own
    rows are equal up to its attention, whose output differs because it attends to those keys. Its origin is the
    k_proj difference of the tokens it attends to (said so), never the attention kernel "not batch-invariant"."""
    m = oc.llama(dtype=torch.bfloat16)
    _scale_prefill_rows(m.model.layers[1].self_attn.k_proj)
    roll = oc.rollout(m, tmp_path / "roll", tc.prompts(), mode="hash")
    train = oc.trainer(oc.llama(dtype=torch.bfloat16), tmp_path / "train", roll.seqs, mode="hash")
    truth = oc.truth(train, roll)
    # the hooks: k_proj's output differs on the prompt tokens only; the decoded tokens' attention output differs
    decoded = {t for t in truth.final_differs if t[1] >= len(tc.prompts()[t[0]])}
    k_rows = truth.out_differs["model.layers.1.self_attn.k_proj"]
    assert decoded and not (k_rows & decoded) and all(t in truth.out_differs["model.layers.1.self_attn"]
                                                      for t in decoded)
    d = divtrace.bisect(train.path, roll.path).to_dict()
    assert d["verdict"] == "diverged"
    assert {o["module"] for o in d["origins"]} == {"model.layers.1.self_attn.k_proj"}, d["origins"]
    assert sum(o["tokens"] for o in d["origins"]) == len(truth.final_differs)
    # the hooks' rule says so too (origin_truth: an earlier token's K/V rows that differ inside the attention
    # module): what the other origin tests compare against on a CPU whose kernels part on prefill rows
    assert truth.origins() == {"model.layers.1.self_attn.k_proj": len(truth.final_differs)}
    via = [o for o in d["origins"] if o.get("note")]
    assert via and "through attention" in via[0]["note"]
    assert "not batch-invariant" not in json.dumps(d["origins"])


def test_an_excluded_call_counts_as_its_parents_code(tmp_path):
    """--exclude / exclude=: the excluded module's ops are its parent's own code (docs), so bisect names the op in
    the parent, not the call after it."""
    x = torch.randn(4, 32)
    for name, eps in (("a", 1e-5), ("b", 1e-3)):
        m = _Block(False, eps).eval()
        with torch.no_grad(), divtrace.record(m, tmp_path / name, mode="full", exclude=r"^norm$"):
            m(x)
    d = divtrace.bisect(tmp_path / "a", tmp_path / "b").to_dict()
    f = d["first"]
    assert d["verdict"] == "diverged" and f["module"] == "" and "layer_norm" in (f["op"] or ""), f


# -- coverage: identical only when both runs did the same work (issue 33, item 3) --------------------------------
def test_partly_different_prompts_are_inconclusive_not_identical(tmp_path):
    """Two rollouts share one prompt and differ in the other: the shared tokens are bitwise equal, but tokens only
    one side fed (beyond a rollout's last sampled token) mean the runs did not do the same work."""
    m = oc.llama(dtype=torch.bfloat16)
    p0, p1 = tc.prompts()
    other = [(x + 7) % tc.VOCAB for x in p1]
    oc.rollout(m, tmp_path / "a", [p0, p1], mode="hash")
    oc.rollout(m, tmp_path / "b", [p0, other], mode="hash")
    r = divtrace.bisect(tmp_path / "a", tmp_path / "b", align="tokens")
    d = r.to_dict()
    assert r.verdict == "inconclusive" and r.exit_code == 3, d["reason"]
    assert d["reason"].startswith("coverage: ") and d["coverage"]["gaps"]
    assert d["tokens"]["one_sided"] == {"a": len(p1) + 3, "b": len(other) + 3}
    # the expected asymmetry alone (the trainer recomputes the last sampled token) is no gap
    seqs = oc.rollout(m, tmp_path / "c", [p0, p1], mode="hash").seqs
    oc.trainer(m, tmp_path / "t", seqs, mode="hash")
    d = divtrace.bisect(tmp_path / "t", tmp_path / "c").to_dict()
    assert d["verdict"] in ("identical", "absorbed") and d["tokens"]["one_sided"] == {"a": 0, "b": 0}, d["reason"]


def test_a_map_that_unpairs_the_model_calls_makes_identical_impossible(tmp_path):
    m = oc.llama(dtype=torch.bfloat16)
    seqs = oc.rollout(m, tmp_path / "roll", tc.prompts(), mode="hash").seqs
    oc.trainer(m, tmp_path / "train", seqs, mode="hash")
    bad = tmp_path / "map.yaml"
    bad.write_text("b:\n  '^model\\.': 'renamed.'\n")
    from divtrace.align.paths import PathMap

    r = divtrace.bisect(tmp_path / "train", tmp_path / "roll", path_map=PathMap.from_file(bad))
    d = r.to_dict()
    assert r.verdict == "inconclusive" and "module calls left unpaired" in d["reason"], d["reason"]
    assert d["tokens"]["unpaired_calls"]
