"""Recording torch.compile'd models (divtrace.compiled): taps inside compiled code, bisect compiled vs eager and
compiled vs compiled, the compiled repro, coverage ("unseen"), settings and bad input.

torch.compile on this CPU takes seconds per graph: one tiny HF Llama (hidden 64, 2 layers) is compiled a few times
in module-scoped fixtures and every test reads their traces; the other tests use a two-layer MLP."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import divtrace
from divtrace.errors import DivtraceError



def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.up = torch.nn.Linear(16, 32)
        self.down = torch.nn.Linear(32, 16)

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(x)))


def _meta(p):
    return json.loads((p / "meta.json").read_text())


@pytest.fixture(scope="module")
def llama_runs(tmp_path_factory):
    """Traces of one tiny Llama: eager (full, ops), compiled (full) twice, and the logits of each run."""
    d = tmp_path_factory.mktemp("compiled")
    m = _llama()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        with divtrace.record(m, d / "eager", mode="full"):
            eager = m(ids).logits
        c = torch.compile(m)
        unrecorded = c(ids).logits
        with divtrace.record(c, d / "comp", mode="full") as rec:  # compiled: automatic
            recorded = c(ids).logits
        assert rec.compiled and not rec.ops
        after = c(ids).logits  # recompiled without the taps
        with divtrace.record(c, d / "comp2", mode="hash"):
            c(ids)
    return {"dir": d, "eager": eager, "unrecorded": unrecorded, "recorded": recorded, "after": after}


def test_recorded_compiled_logits_are_the_unrecorded_compiled_logits(llama_runs):
    r = llama_runs
    assert not torch.equal(r["unrecorded"], r["eager"])  # the compiled model really differs from eager here
    assert torch.equal(r["recorded"], r["unrecorded"])  # bitwise: recording did not change what it computed
    assert torch.equal(r["after"], r["unrecorded"])  # and leaves the model as it was
    from divtrace.trace.reader import Trace

    t = Trace(r["dir"] / "comp")
    root = next(c for c in t.calls.values() if c.module == "")
    key, vid = root.outputs[0]
    assert key == "out.logits" and torch.equal(t.tensor(vid), r["unrecorded"])  # the trace holds those logits
    modules = {c.module for c in t.calls.values()}
    assert "model.layers.1.mlp.down_proj" in modules and not any("_orig_mod" in p for p in modules)
    meta = _meta(r["dir"] / "comp")
    assert meta["compiled"]["recorded"] == "compiled" and meta["granularity"].startswith("modules")
    assert meta["compiled"]["taps_run"] == 2 * len(t.calls) and meta["unseen"] == []
    assert meta["compiled"]["graph_breaks"] == [] and meta["ops"] is False
    assert meta["settings"]["torch_compile"] == "inductor"
    assert meta["compiled"]["kernels"]["model.layers.0.input_layernorm"]["out"]["kernel"].startswith("cpp_fused")


def test_bisect_compiled_vs_eager_names_the_first_module_the_compiled_code_changes(llama_runs):
    d = llama_runs["dir"]
    r = divtrace.bisect(d / "eager", d / "comp")
    assert r.verdict == "diverged" and r.first.cause == "origin" and r.first.kind == "module"
    # Inductor's cos (rotary embedding) differs from ATen's by an ulp; inputs equal, output not.
    assert r.first.module == "model.rotary_emb" and r.first.tensor == "out.0"
    assert r.compiled["b"] == "compiled" and r.compiled["stopped_at_module"]
    assert "cos" in r.compiled["kernel"]["b"]["kernel"]
    assert "bisect stops at module model.rotary_emb" in r.hint and "divtrace repro" in r.hint
    assert any(s["name"] == "torch_compile" and s["b"] == "inductor" for s in r.settings)
    j = r.to_dict()
    assert j["compiled"]["kernel"]["b"]["tensor"] == "out.0"
    # the other origins the compiled code makes are listed too: RMSNorm with equal inputs
    assert any(n.module.endswith("input_layernorm") and n.cause == "origin" for n in r.next)


def test_compiled_vs_compiled_control_is_identical(llama_runs):
    d = llama_runs["dir"]
    r = divtrace.bisect(d / "comp", d / "comp2")
    assert r.verdict == "identical" and r.first is None and r.compared > 40


def test_repro_of_a_compiled_divergence_fails_while_compiled_differs(llama_runs, tmp_path):
    d = llama_runs["dir"]
    from divtrace.repro.writer import write_repro

    rr = write_repro(d / "eager", d / "comp", tmp_path / "repro")
    assert rr.ok and rr.manifest["kind"] == "compiled" and rr.manifest["origin"]["module"] == "model.rotary_emb"
    assert rr.manifest["compiled_matches_trace"]  # the module compiled alone gives the recorded compiled bits
    src = (tmp_path / "repro" / "repro.py").read_text()
    assert "divtrace" not in src.split('"""', 2)[2].split("ORIGIN")[0]  # imports neither divtrace nor the model
    p = subprocess.run([sys.executable, str(tmp_path / "repro" / "repro.py")], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 1 and "FAILED" in p.stdout, p.stdout + p.stderr
    fixed = src.replace("_compiled = torch.compile(side_a, **COMPILE)", "_compiled = side_a")  # a "fix"
    (tmp_path / "repro" / "repro.py").write_text(fixed)
    p = subprocess.run([sys.executable, str(tmp_path / "repro" / "repro.py")], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0 and "PASSED" in p.stdout, p.stdout + p.stderr


def test_ops_inside_compiled_code_is_a_one_line_error(tmp_path):
    m = torch.compile(MLP())
    with pytest.raises(DivtraceError, match="ops=False .* compiled=False"):
        divtrace.record(m, tmp_path / "t", ops=True, compiled=True)
    assert not (tmp_path / "t").exists()


def test_compiled_false_records_the_eager_code_that_ran(tmp_path):
    m = MLP()
    x = torch.randn(4, 16)
    with torch.no_grad():
        eager = m(x)
        c = torch.compile(m)
        with divtrace.record(c, tmp_path / "t", mode="full", compiled=False) as rec:
            got = c(x)  # force_eager: no compilation happens at all
    assert rec.ops and torch.equal(got, eager)
    meta = _meta(tmp_path / "t")
    assert meta["compiled"]["recorded"] == "eager" and meta["unseen"] == []
    assert any("force_eager" in w for w in meta["warnings"])
    assert [n for n, _ in meta["module_tree"]] == ["", "up", "down"]  # no _orig_mod


def test_compiled_code_that_ran_without_hooks_is_unseen(tmp_path):
    """`model` is recorded but its torch.compile'd copy is what runs: the compiled code was built before the hooks
    existed and never runs them. The trace must say so, not hold a root call alone that compares identical."""
    m = MLP()
    x = torch.randn(4, 16)
    c = torch.compile(m)
    with torch.no_grad():
        c(x)
        with divtrace.record(m, tmp_path / "t", mode="hash", ops=False) as rec:
            c(x)
    assert not rec.compiled
    unseen = _meta(tmp_path / "t")["unseen"]
    assert unseen and "compiled code ran" in unseen[0] and "compiled=True" in unseen[0]


def test_a_compile_failure_while_recording_is_one_line(tmp_path):
    def refuses_taps(gm, example_inputs):
        if any("divtrace" in str(n.target) for n in gm.graph.nodes):
            raise RuntimeError("this backend cannot compile custom ops")
        return gm.forward

    m = MLP()
    c = torch.compile(m, backend=refuses_taps)
    with pytest.raises(DivtraceError, match="compiling the model with divtrace's taps failed.*compiled=False"):
        with torch.no_grad(), divtrace.record(c, tmp_path / "t", mode="hash"):
            c(torch.randn(2, 16))
    assert _meta(tmp_path / "t")["status"] == "error"


def test_inductor_settings_are_recorded_and_diffed(tmp_path):
    m = MLP()
    x = torch.randn(2, 16)
    with torch.no_grad():
        c = torch.compile(m, options={"emulate_precision_casts": True})
        with divtrace.record(c, tmp_path / "a", mode="hash"):
            c(x)
        with divtrace.record(m, tmp_path / "b", mode="hash", ops=False):
            m(x)
    sa, sb = _meta(tmp_path / "a")["settings"], _meta(tmp_path / "b")["settings"]
    assert sa["inductor_emulate_precision_casts"] is True and sb["inductor_emulate_precision_casts"] is False
    for k in ("inductor_fallback_random", "inductor_max_autotune", "inductor_coordinate_descent_tuning",
              "inductor_cpp_simdlen", "inductor_triton_cudagraphs"):
        assert k in sa and sa[k] == sb[k]
    r = divtrace.bisect(tmp_path / "b", tmp_path / "a")
    names = {s["name"] for s in r.settings}
    assert {"inductor_emulate_precision_casts", "torch_compile"} <= names


def test_cli_record_compiled(tmp_path):
    entry = tmp_path / "e.py"
    entry.write_text("import torch\n\n\nclass MLP(torch.nn.Module):\n    def __init__(self):\n        super().__init__()\n"
                     "        self.up = torch.nn.Linear(16, 8)\n\n    def forward(self, x):\n        return self.up(x)\n\n\n"
                     "def build():\n    return torch.compile(MLP()), (torch.randn(2, 16),)\n")
    p = subprocess.run([sys.executable, "-m", "divtrace", "record", f"{entry}:build", "--out", str(tmp_path / "t"),
                        "--mode", "hash"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    meta = _meta(tmp_path / "t")
    assert meta["compiled"]["recorded"] == "compiled" and meta["ops"] is False and meta["unseen"] == []
    p = subprocess.run([sys.executable, "-m", "divtrace", "record", f"{entry}:build", "--out", str(tmp_path / "e"),
                        "--mode", "hash", "--no-compiled"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and _meta(tmp_path / "e")["compiled"]["recorded"] == "eager", p.stderr
