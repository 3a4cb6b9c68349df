"""The interface is documented inside the project (docs/contract.md), nothing points at files a clone does not
have, and the docs say the same thing as the code where a newcomer or an agent tripped (verify's direction, ENTRY
and sys.path, the scale-placement cause, why the repro's output is not bisect's tensor)."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import typer

from divtrace.cli.app import app
from divtrace.record.entry import load_entry
from test_trace_fixtures import cli

ROOT = Path(__file__).resolve().parent.parent
SKILL = ROOT / "divtrace" / "skill" / "divtrace"
USER_DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), SKILL / "SKILL.md",
             *sorted((SKILL / "references").glob("*.md"))]
CMD = typer.main.get_command(app)


def _helps(cmd=CMD):
    yield cmd.help or ""
    for p in cmd.params:
        yield getattr(p, "help", None) or ""
    for sub in (getattr(cmd, "commands", None) or {}).values():
        yield from _helps(sub)


def test_no_link_outside_the_project():
    for doc in USER_DOCS:
        text = doc.read_text()
        assert "../shared" not in text and "CONTRACT" not in text, doc
    for h in _helps():
        assert "CONTRACT" not in h and "shared/" not in h, h


def test_contract_doc_covers_the_interface():
    text = (ROOT / "docs" / "contract.md").read_text()
    for code in ("| 0 |", "| 1 |", "| 2 |", "| 3 |"):
        assert code in text
    for name in CMD.commands:
        assert f"`divtrace {name}" in text, name
    for topic in ("divtrace.record(model", "## `bisect --json`", "## Repro directory", "rec.tokens(ids, positions",
                  "--align auto|tokens|calls", "inputs.safetensors", "(json.md)"):
        assert topic in text, topic
    readme = (ROOT / "README.md").read_text()
    assert "(docs/contract.md)" in readme


def test_patchless_verify_direction_agrees():
    skill = (SKILL / "SKILL.md").read_text()
    assert "Without `--patch`, verify checks side b against side a" in skill
    help_text = CMD.commands["verify"].help
    assert "Without --patch, verify checks side b against side a" in help_text
    for text in (skill, help_text, (ROOT / "README.md").read_text()):
        assert not re.search(r"checks side a against side b", text)


def test_skill_explains_repro_output_and_entry_path():
    skill = (SKILL / "SKILL.md").read_text()
    assert "The repro's output is not always bisect's tensor" in skill
    assert "`sys.path` and ENTRY" in skill
    causes = (SKILL / "references" / "causes.md").read_text()
    assert "### Softmax scale placement" in causes


def test_entry_folder_is_on_sys_path_only_while_importing(tmp_path):
    """What the docs say about ENTRY and sys.path is what entry.py does."""
    (tmp_path / "sibling_helper_ux.py").write_text("VALUE = 7\n")
    (tmp_path / "entry_ux.py").write_text("import sibling_helper_ux\n\n\ndef build():\n"
                                          "    return sibling_helper_ux.VALUE\n")
    before = list(sys.path)
    fn = load_entry(f"{tmp_path / 'entry_ux.py'}:build")
    assert fn() == 7  # a top-level import of a module next to the file works
    assert sys.path == before and str(tmp_path) not in sys.path  # and the folder is taken off again


@pytest.mark.parametrize("entry", [":build", ".entry_ux:build"])
def test_an_entry_with_no_module_or_a_relative_one_is_the_usage_line(entry, tmp_path):
    """`:fn` read "ENTRY :fn raised ValueError: Empty module name" (as if the user's function had raised), `.mod:fn`
    a TypeError about relative imports: neither names a file or a module, so the line says what ENTRY must be."""
    code, out, err = cli("record", entry, "--out", tmp_path / "t")
    assert code == 2 and out == "", (code, out)
    assert err.strip() == (f"divtrace: error: ENTRY {entry!r}: expected path/file.py:function or "
                           "pkg.module:function"), err
    assert not (tmp_path / "t").exists()
