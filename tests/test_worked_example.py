"""The scripted worked example (examples/worked_example.sh) runs end to end, as a new user would run it."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ROOT


def test_worked_example_end_to_end(tmp_path):
    if shutil.which("bash") is None:
        pytest.skip("needs bash")
    exe = Path(sys.executable).parent / "divtrace"
    env = dict(os.environ, DIVTRACE=str(exe) if exe.exists() else "divtrace", PYTHON=sys.executable)
    p = subprocess.run(["bash", "examples/worked_example.sh", str(tmp_path / "w")], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]
    assert "PASSED: worked example" in p.stdout
    assert (tmp_path / "w" / "parting.png").stat().st_size > 1000
    assert (tmp_path / "w" / "repro" / "repro.py").exists()
