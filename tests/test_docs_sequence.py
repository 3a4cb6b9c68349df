"""The docs' command sequences do not trip over each other (issue 26 snag 7).

A user follows the README, then docs/*.md and the skill, in one clone: a `divtrace record` of the bundled examples
that one document writes into a directory another document already filled with another trace is refused there
("already holds a trace"). The example's inference side defaults to `variant=all` (every planted cause at once):
a documented command that forgets its `--arg`s records something else than the text says.
"""
from __future__ import annotations

import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
        *sorted((ROOT / "divtrace" / "skill" / "divtrace").rglob("*.md")), ROOT / "examples" / "fixes" / "README.md"]


def _record_commands():
    """(doc, line number, argv after `record`) of every `divtrace record examples/...` the docs show."""
    for doc in DOCS:
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            for m in re.finditer(r"divtrace record (examples/[^`#\n]*)", line):
                yield doc, n, shlex.split(m.group(1).replace("\\|", "|"))


def _out(argv):
    for flag in ("--out", "-o"):
        if flag in argv:
            return argv[argv.index(flag) + 1]
    return None


def _args(argv):
    return {argv[i + 1].split("=")[0]: argv[i + 1] for i, a in enumerate(argv) if a == "--arg"}


def test_no_two_documents_record_different_traces_into_one_directory():
    seen: dict[str, tuple] = {}
    clashes = []
    for doc, n, argv in _record_commands():
        out = _out(argv)
        if out is None or "--overwrite" in argv:
            continue
        what = (argv[0], tuple(sorted(_args(argv).values())), tuple(a for a in argv[1:] if a not in ("--out", out)))
        first = seen.setdefault(out, (what, doc, n))
        if first[0] != what:
            clashes.append(f"{doc.relative_to(ROOT)}:{n} records {argv[0]} into {out}, which "
                           f"{first[1].relative_to(ROOT)}:{first[2]} already filled with another trace")
    assert not clashes, "\n".join(clashes)


def test_example_inference_commands_name_their_variant_and_dtype():
    found = 0
    for doc, n, argv in _record_commands():
        if argv[0].endswith("llama_pair.py:inference"):
            found += 1
            args = _args(argv)
            assert "variant" in args and "dtype" in args, f"{doc.relative_to(ROOT)}:{n}: {' '.join(argv)}"
    assert found >= 4


def test_the_checker_sees_a_clash(tmp_path, monkeypatch):
    a, b = tmp_path / "a.md", tmp_path / "b.md"
    a.write_text("divtrace record examples/llama_pair.py:inference --out runs/infer --arg dtype=bf16 --arg variant=x\n")
    b.write_text("`divtrace record examples/llama_pair.py:inference --out runs/infer --arg dtype=bf16 --arg variant=y`\n")
    monkeypatch.setattr(__import__(__name__), "DOCS", [a, b])
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    try:
        test_no_two_documents_record_different_traces_into_one_directory()
    except AssertionError as e:
        assert "b.md:1 records" in str(e)
    else:
        raise AssertionError("a clash was not seen")
