"""Issue 33: `audit` never says "clean" about what it did not audit, and `--under` errors are one line.

A mode whose context manager raises on enter read "0 audited, 105 not audited", verdict clean, exit 0; an
`--under` file with a syntax error was an internal error; a class as the factory (`contextlib:nullcontext`) was
refused as "has no function". Each case here runs the real audit over a recorded full-mode trace.
"""
from __future__ import annotations

import json

import pytest
import torch

import divtrace
from test_trace_fixtures import cli, record_tiny

MODES = '''
from contextlib import contextmanager

from torch.overrides import TorchFunctionMode


@contextmanager
def refuses():
    raise RuntimeError("no batch-invariant kernels on this device")
    yield


class NoKernels(TorchFunctionMode):
    """A mode whose every op fails: a batch-invariant library missing its kernels."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        raise NotImplementedError(f"{func} has no batch-invariant kernel")
'''


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("audit-under")
    (d / "modes.py").write_text(MODES)
    (d / "broken.py").write_text("def mode(:\n    pass\n")
    return record_tiny(d / "tiny", mode="full"), d


def _ops_in(trace) -> int:
    """The computing ops the tiny model ran (its two Linear's addmm and the GELU), counted in the trace's records."""
    from divtrace.trace.reader import Trace

    return sum(op in ("aten.addmm.default", "aten.gelu.default") for op in Trace(trace).rop)


def test_a_context_manager_that_raises_on_enter_is_one_line_naming_it(tiny):
    trace, d = tiny
    code, out, err = cli("audit", trace, "--under", f"{d / 'modes.py'}:refuses")
    assert code == 2 and out == "", (code, out)
    assert err.strip() == (f"divtrace: error: --under {d / 'modes.py'}:refuses: entering its context manager raised "
                           "RuntimeError: no batch-invariant kernels on this device")


def test_an_under_file_with_a_syntax_error_is_one_line_naming_the_file(tiny):
    trace, d = tiny
    code, out, err = cli("audit", trace, "--under", f"{d / 'broken.py'}:mode")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "internal error" not in err, err
    assert f"{d / 'broken.py'}:1: " in err


def test_a_class_is_a_factory(tiny):
    trace, _ = tiny
    code, out, err = cli("audit", trace, "--under", "contextlib:nullcontext", "--json")
    r = json.loads(out)
    assert code in (0, 1) and r["verdict"] in ("clean", "findings"), err
    assert r["audited"] == _ops_in(trace) == 3 and r["under"] == "contextlib:nullcontext" and r["reason"] is None


def test_nothing_audited_is_inconclusive_never_clean(tiny):
    """Every replay fails inside the mode: no op is audited, so the verdict is inconclusive (exit 3) with the
    reason, and the not-audited list says why for each op."""
    trace, d = tiny
    code, out, err = cli("audit", trace, "--under", f"{d / 'modes.py'}:NoKernels", "--json")
    r = json.loads(out)
    assert code == 3 and r["verdict"] == "inconclusive" and r["audited"] == 0 and r["not_audited"] == _ops_in(trace)
    assert r["reason"].startswith(f"nothing was audited: none of the {_ops_in(trace)} computing ops could be re-run")
    assert all("has no batch-invariant kernel" in n["why"] for n in r["not_audited_ops"])
    code, out, err = cli("audit", trace, "--under", f"{d / 'modes.py'}:NoKernels")
    assert code == 3 and "\nINCONCLUSIVE: nothing was audited: none of the 3 computing ops" in out, out
    assert "PASSED" not in out and "clean:" not in out


def test_only_random_ops_is_inconclusive(tmp_path):
    """A model whose only computing op draws random numbers: nothing can be audited."""
    class Noise(torch.nn.Module):
        def forward(self, x):
            return torch.rand_like(x)

    m = Noise()
    with torch.no_grad(), divtrace.record(m, tmp_path / "t", mode="full"):
        m(torch.zeros(4, 8))
    code, out, err = cli("audit", tmp_path / "t", "--json")
    r = json.loads(out)
    assert code == 3 and r["verdict"] == "inconclusive" and r["audited"] == 0 and r["ops"] == r["not_audited"] >= 1
    assert "a random op" in r["reason"]


def test_an_entry_file_with_a_syntax_error_is_one_line_too(tiny, tmp_path):
    """The loader audit --under shares with `divtrace record ENTRY`: the same one line there."""
    _, d = tiny
    code, out, err = cli("record", f"{d / 'broken.py'}:mode", "--out", tmp_path / "t")
    said = err.strip()  # (the parser's own words after the line number differ between Python versions)
    assert code == 2 and said.startswith(f"divtrace: error: ENTRY '{d / 'broken.py'}:mode': {d / 'broken.py'}:1: ")
    assert len(said.splitlines()) == 1
    assert not (tmp_path / "t").exists()
