"""`bisect --plot/--html`: where two runs part and how the difference grows, per module call in execution order.

One point per aligned module call pair, placed at the call's exit record in A (so the x axis is A's record
index, the same numbers `bisect` reports). With values (both traces in full mode) the y axes are the largest
ULP distance over the elements whose signs agree (a tiny value that changes sign is a sign flip, counted on its
own, not ~30000 ULP through zero; see docs/json.md) and the largest absolute difference over the call's outputs,
log scale, equal calls at a floor below the first decade. Hash-mode traces hold no values, so the picture is a strip: equal or diverged.
"""
from __future__ import annotations

import base64
import html as _html
import io
import math
import re
from dataclasses import dataclass
from pathlib import Path

from divtrace.align.calls import Pairing
from divtrace.align.paths import PathMap
from divtrace.compare.values import ValueComparator
from divtrace.errors import DivtraceError
from divtrace.trace.reader import Trace

# The outermost repeated block of a model: model.layers.3, transformer.h.3, blocks.3 ...
_LAYER = re.compile(r"^(?:.*\.)?(?:layers|layer|h|blocks|block)\.(\d+)$")
EQUAL, DIVERGED, ORIGIN = "#9aa5b1", "#d1495b", "#1d3557"


@dataclass
class CallPoint:
    index: int  # exit record index in A
    module: str
    call: int
    equal: bool
    inputs_equal: bool
    max_ulp: float | None = None
    max_abs: float | None = None
    mismatched: int | None = None
    sign_flips: int | None = None  # non-zero elements of opposite sign (not in max_ulp)
    numel: int = 0
    tensor: str = ""
    note: str = ""  # "dtype differs ..." when no numeric metric exists


def collect(a: Trace, b: Trace, path_map: PathMap | None = None) -> list[CallPoint]:
    """Every aligned call pair of A (calls that returned), with the largest difference over its outputs."""
    pairing = Pairing(a, b, path_map)
    cmp = ValueComparator(a, b)
    points = []
    for ca in sorted((c for c in a.calls.values() if c.exit_index is not None), key=lambda c: c.exit_index):
        cb = pairing.partner(ca)
        if cb is None or cb.exit_index is None:
            continue
        p = CallPoint(ca.exit_index, ca.module, ca.call, True, cmp.first_mismatch(ca.inputs, cb.inputs) is None)
        for key, va, vb in cmp.pairs(ca.outputs, cb.outputs):
            val = a.values[va]
            p.numel += val.numel
            if cmp.same(va, vb):
                continue
            p.equal = False
            p.tensor = p.tensor or key
            d = cmp.diff(va, vb)
            if d is None:
                continue
            if d.reason:
                p.note = p.note or d.reason
            if d.max_ulp is not None:
                p.max_ulp = max(p.max_ulp or 0, d.max_ulp)
            if d.max_abs is not None and math.isfinite(d.max_abs):
                p.max_abs = max(p.max_abs or 0.0, d.max_abs)
            if d.mismatched is not None:
                p.mismatched = (p.mismatched or 0) + d.mismatched
            if d.sign_flips is not None:
                p.sign_flips = (p.sign_flips or 0) + d.sign_flips
        if p.equal and cmp.values_available:
            p.max_ulp, p.max_abs, p.mismatched, p.sign_flips = 0, 0.0, 0, 0
        points.append(p)
    return points


def layer_spans(a: Trace) -> list[tuple[str, int, int]]:
    """(layer number, first record, last record) of each outermost repeated block's calls in A."""
    spans = []
    for c in sorted(a.calls.values(), key=lambda c: c.enter_index):
        m = _LAYER.match(c.module)
        if not m or c.exit_index is None:
            continue
        if spans and spans[-1][1] <= c.enter_index <= spans[-1][2]:
            continue  # nested inside a block already taken (an inner `layers` list)
        spans.append((m.group(1), c.enter_index, c.exit_index))
    return spans


def _origin_label(result) -> str | None:
    f = result.first
    if f is None:
        return None
    where = f.module or "<root>"
    ops = [o.removeprefix("aten.") for o in (f.op, f.op_b) if o]
    op = "" if not ops else f"\nop {ops[0]}" if len(set(ops)) == 1 else f"\nop {ops[0]} (a) / {ops[1]} (b)"
    return f"origin: {where} call {f.call}{op}"


def _tex(s: str) -> str:
    """Matplotlib reads `$...$` as math; module names and labels are shown as they are."""
    return s.replace("$", r"\$")


