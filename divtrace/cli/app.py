"""`divtrace` entry point: registers the commands and formats every error in one place (one line, exit 2)."""
from __future__ import annotations

import os
import sys

import typer

from divtrace.errors import DivtraceError

app = typer.Typer(
    name="divtrace", add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
    help="Find where an inference run and a training run of the same model first diverge, bit for bit.\n\n"
         "Workflow: record each side -> bisect -> repro -> verify a fix.",
)


def _optional(name: str):
    """Commands still being built live in their own modules; a missing module is skipped, a broken one is not."""
    import importlib

    try:
        return importlib.import_module(f"divtrace.cli.{name}")
    except ModuleNotFoundError as e:
        if e.name != f"divtrace.cli.{name}":
            raise
        return None


def _register() -> None:
    from divtrace.cli import bisect_cmd, record_cmd, show_cmd

    app.command("record")(record_cmd.record)
    app.command("show")(show_cmd.show)
    app.command("bisect")(bisect_cmd.bisect)
    for name in ("repro", "verify", "audit"):
        mod = _optional(f"{name}_cmd")
        if mod is not None:
            app.command(name)(getattr(mod, name))
    skill = _optional("skill_cmd")
    if skill is not None:
        app.add_typer(skill.app, name="skill")


_register()


def _click_exceptions():
    """(ClickException, Exit, Abort) classes, from plain click and from the click copy newer typer bundles."""
    import click

    found = {"ClickException": [click.ClickException], "Exit": [click.exceptions.Exit, typer.Exit],
             "Abort": [click.exceptions.Abort, typer.Abort]}
    try:
        import typer._click.exceptions as bundled

        for name in found:
            if hasattr(bundled, name):
                found[name].append(getattr(bundled, name))
    except ImportError:
        pass
    return tuple(tuple(set(v)) for v in (found["ClickException"], found["Exit"], found["Abort"]))


def main(argv: list[str] | None = None) -> int:
    from divtrace.cli.output import error

    click_error, click_exit, click_abort = _click_exceptions()
    debug = os.environ.get("DIVTRACE_DEBUG") == "1"
    try:
        rv = app(args=argv, standalone_mode=False)
        code = rv if isinstance(rv, int) else 0
    except DivtraceError as e:
        if debug:
            raise
        error(str(e))
        code = e.exit_code
    except click_exit as e:
        code = getattr(e, "exit_code", getattr(e, "code", 0)) or 0
    except click_abort:
        error("aborted")
        code = 130
    except click_error as e:
        if type(e).__name__ == "NoArgsIsHelpError":  # bare `divtrace`: show the help, as click would
            sys.stdout.write(e.format_message() + "\n")
            code = 0
        else:
            error(" ".join(e.format_message().split()))
            code = 2
    except KeyboardInterrupt:
        error("interrupted")
        code = 130
    except Exception as e:  # a bug must still not print a traceback at the user unless asked to
        if debug:
            raise
        error(f"internal error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} "
              "(set DIVTRACE_DEBUG=1 for a traceback)")
        code = 2
    sys.stdout.flush()
    return code


def run() -> None:
    sys.exit(main())
