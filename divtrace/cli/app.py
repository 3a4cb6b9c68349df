"""`divtrace` entry point: registers the commands and formats every error in one place (one line, exit 2)."""
from __future__ import annotations

import os
import sys
from typing import Annotated

import typer

from divtrace.errors import DivtraceError

HELP_OPTIONS = {"help_option_names": ["-h", "--help"]}  # inherited by every command and sub-command

app = typer.Typer(
    name="divtrace", add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
    context_settings=HELP_OPTIONS,
)


def _version(value: bool) -> None:
    if value:
        import divtrace

        typer.echo(f"divtrace {divtrace.__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", is_eager=True, callback=_version,
                                          help="print divtrace's version and exit")] = False,
) -> None:
    """Find where an inference run and a training run of the same model first diverge, bit for bit.

    Workflow: record each side -> bisect -> repro -> verify a fix. Exit codes: 0 identical (or the fix holds),
    1 diverged (or still differs), 2 bad input, 3 inconclusive, 4 absorbed (every final output bitwise equal, internal
    differences that never reach one). The interface: docs/contract.md.

    \b
    Examples:
      divtrace record examples/llama_pair.py:training --out runs/train --arg dtype=bf16
      divtrace bisect runs/train runs/infer
      divtrace bisect -h
    """


def reflow(doc: str | None) -> str | None:
    """A docstring as help text: the lines of each paragraph joined into one (the terminal wraps it, so no
    sentence breaks where the source line ended); paragraphs starting with \\b (examples) are kept line by line."""
    if not doc:
        return doc
    import inspect

    paragraphs = inspect.cleandoc(doc).split("\n\n")
    return "\n\n".join(p if p.lstrip().startswith("\b") else " ".join(x.strip() for x in p.splitlines())
                       for p in paragraphs)


def _optional(name: str):
    """Commands still being built live in their own modules; a missing module is skipped, a broken one is not."""
    import importlib

    try:
        return importlib.import_module(f"divtrace.cli.{name}")
    except ModuleNotFoundError as e:
        if e.name != f"divtrace.cli.{name}":
            raise
        return None


def _command(typer_app, name: str, fn) -> None:
    typer_app.command(name, help=reflow(fn.__doc__))(fn)


def _register() -> None:
    from divtrace.cli import bisect_cmd, record_cmd, show_cmd

    _command(app, "record", record_cmd.record)
    _command(app, "show", show_cmd.show)
    _command(app, "bisect", bisect_cmd.bisect)
    for name in ("repro", "verify", "audit", "cert"):
        mod = _optional(f"{name}_cmd")
        if mod is not None:
            _command(app, name, getattr(mod, name))
    skill = _optional("skill_cmd")
    if skill is not None:
        for info in skill.app.registered_commands:
            info.help = reflow(info.help or info.callback.__doc__)
        skill.app.info.help = reflow(skill.app.info.help)
        app.add_typer(skill.app, name="skill")


_register()
app.registered_callback.help = reflow(_root.__doc__)


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
    from divtrace.cli import output
    from divtrace.cli.output import error

    click_error, click_exit, click_abort = _click_exceptions()
    debug = os.environ.get("DIVTRACE_DEBUG") == "1"
    said = output.errors_printed
    try:
        rv = app(args=argv, standalone_mode=False)
        code = rv if isinstance(rv, int) else 0
        if code == 130 and output.errors_printed == said:
            error("interrupted")  # typer turns a Ctrl-C (inside a command's imports too) into a silent 130
    except DivtraceError as e:
        if debug:
            raise
        error(str(e))
        code = e.exit_code
    except click_exit as e:
        code = getattr(e, "exit_code", getattr(e, "code", 0)) or 0
    except click_abort as e:  # click turns a Ctrl-C inside a command (its imports included) into Abort
        error("interrupted" if isinstance(e.__context__, KeyboardInterrupt) else "aborted")
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
        from divtrace.oserrors import is_write_error, os_reason

        if is_write_error(e):  # a file the system would not let us write (or read): its path and the reason
            where = getattr(e, "filename", None)
            error(f"{where}: {os_reason(e)}" if where else f"cannot write the output: {os_reason(e)}")
            return 2
        error(f"internal error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} "
              "(set DIVTRACE_DEBUG=1 for a traceback)")
        code = 2
    try:
        sys.stdout.flush()
    except OSError as e:  # stdout is a full disk or a closed pipe: the output is lost, say so once
        from divtrace.oserrors import os_reason

        error(f"cannot write the output to stdout: {os_reason(e)}")
        code = code or 2
    return code


def run() -> None:
    sys.exit(main())
