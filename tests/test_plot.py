"""bisect --plot/--html: a real PNG, a self-contained HTML page naming the origin, every module name escaped."""
from __future__ import annotations

import re
import sys

import pytest
import torch
from torch import nn

import divtrace
from divtrace.cli.app import main
from divtrace.compare.plot import collect, layer_spans, write_plots
from divtrace.trace.reader import Trace
from helpers import record_model, record_pair

pytest.importorskip("matplotlib")

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
EVIL = "<script>alert(1)</script>"


@pytest.fixture(scope="module")
def pair_all(tmp_path_factory):
    return record_pair(tmp_path_factory.mktemp("plot"), "all")


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == PNG_MAGIC and data[12:16] == b"IHDR"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def test_cli_writes_png_and_html(pair_all, tmp_path, capsys):
    a, b = pair_all
    png, page = tmp_path / "parting.png", tmp_path / "parting.html"
    assert main(["bisect", str(a), str(b), "--plot", str(png), "--html", str(page)]) == 1
    assert f"wrote {png}" in capsys.readouterr().out
    w, h = _png_size(png.read_bytes())
    assert w >= 800 and h >= 300
    text = page.read_text()
    assert "model.layers.0.input_layernorm" in text and "aten._to_copy.default" in text
    assert re.search(r"<tr class='origin'><td>\d+</td><td><code>model\.layers\.0\.input_layernorm</code>", text)
    # self-contained: the image is inline and nothing is fetched from elsewhere
    assert "data:image/png;base64," in text
    assert not re.search(r"""(src|href)=["']?(https?:|//)""", text)


def test_points_follow_execution_order_and_origin(pair_all):
    a, b = (Trace(p) for p in pair_all)
    points = collect(a, b)
    assert [p.index for p in points] == sorted(p.index for p in points)
    first = next(p for p in points if not p.equal)
    # the planted origin (first norm) is the first call that differs, and its own inputs still agree
    assert (first.module, first.call, first.inputs_equal) == ("model.layers.0.input_layernorm", 0, True)
    assert first.max_ulp == 1 and first.mismatched == 1081
    embed = next(p for p in points if p.module == "model.embed_tokens")
    assert embed.equal and embed.max_ulp == 0
    assert [n for n, _, _ in layer_spans(a)] == ["0", "1"]


def test_hash_mode_strip(tmp_path):
    a, b = record_pair(tmp_path, "sdpa", mode="hash")
    r = divtrace.bisect(a, b)
    png, page = tmp_path / "h.png", tmp_path / "h.html"
    write_plots(a, b, r, png=png, html=page)
    _png_size(png.read_bytes())
    points = collect(Trace(a), Trace(b))
    assert all(p.max_ulp is None for p in points) and any(not p.equal for p in points)
    assert "model.layers.0.self_attn" in page.read_text()


class Bump(nn.Module):
    """Side b scales its linear's output: the divergence is planted in this module's own code."""

    def __init__(self, bump: bool):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.bump = bump

    def forward(self, x):
        y = self.lin(x)
        return y * 1.001 if self.bump else y


def test_module_names_are_escaped(tmp_path):
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(1))
    traces = []
    for side, bump in (("a", False), ("b", True)):
        torch.manual_seed(0)
        m = nn.Sequential()
        m.add_module(EVIL, Bump(bump))
        record_model(m, (x,), tmp_path / side, label=EVIL)
        traces.append(tmp_path / side)
    r = divtrace.bisect(*traces)
    assert r.first.module == EVIL and r.first.cause == "origin"
    page = tmp_path / "evil.html"
    write_plots(*traces, r, html=page)
    text = page.read_text()
    assert "<script" not in text.lower()
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in text


def test_missing_matplotlib_is_one_line_error(pair_all, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what `import matplotlib` sees when it is not installed
    assert main(["bisect", *map(str, pair_all), "--plot", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert err == "divtrace: error: --plot needs matplotlib: pip install 'divtrace[plot]'\n"
    assert not (tmp_path / "x.png").exists()


def test_identical_runs_plot_without_origin(tmp_path):
    a, b = record_pair(tmp_path, "none", mode="hash")
    r = divtrace.bisect(a, b)
    assert r.verdict == "identical"
    png, page = tmp_path / "same.png", tmp_path / "same.html"
    write_plots(a, b, r, png=png, html=page)
    _png_size(png.read_bytes())
    assert "verdict:</b> identical" in page.read_text() and "class='dv'" not in page.read_text()


class SignFlip(nn.Module):
    """Side b negates the output elements closest to zero: a sign flip, not tens of thousands of ULP."""

    def __init__(self, flip: bool):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.flip = flip

    def forward(self, x):
        y = self.lin(x)
        if self.flip:
            small = y.abs() < 0.05
            y = torch.where(small, -y, y)
        return y


def test_sign_flips_are_counted_not_plotted_as_ulp(tmp_path):
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(3), dtype=torch.bfloat16)
    traces = []
    for side, flip in (("a", False), ("b", True)):
        torch.manual_seed(0)
        m = nn.Sequential(SignFlip(flip)).to(torch.bfloat16)
        record_model(m, (x,), tmp_path / side, label=side)
        traces.append(tmp_path / side)
    r = divtrace.bisect(*traces)
    d = r.to_dict()["first"]
    assert d["sign_flips"] > 0 and d["max_ulp"] == 0 and d["max_ulp_raw"] > 1000
    points = [p for p in collect(*(Trace(t) for t in traces)) if not p.equal]
    assert points and all(p.max_ulp == 0 and p.sign_flips > 0 for p in points)
    page = tmp_path / "flip.html"
    write_plots(*traces, r, png=tmp_path / "flip.png", html=page)
    assert "sign flips" in page.read_text()
