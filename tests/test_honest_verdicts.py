"""Regressions from an exploratory pass over real trainer and engine setups: each case once made bisect claim
"identical" where it had not looked, crash, or report a divergence that was not there."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from torch import nn

import divtrace
from divtrace.compare.diffs import Tolerance
from divtrace.errors import DivtraceError
from helpers import ROOT
from test_trace_fixtures import Tiny, cli, record_tiny, tiny_input


def test_nothing_compared_is_an_error_not_identical(tmp_path):
    """A model on the meta device records no tensor (each skipped with a warning): bisect against a real run
    said "identical: 0 tensor pairs compared" with exit 0."""
    with torch.device("meta"):
        meta_model = Tiny()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.no_grad(), divtrace.record(meta_model, tmp_path / "a", mode="hash"):
            meta_model(torch.empty(3, 8, device="meta"))
    record_tiny(tmp_path / "b", mode="hash")
    code, out, err = cli("bisect", tmp_path / "a", tmp_path / "b", "--json")
    assert code == 2 and out == "" and "nothing was compared" in err and len(err.strip().splitlines()) == 1, err


def test_calls_only_on_one_side_are_said(tmp_path):
    """Side b ran a second micro-batch: every compared tensor is equal, but b's second root call was never
    compared. A warning says what was left out (it used to be only a count in `unmatched_calls`), and the verdict
    is inconclusive (exit 3): b's final output has no counterpart, so "identical" cannot be claimed (issue 22;
    the verdict was "identical" before)."""
    m = Tiny()
    with torch.no_grad():
        with divtrace.record(m, tmp_path / "a", mode="hash"):
            m(tiny_input())
        with divtrace.record(m, tmp_path / "b", mode="hash"):
            m(tiny_input())
            m(tiny_input(2))
    code, out, _ = cli("bisect", tmp_path / "a", tmp_path / "b", "--json")
    r = json.loads(out)
    assert code == 3 and r["verdict"] == "inconclusive" and r["unmatched_calls"] == {"a": 0, "b": 4}
    assert r["coverage"]["only_b"] == 4 and r["coverage"]["final_compared"] is False
    assert "the final outputs were not compared" in r["reason"] and "call 1 (of 2)" in r["reason"]
    assert any("4 only in b were not compared (a called the root 1 times, b 2)" in w for w in r["warnings"])
    code, out, err = cli("bisect", tmp_path / "a", tmp_path / "b")
    assert code == 3 and out.startswith("INCONCLUSIVE: ") and "were not compared" in err


class _Head(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(8, 16)

    def forward(self, x):
        return self.lin(x)


def test_an_empty_root_output_is_compared_not_a_crash(tmp_path):
    """Logits of an empty micro-batch ([0, V]) made full-mode bisect fail with an internal error (max() of an
    empty tensor in the final logprob summary)."""
    for side in ("a", "b"):
        m = _Head()
        with torch.no_grad(), divtrace.record(m, tmp_path / side, mode="full"):
            m(torch.randn(0, 8))
    r = divtrace.bisect(tmp_path / "a", tmp_path / "b")
    assert r.verdict == "identical" and r.final["kl"] is None and "no positions" in r.final["note"]


def test_a_hook_added_while_recording_runs_before_the_recorded_output(tmp_path):
    """A forward hook registered inside the block (a temperature on the logits) ran after divtrace's, so the
    trace held the logits from before it and bisect said "identical" for runs that returned different logits.
    divtrace's post hook is moved behind it at each call: the hook's op is the root's own code, recorded."""
    outs = {}
    for side in ("a", "b"):
        m = _Head()
        with torch.no_grad(), divtrace.record(m, tmp_path / side, mode="hash"):
            if side == "b":
                m.register_forward_hook(lambda mod, args, o: o / 0.7)
            outs[side] = m(torch.randn(2, 8, generator=torch.Generator().manual_seed(0)))
    assert not torch.equal(outs["a"], outs["b"])
    r = divtrace.bisect(tmp_path / "a", tmp_path / "b")
    assert r.verdict == "diverged" and r.first.module == "" and r.first.op_b == "aten.div.Tensor"
    assert not r.warnings


