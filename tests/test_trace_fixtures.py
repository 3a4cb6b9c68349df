"""Small models and helpers shared by the record/trace hardening tests (imported as a module; its one test
checks the helpers themselves)."""
from __future__ import annotations

import io
import json
import shutil
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import torch
from torch import nn

import divtrace


class Tiny(nn.Module):
    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.lin = nn.Linear(8, 16)
        self.act = nn.GELU()
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        return self.out(self.act(self.lin(x)))


def tiny_input(seed: int = 1) -> torch.Tensor:
    return torch.randn(3, 8, generator=torch.Generator().manual_seed(seed))


def record_tiny(path: Path, mode: str = "full", seed: int = 0, x=None, **kw) -> Path:
    model = Tiny(seed)
    with torch.no_grad(), divtrace.record(model, path, mode=mode, **kw):
        model(tiny_input() if x is None else x)
    return path


def cli(*args) -> tuple[int, str, str]:
    """divtrace's CLI in-process: (exit code, stdout, stderr)."""
    from divtrace.cli.app import main

    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main([str(a) for a in args])
    return code, out.getvalue(), err.getvalue()


def copy_trace(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def shard(path: Path) -> Path:
    return sorted(path.glob("tensors-*.safetensors"))[0]


def edit_meta(path: Path, **changes) -> None:
    meta = json.loads((path / "meta.json").read_text())
    for k, v in changes.items():
        if v is None:
            meta.pop(k, None)
        else:
            meta[k] = v
    (path / "meta.json").write_text(json.dumps(meta))


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_fixtures_record_identical_pair(tmp_path):
    a, b = record_tiny(tmp_path / "a"), record_tiny(tmp_path / "b")
    code, out, _ = cli("bisect", a, b, "--json")
    assert code == 0 and json.loads(out)["verdict"] == "identical"
