"""Which Python can run a repro: the one that wrote it. `divtrace repro` replays both sides in its own process
before writing (custom ops' modules imported), so its interpreter is one that runs the script; it goes into
manifest.json (`python`) and into the command `divtrace repro` prints."""
from __future__ import annotations

import os
import platform
import shutil
import sys
from pathlib import Path


def interpreter() -> dict:
    """manifest.json `python`: the interpreter that wrote (and replayed) the repro."""
    import torch

    return {"executable": sys.executable, "version": platform.python_version(), "torch": torch.__version__}


def run_command(script: Path) -> str:
    """`python DIR/repro.py` when `python` on PATH is this interpreter (an activated venv), else the command with
    this interpreter's path (a venv that is not activated: the vLLM venv's, say)."""
    on_path = shutil.which("python")
    same = on_path is not None and os.path.dirname(os.path.abspath(on_path)) == \
        os.path.dirname(os.path.abspath(sys.executable))
    return f"{'python' if same else sys.executable} {script}"
