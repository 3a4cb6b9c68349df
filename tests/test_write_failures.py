"""Issue 22, items 2 and 3: outputs that cannot be written give exit 2 and one line naming the path and the
system's reason (never "internal error"), leave nothing half-written that looks whole, and the messages around
a stopped `record` are true (Ctrl-C during imports, nothing written yet, a full disk, a second recording into
the same directory)."""
from __future__ import annotations

import builtins
import errno
import json
import os
import platform
import subprocess
import sys

import pytest
import torch

import divtrace
from divtrace.errors import DivtraceError
from divtrace.trace.reader import Trace
from helpers import ROOT
from test_trace_fixtures import Tiny, cli, record_tiny, tiny_input

ENTRY = """
import torch

def build(stop: str = ""):
    if stop == "build":
        raise KeyboardInterrupt
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU(), torch.nn.Linear(4, 4))
    if stop == "forward":
        def boom(mod, args):
            raise KeyboardInterrupt
        model[2].register_forward_pre_hook(boom)
    return model, (torch.randn(2, 4),)
"""


@pytest.fixture
def entry(tmp_path):
    p = tmp_path / "entry.py"
    p.write_text(ENTRY)
    return f"{p}:build"


def _one_line(code, err, *needles, exit_code=2):
    assert code == exit_code, (code, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("divtrace: error: "), err
    assert "internal error" not in err and "Traceback" not in err
    for n in needles:
        assert n in err, (n, err)


def _enospc(*args):
    return OSError(errno.ENOSPC, "No space left on device", *args)


# -- item 2: outputs that cannot be written --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def diverging_pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("pair")
    return record_tiny(d / "a", seed=0), record_tiny(d / "b", seed=1)


def test_repro_out_that_cannot_be_made(diverging_pair, tmp_path):
    a, b = diverging_pair
    f = tmp_path / "afile"
    f.write_text("x")
    code, out, err = cli("repro", a, b, "--out", f / "sub")
    _one_line(code, err, f"{f / 'sub'}: cannot write the repro: a part of the path is not a directory",
              "nothing was written")
    assert out == "" and f.read_text() == "x"
    code, _, err = cli("repro", a, b, "--out", "/proc/divtrace-test/sub")
    _one_line(code, err, "/proc/divtrace-test", "cannot write the repro")


def test_repro_disk_full_removes_what_it_wrote(diverging_pair, tmp_path, monkeypatch):
    """The second safetensors file fails as a full disk makes it fail (safetensors' own error type, the OS
    error inside): the half-written repro is removed, directory and all, and the line says so."""
    import safetensors.torch
    from safetensors import SafetensorError

    a, b = diverging_pair
    real = safetensors.torch.save_file

    def save_file(tensors, filename, *args, **kw):
        if filename.endswith("expected.safetensors"):
            with open(filename, "wb") as fh:
                fh.write(b"\0" * 10)  # a torn file, as a full disk leaves it
            raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: '
                                  '"No space left on device" })')
        return real(tensors, filename, *args, **kw)

    monkeypatch.setattr(safetensors.torch, "save_file", save_file)
    out = tmp_path / "r"
    code, _, err = cli("repro", a, b, "--out", out)
    _one_line(code, err, f"{out}: cannot write the repro: no space left on device",
              f"the partial directory {out} was removed")
    assert not out.exists()
    # Into a directory that was there already: only the repro's own files go, the directory stays.
    out.mkdir()
    code, _, err = cli("repro", a, b, "--out", out)
    _one_line(code, err, "no space left on device", f"the partial files in {out} were removed")
    assert out.is_dir() and not list(out.iterdir())


def test_repro_manifest_write_fails(diverging_pair, tmp_path, monkeypatch):
    from pathlib import Path

    a, b = diverging_pair
    real = Path.write_text

    def write_text(self, data, *args, **kw):
        if self.name == "manifest.json":
            real(self, data[:5])
            raise _enospc(str(self))
        return real(self, data, *args, **kw)

    monkeypatch.setattr(Path, "write_text", write_text)
    out = tmp_path / "r"
    code, _, err = cli("repro", a, b, "--out", out)
    _one_line(code, err, f"{out / 'manifest.json'}: cannot write the repro: no space left on device", "removed")
    assert not out.exists()


