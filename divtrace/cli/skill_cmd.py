"""divtrace skill: the agent skill that ships inside the package (install it where agents load skills)."""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Annotated, Optional

import typer

from divtrace.cli.output import Output
from divtrace.errors import DivtraceError

app = typer.Typer(name="skill", no_args_is_help=True, add_completion=False, rich_markup_mode=None,
                  help="""The divtrace agent skill: install it for coding agents, or print where it lives.

                  \b
                  Examples:
                    divtrace skill install
                    divtrace skill path
                  """)

NAME = "divtrace"
DEFAULT_DIRS = (Path(".claude") / "skills", Path(".agents") / "skills")


def skill_source() -> Path:
    """The skill directory inside the installed package (holds SKILL.md and references/)."""
    src = Path(__file__).resolve().parent.parent / "skill" / NAME
    if not (src / "SKILL.md").is_file():
        raise DivtraceError(f"{src}: the packaged skill is missing (SKILL.md not found); reinstall divtrace")
    return src


def _is_our_skill(path: Path) -> bool:
    skill = path / "SKILL.md"
    if not skill.is_file():
        return False
    head = skill.read_text(errors="replace").split("---")
    return len(head) >= 3 and any(line.strip() == f"name: {NAME}" for line in head[1].splitlines())


def install_skill(dest_root: Path) -> Path:
    """Copy the skill to `dest_root/divtrace`, replacing an older copy of it but nothing else."""
    src = skill_source()
    dest = dest_root / NAME
    if dest.exists() and not (dest.is_dir() and _is_our_skill(dest)):
        raise DivtraceError(f"{dest}: exists and is not a divtrace skill; remove it or pass another --dir")
    tmp = dest_root / f".{NAME}.installing"
    try:
        dest_root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        shutil.copytree(src, tmp, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        if dest.exists():
            shutil.rmtree(dest)
        tmp.rename(dest)  # a half-copied skill is never left where agents look
    except OSError as e:
        from divtrace.oserrors import os_reason

        shutil.rmtree(tmp, ignore_errors=True)  # a half-copied skill is never left behind either
        left = " (a partial copy is left in " + str(tmp) + ": remove it)" if tmp.exists() else ""
        state = "the earlier copy is unchanged" if dest.exists() else "nothing was installed"
        raise DivtraceError(f"{dest}: cannot install the skill: {os_reason(e)}; {state}{left}") from None
    return dest


@app.command("install")
def install(
    dirs: Annotated[Optional[list[Path]], typer.Option(
        "--dir", metavar="DIR", help="skills directory to install into (repeatable); the skill goes to DIR/divtrace. "
                      "Default: .claude/skills and .agents/skills of the current directory")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="machine-readable list of installed paths")] = False,
):
    """Copy the divtrace skill (SKILL.md and references/) to where coding agents load skills.

    An earlier copy of the divtrace skill is replaced; any other directory in the way is left alone (exit 2).

    \b
    Examples:
      divtrace skill install
      divtrace skill install --dir ~/.claude/skills
    """
    o = Output(json_out)
    installed = [install_skill(d) for d in (dirs or list(DEFAULT_DIRS))]
    if json_out:
        o.json({"source": str(skill_source()), "installed": [str(p) for p in installed]})
    else:
        for p in installed:
            o.line(f"installed {p}/SKILL.md")
    return 0


@app.command("path")
def path():
    """Print the directory of the skill inside the installed divtrace package.

    \b
    Examples:
      divtrace skill path
      cat "$(divtrace skill path)/SKILL.md"
    """
    typer.echo(str(skill_source()))  # unwrapped, so `$(divtrace skill path)` works for long paths
    return 0