def _value_panels(axes, points: list[CallPoint]) -> None:
    """Max ULP (top) and max |a - b| (bottom), log scale; equal calls on a dotted floor line."""
    xs_eq = [p.index for p in points if p.equal]
    for ax, ylabel, get, floor in ((axes[0], "max ULP (signs agree)", lambda p: p.max_ulp, 0.5),
                                   (axes[1], "max |a - b|", lambda p: p.max_abs, None)):
        pts = [(p.index, get(p)) for p in points if not p.equal and get(p)]
        if floor is None:  # a decade below the smallest difference drawn
            floor = 10 ** math.floor(math.log10(min(y for _, y in pts))) / 10 if pts else 1e-8
        top = max(y for _, y in pts) * 12 if pts else floor * 100  # headroom for the layer labels
        ax.set_yscale("log")
        ax.set_ylim(floor / 2, top)
        ax.scatter(xs_eq, [floor] * len(xs_eq), s=10, color=EQUAL, label="bitwise equal (drawn at floor)", zorder=3)
        if pts:
            ax.plot(*zip(*pts), color=DIVERGED, lw=0.8, alpha=0.5, zorder=2)
            ax.scatter(*zip(*pts), s=16, color=DIVERGED, label="differs", zorder=4)
        nometric = [p.index for p in points if not p.equal and get(p) is None]
        zero = [p.index for p in points if not p.equal and get(p) == 0]  # only sign flips, or -0.0 vs 0.0
        if zero:
            ax.scatter(zero, [floor] * len(zero), marker="v", s=22, color=DIVERGED,
                       label="differs, 0 ULP where signs agree (sign flips or -0.0)", zorder=4)
        if nometric:
            ax.scatter(nometric, [top / 1.6] * len(nometric), marker="x", s=22, color=DIVERGED,
                       label="differs (dtype/shape, no metric)", zorder=4)
        ax.axhline(floor, color=EQUAL, lw=0.6, ls=":", zorder=1)
        ax.text(1.002, floor, "equal", transform=ax.get_yaxis_transform(), va="center", ha="left", fontsize=8,
                color="#667")
        ax.set_ylabel(ylabel)
        ax.grid(axis="y", which="major", alpha=0.3)


def _strip(ax, points: list[CallPoint]) -> None:
    ax.vlines([p.index for p in points if p.equal], 0, 1, color=EQUAL, lw=1.5, label="bitwise equal")
    ax.vlines([p.index for p in points if not p.equal], 0, 1, color=DIVERGED, lw=1.5, label="differs")
    ax.set_ylim(0, 1.35)
    ax.set_yticks([])
    ax.set_ylabel("values not\nrecorded\n(hash mode):\nequal or\ndiffers only", rotation=0, ha="right", va="center",
                  fontsize=8, color="#444")


def _layer_bands(axes, spans, xmax: int) -> None:
    every = max(1, math.ceil(len(spans) / 12))  # about 12 layer labels fit across the width
    for ax in axes:
        ax.set_xlim(-1, xmax + 1)
        for i, (n, lo, hi) in enumerate(spans):
            if i % 2 == 0:
                ax.axvspan(lo, hi, color="#e8eef5", zorder=0)
            if ax is axes[0] and i % every == 0:  # inside the band's top-left corner: the margin above is the origin's
                ax.text(lo + 0.004 * xmax, 0.97, f"layer {n}", transform=ax.get_xaxis_transform(), ha="left",
                        va="top", fontsize=8, color="#556", zorder=7,
                        bbox=dict(boxstyle="square,pad=0.15", fc="white", ec="none", alpha=0.8))


def _mark_origin(axes, result, points: list[CallPoint], values: bool) -> None:
    """A dashed line at the parting op's record, an arrow above the plot, a ring on the origin call's output."""
    f = result.first
    for ax in axes:
        ax.axvline(f.index, color=ORIGIN, lw=1.4, ls="--", zorder=5)
    axes[0].annotate("origin", xy=(f.index, 1.0), xycoords=axes[0].get_xaxis_transform(), xytext=(0, 12),
                     textcoords="offset points", ha="center", va="bottom", fontsize=9, color=ORIGIN,
                     fontweight="bold", arrowprops=dict(arrowstyle="-|>", color=ORIGIN, lw=1.2))
    origin = [p for p in points if (p.module, p.call) == (f.module, f.call) and not p.equal]
    if values and origin:
        for ax, y in ((axes[0], origin[0].max_ulp), (axes[1], origin[0].max_abs)):
            if y:
                ax.scatter([origin[0].index], [y], s=90, facecolors="none", edgecolors=ORIGIN, lw=1.5, zorder=6,
                           label="origin call's output" if ax is axes[0] else None)