def test_other_outputs_that_cannot_be_written(diverging_pair, entry, tmp_path):
    a, b = diverging_pair
    f = tmp_path / "afile"
    f.write_text("x")
    code, _, err = cli("record", entry, "--out", f / "t")
    _one_line(code, err, f"{f / 't'}: cannot write trace directory: a part of the path is not a directory")
    code, _, err = cli("skill", "install", "--dir", f / "skills")
    _one_line(code, err, f"{f / 'skills' / 'divtrace'}: cannot install the skill")
    pytest.importorskip("matplotlib")
    code, out, err = cli("bisect", a, b, "--plot", f / "p.png")
    _one_line(code, err, f"{f / 'p.png'}: cannot write")
    assert out == ""


def test_stdout_that_cannot_be_written(diverging_pair):
    a, _ = diverging_pair
    with open("/dev/full", "w") as full:
        p = subprocess.run([sys.executable, "-m", "divtrace", "show", str(a), "--json"], stdout=full,
                           stderr=subprocess.PIPE, text=True, cwd=ROOT, timeout=120)
    _one_line(p.returncode, p.stderr, "no space left on device")


def test_os_error_reasons():
    from divtrace.oserrors import is_write_error, os_reason

    assert os_reason(_enospc()) == "no space left on device"
    assert os_reason(OSError(errno.EROFS, "Read-only file system")) == "read-only file system"
    assert os_reason(OSError(errno.EIO, "Input/output error")) == "Input/output error"
    from safetensors import SafetensorError

    e = SafetensorError('Error while serializing: IoError(Os { code: 30, kind: ReadOnlyFilesystem, message: '
                        '"Read-only file system" })')
    assert is_write_error(e) and os_reason(e) == "read-only file system"
    assert not is_write_error(ValueError("x"))


# -- record: a full disk -------------------------------------------------------------------------------------------

def _fail_os_call(monkeypatch, name, path_part):
    """Make os.<name> fail with ENOSPC for files whose path ends with `path_part`."""
    real = getattr(os, name)

    def fake(first, *args, **kw):
        target = str(first)
        if isinstance(first, int):
            try:
                target = os.readlink(f"/proc/self/fd/{first}")
            except OSError:
                target = ""
        if target.endswith(path_part):
            raise _enospc()
        return real(first, *args, **kw)

    monkeypatch.setattr(os, name, fake)


def test_disk_full_before_the_first_record(entry, tmp_path, monkeypatch):
    """The records file cannot take its first write (the only flush, at close): record says the disk is full
    and where, and bisect then says the same instead of "was the recorded model called inside the block?"."""
    ref = tmp_path / "ref"
    assert cli("record", entry, "--out", ref, "--mode", "hash")[0] == 0
    part = tmp_path / "part"
    _fail_os_call(monkeypatch, "write", "records.jsonl")
    code, _, err = cli("record", entry, "--out", part, "--mode", "hash")
    monkeypatch.undo()
    _one_line(code, err, f"{part}: write failed: no space left on device", "0 records", "marked incomplete")
    t = Trace(part)
    assert t.meta["status"] == "error" and not t.records
    code, out, err = cli("bisect", ref, part, "--json")
    r = json.loads(out)
    assert code == 3 and r["verdict"] == "inconclusive"
    assert f"trace {part} is incomplete (status: error, write failed: no space left on device)" in r["reason"]
    assert "inside the record block" not in out + err


def test_disk_full_when_the_trace_starts_leaves_no_directory(entry, tmp_path, monkeypatch):
    out = tmp_path / "deep" / "t"
    _fail_os_call(monkeypatch, "open", "checksums.jsonl")
    code, _, err = cli("record", entry, "--out", out)
    monkeypatch.undo()
    _one_line(code, err, f"{out}: cannot start the trace: no space left on device; the directory was removed")
    assert not out.exists()
    # Into an existing directory: it stays, empty (not a trace without records that looks whole).
    out.mkdir()
    _fail_os_call(monkeypatch, "open", "records.jsonl")
    code, _, err = cli("record", entry, "--out", out)
    monkeypatch.undo()
    _one_line(code, err, "cannot start the trace: no space left on device; nothing was recorded")
    assert out.is_dir() and not list(out.iterdir())


