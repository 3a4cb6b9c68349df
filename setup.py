"""Build hook for the three optional C extensions; everything else is in pyproject.toml.

None has a dependency beyond the CPython API. Where no C compiler is available their build is skipped
(optional=True) and divtrace does the same in Python, slower: `_native` is the fingerprint kernel (else torch
ops hash), `_index` reads records.jsonl into the reader's index (else json and trace/reader.py's loop), `_rows`
fingerprints token rows (else torch ops, divtrace/record/rowhash.py).
"""
from setuptools import Extension, setup

setup(ext_modules=[Extension("divtrace._native", ["divtrace/_native.c"], extra_compile_args=["-O3"], optional=True),
                   Extension("divtrace._index", ["divtrace/_index.c"], extra_compile_args=["-O2"], optional=True),
                   Extension("divtrace._rows", ["divtrace/_rows.c"], extra_compile_args=["-O3"], optional=True)])
