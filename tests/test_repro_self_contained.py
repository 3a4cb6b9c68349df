"""A generated side is self-contained: copied into a patch file as it is, it runs (no module-level DEVICE, no
harness helper), so `verify --patch copy.py:side_a --side b` checks side a against itself and passes. verify's
report names each input next to its shape, and says each warning once."""
from __future__ import annotations

import ast
import re

import pytest

from divtrace.cli.app import main
from helpers import record_pair


@pytest.fixture(scope="module")
def sdpa_repro(tmp_path_factory):
    d = tmp_path_factory.mktemp("selfc")
    a, b = record_pair(d, "sdpa")
    out = d / "repro"
    assert main(["repro", str(a), str(b), "--out", str(out)]) == 0
    return out


def _function_source(path, name):
    src = path.read_text()
    node = next(n for n in ast.parse(src).body if isinstance(n, ast.FunctionDef) and n.name == name)
    return ast.get_source_segment(src, node)


def test_side_uses_a_device_and_defines_it_itself(sdpa_repro):
    side_a = _function_source(sdpa_repro / "repro.py", "side_a")
    assert "device=DEVICE" in side_a  # the eager side builds its causal mask on the device
    tree = ast.parse(side_a)
    assigned = {t.id for n in ast.walk(tree) if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    params = {a.arg for a in tree.body[0].args.args}
    loaded = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    assert loaded - assigned - params <= {"torch", "float", "complex"}, "side_a reads a name the script defines"


def test_side_copied_into_a_patch_runs(sdpa_repro, tmp_path, capsys):
    patch = tmp_path / "copy.py"
    patch.write_text("import torch\n\n\n" + _function_source(sdpa_repro / "repro.py", "side_a") + "\n")
    capsys.readouterr()
    code = main(["verify", str(sdpa_repro), "--patch", f"{patch}:side_a", "--side", "b", "--trials", "2"])
    cap = capsys.readouterr()
    assert "NameError" not in cap.out + cap.err
    assert code == 0, cap.out[-3000:]


def test_verify_shapes_column_separates_inputs(sdpa_repro, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "300")
    capsys.readouterr()
    main(["verify", str(sdpa_repro), "--trials", "1"])
    out = capsys.readouterr().out
    assert re.search(r"v_proj_out \[2, 16, 128\], add_out \[2, 4, 16, 32\]", out), out[-2000:]
    assert "v_proj_out[2,16,128]add_out" not in out


def test_sequence_length_is_symbolic_so_the_sweep_runs(sdpa_repro, tmp_path, capsys):
    """The attention region builds its causal mask and views at the sequence length: written as S, read from an
    input, so verify's "another sequence length" sweep runs (it was SKIPPED with the length hard-coded)."""
    import json

    m = json.loads((sdpa_repro / "manifest.json").read_text())
    assert m["seq_symbolic"] is True and m["seq"] == 16
    dims = {i["name"]: i["seq_dims"] for i in m["inputs"]}
    assert dims == {"v_proj_out": [1], "add_out": [2], "add_out_2": [2]}
    side_a = _function_source(sdpa_repro / "repro.py", "side_a")
    assert "S = v_proj_out.shape[1]" in side_a and "full.default([S, S]" in side_a
    patch = tmp_path / "copy.py"
    patch.write_text("import torch\n\n\n" + side_a + "\n")
    capsys.readouterr()
    assert main(["verify", str(sdpa_repro), "--patch", f"{patch}:side_a", "--side", "b", "--trials", "1"]) == 0
    assert "PASSED: sweep v_proj_out dim 1 = 31 (another sequence length, was 16)" in capsys.readouterr().out
    # the unchanged sides differ at the other length too (the sweep compares, it is not skipped)
    capsys.readouterr()
    assert main(["verify", str(sdpa_repro), "--trials", "1"]) == 1
    assert "FAILED: sweep v_proj_out dim 1 = 31 (another sequence length" in capsys.readouterr().out


def test_sequence_length_kept_when_it_cannot_be_told(tmp_path):
    """T equal to the batch size cannot be told apart from it: the repro keeps the recorded length and the
    manifest says so (no seq_dims, so verify never sweeps a length the code does not follow)."""
    import json

    a, b = record_pair(tmp_path, "sdpa", batch=2, seq=2)
    out = tmp_path / "repro"
    assert main(["repro", str(a), str(b), "--out", str(out)]) == 0
    m = json.loads((out / "manifest.json").read_text())
    assert m["seq_symbolic"] is False and all(i["seq_dims"] is None for i in m["inputs"])