# -- item 3: true messages -------------------------------------------------------------------------------------------

def _interrupt_import(monkeypatch, module: str):
    real = builtins.__import__

    def fake(name, *args, **kw):
        if name == module:
            raise KeyboardInterrupt
        return real(name, *args, **kw)

    monkeypatch.setattr(builtins, "__import__", fake)


@pytest.mark.parametrize("module", ["divtrace.cli.app", "divtrace.record.entry"])
def test_ctrl_c_while_importing(entry, tmp_path, monkeypatch, capsys, module):
    """Ctrl-C while the CLI's own imports run (typer, torch): one line, exit 130, no traceback. The console
    entry point (divtrace.cli:main) imports the CLI inside its try."""
    from divtrace.cli import main

    _interrupt_import(monkeypatch, module)
    code = main(["record", entry, "--out", str(tmp_path / "t")])
    monkeypatch.undo()
    err = capsys.readouterr().err
    _one_line(code, err, "interrupted", exit_code=130)
    assert not (tmp_path / "t").exists()


def test_entry_points_cover_the_imports():
    import tomllib

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["divtrace"] == "divtrace.cli:main"
    main_py = (ROOT / "divtrace" / "__main__.py").read_text()
    assert "from divtrace.cli import main" in main_py
    # divtrace.cli itself imports nothing that takes time: the window before main's try is nothing.
    p = subprocess.run([sys.executable, "-c", "import sys; import divtrace.cli; "
                        "sys.exit(sorted(m for m in sys.modules if m.startswith(('typer', 'torch', 'rich'))) != [])"],
                       cwd=ROOT, timeout=60)
    assert p.returncode == 0


def test_stop_before_the_recording_began_says_nothing_was_written(entry, tmp_path):
    out = tmp_path / "t"
    code, _, err = cli("record", entry, "--out", out, "--arg", "stop=build")
    _one_line(code, err, f"interrupted; it stopped before the recording began: nothing was written to {out}",
              exit_code=130)
    assert "marked incomplete" not in err and not out.exists()
    # An older trace in --out is not the "partial trace" of this run.
    assert cli("record", entry, "--out", out)[0] == 0
    code, _, err = cli("record", entry, "--out", out, "--overwrite", "--arg", "stop=build")
    _one_line(code, err, "nothing was written", exit_code=130)
    assert Trace(out).complete


def test_stop_during_the_recording_says_the_trace_is_marked(entry, tmp_path):
    out = tmp_path / "t"
    code, _, err = cli("record", entry, "--out", out, "--arg", "stop=forward")
    _one_line(code, err, f"interrupted; the partial trace in {out} is marked incomplete (status: interrupted)",
              exit_code=130)
    assert Trace(out).meta["status"] == "interrupted"


def test_a_second_recording_into_a_busy_directory_names_the_process(entry, tmp_path):
    """The first recording holds a lock naming its PID: a second one is refused at once, --overwrite or not,
    and leaves the first one's files alone. Once that process is gone its lock does not block --overwrite."""
    from divtrace.trace.directory import LOCK

    out = tmp_path / "t"
    assert cli("record", entry, "--out", out)[0] == 0
    assert not (out / LOCK).exists()  # released at close
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        (out / LOCK).write_text(json.dumps({"pid": holder.pid, "host": platform.node()}))
        before = {p.name: p.read_bytes() for p in out.iterdir()}
        for extra in ((), ("--overwrite",)):
            code, _, err = cli("record", entry, "--out", out, *extra)
            _one_line(code, err, f"{out}: is being recorded by process {holder.pid}", str(out / LOCK))
        assert {p.name: p.read_bytes() for p in out.iterdir()} == before
        # At once: before the ENTRY builds its model (this one would be interrupted while building).
        code, _, err = cli("record", entry, "--out", out, "--arg", "stop=build")
        _one_line(code, err, f"is being recorded by process {holder.pid}")
        with pytest.raises(DivtraceError, match=f"being recorded by process {holder.pid}"):
            with divtrace.record(Tiny(), out, overwrite=True):
                pass
    finally:
        holder.kill()
        holder.wait()
    # Stale now: refused only for what the directory holds (a trace), and --overwrite replaces it.
    code, _, err = cli("record", entry, "--out", out)
    _one_line(code, err, "already holds a trace")
    assert cli("record", entry, "--out", out, "--overwrite")[0] == 0
    assert Trace(out).complete and not (out / LOCK).exists()


