"""pytest plugin: divtrace's C extensions absent, as on a machine where the install found no C compiler.

    PYTHONPATH=tests python -m pytest -p sim_no_c_extensions ...

`import divtrace._native` (and `_index`, `_rows`) then raises ImportError, so the torch and Python paths do the
work (scripts/simulate_machines.py). Loaded before anything imports divtrace.
"""
import sys

for _name in ("divtrace._native", "divtrace._index", "divtrace._rows"):
    sys.modules[_name] = None  # an import of a name mapped to None raises ImportError
