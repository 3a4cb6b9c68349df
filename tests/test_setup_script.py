"""scripts/setup.sh skips the editable install when the venv already has this checkout installed and nothing the
install depends on changed (a stamp in the venv). Run against a stand-in venv whose `python` logs each call and
passes everything but `-m pip` to this test's interpreter (which imports divtrace from this checkout)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _fake_venv(tmp_path: Path) -> tuple[Path, Path]:
    venv, log = tmp_path / "venv", tmp_path / "calls.log"
    (venv / "bin").mkdir(parents=True)
    py = venv / "bin" / "python"
    # `-m pip` is logged and skipped; the torch checks are answered without importing torch (seconds on a busy
    # machine); everything else (the stamp's hash, whether divtrace is this checkout's) runs for real
    py.write_text(f'#!/bin/sh\necho "$*" >> "{log}"\n'
                  f'if [ "$1 $2" = "-m pip" ]; then exit 0; fi\n'
                  f'case "$*" in *"import torch"*) echo "stand-in: torch imports"; exit 0;; esac\n'
                  f'exec "{sys.executable}" "$@"\n')
    py.chmod(0o755)
    return venv, log


def _setup(venv: Path) -> str:
    env = {**os.environ, "DIVTRACE_VENV": str(venv)}
    env.pop("DIVTRACE_TORCH", None)
    r = subprocess.run(["bash", str(ROOT / "scripts" / "setup.sh")], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def _pip_installs(log: Path) -> list[str]:
    return [x for x in log.read_text().splitlines() if x.startswith("-m pip") and " -e " in x]


def test_second_setup_skips_the_install(tmp_path):
    venv, log = _fake_venv(tmp_path)
    out = _setup(venv)
    assert len(_pip_installs(log)) == 1 and "install skipped" not in out
    stamp = venv / ".divtrace-install-stamp"
    assert stamp.is_file() and len(stamp.read_text().strip()) == 64
    out = _setup(venv)
    assert len(_pip_installs(log)) == 1, "reinstalled although nothing changed"
    assert "install skipped" in out
    # a stamp from another pyproject.toml (or another checkout): installed again
    stamp.write_text("0" * 64 + "\n")
    out = _setup(venv)
    assert len(_pip_installs(log)) == 2 and "install skipped" not in out
    # other extras ask for another install
    env_extras = {**os.environ, "DIVTRACE_VENV": str(venv), "DIVTRACE_EXTRAS": "test,plot"}
    subprocess.run(["bash", str(ROOT / "scripts" / "setup.sh")], env=env_extras, capture_output=True, check=True,
                   timeout=300)
    assert len(_pip_installs(log)) == 3


def test_setup_installs_when_the_venv_has_another_checkout(tmp_path):
    """The stamp alone is not enough: the venv must import divtrace from this checkout."""
    venv, log = _fake_venv(tmp_path)
    _setup(venv)
    other = tmp_path / "other"
    (other / "divtrace").mkdir(parents=True)
    (other / "divtrace" / "__init__.py").write_text("")
    py = venv / "bin" / "python"  # the venv now imports another divtrace first
    py.write_text(py.read_text().replace("exec ", f'PYTHONPATH="{other}" exec '))
    out = _setup(venv)
    assert len(_pip_installs(log)) == 2 and "install skipped" not in out


