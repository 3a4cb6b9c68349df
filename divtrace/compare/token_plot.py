"""`bisect --plot` under token alignment: where the runs part, token by module.

Columns are the shared tokens (sequence by sequence, in position order), rows the paired module calls in forward
order (of the first root call that holds them); a cell is dark where that token's output row of that module
differs. A divergence that starts at one module and spreads down the layers shows as a wedge; a batch-size effect
shows as whole columns (the decoded tokens) starting at the first module that is not batch-invariant. The origin
is marked.
"""
from __future__ import annotations

import io

from divtrace.errors import DivtraceError


def render_token_png(result) -> bytes:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise DivtraceError("--plot needs matplotlib: pip install 'divtrace[plot]'") from None
    tokens = sorted(result.token_order, key=lambda k: result.token_order[k])
    col = {k: i for i, k in enumerate(tokens)}
    mods = sorted(result.module_rows.items(), key=lambda kv: kv[1][0])
    grid = [[0.0] * len(tokens) for _ in mods]
    for r, (_, (_, row)) in enumerate(mods):
        for k, d in row.items():
            if d and k in col:
                grid[r][col[k]] = 1.0
    height = max(3.0, min(0.16 * len(mods) + 1.5, 30.0))
    fig = Figure(figsize=(max(6.0, min(0.12 * len(tokens) + 3, 24.0)), height))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    if mods and tokens:
        ax.imshow(grid, aspect="auto", interpolation="nearest", cmap="Greys", vmin=0, vmax=1)
    ax.set_yticks(range(len(mods)))
    ax.set_yticklabels([m or "<root>" for m, _ in mods], fontsize=6)
    seqs = [result.token_order[k][0] for k in tokens]
    starts = [i for i, s in enumerate(seqs) if i == 0 or s != seqs[i - 1]]
    for i in starts[1:]:
        ax.axvline(i - 0.5, color="tab:blue", lw=0.6)
    ax.set_xlabel("shared tokens (sequence by sequence, by position; blue lines separate sequences)")
    d = result.to_dict()
    f = d.get("first")
    title = f"{result.labels[0]} vs {result.labels[1]}: {d['tokens']['differing']} of {d['tokens']['shared']} shared tokens differ"
    if f is not None:
        names = [m for m, _ in mods]
        label = f["module"] + (f" #{f['call']}" if f["call"] else "")
        key = next((k for k in tokens if result.token_order[k] == (f["token"]["seq"]["number"], f["token"]["position"])),
                   None)
        if label in names and key is not None:
            ax.plot([col[key]], [names.index(label)], marker="o", color="tab:red", ms=6)
        title += f"; origin {f['module'] or '<root>'} ({f['op'] or f['op_b'] or 'module'}) at position {f['token']['position']}"
    import textwrap

    ax.set_title("\n".join(textwrap.wrap(title, 110)), fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    return buf.getvalue()


def write_token_plot(result, png) -> None:
    from pathlib import Path

    data = render_token_png(result)
    p = Path(png)
    try:
        p.write_bytes(data)
    except OSError as e:
        raise DivtraceError(f"{p}: cannot write: {e.strerror or e}") from None
