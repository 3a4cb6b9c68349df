"""No drift between the docs and the CLI.

Every `divtrace ...` command written in the skill (SKILL.md, references/*.md), README.md and docs/*.md is checked
against the real command tree (`typer.main.get_command(divtrace.cli.app.app)`): each subcommand and each
`--flag` must exist. Commands are taken from shell code blocks (```bash, ```sh, no language, and the `$ ` lines
of ```console) and from inline `code` spans; ```text blocks are output and are not read.

Shell blocks preceded by the line `<!-- divtrace-example: run -->` are also *run*, in order, in a fresh working
directory per document (with `examples/` linked in): `divtrace ...` lines in-process, `python ...` lines as
subprocesses. A line expects exit 0 unless it ends with a comment `# exit N`. A block preceded by
`<!-- divtrace-example: file NAME -->` is written to NAME in that directory when the run reaches it (a patch the
doc shows, say). A ```text block preceded by `<!-- divtrace-example: output -->` is output the doc shows: each of
its lines (but `...`) must be a line the commands run since the last such block printed, with timings and
percentages free to differ and table padding ignored (see `_normal`); a ```json block so marked must agree with
the last `--json` output on every value it shows (a list may end with "..."). The output is rendered at
COLUMNS=120, as the docs show it.

`repro` and `verify` are registered only once their modules exist; until then the checks that need them are
expected failures (xfail, not strict) that turn into passes on their own.
"""
from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import typer

from divtrace.cli.app import app, main

ROOT = Path(__file__).resolve().parent.parent
SKILL = ROOT / "divtrace" / "skill" / "divtrace"
DOCS = [SKILL / "SKILL.md", *sorted((SKILL / "references").glob("*.md")), ROOT / "README.md",
        *sorted((ROOT / "docs").glob("*.md"))]
PENDING = {"repro": "divtrace/cli/repro_cmd.py", "verify": "divtrace/cli/verify_cmd.py"}  # registered when they exist
SHELL_LANGS = {"", "bash", "sh", "shell", "zsh", "console"}  # ```text is output; in ```console only `$ ` lines
RUN_MARKER = "<!-- divtrace-example: run -->"
OUTPUT_MARKER = "<!-- divtrace-example: output -->"
FILE_MARKER = re.compile(r"^<!-- divtrace-example: file (\S+) -->$")
ROOT_CMD = typer.main.get_command(app)

# `divtrace` as a command word: not part of a path, module name or Python attribute.
_WORD = re.compile(r"(?<![\w./$-])divtrace(?=[ \t]+[-a-z])")
# Where a shell command ends inside a line: a pipe, redirection, list operator, comment, or a closing `$(`.
_END = re.compile(r"\s+(\||>>?|;|&&|\|\||#)(\s|$)|\)(\s|$|/)|;$")


@dataclass
class Cmd:
    doc: Path
    line: int
    text: str  # the command as written, from `divtrace`
    argv: list[str] = field(default_factory=list)
    error: str | None = None

    @property
    def sub(self) -> str | None:
        return self.argv[0] if self.argv and not self.argv[0].startswith("-") else None

    def id(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}: {self.text[:70]}"


@dataclass
class Block:
    doc: Path
    line: int
    lang: str
    lines: list[tuple[int, str]]
    run: bool
    file: str | None = None  # write the block to this file instead of running it
    output: bool = False  # output the doc shows: checked against what the commands printed


