"""Recording torch.compile'd models (divtrace.record.compiled): taps inside compiled code, bisect compiled vs eager and
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
from test_trace_fixtures import cli

ROOT = __import__("pathlib").Path(__file__).resolve().parent.parent


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
    lm_head = next(c for c in t.calls.values() if c.module == "lm_head")
    assert lm_head.outputs[0][1] == vid  # the root's hook (a graph of its own) got the logits unchanged: hashed once
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


def test_compiled_traces_carry_no_token_identity(llama_runs):
    """Inside compiled code divtrace sees module boundaries through taps, not the root call's token rows: the
    compiled trace has no token files, so --align tokens is refused naming it (docs/compiled.md says so)."""
    d = llama_runs["dir"]
    assert (d / "eager" / "tokens.jsonl").is_file() and not (d / "comp" / "tokens.jsonl").exists()
    assert "tokens" not in _meta(d / "comp")
    for a, b in ((d / "eager", d / "comp"), (d / "comp", d / "eager")):
        code, _, err = cli("bisect", a, b, "--align", "tokens")
        assert code == 2 and f"{d / 'comp'}: the trace carries no token identity" in err, err


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


def test_compiled_true_on_a_model_that_is_not_compiled_is_refused(tmp_path, capsys):
    """Issue 26 snag 1: `record --compiled` of an uncompiled ENTRY recorded eager code labelled "compiled"."""
    from divtrace.cli.app import main

    with pytest.raises(DivtraceError, match="no module of the model is torch.compile'd"):
        divtrace.record(MLP(), tmp_path / "t", mode="hash", compiled=True)
    assert not (tmp_path / "t").exists()
    entry = f"{ROOT / 'examples' / 'llama_pair.py'}:inference"
    capsys.readouterr()
    assert main(["record", entry, "--out", str(tmp_path / "c"), "--compiled", "--mode", "hash"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("divtrace: error: compiled=True (--compiled)") and "\n" not in err, err
    assert not (tmp_path / "c" / "meta.json").exists()


def test_compiled_code_that_did_not_run_is_not_labelled_compiled(tmp_path):
    """compiled=True on a compiled model whose compiled code never ran inside the block (here a force_eager
    stance; TORCHDYNAMO_DISABLE=1 does the same): the module boundaries recorded are eager code."""
    c = torch.compile(MLP())
    with torch.no_grad(), torch.compiler.set_stance("force_eager"), \
            divtrace.record(c, tmp_path / "t", mode="hash", compiled=True):
        c(torch.randn(2, 16))
    meta = _meta(tmp_path / "t")
    assert meta["compiled"]["recorded"] == "eager" and meta["settings"]["torch_compile"] is None
    assert meta["granularity"] == "modules" and meta["compiled"]["taps_run"] == 6
    assert not any("inside the compiled code (compiled=True)" in w for w in meta["warnings"])


def test_docs_record_compiled_with_an_entry_that_compiles():
    """Every documented `record ... --compiled` names an ENTRY that returns a compiled model (no compilation
    happens here: torch.compile is lazy)."""
    import re
    import shlex

    from divtrace.record.compiled.paths import compiled_regions
    from divtrace.record.entry import build_from_entry, parse_args

    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
            *sorted((ROOT / "divtrace" / "skill" / "divtrace").rglob("*.md"))]
    found = 0
    for doc in docs:
        for line in doc.read_text().splitlines():
            m = re.search(r"divtrace record (examples/\S+) (.*--compiled\b.*)", line.strip(" `"))
            if not m:
                continue
            argv = shlex.split(m.group(2).split("#")[0])
            args = parse_args([argv[i + 1] for i, a in enumerate(argv) if a == "--arg"])
            model, _ = build_from_entry(str(ROOT / m.group(1)), args)
            assert compiled_regions(model), f"{doc.name}: {line.strip()}: the ENTRY's model is not compiled"
            found += 1
    assert found >= 1


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


def test_a_graph_compiled_for_a_twin_without_taps_is_not_reused(tmp_path):
    """Dynamo reuses a graph across instances of one class and by default does not guard on hooks: a twin
    compiled inside the block made the recorded model run the twin's graph, with no tap."""
    import copy

    m = MLP()
    twin = copy.deepcopy(m)
    c, plain = torch.compile(m), torch.compile(twin)
    x = torch.randn(4, 16)
    with torch.no_grad(), divtrace.record(c, tmp_path / "t", mode="hash") as rec:
        plain(x)
        c(x)
    meta = _meta(tmp_path / "t")
    assert meta["unseen"] == [] and meta["compiled"]["taps_run"] == 6
    assert {k for k in rec._calls} == {"", "up", "down"}
    assert torch._dynamo.config.skip_nnmodule_hook_guards  # restored


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
    with torch.no_grad(), divtrace.record(m, tmp_path / "t2", mode="hash", ops=False):
        c(x)
    r = divtrace.bisect(tmp_path / "t", tmp_path / "t2")  # every compared tensor equal, but the insides unseen
    assert r.verdict == "inconclusive" and r.exit_code == 3  # never "identical"


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


