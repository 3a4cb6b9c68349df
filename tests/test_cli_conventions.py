"""CLI conventions a typer / huggingface_hub user expects: --version, -h everywhere, choices shown, one spelling
for argument names, help text that does not break mid-sentence, COLUMNS respected when output is not a terminal."""
from __future__ import annotations

import re

import pytest
import typer

import divtrace
from divtrace.cli.app import app, main, reflow
from divtrace.cli.output import Output

ROOT = typer.main.get_command(app)


def _commands(cmd=ROOT, path=()):
    yield path, cmd
    for name, sub in sorted((getattr(cmd, "commands", None) or {}).items()):
        yield from _commands(sub, path + (name,))


COMMANDS = list(_commands())


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"divtrace {divtrace.__version__}"


@pytest.mark.parametrize("path", [p for p, _ in COMMANDS], ids=lambda p: " ".join(p) or "divtrace")
def test_dash_h_on_every_command(path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    assert main([*path, "-h"]) == 0
    out = capsys.readouterr().out
    assert "Usage:" in out and "-h" in out


# options that take one of a few words: the words must be listed in --help (and checked by the parser)
CHOICE_OPTIONS = {"--mode", "--side", "--align", "--grad-mode"}


def _choice_options():
    for path, cmd in COMMANDS:
        for p in cmd.params:
            if getattr(p, "param_type_name", None) == "option" and set(p.opts) & CHOICE_OPTIONS:
                yield pytest.param(path, p, id=f"{' '.join(path)} {p.opts[0]}")


def _choices(param) -> tuple | None:
    """The words an option accepts: a Literal[...] annotation (this typer), or a click Choice (older ones)."""
    from typing import Literal, Union, get_args, get_origin

    desc = getattr(param, "type_descriptor", None)
    ann = getattr(desc, "annotation", None)
    while get_origin(ann) is Union:  # Optional[Literal[...]]
        ann = next(a for a in get_args(ann) if a is not type(None))
    if get_origin(ann) is Literal:
        return get_args(ann)
    return getattr(getattr(param, "type", None), "choices", None)


@pytest.mark.parametrize("path,param", list(_choice_options()))
def test_choices_are_shown(path, param, capsys, monkeypatch):
    choices = _choices(param)
    assert choices, f"{param.opts[0]} of `divtrace {' '.join(path)}` takes free text; give it a Literal[...] type"
    monkeypatch.setenv("COLUMNS", "200")
    main([*path, "-h"])
    assert "|".join(choices) in capsys.readouterr().out


def test_the_three_choice_options_exist():
    found = {(" ".join(p.values[0]), p.values[1].opts[0]) for p in _choice_options()}
    assert {("record", "--mode"), ("verify", "--side"), ("verify", "--mode")} <= found


def test_bad_choice_is_one_line_exit_2(capsys, tmp_path):
    assert main(["record", "x.py:f", "--out", str(tmp_path / "t"), "--mode", "fast"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'fast' is not one of 'full', 'hash'" in err


@pytest.mark.parametrize("path", [p for p, c in COMMANDS if p], ids=" ".join)
def test_argument_names_are_upper_case(path):
    cmd = dict(COMMANDS)[path]
    for p in cmd.params:
        if getattr(p, "param_type_name", None) == "argument":
            name = p.metavar or p.name
            assert re.fullmatch(r"[A-Z][A-Z_]*", name), f"`divtrace {' '.join(path)}` argument {name!r}"


@pytest.mark.parametrize("path", [p for p, c in COMMANDS], ids=lambda p: " ".join(p) or "divtrace")
def test_help_paragraphs_are_not_hard_wrapped(path):
    """Each paragraph of a command's help is one line (the terminal wraps it), except the \\b example blocks."""
    text = dict(COMMANDS)[path].help or ""
    for para in text.split("\n\n"):
        if not para.lstrip().startswith("\b"):
            assert "\n" not in para, f"`divtrace {' '.join(path)}` help breaks a paragraph: {para[:80]!r}"


def test_reflow_keeps_examples():
    doc = """First line
    goes on.

    \b
    Examples:
      divtrace show A
    """
    assert reflow(doc) == "First line goes on.\n\n\b\nExamples:\n  divtrace show A"


def test_columns_respected_when_not_a_terminal(capsys, monkeypatch):
    row = ["x" * 150]
    monkeypatch.setenv("COLUMNS", "200")
    Output().table("t", ["c"], [row])
    wide = capsys.readouterr().out
    assert "x" * 150 in wide and max(map(len, wide.splitlines())) <= 200
    monkeypatch.setenv("COLUMNS", "60")
    Output().table("t", ["c"], [row])
    narrow = capsys.readouterr().out
    assert max(map(len, narrow.splitlines())) <= 60
    monkeypatch.delenv("COLUMNS")
    Output().table("t", ["c"], [row])
    assert max(map(len, capsys.readouterr().out.splitlines())) <= 120  # not a terminal, no COLUMNS: 120


def _help_texts(cmd) -> list[str]:
    return [cmd.help or ""] + [getattr(p, "help", None) or "" for p in cmd.params]


def _options(cmd) -> set[str]:
    return {o for p in cmd.params for o in (*getattr(p, "opts", ()), *getattr(p, "secondary_opts", ()))}


def test_every_flag_a_help_text_names_exists():
    """Issue 26 snag 10: `record --help` spoke of "--ops is not forced" while only --no-ops exists. A `--flag` in
    any help text must be an option of some command, or of the repro script (`python DIR/repro.py --trials N`)."""
    known = {"--help"} | {o for _, c in COMMANDS for o in _options(c)}
    known |= {"--trials", "--seed", "--fidelity", "--json", "--device"}  # repro.py's own (divtrace/repro/harness.py)
    bad = [(" ".join(path), flag) for path, c in COMMANDS for text in _help_texts(c)
           for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", text) if flag not in known]
    assert not bad, bad


def test_map_help_names_the_shipped_maps():
    from pathlib import Path

    shipped = sorted(p.stem for p in (Path(divtrace.__file__).parent / "maps").glob("*.yaml"))
    assert "vllm-hf" in shipped
    for path, c in COMMANDS:
        for p in c.params:
            if "--map" in getattr(p, "opts", ()):
                assert all(name in p.help for name in shipped), (path, p.help)


def test_root_help_names_every_exit_code(capsys, monkeypatch):
    """`divtrace -h` lists the exit codes; 4 (absorbed) was left out of it."""
    from divtrace.compare.verdict import ABSORBED, EXIT_CODES, INCONCLUSIVE

    monkeypatch.setenv("COLUMNS", "200")
    assert main(["-h"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    for words in ("0 identical", "1 diverged", "2 bad input", f"{EXIT_CODES[INCONCLUSIVE]} inconclusive",
                  f"{EXIT_CODES[ABSORBED]} absorbed"):
        assert words in out, (words, out)


@pytest.mark.parametrize("path", [p for p, _ in COMMANDS], ids=lambda p: " ".join(p) or "divtrace")
def test_every_help_has_an_example(path, capsys, monkeypatch):
    """docs/contract.md: every command has --help with an example; `divtrace -h` and `divtrace skill -h` had none."""
    monkeypatch.setenv("COLUMNS", "200")
    assert main([*path, "-h"]) == 0
    out = capsys.readouterr().out
    examples = out[out.index("Examples:"):] if "Examples:" in out else ""
    assert re.search(r"^\s+divtrace " + " ".join(path), examples, re.M), out
