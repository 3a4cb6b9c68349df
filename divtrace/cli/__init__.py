"""The divtrace command line: one module per command, thin over the library, printing through `output`.

`main` here is the console entry point: it imports the CLI inside its own try, so a Ctrl-C that lands while
the imports run (typer, rich, torch) ends in one line, not a traceback.

In: argv. Out: the library's calls (divtrace.record, .compare, .repro, .verify, .audit) and their results, as rich
text for people or --json for machines, with the exit codes of docs/contract.md.
"""
from __future__ import annotations

import signal
import sys

# Commands that import torch anyway: it is imported up front, where a Ctrl-C is watched for (below).
_TORCH_COMMANDS = ("record", "repro", "verify")


class _WatchCtrlC:
    """Python's Ctrl-C handling, plus a note that it fired: torch's import probes numpy and swallows whatever
    that raises, a KeyboardInterrupt included, so a Ctrl-C landing there was lost and the recording went on.
    On exit Python's own handler is back (the recorder installs its own over it) and a Ctrl-C seen is raised."""

    def __enter__(self):
        self.fired = False
        self.installed = signal.getsignal(signal.SIGINT) is signal.default_int_handler

        def on_sigint(signum, frame):
            self.fired = True
            raise KeyboardInterrupt

        if self.installed:
            signal.signal(signal.SIGINT, on_sigint)
        return self

    def __exit__(self, exc_type, exc, tb):
        if self.installed:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        if exc_type is None and self.fired:
            raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    try:
        with _WatchCtrlC():
            from divtrace.cli.app import main as app_main

            args = sys.argv[1:] if argv is None else argv
            if next((a for a in args if not a.startswith("-")), None) in _TORCH_COMMANDS:
                import torch  # noqa: F401
        return app_main(argv)
    except KeyboardInterrupt:
        sys.stderr.write("divtrace: error: interrupted\n")
        return 130


def run() -> None:
    sys.exit(main())