def render_png(a: Trace, b: Trace, result, points: list[CallPoint]) -> bytes:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise DivtraceError("--plot needs matplotlib: pip install 'divtrace[plot]'") from None

    values = result.metrics_available
    height = 6.2 if values else 3.4  # inches; the title block above the axes keeps a fixed size
    fig = Figure(figsize=(12, height), dpi=110)
    FigureCanvasAgg(fig)
    axes = fig.subplots(2 if values else 1, 1, sharex=True, squeeze=False)[:, 0]
    if values:
        _value_panels(axes, points)
    else:
        _strip(axes[0], points)
    _layer_bands(axes, layer_spans(a), max([p.index for p in points] + [len(a.records) - 1, 1]))
    label = _origin_label(result)
    if label is not None:
        _mark_origin(axes, result, points, values)
    la, lb = (_tex(x) for x in result.labels)
    n_dv = sum(not p.equal for p in points)
    fig.text(0.01, 1 - 0.1 / height, f"{la} vs {lb}: {n_dv} of {len(points)} aligned module calls differ",
             fontsize=12, fontweight="bold", ha="left", va="top")
    sub = _tex(label.replace("\n", ", ")) if label else "no divergence: every aligned call is bitwise equal"
    fig.text(0.01, 1 - 0.4 / height, sub, fontsize=10, color=ORIGIN, ha="left", va="top")
    handles, names = axes[0].get_legend_handles_labels()
    fig.legend(handles, names, loc="upper right", fontsize=8, ncol=len(names), frameon=False,
               bbox_to_anchor=(0.995, 1 - 0.05 / height))
    axes[-1].set_xlabel(f"record index in {la} (execution order; one point per module call, at its exit record)")
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.85 / height))
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def _fmt(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.4g}"
    return str(x)


def render_html(result, points: list[CallPoint], png: bytes) -> str:
    e = _html.escape
    f = result.first
    la, lb = result.labels
    head = (f"<p><b>verdict:</b> {e(result.verdict)}</p>" if f is None else
            f"<p><b>first divergence originates in</b> <code>{e(f.module or '<root>')}</code> call {f.call}, "
            f"op <code>{e(str(f.op))}</code> (a) / <code>{e(str(f.op_b))}</code> (b), record {f.index} "
            f"[cause: {e(f.cause)}]</p>")
    rows = []
    for p in points:
        origin = f is not None and p.module == f.module and p.call == f.call
        status = "equal" if p.equal else ("differs, inputs equal" if p.inputs_equal else "differs")
        cls = "origin" if origin else ("eq" if p.equal else "dv")
        rows.append(f"<tr class='{cls}'><td>{p.index}</td><td><code>{e(p.module or '<root>')}</code></td>"
                    f"<td>{p.call}</td><td>{e(status + (' (origin)' if origin else ''))}</td>"
                    f"<td>{e(p.tensor or '-')}</td><td>{_fmt(p.max_ulp)}</td><td>{_fmt(p.max_abs)}</td>"
                    f"<td>{_fmt(p.sign_flips)}</td><td>{_fmt(p.mismatched)} / {p.numel}</td><td>{e(p.note)}</td></tr>")
    img = base64.b64encode(png).decode("ascii")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>divtrace bisect: {e(la)} vs {e(lb)}</title>
<style>
body {{ font-family: sans-serif; margin: 1.5em; color: #222; }}
table {{ border-collapse: collapse; font-size: 13px; }}
td, th {{ border: 1px solid #ccc; padding: 2px 6px; text-align: left; }}
tr.eq td {{ color: #777; }} tr.dv td {{ color: #a4161a; }} tr.origin td {{ background: #ffe8a3; font-weight: bold; }}
img {{ max-width: 100%; }}
</style></head><body>
<h1>divtrace bisect: {e(la)} vs {e(lb)}</h1>
<p>a: <code>{e(result.paths[0])}</code><br>b: <code>{e(result.paths[1])}</code></p>
{head}
<img alt="max ULP and max abs difference per module call" src="data:image/png;base64,{img}">
<h2>module calls in execution order ({len(points)} aligned pairs)</h2>
<table><tr><th>record (a)</th><th>module</th><th>call</th><th>status</th><th>tensor</th><th>max ULP (signs agree)</th>
<th>sign flips</th><th>max abs</th><th>mismatched / numel</th><th>note</th></tr>
{chr(10).join(rows)}
</table></body></html>
"""


def _write(path, data: bytes) -> None:
    p = Path(path)
    try:
        p.write_bytes(data)
    except OSError as e:
        raise DivtraceError(f"{p}: cannot write: {e.strerror or e}") from None


def write_plots(a, b, result, png=None, html=None, path_map: PathMap | None = None) -> None:
    """Write the PNG and/or the self-contained HTML report for a bisect `result` of traces `a`, `b`."""
    if png is None and html is None:
        return
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        flag = "--plot" if png is not None else "--html"
        raise DivtraceError(f"{flag} needs matplotlib: pip install 'divtrace[plot]'") from None
    ta = a if isinstance(a, Trace) else Trace(a)
    tb = b if isinstance(b, Trace) else Trace(b)
    points = collect(ta, tb, path_map)
    image = render_png(ta, tb, result, points)
    if png is not None:
        _write(png, image)
    if html is not None:
        _write(html, render_html(result, points, image).encode("utf-8"))
