"""Load examples/llama_pair.py by path (the fixes live one directory below it and must not need it on sys.path)."""
import importlib.util
import sys
from pathlib import Path

_NAME = "divtrace_example_llama_pair_for_fixes"


def llama_pair():
    if _NAME not in sys.modules:
        spec = importlib.util.spec_from_file_location(_NAME, Path(__file__).resolve().parents[1] / "llama_pair.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[_NAME] = mod
        spec.loader.exec_module(mod)
    return sys.modules[_NAME]
