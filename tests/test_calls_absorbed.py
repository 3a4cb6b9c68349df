"""Call alignment: a difference that reaches no output is absorbed (exit 4), never an origin.

Regression: bisect by calls named such a difference as the origin ("diverged", exit 1) while its own final table
said the outputs were bitwise equal (a 1-ulp nudge of one element of a TP rank's q_proj block that attention then
rounded away); token alignment said "absorbed" on the same pair. Planted here where the absorption holds by
construction on any CPU: a row of fc1 whose pre-activation is far below zero on every token, nudged on side b, so
its ReLU output is 0 on both sides. Ground truth from plain forward hooks.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import divtrace


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = torch.nn.Linear(16, 32)
        self.act = torch.nn.ReLU()
        self.fc2 = torch.nn.Linear(32, 16)
        with torch.no_grad():
            self.fc1.bias[5] = -1e4  # row 5: its pre-activation is below zero whatever the input

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def _run(path, nudge: bool, mode: str) -> dict:
    m = MLP().eval()
    if nudge:
        with torch.no_grad():
            m.fc1.weight[5, 3] += 1.0
    seen = {}
    hooks = [getattr(m, n).register_forward_hook(lambda mod, a, out, n=n: seen.__setitem__(n, out.detach().clone()))
             for n in ("fc1", "act", "fc2")]
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), divtrace.record(m, path, mode=mode):
        m(x)
    for h in hooks:
        h.remove()
    return seen


@pytest.mark.parametrize("mode", ["hash", "full"])
def test_an_absorbed_difference_is_absorbed_under_call_alignment(tmp_path, mode):
    a = _run(tmp_path / "a", False, mode)
    b = _run(tmp_path / "b", True, mode)
    # the hooks' truth: fc1's output differs (row 5's pre-activation), the ReLU after it and the output do not
    assert not torch.equal(a["fc1"], b["fc1"])
    assert torch.equal(a["act"], b["act"]) and torch.equal(a["fc2"], b["fc2"])

    r = divtrace.bisect(tmp_path / "a", tmp_path / "b", align="calls")
    assert r.verdict == "absorbed" and r.first is None and r.next == []
    assert {x["module"] for x in r.absorbed} == {"fc1"}
    # the op's output that differs, and the weight that differs (compared by name: compare/params.py)
    assert [x["kind"] for x in r.absorbed] == ["op", "parameter"] and r.absorbed[1]["name"] == "fc1.weight"
    cli = [sys.executable, "-m", "divtrace", "bisect", str(tmp_path / "a"), str(tmp_path / "b")]
    res = subprocess.run(cli + ["--json"], capture_output=True, text=True)
    assert res.returncode == 4, res.stdout + res.stderr
    d = json.loads(res.stdout)
    assert d["verdict"] == "absorbed" and d["first"] is None and d["absorbed"][0]["module"] == "fc1"
    human = subprocess.run(cli, capture_output=True, text=True)
    assert human.returncode == 4 and "PASSED: final outputs identical; 2 internal difference(s) absorbed" in human.stdout


@pytest.mark.parametrize("mode", ["hash", "full"])
def test_a_difference_that_reaches_the_output_is_still_the_origin(tmp_path, mode):
    def run(path, nudge):
        m = MLP().eval()
        if nudge:
            with torch.no_grad():
                m.fc1.bias[2] += 1.0  # a live row: reaches fc2's output
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
        with torch.no_grad(), divtrace.record(m, path, mode=mode):
            return m(x)
    assert not torch.equal(run(tmp_path / "a", False), run(tmp_path / "b", True))
    r = divtrace.bisect(tmp_path / "a", tmp_path / "b", align="calls")
    assert r.verdict == "diverged" and r.first.module == "fc1" and r.absorbed == []
