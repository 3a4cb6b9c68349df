"""divtrace repro beyond the planted pairs: hash-only traces, hostile names, custom ops, per-side settings, a
kernel that does not replay, --at, bad input, and the code generator's literals."""
from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import math
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from divtrace.cli.app import main as cli
from divtrace.errors import DivtraceError
from divtrace.repro import codegen, write_repro
from helpers import EXAMPLE, record_model

OPS_MODULE = "divtrace_repro_test_ops"
OPS_SOURCE = '''
"""Custom ops for the repro tests (a fused kernel, and one whose result depends on uncaptured state)."""
import torch

CALLS = [0]


@torch.library.custom_op("divtrace_repro_test::scaled_add", mutates_args=())
def scaled_add(x: torch.Tensor, y: torch.Tensor, alpha: float) -> torch.Tensor:
    return (x.float() + alpha * y.float()).to(x.dtype)  # one rounding


@torch.library.custom_op("divtrace_repro_test::scaled_add_", mutates_args=("x",))
def scaled_add_(x: torch.Tensor, y: torch.Tensor, alpha: float) -> None:
    x.copy_((x.float() + alpha * y.float()).to(x.dtype))  # in place, returns nothing (vLLM's rotary_embedding)


@torch.library.custom_op("divtrace_repro_test::stateful", mutates_args=())
def stateful(x: torch.Tensor) -> torch.Tensor:
    CALLS[0] += 1
    return x + CALLS[0]  # depends on how often it ran before: state a trace cannot hold
'''
EVIL = "evil\"'''\"\"\"\\\n__import__('os')\r\nopen('PWNED','w')\n#"


@pytest.fixture(scope="module")
def ops(tmp_path_factory):
    d = tmp_path_factory.mktemp("ops")
    (d / f"{OPS_MODULE}.py").write_text(OPS_SOURCE)
    sys.path.insert(0, str(d))
    try:
        yield importlib.import_module(OPS_MODULE)
    finally:
        sys.path.remove(str(d))