def test_an_observing_hook_added_while_recording_changes_nothing(tmp_path):
    """transformers installs observe-only forward hooks on the first call that asks for hidden states: no
    false warning, and the two runs stay identical."""
    seen = []
    for side in ("a", "b"):
        m = _Head()
        with torch.no_grad(), divtrace.record(m, tmp_path / side, mode="hash") as rec:
            if side == "b":
                m.lin.register_forward_hook(lambda mod, args, o: seen.append(o.shape))
            m(torch.randn(2, 8, generator=torch.Generator().manual_seed(0)))
        assert not rec.warnings
    assert seen and divtrace.bisect(tmp_path / "a", tmp_path / "b").verdict == "identical"


def test_a_prepended_pre_hook_added_while_recording_is_said(tmp_path):
    m = _Head()
    with torch.no_grad(), divtrace.record(m, tmp_path / "t", mode="hash"):
        m.lin.register_forward_pre_hook(lambda mod, args: (args[0] * 2,), prepend=True)
        m(torch.randn(2, 8))
    warns = json.loads((tmp_path / "t" / "meta.json").read_text())["warnings"]
    assert any("pre hooks were prepended on 1 module(s) while recording (lin)" in w for w in warns)


@pytest.mark.parametrize("how", ["wrapper", "in_place", "submodule"])
def test_a_compiled_model_is_said_to_be_recorded_eagerly(tmp_path, how):
    m = Tiny()
    if how == "wrapper":
        m = torch.compile(m)
    elif how == "in_place":
        m.compile()
    else:
        m.lin.compile()
    with torch.no_grad(), divtrace.record(m, tmp_path / "t", mode="hash") as rec:
        pass
    assert any("torch.compile'd" in w for w in rec.warnings)
    with torch.no_grad(), divtrace.record(Tiny(), tmp_path / "plain", mode="hash") as rec:
        pass
    assert not rec.warnings


def test_activation_checkpointing_recompute_is_not_recorded(tmp_path):
    """The recompute of activation checkpointing runs the module hooks again inside backward: recorded as
    forward calls, it shifted the next micro-batch's call numbers and bisect reported a divergence between
    runs whose logits were bitwise equal."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=300, use_cache=False)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 300, (2, 8), generator=g) for _ in range(2)]
    logits = {}
    for side, checkpointing in (("a", False), ("b", True)):
        torch.manual_seed(0)
        m = LlamaForCausalLM(cfg).train()
        if checkpointing:
            m.gradient_checkpointing_enable()
        with divtrace.record(m, tmp_path / side, mode="hash") as rec:
            for ids in batches:
                out = m(ids, labels=ids)
                out.loss.backward()
                logits.setdefault(side, []).append(out.logits.detach())
        if checkpointing:
            assert any("ran inside backward" in w for w in rec.warnings)
    assert all(torch.equal(x, y) for x, y in zip(logits["a"], logits["b"]))
    r = divtrace.bisect(tmp_path / "a", tmp_path / "b")
    assert r.verdict == "identical" and r.unmatched == {"a": 0, "b": 0}


_KEEPS_ITS_HANDLER = textwrap.dedent("""
    import signal, sys, time, torch, divtrace
    stop = []
    signal.signal(signal.SIGTERM, lambda *a: stop.append(1))  # graceful preemption: finish the step
    class Slow(torch.nn.Module):
        def forward(self, x):
            for _ in range(100):
                x = x + 1
                time.sleep(0.01)
            return x
    m = Slow()
    with divtrace.record(m, sys.argv[1], mode="hash"):
        print("ready", flush=True)
        m(torch.zeros(2))
    print("finished; handler ran:", bool(stop), flush=True)
""")


def test_a_trainers_own_sigterm_handler_is_kept(tmp_path):
    """divtrace took SIGTERM over unconditionally: a trainer's preemption handler never ran and the process
    died in the middle of the step."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.Popen([sys.executable, "-c", _KEEPS_ITS_HANDLER, str(tmp_path / "t")], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env)
    assert p.stdout.readline().strip() == "ready"
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0 and "handler ran: True" in out, err
    assert json.loads((tmp_path / "t" / "meta.json").read_text())["status"] == "complete"


