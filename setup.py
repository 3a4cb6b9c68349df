"""Build hook for the optional C fingerprint kernel; everything else is in pyproject.toml.

The kernel has no dependency beyond the CPython API. Where no C compiler is available the build of the
extension is skipped (optional=True) and divtrace hashes with torch ops instead: same fingerprints, slower.
"""
from setuptools import Extension, setup

setup(ext_modules=[Extension("divtrace._native", ["divtrace/_native.c"], extra_compile_args=["-O3"],
                             optional=True)])
