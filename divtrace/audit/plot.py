"""`audit --plot F`: each audited op at its record index, by the largest ULP distance its rows reach in another
batch (clean ops on a floor below the first decade), and each finding's share of the replay time."""
from __future__ import annotations

from pathlib import Path

from divtrace.audit.core import AuditResult
from divtrace.errors import DivtraceError

CLEAN, FINDING, NONDET, SKIPPED = "#9aa5b1", "#d1495b", "#6a4c93", "#e9c46a"


def write_plot(result: AuditResult, path) -> None:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise DivtraceError("--plot needs matplotlib: pip install 'divtrace[plot]'") from None
    fig = Figure(figsize=(12, 6.4), dpi=110)
    FigureCanvasAgg(fig)
    top, bottom = fig.subplots(2, 1, gridspec_kw={"height_ratios": [3, 2]})
    floor = 0.5
    for color, label, sel in (
            (CLEAN, "batch-invariant and deterministic", lambda o: o.audited and not o.finding),
            (FINDING, "not batch-invariant", lambda o: o.batch_invariant is False),
            (NONDET, "not deterministic", lambda o: o.deterministic is False),
            (SKIPPED, "not audited", lambda o: not o.audited and o.deterministic is not False)):
        pts = [(o.index, max(o.max_ulp or 0, floor) if o.batch_invariant is False else floor) for o in result.ops
               if sel(o)]
        if pts:
            top.scatter([p[0] for p in pts], [p[1] for p in pts], s=14, c=color, label=f"{label} ({len(pts)})")
    top.set_yscale("log")
    top.set_ylabel("max ULP of a row in another batch")
    top.set_xlabel("record index (forward order)")
    top.legend(loc="upper left", fontsize=8)
    top.set_title(result.headline(), loc="left", fontsize=10)
    groups = result.findings
    names = [f"{g.first.module_class}: {g.first.op.removeprefix('aten.')} x{len(g.ops)}" for g in groups]
    shares = [g.to_dict(result.seconds)["time_share"] for g in groups]
    if groups:
        bottom.barh(range(len(groups)), shares, color=[FINDING if g._all("batch_invariant") is False else NONDET
                                                      for g in groups])
        bottom.set_yticks(range(len(groups)), names, fontsize=7)
        bottom.invert_yaxis()
    bottom.set_xlabel("share of the replay time (what fixing it costs at most)")
    fig.tight_layout()
    p = Path(path)
    try:
        fig.savefig(p, format="png")
    except OSError as e:
        raise DivtraceError(f"--plot {p}: cannot write: {e.strerror or e}") from None