@pytest.mark.parametrize("text,message", [
    (b"\x00\x01binary\xff", "not a text (UTF-8) file"),
    (b'b:\n  "^": "\\\\9"\n', "bad replacement"),
    (b"c:\n  x: y\n", "is not a string"),
    # issue 33: a number was taken as its text, renaming every matching call to "12...", and read identical
    (b"'^lin': 12\n", "the replacement for '^lin' (side b) is not a string: 12 (quote it"),
    (b"b:\n  '^out': 1.5\n", "is not a string: 1.5"),
    (b"a:\n  '^lin':\n", "is not a string: None"),
])
def test_bad_map_files_are_one_line_errors(tmp_path, text, message):
    """These went through as "internal error" tracebacks' last lines, or (a mistyped side key) as a regex
    whose replacement was the text of a dict, renaming module paths to garbage."""
    record_tiny(tmp_path / "a", mode="hash")
    record_tiny(tmp_path / "b", mode="hash")
    (tmp_path / "map.yaml").write_bytes(text)
    code, out, err = cli("bisect", tmp_path / "a", tmp_path / "b", "--map", tmp_path / "map.yaml")
    assert code == 2 and message in err and "internal error" not in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("opt,value", [("--atol", "-1"), ("--rtol", "nan"), ("--ulp", "-3")])
def test_tolerances_must_not_be_negative_or_nan(tmp_path, opt, value):
    record_tiny(tmp_path / "a", mode="hash")
    record_tiny(tmp_path / "b", mode="hash")
    code, _, err = cli("bisect", tmp_path / "a", tmp_path / "b", opt, value)
    assert code == 2 and f"{opt} must be a number >= 0" in err, err
    with pytest.raises(DivtraceError):
        Tolerance(atol=-1.0)


class _TwoRotations(nn.Module):
    def __init__(self, k_first: bool):
        super().__init__()
        self.k_first = k_first

    def forward(self, q, k):
        if self.k_first:
            k2 = k * 2.0 + 1.0
            q2 = q * 2.0 + 1.0
        else:
            q2 = q * 2.0 + 1.0
            k2 = k * 2.0 + 1.0
        return q2, k2


@pytest.mark.parametrize("mode", ["hash", "full"])
def test_the_same_values_made_in_another_order_are_identical(tmp_path, mode):
    """Side b runs two independent computations the other way round (RoPE on k before q): the op names come
    out in the same sequence, so a's ops were paired with b's by position, a's f(q) met b's f(k), and bisect
    said "diverged" at `mul` between runs whose every tensor was bitwise equal."""
    q, k = torch.randn(4, 8), torch.randn(2, 8)
    for side, k_first in (("a", False), ("b", True)):
        with torch.no_grad(), divtrace.record(_TwoRotations(k_first), tmp_path / side, mode=mode) as rec:
            rec.model(q, k)
    r = divtrace.bisect(tmp_path / "a", tmp_path / "b")
    assert r.verdict == "identical" and r.first is None and r.bitwise_differs == 0


def test_a_real_difference_among_reordered_ops_is_still_found(tmp_path):
    """The reorder check must not hide a value that differs: b's k path adds 1.5, not 1."""
    class Off(_TwoRotations):
        def forward(self, q, k):
            return q * 2.0 + 1.0, k * 2.0 + 1.5

    q, k = torch.randn(4, 8), torch.randn(2, 8)
    for side, m in (("a", _TwoRotations(False)), ("b", Off(False))):
        with torch.no_grad(), divtrace.record(m, tmp_path / side, mode="hash"):
            m(q, k)
    r = divtrace.bisect(tmp_path / "a", tmp_path / "b")
    assert r.verdict == "diverged" and r.first.module == "" and r.first.op == "aten.add.Tensor"


class _Experts(nn.Module):
    """An MoE combine: each expert's output added into `out`, in expert order or the reverse."""

    def __init__(self, reverse: bool):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w1 = nn.Parameter(torch.randn(4, 64, 16, generator=g) * 0.2)
        self.w2 = nn.Parameter(torch.randn(4, 16, 32, generator=g) * 0.2)
        self.act = nn.SiLU()
        self.reverse = reverse

    def forward(self, x):
        out = torch.zeros_like(x)
        for e in (reversed(range(4)) if self.reverse else range(4)):
            gate, up = torch.nn.functional.linear(x, self.w1[e]).chunk(2, dim=-1)
            out.add_(torch.nn.functional.linear(self.act(gate) * up, self.w2[e]))
        return out


