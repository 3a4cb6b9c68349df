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