def _blocks_and_prose(doc: Path):
    """Fenced blocks (with their run marker) and the prose lines outside them."""
    blocks, prose = [], []
    lines = doc.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^\s*(```+|~~~+)\s*([\w+-]*)", lines[i])
        if not m:
            prose.append((i + 1, lines[i]))
            i += 1
            continue
        fence, lang, start = m.group(1), m.group(2).lower(), i
        prev = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        body = []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append((i + 1, lines[i]))
            i += 1
        i += 1
        fm = FILE_MARKER.match(prev)
        out = prev == OUTPUT_MARKER
        blocks.append(Block(doc, start + 1, lang, body, prev == RUN_MARKER or bool(fm) or out,
                            fm.group(1) if fm else None, out))
    return blocks, prose


def _join_continuations(lines: list[tuple[int, str]]) -> list[tuple[int, str]]:
    out, buf, first = [], "", None
    for n, text in lines:
        first = n if first is None else first
        if text.rstrip().endswith("\\") and not text.rstrip().endswith("\\\\"):
            buf += text.rstrip()[:-1] + " "
            continue
        out.append((first, buf + text))
        buf, first = "", None
    if buf:
        out.append((first, buf))
    return out


def _commands_in(doc: Path, n: int, text: str) -> list[Cmd]:
    text = text.replace("\\|", "|")  # a pipe escaped inside a Markdown table
    cmds = []
    for m in _WORD.finditer(text):
        rest = text[m.start():]
        end = _END.search(rest)
        piece = rest[:end.start()] if end else rest
        cmd = Cmd(doc, n, piece.strip())
        try:
            cmd.argv = shlex.split(piece)[1:]
        except ValueError as e:
            cmd.error = f"cannot parse as a shell command: {e}"
        cmds.append(cmd)
    return cmds


def _paragraphs(prose: list[tuple[int, str]]) -> list[tuple[int, str]]:
    out, start, buf, last = [], None, [], None
    for n, text in prose + [(None, "")]:
        if not text.strip() or (last is not None and n != last + 1):
            if buf:
                out.append((start, " ".join(buf)))
            start, buf = None, []
        if text.strip():
            start = n if start is None else start
            buf.append(text.strip())
        last = n
    return out


def extract(doc: Path) -> tuple[list[Cmd], list[Block]]:
    blocks, prose = _blocks_and_prose(doc)
    cmds = []
    for b in blocks:
        if b.lang in SHELL_LANGS and b.file is None:
            lines = [(n, t) for n, t in b.lines if b.lang != "console" or re.match(r"^\s*\$\s", t)]
            for n, text in _join_continuations(lines):
                cmds += _commands_in(doc, n, re.sub(r"^\s*\$\s+", "", text))
    for n, text in _paragraphs(prose):  # an inline span may wrap onto the next line
        for span in re.findall(r"`([^`]+)`", text):
            cmds += _commands_in(doc, n, span)
    return cmds, [b for b in blocks if b.run]


ALL = [(doc, *extract(doc)) for doc in DOCS if doc.exists()]
COMMANDS = [c for _, cmds, _ in ALL for c in cmds]


def _registered(name: str) -> bool:
    return name in _subcommands(ROOT_CMD)


def _pending_mark(names):
    missing = sorted({n for n in names if n in PENDING and not _registered(n)})
    if not missing:
        return []
    why = ", ".join(f"`divtrace {n}` is not registered yet ({PENDING[n]} missing)" for n in missing)
    return [pytest.mark.xfail(reason=why, strict=False)]


# Duck-typed: recent typer versions build on a vendored copy of click, whose classes are not `click`'s.
def _subcommands(cmd) -> dict | None:
    return getattr(cmd, "commands", None)


def _option_names(cmd) -> set[str]:
    names = {"--help"}
    for p in cmd.params:
        if getattr(p, "param_type_name", None) == "option":
            names.update(p.opts)
            names.update(p.secondary_opts)
    return names


def check_command(c: Cmd) -> list[str]:
    """What is wrong with one documented command line, against the real CLI."""
    if c.error:
        return [c.error]
    cmd, i, path = ROOT_CMD, 0, "divtrace"
    while _subcommands(cmd) is not None and i < len(c.argv) and not c.argv[i].startswith("-"):
        word = c.argv[i]
        sub = _subcommands(cmd).get(word)
        if sub is None:
            return [f"`{path} {word}`: no such command (have: {', '.join(sorted(_subcommands(cmd)))})"]
        cmd, path, i = sub, f"{path} {word}", i + 1
    problems = []
    known = _option_names(cmd)
    for tok in c.argv[i:]:
        tok = tok.lstrip("[(").rstrip("]),.")
        if not re.match(r"^--?[A-Za-z]", tok):
            continue
        name = tok.split("=", 1)[0].split("|", 1)[0]
        if name not in known:
            problems.append(f"`{path}` has no option {name} (has: {', '.join(sorted(known))})")
    return problems


def test_docs_have_commands():
    """The extraction itself works: the docs name every command, and SKILL.md has blocks that run."""
    named = {c.sub for c in COMMANDS}
    assert {"record", "show", "bisect", "repro", "verify", "skill"} <= named
    assert any(b for doc, _, blocks in ALL if doc == SKILL / "SKILL.md" for b in blocks)
    assert len(COMMANDS) >= 40


@pytest.mark.parametrize("cmd", [pytest.param(c, id=c.id(), marks=_pending_mark([c.sub])) for c in COMMANDS])
def test_documented_command_exists(cmd):
    assert check_command(cmd) == []


def test_checker_catches_drift(tmp_path):
    """A wrong subcommand or flag must be reported (else the test above would pass on anything)."""
    doc = tmp_path / "bad.md"
    doc.write_text("Run `divtrace bisekt A B` and\n\n```bash\ndivtrace bisect A B --jsn\n"
                   "divtrace record ENTRY --out DIR [--mode full|hash] [--no-ops]\n```\n")
    found = {c.text: c for c in extract(doc)[0]}
    bad, good_flags = found["divtrace bisekt A B"], found["divtrace bisect A B --jsn"]
    good = found["divtrace record ENTRY --out DIR [--mode full|hash] [--no-ops]"]
    assert "no such command" in check_command(bad)[0]
    assert "has no option --jsn" in check_command(good_flags)[0]
    assert check_command(good) == []


# -- running the example blocks -------------------------------------------------------------------------------

def _argv_of(line: str) -> tuple[list[str], int]:
    m = re.search(r"#\s*exit\s+(\d+)", line)
    code = int(m.group(1)) if m else 0
    line = re.sub(r"\s+#.*$", "", line).strip()
    return shlex.split(line), code


_RECORDED: dict[tuple, Path] = {}  # identical `divtrace record` lines in several documents are recorded once


def _out_dir(argv: list[str]) -> Path | None:
    for flag in ("--out", "-o"):
        if flag in argv:
            return Path(argv[argv.index(flag) + 1])
    return None


def _run_line(argv: list[str], cwd: Path, capsys) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of one example line."""
    if argv[0] == "divtrace":
        out = _out_dir(argv) if argv[1:2] == ["record"] else None
        key = tuple(argv)
        if out is not None and key in _RECORDED and not (cwd / out).exists():
            shutil.copytree(_RECORDED[key], cwd / out)
            return 0, "", ""
        capsys.readouterr()
        rc = main(argv[1:])
        captured = capsys.readouterr()
        if out is not None and rc == 0:
            _RECORDED[key] = cwd / out
        return rc, captured.out, captured.err
    if argv[0] == "python":
        r = subprocess.run([sys.executable, *argv[1:]], cwd=cwd, capture_output=True, text=True, timeout=600)
        return r.returncode, r.stdout, r.stderr
    raise AssertionError(f"example blocks may only hold `divtrace ...` and `python ...` lines, got {argv[0]!r}")


def _run_params():
    for doc, _, blocks in ALL:
        if not blocks:
            continue
        lines = [t for b in blocks if b.file is None and not b.output for _, t in b.lines
                 if t.strip() and not t.strip().startswith("#")]
        subs = {a[1] for a in map(lambda t: _argv_of(t)[0], lines) if a[:1] == ["divtrace"] and len(a) > 1}
        yield pytest.param(doc, blocks, id=str(doc.relative_to(ROOT)), marks=_pending_mark(subs))


def run_blocks(doc: Path, blocks: list[Block], cwd: Path, capsys) -> None:
    """Run a document's example blocks in `cwd` (the current directory), asserting each line's exit code and the
    output the document shows."""
    printed, last_json = [], None
    for b in blocks:
        if b.output:
            check_output(doc, b, "".join(printed), last_json)
            printed = []
            continue
        if b.file is not None:
            assert "/" not in b.file and not b.file.startswith("."), b.file
            (cwd / b.file).write_text("".join(t + "\n" for _, t in b.lines))
            continue
        for n, line in _join_continuations(b.lines):
            if not line.strip() or line.strip().startswith("#"):
                continue
            argv, want = _argv_of(line)
            rc, out, err = _run_line(argv, cwd, capsys)
            assert rc == want, (f"{doc.name}:{n}: `{line.strip()}` exited {rc}, the doc says {want}\n"
                                f"{(out + err)[-3000:]}")
            if "--json" in argv and argv[0] == "divtrace":
                last_json = json.loads(out)  # what the doc calls JSON is JSON
            else:
                printed.append(out + err)


# a number with a unit of time, a rate, a size or a percentage: what differs from run to run
_VOLATILE = re.compile(r"-?\d+(\.\d+)?(e-?\d+)?\s?(s|ms|us|µs|MB|GB/s|%|x)(?=\W|$)")


def _normal(line: str) -> str:
    """A line with its volatile figures replaced and runs of spaces (table padding) collapsed."""
    return " ".join(_VOLATILE.sub("<N>", line).split())


def _json_agrees(shown, real, where="") -> list[str]:
    if isinstance(shown, dict):
        if not isinstance(real, dict):
            return [f"{where}: the doc shows an object, the output has {type(real).__name__}"]
        bad = [f"{where}.{k}: not in the output" for k in shown if k not in real]
        return bad + [p for k in shown if k in real for p in _json_agrees(shown[k], real[k], f"{where}.{k}")]
    if isinstance(shown, list):
        if not isinstance(real, list):
            return [f"{where}: the doc shows a list, the output has {type(real).__name__}"]
        cut = next((i for i, x in enumerate(shown) if isinstance(x, str) and x.startswith("...")), None)
        if cut is None and len(shown) != len(real):
            return [f"{where}: {len(shown)} entries shown, {len(real)} in the output"]
        return [p for i, x in enumerate(shown[:cut]) for p in _json_agrees(x, real[i] if i < len(real) else None,
                                                                           f"{where}[{i}]")]
    if isinstance(shown, float) and isinstance(real, (int, float)) and not isinstance(real, bool):
        return [] if real == pytest.approx(shown, rel=5e-3) else [f"{where}: doc {shown}, output {real}"]
    return [] if shown == real else [f"{where}: doc {shown!r}, output {real!r}"]


def check_output(doc: Path, block: Block, printed: str, last_json) -> None:
    text = "\n".join(t for _, t in block.lines)
    if block.lang == "json":
        assert last_json is not None, f"{doc.name}:{block.line}: a JSON output block with no --json run before it"
        problems = _json_agrees(json.loads(text), last_json)
        assert not problems, f"{doc.name}:{block.line}: the JSON shown is not what bisect wrote: {problems[:5]}"
        return
    real = {_normal(x) for x in printed.splitlines()}
    missing = [(n, t) for n, t in block.lines if t.strip() and t.strip() != "..." and _normal(t) not in real]
    assert not missing, (f"{doc.name}:{missing[0][0]}: this output line was not printed by the commands above it:\n"
                         + "\n".join(f"{n}: {t}" for n, t in missing)
                         + f"\n--- what they printed ---\n{printed[-6000:]}")


@pytest.mark.parametrize("doc,blocks", list(_run_params()))
def test_example_blocks_run(doc, blocks, tmp_path, monkeypatch, capsys):
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    monkeypatch.setenv("COLUMNS", "120")
    monkeypatch.chdir(tmp_path)
    run_blocks(doc, blocks, tmp_path, capsys)


def test_runner_checks_exit_codes(tmp_path, monkeypatch, capsys):
    doc = tmp_path / "doc.md"
    doc.write_text(f"{RUN_MARKER}\n```bash\ndivtrace show missing-trace   # exit 2\n```\n\n"
                   f"{RUN_MARKER}\n```bash\ndivtrace show missing-trace\n```\n")
    blocks = extract(doc)[1]
    monkeypatch.chdir(tmp_path)
    run_blocks(doc, blocks[:1], tmp_path, capsys)
    with pytest.raises(AssertionError, match="exited 2, the doc says 0"):
        run_blocks(doc, blocks[1:], tmp_path, capsys)


# -- docs/json.md lists exactly the keys bisect --json emits ------------------------------------------------------

def _documented_keys(doc: Path, column: int = 1) -> dict[str, set[str]]:
    """Backticked names in one column of each section's table (the first by default), by section heading."""
    keys, section = {}, None
    for line in doc.read_text().splitlines():
        if re.match(r"^#{2,4} ", line):
            section = line.lstrip("#").strip()
            keys[section] = set()
        elif section and line.startswith("| ") and not line.startswith("|--") and len(line.split("|")) > column + 1:
            keys[section].update(re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)`", line.split("|")[column]))
    return keys


@pytest.fixture(scope="module")
def bisect_dict(tmp_path_factory):
    from divtrace.compare.bisect import bisect
    from helpers import record_pair

    return bisect(*record_pair(tmp_path_factory.mktemp("json"), "rmsnorm_cast")).to_dict()


@pytest.mark.parametrize("doc", [ROOT / "docs" / "json.md", SKILL / "references" / "bisect-json.md"],
                         ids=["docs/json.md", "references/bisect-json.md"])
def test_json_doc_matches_emitted_keys(bisect_dict, doc):
    keys = _documented_keys(doc)
    assert set(bisect_dict) == keys["Top level"]
    first = next(v for k, v in keys.items() if k.startswith("`first`"))
    assert set(bisect_dict["first"]) == first
    assert set(bisect_dict["next"][0]) == first
    if "`final`" in keys and keys["`final`"]:
        final = keys["`final`"]
        assert set(bisect_dict["final"]) <= final and final - set(bisect_dict["final"]) == {"note"}


# -- docs/trace-format.md lists every field the recorder writes ---------------------------------------------------

@pytest.fixture(scope="module")
def recorded_trace(tmp_path_factory):
    from divtrace.record.entry import record_entry

    out = tmp_path_factory.mktemp("fmt") / "t"
    record_entry(f"{ROOT / 'examples' / 'llama_pair.py'}:training", out, args={"layers": 2}, mode="full")
    return out


def test_trace_format_doc_lists_every_field(recorded_trace):
    import dataclasses
    import inspect

    from divtrace.record import op_records as recorder
    from divtrace.trace import records
    from divtrace.record.settings import numerics_settings

    doc_path = ROOT / "docs" / "trace-format.md"
    doc, fields_doc, text = _documented_keys(doc_path), _documented_keys(doc_path, 2), doc_path.read_text()
    section = lambda prefix, d=doc: next(v for k, v in d.items() if k.startswith(prefix))  # noqa: E731
    for cls, prefix in ((records.ModuleEnter, "`enter`"), (records.ModuleExit, "`exit`"),
                        (records.OpRecord, "`op`"), (records.TensorValue, "Tensor values")):
        # the record tables name both the key on disk (column 1) and the dataclass field it fills (column 2)
        assert {f.name for f in dataclasses.fields(cls)} == section(prefix, fields_doc), cls.__name__
    meta = json.loads((recorded_trace / "meta.json").read_text())
    missing = set(meta) - section("meta.json")
    assert not missing, f"meta.json fields not documented: {sorted(missing)}"
    assert all(f"`{k}`" in text for k in numerics_settings()), "a numerics setting is not documented"
    assert f"`\"{meta['hash_scheme']}\"`" in text  # the current scheme is named
    tags = set(re.findall(r'"(\$[a-z_]+)"', inspect.getsource(recorder.encode_constant)))
    assert tags and all(f'"{t}"' in text for t in tags), "an argument encoding tag is not documented"
    lines = [json.loads(x) for x in (recorded_trace / "records.jsonl").read_text().splitlines()]
    on_disk = {"e": set(), "x": set(), "o": set(), "v": set()}
    for rec in lines:
        on_disk[rec["k"]].update(rec)
        for v in rec.get("V", []):
            on_disk["v"].update(v)
    for k, prefix in (("e", "`enter`"), ("x", "`exit`"), ("o", "`op`"), ("v", "Tensor values")):
        assert on_disk[k] <= section(prefix), (prefix, sorted(on_disk[k] - section(prefix)))
    for line in (recorded_trace / "checksums.jsonl").read_text().splitlines():
        assert all(f'"{k}"' in text for k in json.loads(line)), line


def test_output_check_catches_drift(tmp_path, monkeypatch, capsys):
    """Output a doc shows must be what the commands print (else the docs could show anything)."""
    doc = tmp_path / "doc.md"
    doc.write_text(f"{RUN_MARKER}\n```bash\ndivtrace show missing-trace   # exit 2\n```\n\n"
                   f"{OUTPUT_MARKER}\n```text\n{{}}\n...\n```\n")
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    main(["show", "missing-trace"])
    printed = capsys.readouterr().err.strip()
    doc.write_text(doc.read_text().replace("{}", printed))
    run_blocks(doc, extract(doc)[1], tmp_path, capsys)
    doc.write_text(doc.read_text().replace(printed, printed + " (not really)"))
    with pytest.raises(AssertionError, match="was not printed by the commands above it"):
        run_blocks(doc, extract(doc)[1], tmp_path, capsys)
    assert _normal("│ side a    │ 7.0 us │ 96% of b │") == _normal("│ side a │ 12.5 us │ 101% of b │")
    assert _json_agrees({"a": [1, "..."], "b": 0.0155}, {"a": [1, 2, 3], "b": 0.01552, "c": 0}) == []
    assert _json_agrees({"a": [2, "..."]}, {"a": [1, 2]}) == [".a[0]: doc 2, output 1"]
