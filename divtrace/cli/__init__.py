"""The divtrace command line: one module per command, thin over the library, printing through `output`.

`main` here is the console entry point: it imports the CLI inside its own try, so a Ctrl-C that lands while
the imports run (typer, rich, torch) ends in one line, not a traceback.
"""
from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    try:
        from divtrace.cli.app import main as app_main

        return app_main(argv)
    except KeyboardInterrupt:
        sys.stderr.write("divtrace: error: interrupted\n")
        return 130


def run() -> None:
    sys.exit(main())
