"""The autograd mode a forward ran under is a recorded setting, and bisect lists it when the two runs differ."""
from __future__ import annotations

import json

import torch
from torch import nn

import divtrace
from divtrace.cli.app import main
from divtrace.record.settings import numerics_settings


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))


X = torch.randn(2, 8, generator=torch.Generator().manual_seed(1))


def _record(path, ctx, inside: bool):
    m = _model()
    if inside:  # the common pattern: the grad context inside the record block
        with divtrace.record(m, path, label=path.name):
            with ctx():
                m(X)
    else:
        with ctx(), divtrace.record(m, path, label=path.name):
            m(X)
    return json.loads((path / "meta.json").read_text())["settings"]


def test_grad_mode_keys_are_numerics_settings():
    assert {"grad_enabled", "inference_mode"} <= set(numerics_settings())


def test_grad_mode_is_what_the_forward_ran_under(tmp_path):
    assert _record(tmp_path / "g", torch.enable_grad, inside=True)["grad_enabled"] is True
    s = _record(tmp_path / "ng", torch.no_grad, inside=True)
    assert s["grad_enabled"] is False and s["inference_mode"] is False
    s = _record(tmp_path / "inf", torch.inference_mode, inside=False)
    assert s["grad_enabled"] is False and s["inference_mode"] is True


def test_mixed_grad_mode_is_marked(tmp_path):
    m = _model()
    with divtrace.record(m, tmp_path / "mixed"):
        with torch.no_grad():
            m(X)
        m(X)
    s = json.loads((tmp_path / "mixed" / "meta.json").read_text())["settings"]
    assert s["grad_enabled"] == "mixed" and s["inference_mode"] is False


def test_bisect_lists_grad_mode(tmp_path, capsys):
    _record(tmp_path / "train", torch.enable_grad, inside=True)
    _record(tmp_path / "infer", torch.no_grad, inside=True)
    r = divtrace.bisect(tmp_path / "train", tmp_path / "infer")
    assert {"name": "grad_enabled", "a": True, "b": False} in r.settings
    capsys.readouterr()
    main(["bisect", str(tmp_path / "train"), str(tmp_path / "infer")])
    assert "grad_enabled" in capsys.readouterr().out
    capsys.readouterr()
    main(["bisect", str(tmp_path / "train"), str(tmp_path / "infer"), "--json"])
    diff = json.loads(capsys.readouterr().out)["settings_diff"]
    assert {"name": "grad_enabled", "a": True, "b": False} in diff


def test_cli_grad_mode_is_recorded(tmp_path):
    from pathlib import Path

    entry = Path(__file__).resolve().parent.parent / "examples" / "llama_pair.py"
    for mode, want in (("grad", True), ("no_grad", False)):
        assert main(["record", f"{entry}:training", "--out", str(tmp_path / mode), "--grad-mode", mode,
                     "--mode", "hash", "--no-ops"]) == 0
        assert json.loads((tmp_path / mode / "meta.json").read_text())["settings"]["grad_enabled"] is want