class Mix(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.proj = nn.Linear(16, 16, bias=False)
        self.kind = kind

    def forward(self, x):
        h = self.proj(x)
        if self.kind == "eager":
            return h + 0.3 * x  # two roundings
        if self.kind == "fused":
            return (h.float() + 0.3 * x.float()).to(x.dtype)
        if self.kind == "custom":
            return torch.ops.divtrace_repro_test.scaled_add(h, x, 0.3)
        if self.kind == "custom_inplace":
            torch.ops.divtrace_repro_test.scaled_add_(h, x, 0.3)
            return h
        return torch.ops.divtrace_repro_test.stateful(h)


class Root(nn.Module):
    def __init__(self, name: str, kind: str):
        super().__init__()
        self.add_module(name, Mix(kind))
        self.child = name

    def forward(self, x):
        return getattr(self, self.child)(x) * 2


def record_mix(path, kind, name="blk", label=None, **kw):
    torch.manual_seed(0)
    model = Root(name, kind).to(torch.bfloat16)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    record_model(model, (x,), path, label=label, **kw)
    return path


def _load(d):
    spec = importlib.util.spec_from_file_location(f"repro_{abs(hash(str(d)))}", d / "repro.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_hostile_module_name_and_label_cannot_inject_code(tmp_path, monkeypatch):
    a = record_mix(tmp_path / "a", "eager", EVIL, label=EVIL)
    b = record_mix(tmp_path / "b", "fused", EVIL, label="b'''\nopen('PWNED2','w')")
    r = write_repro(a, b, tmp_path / "r")
    assert r.ok and r.manifest["origin"]["module"] == EVIL
    src = (tmp_path / "r" / "repro.py").read_text()
    tree = ast.parse(src)
    calls = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    assert "open" not in calls and "__import__" not in calls
    assert all(n.isidentifier() and "PWNED" not in n for n in _load(tmp_path / "r").INPUT_NAMES)
    monkeypatch.chdir(tmp_path)
    p = subprocess.run([sys.executable, "-I", str(tmp_path / "r" / "repro.py")], capture_output=True, text=True,
                       cwd=tmp_path, timeout=120)
    assert p.returncode == 1, p.stderr
    assert not (tmp_path / "PWNED").exists() and not (tmp_path / "PWNED2").exists()
    assert "evil" in p.stdout  # the name is printed, as data


def test_custom_op_module_is_imported_and_reported(ops, tmp_path):
    a = record_mix(tmp_path / "a", "eager")
    b = record_mix(tmp_path / "b", "custom")
    env = {k: v for k, v in __import__("os").environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(Path(ops.__file__).parent)  # importable, but nothing imports it unless asked

    def run(*extra):
        return subprocess.run([sys.executable, "-m", "divtrace", "repro", str(a), str(b), *extra], env=env,
                              capture_output=True, text=True, timeout=300)

    p = run("--out", str(tmp_path / "unknown"))  # a separate process that never loaded the op's module
    assert p.returncode == 1 and "NOT aten and its module is unknown (pass --import MODULE)" in p.stdout, p.stderr
    p = run("--out", str(tmp_path / "r"), "--import", OPS_MODULE)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "custom op divtrace_repro_test.scaled_add.default" in p.stdout and OPS_MODULE in p.stdout
    m = json.loads((tmp_path / "r" / "manifest.json").read_text())
    assert m["custom_ops"] == [{"op": "divtrace_repro_test.scaled_add.default", "module": OPS_MODULE}]
    src = (tmp_path / "r" / "repro.py").read_text()
    assert f"importlib.import_module({OPS_MODULE!r})" in src and "Custom ops (not aten)" in src
    # a fresh interpreter without the ops module on its path: the script finds it where it was recorded from
    p = subprocess.run([sys.executable, "-I", str(tmp_path / "r" / "repro.py")], capture_output=True, text=True,
                       cwd=tmp_path, timeout=120)
    assert p.returncode == 1 and "scaled_add" in p.stdout, p.stderr


def test_kernel_that_does_not_replay_fails_loudly(ops, tmp_path, capsys):
    a = record_mix(tmp_path / "a", "eager")
    b = record_mix(tmp_path / "b", "stateful")
    assert cli(["repro", str(a), str(b), "--out", str(tmp_path / "r")]) == 1
    text = capsys.readouterr().out
    assert "FAILED: side b of the repro does NOT reproduce the recorded output" in text
    assert "does not capture" in text and "differ from the recorded output" in text
    m = json.loads((tmp_path / "r" / "manifest.json").read_text())
    assert m["fidelity"] == {"a": True, "b": False} and m["fidelity_errors"]["b"]
    assert (tmp_path / "r" / "repro.py").exists()  # written, for inspection


def test_each_side_runs_under_its_own_settings(tmp_path, capsys):
    a = record_mix(tmp_path / "a", "eager")
    old = torch.get_num_threads(), torch.get_float32_matmul_precision()
    torch.set_num_threads(2 if old[0] != 2 else 1)
    torch.set_float32_matmul_precision("high")
    try:
        b = record_mix(tmp_path / "b", "fused")
        b_threads = torch.get_num_threads()
    finally:
        torch.set_num_threads(old[0])
        torch.set_float32_matmul_precision(old[1])
    assert cli(["repro", str(a), str(b), "--out", str(tmp_path / "r")]) == 0
    assert "they differ in: " in capsys.readouterr().out
    mod = _load(tmp_path / "r")
    assert mod.SETTINGS_A["num_threads"] == old[0] and mod.SETTINGS_B["num_threads"] == b_threads
    assert mod.SETTINGS_A["float32_matmul_precision"] == old[1] and mod.SETTINGS_B["float32_matmul_precision"] == "high"
    seen = mod.run_side(lambda **kw: (torch.get_num_threads(), torch.get_float32_matmul_precision()),
                        mod.SETTINGS_B, mod.load_inputs())
    assert seen == (b_threads, "high")
    assert (torch.get_num_threads(), torch.get_float32_matmul_precision()) == old  # restored


@pytest.fixture(scope="module")
def example_hash(tmp_path_factory):
    d = tmp_path_factory.mktemp("hash")
    for name, extra in (("a", [f"{EXAMPLE}:training"]), ("b", [f"{EXAMPLE}:inference", "--arg", "variant=silu_fused"])):
        assert cli(["record", *extra, "--out", str(d / name), "--mode", "hash"]) == 0
    return d


def test_hash_only_traces_print_the_exact_record_command(example_hash, capsys):
    d = example_hash
    assert cli(["repro", str(d / "a"), str(d / "b"), "--out", str(d / "r")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "only fingerprints" in err
    assert "--mode full --include '^model\\.layers\\.0\\.mlp$'" in err
    cmds = err.split("record them with: ")[1].split(", then run")[0].split(" ; ")
    assert len(cmds) == 2
    for c in cmds:  # run exactly what it says
        argv = shlex.split(c.split("  (or in Python")[0])
        assert argv[:2] == ["divtrace", "record"]
        assert cli(argv[1:]) == 0
    assert not (d / "r").exists()
    assert cli(["repro", str(d / "a-full"), str(d / "b-full"), "--out", str(d / "r")]) == 0


def test_at_module_exit_and_op(tmp_path, capsys):
    a = record_mix(tmp_path / "a", "eager")
    b = record_mix(tmp_path / "b", "fused")
    from divtrace.trace.reader import Trace

    t = Trace(a)
    root = next(c for c in t.calls.values() if c.module == "")
    blk = next(c for c in t.calls.values() if c.module == "blk")
    # the root's exit: the divergence seen at the model output, through the root's own * 2
    r = write_repro(a, b, tmp_path / "root", at=root.exit_index)
    assert r.ok and r.manifest["origin"]["module"] == ""
    assert max(r.manifest["ops"]["a"]["records"]) == t.values[root.outputs[0][1]].producer
    # an op of blk's own code without a counterpart on side b (different op sequences there)
    op = next(i for i in blk.ops if t.records[i].op == "aten.add.Tensor")
    with pytest.raises(DivtraceError, match=f"pass the call's exit record {blk.exit_index}"):
        write_repro(a, b, tmp_path / "op", at=op)
    # an op with a counterpart (the root's * 2, same code on both sides): from the last shared tensors to it
    mul2 = root.ops[-1]
    r = write_repro(a, b, tmp_path / "mul2", at=mul2)
    recs = r.manifest["ops"]["a"]["records"]
    assert r.ok and recs[-1] == mul2 and set(recs[:-1]) <= set(blk.ops) and r.manifest["origin"]["cause"] == "origin"
    assert cli(["repro", str(a), str(b), "--out", str(tmp_path / "x"), "--at", "99999"]) == 2
    assert "no such record" in capsys.readouterr().err


def test_bad_input(tmp_path, capsys):
    a = record_mix(tmp_path / "a", "eager")
    same = record_mix(tmp_path / "same", "eager")
    assert cli(["repro", str(a), str(same), "--out", str(tmp_path / "r")]) == 2
    assert "nothing to reproduce" in capsys.readouterr().err
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("x")
    b = record_mix(tmp_path / "b", "fused")
    assert cli(["repro", str(a), str(b), "--out", str(tmp_path / "busy")]) == 2
    assert "not empty" in capsys.readouterr().err
    assert cli(["repro", str(tmp_path / "missing"), str(b), "--out", str(tmp_path / "r2")]) == 2


def test_help_has_examples(capsys):
    assert cli(["repro", "--help"]) == 0
    out = capsys.readouterr().out
    assert "Examples" in out and "divtrace repro runs/train runs/infer --out repro/" in out


# -- the code generator ---------------------------------------------------------------------------------------
def _ev(src: str):
    return eval(src, {"torch": torch, "DEVICE": torch.device("cpu"), "float": float, "complex": complex})


@pytest.mark.parametrize("enc, value", [
    ({"$float": "inf"}, math.inf), ({"$float": "-inf"}, -math.inf), (1e-06, 1e-06), (-3.3895313892515355e+38,
                                                                                      -3.3895313892515355e+38),
    ({"$tuple": [1, 2]}, (1, 2)), ({"$tuple": [3]}, (3,)), ([1, [2, None]], [1, [2, None]]), (True, True),
    ({"$dtype": "torch.bfloat16"}, torch.bfloat16), ({"$layout": "torch.strided"}, torch.strided),
    ({"$memory_format": "torch.contiguous_format"}, torch.contiguous_format),
    ({"$device": "cpu"}, torch.device("cpu")), ({"$device": "meta"}, torch.device("meta")),
    ({"$complex": [1.5, -2.0]}, complex(1.5, -2.0)), ({"$dict": [["k", 1]]}, {"k": 1}),
    ("a'\"\n''';x", "a'\"\n''';x"),
])
def test_literals_round_trip(enc, value):
    got = _ev(codegen.literal(enc, codegen.Ctx({}, "cpu")))
    assert got == value and type(got) is type(value)


@pytest.mark.parametrize("enc", [{"$repr": "<object>", "$type": "Foo"}, {"$dtype": "torch.os"}, {"$v": 5},
                                 {"$dtype": "__import__('os')"}, {"$float": "1e9"}, {"$what": 1}])
def test_unreplayable_arguments_are_refused(enc):
    with pytest.raises(codegen.Unreplayable):
        codegen.literal(enc, codegen.Ctx({}, "cpu"))


def test_op_names_and_identifiers_are_safe():
    assert codegen.op_expr("aten.mm.default") == "torch.ops.aten.mm.default"
    weird = codegen.op_expr("ns.na'me.default")
    assert weird.startswith("getattr(") and ast.parse(weird)
    with pytest.raises(codegen.Unreplayable):
        codegen.op_expr("aten.mm")
    taken: set = set()
    hints = (EVIL, "class", "t3", "1x", "", "B", "x", "x", "é", "float", "getattr")
    names = [codegen.safe_ident(h, taken) for h in hints]
    assert len(set(names)) == len(names)
    for n in names:
        assert n.isidentifier() and n not in ("class", "t3", "B", "float", "getattr") and not n.startswith("_")


def test_script_compiles_without_divtrace_names(tmp_path):
    a = record_mix(tmp_path / "a", "eager")
    b = record_mix(tmp_path / "b", "fused")
    write_repro(a, b, tmp_path / "r")
    src = (tmp_path / "r" / "repro.py").read_text()
    imported = {n.names[0].name.split(".")[0] for n in ast.walk(ast.parse(src)) if isinstance(n, ast.Import)}
    imported |= {n.module.split(".")[0] for n in ast.walk(ast.parse(src)) if isinstance(n, ast.ImportFrom)}
    assert imported <= {"argparse", "json", "math", "os", "sys", "pathlib", "traceback", "torch", "safetensors"}
    assert 'if __name__ == "__main__":' in src and textwrap.dedent(src).count("sys.exit(main())") == 1


def test_script_compare_is_bitwise(tmp_path):
    a = record_mix(tmp_path / "a", "eager")
    b = record_mix(tmp_path / "b", "fused")
    write_repro(a, b, tmp_path / "r")
    cmp = _load(tmp_path / "r").compare
    one = torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16)
    r = cmp(one, torch.tensor([1.0, 2.0, 3.015625], dtype=torch.bfloat16))
    assert (r["equal"], r["mismatched"], r["max_ulp"], r["first_index"]) == (False, 1, 1, [2])
    assert (r["first_a_bits"], r["first_b_bits"], r["max_abs"]) == ("0x4040", "0x4041", 0.015625)
    z = cmp(torch.tensor([0.0]), torch.tensor([-0.0]))
    assert not z["equal"] and z["max_abs"] == 0.0 and z["first_b_bits"] == "0x80000000"
    nan = torch.tensor([float("nan")])
    assert cmp(nan, nan.clone())["equal"]
    assert cmp(torch.arange(6), torch.arange(6).reshape(2, 3))["equal"]  # only the layout differs: aligned
    assert cmp(torch.arange(6), torch.arange(6).reshape(2, 3))["aligned"]
    assert cmp(torch.arange(6), torch.arange(4))["reason"].startswith("sizes differ")
    d = cmp(one, one.float())
    assert not d["equal"] and "dtypes differ" in d["reason"]
    i = cmp(torch.tensor([1, 5]), torch.tensor([1, 7]))
    assert i["mismatched"] == 1 and i["max_abs"] == 2.0 and i["max_ulp"] is None


def test_map_pairs_renamed_modules(tmp_path):
    a = record_mix(tmp_path / "a", "eager", "blk")
    b = record_mix(tmp_path / "b", "fused", "engine_block")
    (tmp_path / "map.yaml").write_text("'^engine_block': blk\n")
    assert cli(["repro", str(a), str(b), "--out", str(tmp_path / "r0")]) == 2  # unrelated without the map
    assert cli(["repro", str(a), str(b), "--out", str(tmp_path / "r"), "--map", str(tmp_path / "map.yaml")]) == 0
    m = json.loads((tmp_path / "r" / "manifest.json").read_text())
    assert (m["origin"]["module"], m["origin"]["module_b"]) == ("blk", "engine_block")


def test_custom_op_that_writes_into_its_argument_replays(ops, tmp_path):
    """An op that returns nothing and writes its result into an argument (vLLM's _C.rotary_embedding): the trace
    says which argument holds each output ($writes) and the repro reads the result from it after the call."""
    a = record_mix(tmp_path / "a", "eager")
    b = record_mix(tmp_path / "b", "custom_inplace")
    from divtrace.trace.reader import Trace

    tb = Trace(b)
    rec = next(r for r in tb.records if r.kind == "op" and r.op == "divtrace_repro_test.scaled_add_.default")
    assert rec.out == {"$writes": [0]} and len(rec.outputs) == 1
    r = write_repro(a, b, tmp_path / "r", imports=[OPS_MODULE])
    assert r.ok, r.explanation
    src = (tmp_path / "r" / "repro.py").read_text()
    assert "torch.ops.divtrace_repro_test.scaled_add_.default(" in src and "_r = torch.ops.divtrace_repro_test" not in src
    p = subprocess.run([sys.executable, "-I", str(tmp_path / "r" / "repro.py")], capture_output=True, text=True,
                       cwd=tmp_path, timeout=120)
    assert p.returncode == 1 and "DIFFER" in p.stdout.upper(), p.stdout + p.stderr
