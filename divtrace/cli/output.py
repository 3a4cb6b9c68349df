"""The one output layer: rich text for people, `--json` for machines, greppable PASSED/FAILED lines."""
from __future__ import annotations

import json
import os
import sys

from divtrace.trace.records import json_safe


def _json_default(x):
    if isinstance(x, tuple):
        return list(x)
    return str(x)


class Output:
    def __init__(self, json_mode: bool = False):
        self.json_mode = json_mode
        self._console = self._err = None

    # rich is imported on first use: a --json run that has nothing to warn about never needs it
    @property
    def console(self):
        if self._console is None:
            from rich.console import Console

            self._console = Console(highlight=False, soft_wrap=False, width=_width(sys.stdout))
        return self._console

    @property
    def err(self):
        if self._err is None:
            from rich.console import Console

            self._err = Console(stderr=True, highlight=False, width=_width(sys.stderr))
        return self._err

    def json(self, obj) -> None:
        sys.stdout.write(json.dumps(json_safe(obj), indent=2, default=_json_default, allow_nan=False) + "\n")

    def print(self, *args, **kw) -> None:
        if not self.json_mode:
            self.console.print(*args, **kw)

    def line(self, text: str) -> None:
        """A plain, unstyled line (markup off) so names with brackets print as they are."""
        if not self.json_mode:
            self.console.print(text, markup=False, highlight=False)

    def passed(self, text: str) -> None:
        if not self.json_mode:
            self.console.print(f"[bold green]PASSED[/]: {_esc(text)}")

    def failed(self, text: str) -> None:
        if not self.json_mode:
            self.console.print(f"[bold red]FAILED[/]: {_esc(text)}")

    def inconclusive(self, text: str) -> None:
        if not self.json_mode:
            self.console.print(f"[bold yellow]INCONCLUSIVE[/]: {_esc(text)}")

    def warn(self, text: str) -> None:
        self.err.print(f"[yellow]warning[/]: {_esc(text)}")

    def table(self, title: str | None, columns: list[str], rows: list[list]) -> None:
        if self.json_mode:
            return
        from rich.table import Table

        t = Table(title=title, title_justify="left", show_lines=False)
        for c in columns:
            t.add_column(c, overflow="fold")
        for r in rows:
            t.add_row(*[_esc(_fmt(v)) for v in r])
        self.console.print(t)


def _width(stream) -> int | None:
    """COLUMNS when set (also when the output is a pipe or a file), else the terminal's width, else 120."""
    try:
        cols = int(os.environ.get("COLUMNS", ""))
        if cols > 0:
            return cols
    except ValueError:
        pass
    try:
        return None if stream.isatty() else 120
    except (AttributeError, ValueError):  # a closed or replaced stream
        return 120


def _esc(s: str) -> str:
    from rich.markup import escape

    return escape(str(s))


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


errors_printed = 0  # error lines printed so far (main() says "interrupted" only where nothing was said)


def error(message: str) -> None:
    """The single place errors are printed: one line on stderr."""
    global errors_printed
    errors_printed += 1
    sys.stderr.write(f"divtrace: error: {message}\n")
