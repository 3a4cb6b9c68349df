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
its lines (but `...`) must be a line the commands run since the last such block printed; a ```json block so marked
must agree with the last `--json` output on every value it shows (a list may end with "..."). What in a line is
fixed and what may differ on another machine (mismatch counts, ULPs, KL and logprob digits, ...) is listed in
tests/docs_output.py; timings and percentages are free, table padding is ignored. The output is rendered at
COLUMNS=120, as the docs show it, with the venv's bin first on PATH (as after `source .venv/bin/activate`).

Each output block is also checked against two edits of itself (`_check_sensitivity`): with the last digit of every
machine-dependent figure changed (another machine) it must still pass; with a module, an op, a verdict, a total or
a record index changed (drift) it must fail. Set DIVTRACE_DRIFT_DUMP=DIR to keep what the commands printed for each
output block (scripts/simulate_machines.py compares runs under other CPU capabilities, thread counts and without
the C extensions).

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

import os

import pytest
import typer

import docs_output
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


_RECORDED: dict[tuple, tuple] = {}  # identical `divtrace record` lines in several documents are recorded once:
# argv -> (the trace, what the command printed)


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
            shutil.copytree(_RECORDED[key][0], cwd / out)
            return 0, *_RECORDED[key][1:]
        capsys.readouterr()
        rc = main(argv[1:])
        captured = capsys.readouterr()
        if out is not None and rc == 0:
            _RECORDED[key] = (cwd / out, captured.out, captured.err)
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
            _dump(doc, b, "".join(printed), last_json)
            check_output(doc, b, "".join(printed), last_json)
            _check_sensitivity(doc, b, "".join(printed), last_json)
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


def _normal(line: str) -> str:
    return docs_output.normal(line)


def check_output(doc: Path, block: Block, printed: str, last_json) -> None:
    text = "\n".join(t for _, t in block.lines)
    if block.lang == "json":
        assert last_json is not None, f"{doc.name}:{block.line}: a JSON output block with no --json run before it"
        problems = docs_output.json_agrees(json.loads(text), last_json)
        assert not problems, f"{doc.name}:{block.line}: the JSON shown is not what bisect wrote: {problems[:5]}"
        return
    missing = docs_output.missing_lines(block.lines, printed)
    assert not missing, (f"{doc.name}:{missing[0][0]}: this output line was not printed by the commands above it:\n"
                         + "\n".join(f"{n}: {t}" for n, t in missing)
                         + f"\n--- what they printed ---\n{printed[-6000:]}")


def _check_sensitivity(doc: Path, block: Block, printed: str, last_json) -> None:
    """The check passes this block as if printed on another machine (the last digit of every machine-dependent
    figure changed) and fails it for real drift (a module, op, verdict, total or record index changed)."""
    if block.lang == "json":
        shown = json.loads("\n".join(t for _, t in block.lines))
        other = docs_output.json_as_on_another_machine(shown)
        assert other != shown, f"{doc.name}:{block.line}: no machine-dependent value to perturb"
        assert docs_output.json_agrees(other, last_json) == [], f"{doc.name}:{block.line}: another machine fails"
        for name, bad in docs_output.json_drifted(shown).items():
            assert docs_output.json_agrees(bad, last_json), f"{doc.name}:{block.line}: a changed {name} passes"
        return
    other = [(n, docs_output.as_on_another_machine(t) or t) for n, t in block.lines]
    assert docs_output.missing_lines(other, printed) == [], (
        f"{doc.name}:{block.line}: the block with its machine-dependent figures perturbed (another machine) fails")
    drifts = docs_output.drifted(block.lines)
    assert drifts or not doc.is_relative_to(ROOT), \
        f"{doc.name}:{block.line}: shows no module, op, verdict, total or record index to check"
    for name, bad in drifts.items():
        assert docs_output.missing_lines(bad, printed), f"{doc.name}:{block.line}: a changed {name} still passes"


def _dump(doc: Path, block: Block, printed: str, last_json) -> None:
    where = os.environ.get("DIVTRACE_DRIFT_DUMP")
    if where:
        Path(where).mkdir(parents=True, exist_ok=True)
        name = f"{doc.relative_to(ROOT)}:{block.line}".replace("/", "__")
        (Path(where) / f"{name}.json").write_text(json.dumps(
            {"doc": str(doc.relative_to(ROOT)), "line": block.line, "lang": block.lang,
             "shown": [t for _, t in block.lines], "printed": printed, "json": last_json}))


@pytest.mark.parametrize("doc,blocks", list(_run_params()))
def test_example_blocks_run(doc, blocks, tmp_path, monkeypatch, capsys):
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    monkeypatch.setenv("COLUMNS", "120")
    monkeypatch.setenv("PATH", os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
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
    agrees = docs_output.json_agrees
    assert agrees({"a": [1, "..."], "b": 3}, {"a": [1, 2, 3], "b": 3, "c": 0}) == []
    assert agrees({"a": [2, "..."]}, {"a": [1, 2]}) == [".a[0]: doc 2, output 1"]
    # machine-dependent values differ in their digits only; everything else exactly
    assert agrees({"first": {"max_abs": 0.0155, "mismatched": 1081, "first_a_bits": "0x3e5f"}},
                  {"first": {"max_abs": 0.01552, "mismatched": 1077, "first_a_bits": "0x3e60"}}) == []
    assert agrees({"first": {"mismatched": 1081}}, {"first": {"mismatched": None}})  # gone is not a digit
    assert agrees({"first": {"module": "a.b", "numel": 4096}}, {"first": {"module": "a.c", "numel": 4096}})
    assert agrees({"first": {"numel": 4096}}, {"first": {"numel": 4097}})  # a total is fixed


def test_machine_dependent_figures_are_named_by_their_line():
    """What may vary is a figure in a known line, of a known kind; the labels, totals, modules and ops around it
    stay fixed (tests/docs_output.py)."""
    shown = [(1, "│ mismatched        │ 1081 of 4096 elements  │"),
             (2, "│ max ULP           │ 1                      │"),
             (3, "│ KL(train||infer) per position │ 1.33136e-06 │"),
             (4, "│ 24     │ model.layers.0.self_attn.q_proj │ 0    │ propagated │ out    │ 0.00390625  │ 444     │")]
    other_cpu = ("│ mismatched │ 1077 of 4096 elements │\n│ max ULP │ 2 │\n│ KL(train||infer) per position │ "
                 "1.33355e-06 │\n│ 24 │ model.layers.0.self_attn.q_proj │ 0 │ propagated │ out │ 0.0078125 │ 431 │")
    assert docs_output.missing_lines(shown, other_cpu) == []
    for bad in ("1077 of 4097 elements", "model.layers.1.self_attn.q_proj", "│ 25 │", "│ identical │",
                "per token │", "│ max ULP │ two │"):
        old = {"1077 of 4097 elements": "1077 of 4096 elements", "model.layers.1.self_attn.q_proj":
               "model.layers.0.self_attn.q_proj", "│ 25 │": "│ 24 │", "│ identical │": "│ propagated │",
               "per token │": "per position │", "│ max ULP │ two │": "│ max ULP │ 2 │"}[bad]
        assert docs_output.missing_lines(shown, other_cpu.replace(old, bad)), bad
    # a line with no machine-dependent figure is compared whole: a count there is fixed
    assert docs_output.missing_lines([(1, "FAILED: side_a and side_b differ on 6 of 6 input sets")],
                                     "FAILED: side_a and side_b differ on 5 of 6 input sets")
    assert docs_output.as_on_another_machine("│ mismatched │ 1081 of 4096 elements │") == \
        "│ mismatched │ 1082 of 4096 elements │"
    assert docs_output.as_on_another_machine("PASSED: verify: every check holds (1 recorded)") is None


def _following_paragraph(doc: Path, block: Block) -> str:
    """The prose right after a fenced block (its first paragraph)."""
    lines = doc.read_text().splitlines()
    i = block.lines[-1][0] + 1 if block.lines else block.line + 1  # the closing fence's line number (1-based)
    out = []
    for text in lines[i:]:
        if not text.strip():
            if out:
                break
            continue
        if text.lstrip().startswith(("```", "<!--")):
            break
        out.append(text)
    return " ".join(out)


def _has_machine_figures(block: Block) -> bool:
    if block.lang == "json":
        try:
            shown = json.loads("\n".join(t for _, t in block.lines))
        except ValueError:
            return False
        return docs_output.json_as_on_another_machine(shown) != shown
    return any(docs_output.figures(docs_output.normal(t)) for _, t in block.lines)


def test_machine_dependent_figures_are_said_to_be():
    """Where a doc shows figures that depend on the machine (tests/docs_output.py), the paragraph after it says so
    ("Machine-dependent ..."), so that a reader on another CPU knows which digits to expect to differ."""
    silent = []
    for doc, _, _ in ALL:
        blocks, _ = _blocks_and_prose(doc)
        for b in blocks:
            if b.lang in ("text", "json") and _has_machine_figures(b) and \
                    "machine-dependent" not in _following_paragraph(doc, b).lower():
                silent.append(f"{doc.relative_to(ROOT)}:{b.line}")
    assert not silent, silent
