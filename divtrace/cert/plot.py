"""`divtrace cert --plot`: over the steps of a run, the fraction of tokens bitwise equal and the KL per step.

matplotlib is imported here only (optional: `pip install 'divtrace[plot]'`). Steps whose weights differ are
marked; the first parting step gets a vertical line.
"""
from __future__ import annotations

from divtrace.errors import DivtraceError

KL_FLOOR = 1e-12  # an exact 0 KL is drawn here (or a decade below the smallest KL that is not 0), hollow


def write_cert_plot(result, path) -> None:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise DivtraceError("--plot needs matplotlib: pip install 'divtrace[plot]'") from None
    steps = [s for s in result.steps if s.tokens_compared]
    fig = Figure(figsize=(9, 5.5))
    FigureCanvasAgg(fig)
    top, bottom = fig.subplots(2, 1, sharex=True)
    xs = [s.step for s in steps]
    top.plot(xs, [s.equal_fraction for s in steps], marker="o", color="#1d3557")
    top.set_ylabel("tokens bitwise equal")
    top.set_ylim(-0.05, 1.05)
    positive = [s.kl for s in steps if s.kl]
    floor = min([KL_FLOOR] + [k / 10 for k in positive])
    bottom.plot(xs, [s.kl or floor for s in steps], color="#d1495b")
    for s in steps:
        bottom.plot([s.step], [s.kl or floor], marker="o", color="#d1495b", fillstyle="full" if s.kl else "none")
    bottom.set_yscale("log")
    bottom.set_ylabel(f"KL per token (k3; hollow: 0, drawn at {floor:.0e})")
    bottom.set_xlabel("step")
    from matplotlib.ticker import MaxNLocator

    bottom.xaxis.set_major_locator(MaxNLocator(integer=True))
    bad = [s.step for s in result.steps if s.weights.get("equal") is False]
    for ax in (top, bottom):
        for x in bad:
            ax.axvline(x, color="#e9c46a", lw=6, alpha=0.5)
        if result.first is not None:
            ax.axvline(result.first["step"], color="#d1495b", ls="--", lw=1)
    title = f"{result.ledger}: {result.verdict}"
    if result.first is not None:
        title += f" (first parting step {result.first['step']}, {result.first['cause']})"
    if bad:
        title += "; yellow: weights differ"
    top.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(str(path), format="png", dpi=110)