def test_a_lock_left_by_a_killed_recording_into_a_new_directory(tmp_path):
    """A lock with an unreadable body (killed between creating and filling it) is stale too."""
    from divtrace.trace.directory import LOCK

    out = tmp_path / "t"
    out.mkdir()
    (out / LOCK).write_text("")
    m = Tiny()
    with torch.no_grad(), divtrace.record(m, out, mode="hash"):
        m(tiny_input())
    assert Trace(out).complete and not (out / LOCK).exists()


def test_skill_install_that_fails_halfway_leaves_no_partial_copy(tmp_path, monkeypatch):
    import shutil

    from divtrace.cli import skill_cmd

    real = shutil.copytree
    calls = {"n": 0}

    def copy2(src, dst, *args, **kw):
        calls["n"] += 1
        if calls["n"] == 2:  # the second file: the first is already in the temp copy
            raise _enospc(dst)
        return shutil.copy2(src, dst, *args, **kw)

    def copytree(src, dst, **kw):
        return real(src, dst, **{**kw, "copy_function": copy2})

    from types import SimpleNamespace

    monkeypatch.setattr(skill_cmd, "shutil", SimpleNamespace(copytree=copytree, rmtree=shutil.rmtree,
                                                             ignore_patterns=shutil.ignore_patterns))
    code, _, err = cli("skill", "install", "--dir", tmp_path)
    _one_line(code, err, f"{tmp_path / 'divtrace'}: cannot install the skill: no space left on device",
              "nothing was installed")
    assert list(tmp_path.iterdir()) == [] and skill_cmd.NAME == "divtrace"


SWALLOW = """
import importlib.abc, os, signal, sys, time

class SwallowCtrlC(importlib.abc.MetaPathFinder):
    # What torch's import does with a Ctrl-C landing in its numpy probe: swallows it.
    done = False

    def find_spec(self, name, path, target=None):
        if name == "torch" and not self.done:
            SwallowCtrlC.done = True
            try:
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(1)
            except BaseException:
                pass
        return None

sys.meta_path.insert(0, SwallowCtrlC())
from divtrace.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_ctrl_c_swallowed_by_an_import_still_stops_record(entry, tmp_path):
    """A Ctrl-C that an import swallows (torch's numpy probe does) used to be lost: the recording went on and
    exited 0. It is noticed and stops the command before anything is recorded."""
    script = tmp_path / "swallow.py"
    script.write_text(SWALLOW)
    out = tmp_path / "t"
    p = subprocess.run([sys.executable, str(script), "record", entry, "--out", str(out)], capture_output=True,
                       text=True, cwd=ROOT, timeout=300)
    _one_line(p.returncode, p.stderr, "interrupted", exit_code=130)
    assert not out.exists()


def test_plot_cut_short_by_a_full_disk_is_removed(diverging_pair, tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from pathlib import Path

    a, b = diverging_pair
    real = Path.write_bytes

    def write_bytes(self, data):
        if self.suffix == ".png":
            real(self, data[:100])  # torn, as a full disk leaves it
            raise _enospc(str(self))
        return real(self, data)

    monkeypatch.setattr(Path, "write_bytes", write_bytes)
    png = tmp_path / "p.png"
    code, out, err = cli("bisect", a, b, "--plot", png)
    _one_line(code, err, f"{png}: cannot write", "o space left on device", "the partial file was removed")
    assert not png.exists() and out == ""