@pytest.mark.parametrize("mode", ["hash", "full"])
def test_moe_combine_order_names_the_sum_not_a_view(tmp_path, mode):
    """Summing the experts the other way round: every per-expert value is made on both sides, and the child
    `act` meets expert 0 on one side and expert 3 on the other. Bisect named `aten.split` (the value feeding
    the child, which the other side also made, later), with full-mode metrics of two unrelated tensors; the
    first value only one side made is the running sum."""
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    for side, reverse in (("a", False), ("b", True)):
        m = _Experts(reverse)
        with torch.no_grad(), divtrace.record(m, tmp_path / side, mode=mode):
            m(x)
    r = divtrace.bisect(tmp_path / "a", tmp_path / "b")
    f = r.first
    assert r.verdict == "diverged" and f.module == "" and f.cause == "origin"
    assert (f.op, f.op_b) == ("aten.add_.Tensor", "aten.add_.Tensor") and f.tensor.startswith("output of aten.add_")
    if mode == "full":
        assert f.diff is not None and f.diff.shape_a == f.diff.shape_b == list(x.shape)  # the two running sums


def test_handlers_set_inside_the_block_or_by_overlapping_recorders_are_right_after(tmp_path):
    """Review findings: a handler the trainer set inside the block was replaced by the default at exit, and two
    recorders exited in the order they were entered left a stale divtrace handler installed."""
    def trainer(signum, frame):
        pass

    old = signal.getsignal(signal.SIGTERM)
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        m, m2 = Tiny(), Tiny(1)
        with torch.no_grad(), divtrace.record(m, tmp_path / "a", mode="hash"):
            signal.signal(signal.SIGTERM, trainer)
        assert signal.getsignal(signal.SIGTERM) is trainer
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        r1, r2 = divtrace.record(m, tmp_path / "b", mode="hash"), divtrace.record(m2, tmp_path / "c", mode="hash")
        r1.__enter__()
        r2.__enter__()
        r1.__exit__(None, None, None)
        assert getattr(signal.getsignal(signal.SIGTERM), "divtrace_handler", False)  # r2 still records
        r2.__exit__(None, None, None)
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, old)


class _Cache(nn.Module):
    def __init__(self, swap: bool):
        super().__init__()
        self.swap = swap
        self.register_buffer("ck", torch.zeros(2, 4))
        self.register_buffer("cv", torch.zeros(2, 4))

    def forward(self, x):
        k, v = x * 2.0, x * 3.0
        self.ck.copy_(v if self.swap else k)
        self.cv.copy_(k if self.swap else v)
        return x + 1.0  # the caches are read by the next step only: the op outputs alone show the swap


def test_values_written_into_swapped_buffers_are_a_divergence(tmp_path):
    """Review finding: k and v copied into each other's cache are the same values in another order; the
    reorder check must not take in-place writes for independent ops run the other way round."""
    x = torch.randn(2, 4)
    for side, swap in (("a", False), ("b", True)):
        with torch.no_grad(), divtrace.record(_Cache(swap), tmp_path / side, mode="hash") as rec:
            rec.model(x)
    r = divtrace.bisect(tmp_path / "a", tmp_path / "b")
    assert r.verdict == "diverged" and r.first.op == "aten.copy_.default"


class _Block(nn.Module):
    def __init__(self, wrong: bool):
        super().__init__()
        torch.manual_seed(0)
        self.norm = nn.LayerNorm(8)
        self.mlp = nn.Linear(8, 8)
        self.wrong = wrong

    def forward(self, x):
        h = self.norm(x)
        return x + self.mlp(x if self.wrong else h)


def test_a_wrong_tensor_passed_to_a_child_is_named_as_its_input(tmp_path):
    """Review finding: both differing values exist on the other side (b made norm(x) too; x is a's as well),
    which must not read as child calls met in another order: the answer stays the child's input."""
    x = torch.randn(3, 8)
    for side, wrong in (("a", False), ("b", True)):
        with torch.no_grad(), divtrace.record(_Block(wrong), tmp_path / side, mode="hash") as rec:
            rec.model(x)
    r = divtrace.bisect(tmp_path / "a", tmp_path / "b")
    assert r.verdict == "diverged" and r.first.module == "" and r.first.tensor == "input args.0 of mlp"