def test_values_written_in_place_by_compiled_kernels_are_recorded_as_written(tmp_path):
    """Inductor writes the ReLU into the buffer of the Linear's output (in place, without moving torch's version
    counter), and the taps get the same tensor object before and after: the ReLU's output was recorded as its
    input. And a module's output that the next module's enter tap reads unchanged is hashed once."""
    torch.manual_seed(2)
    m = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16), torch.nn.ReLU())
    x = torch.randn(4, 16)
    from divtrace.trace.writer import TraceWriter

    hashed = []
    new_value = TraceWriter.new_value

    def counting(self, t, *a, **k):
        hashed.append(t.shape)
        return new_value(self, t, *a, **k)

    with torch.no_grad(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(TraceWriter, "new_value", counting)
        c = torch.compile(m)
        with divtrace.record(c, tmp_path / "comp", mode="full"):
            c(x)
            c(x)
        n_shared = len(hashed)
        from divtrace.record.compiled import kernels

        mp.setattr(kernels, "site_info", lambda site: None)  # no value shared between taps
        with divtrace.record(c, tmp_path / "plain", mode="hash"):
            c(x)
            c(x)
    from divtrace.trace.reader import Trace

    t = Trace(tmp_path / "comp")
    by = {(c.module, c.call): c for c in t.calls.values()}
    for call in (0, 1):
        relu = by[("2", call)]
        assert torch.equal(t.tensor(relu.outputs[0][1]), torch.relu(t.tensor(relu.inputs[0][1])))
        assert by[("0", call)].outputs[0][1] == by[("1", call)].inputs[0][1]  # hashed once
    assert n_shared < len(hashed) - n_shared
    r = divtrace.bisect(tmp_path / "comp", tmp_path / "plain")
    assert r.verdict == "identical" and r.unmatched == {"a": 0, "b": 0}


GENERATED = '''
cpp_fused_relu_0 = async_compile.cpp_pybinding(['float*', 'const float*'], r\'\'\'
extern "C"  void  kernel(float* out_ptr0,
                       const float* in_ptr0)
{}
\'\'\')
class Runner:
    def call(self, args):
        arg0_1, = args
        buf0 = empty_strided_cpu((4, 16), (16, 1), torch.float32)
        extern_kernels.mm(arg0_1, arg0_1, out=buf0)
        torch.ops.divtrace.tap.default(arg2_1, [buf0], 'a', 'a', 1, '0', 'exit')
        torch.ops.divtrace.tap.default(arg2_1, [buf0], 'a', 'a', 1, '1', 'enter')
        some_new_launcher(buf0, stream=0)
        torch.ops.divtrace.tap.default(arg2_1, [buf0], 'a', 'a', 1, '1', 'exit')
        buf1 = empty_strided_cpu((4, 16), (16, 1), torch.float32)
        cpp_fused_relu_0(buf1, buf0)
        torch.ops.divtrace.tap.default(arg2_1, [buf1, buf0], 'a', 'a', 1, '2', 'exit')
        return (buf1, )
'''


def test_generated_code_reading_never_shares_a_value_across_a_line_it_does_not_understand(tmp_path):
    from divtrace.record.compiled.kernels import _analyze

    p = tmp_path / "gen.py"
    p.write_text(GENERATED)
    lines = {i + 1: line for i, line in enumerate(GENERATED.splitlines())}
    taps = sorted(no for no, line in lines.items() if "divtrace.tap" in line)
    t = _analyze(str(p))
    assert t[taps[0]][1] == t[taps[1]][1]  # nothing between: one value
    assert t[taps[1]][1] != t[taps[2]][1]  # an unknown launcher may have written buf0
    assert t[taps[3]][1][1] == t[taps[2]][1][0]  # the relu kernel only reads buf0 (const in_ptr0)
    assert t[taps[0]][0][0]["kernel"] == "extern_kernels.mm" and t[taps[3]][0][0]["kernel"] == "cpp_fused_relu_0"
    assert t[taps[1]][1][0] in t[taps[1]][2]  # released after its last tap
