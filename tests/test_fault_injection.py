"""Issue 22: recordings killed at random points (SIGTERM through `divtrace record`, SIGKILL of a recording
process), compared with a complete reference of the same run. bisect must never call them identical (exit 0)
unless the recording had in fact finished, and never print a traceback; while a recording runs, a second one
into its directory is refused naming its process, and the lock a SIGKILL leaves does not block --overwrite."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from divtrace.trace.reader import Trace
from helpers import ROOT
from test_trace_fixtures import cli

ENTRY = """
import time
import torch
from torch import nn

class Step(nn.Module):
    def __init__(self, pause):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.act = nn.GELU()
        self.pause = pause

    def forward(self, x):
        if self.pause:
            time.sleep(self.pause)  # a slow layer: the kill lands inside the forward
        return self.act(self.lin(x))

class Deep(nn.Module):
    def __init__(self, pause):
        super().__init__()
        self.steps = nn.ModuleList(Step(pause) for _ in range(60))

    def forward(self, x):
        for s in self.steps:
            x = s(x)
        return x

def build(pause: float = 0.0):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    return Deep(pause), (torch.randn(4, 16, generator=torch.Generator().manual_seed(1)),)
"""

# One process imports torch once and forks a recording per kill (a torch import takes seconds on a busy
# machine); each child records with small flushes, so a SIGKILL leaves a prefix of whole records on disk (the
# CLI flushes every 4096 records, more than this model makes). The CLI's own SIGTERM path is tested in
# test_record_runs.py.
FORK_SCRIPT = """
import os
import sys
import torch
import divtrace
sys.path.insert(0, sys.argv[1])
from entry import build

model, inputs = build(pause=0.05)  # 60 steps: 3 s or more, so that the kills land inside the recordings on a loaded machine
children = []
for spec in sys.argv[2:]:
    out, mode = spec.split(",")
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            with torch.no_grad(), divtrace.record(model, out, mode=mode, flush_records=32):
                model(*inputs)
        except BaseException as e:
            code = 0 if type(e).__name__ == "RecordingTerminated" else 1
            if code:
                print(repr(e), file=sys.stderr)
        finally:
            os._exit(code)
    children.append(pid)
    print(pid, flush=True)
for pid in children:
    os.waitpid(pid, 0)
"""


def _wait_for(path, proc, limit=120.0):
    deadline = time.time() + limit
    while time.time() < deadline:
        if path.exists():
            return
        if proc.poll() is not None:
            pytest.fail(f"the recording ended before it began: {proc.communicate()[1][-2000:]}")
        time.sleep(0.01)
    proc.kill()
    pytest.fail("the recording did not start")


def test_killed_recordings_are_never_identical(tmp_path):
    from divtrace.record.entry import record_entry
    from divtrace.trace.directory import LOCK

    (tmp_path / "entry.py").write_text(ENTRY)
    (tmp_path / "fork.py").write_text(FORK_SCRIPT)
    entry = f"{tmp_path / 'entry.py'}:build"
    rng = random.Random(22)
    plan = [("SIGKILL", "full"), ("SIGKILL", "hash"), ("SIGKILL", "full"), ("SIGTERM", "hash"), ("SIGTERM", "full")]
    outs = [tmp_path / f"killed-{i}-{sig}-{mode}" for i, (sig, mode) in enumerate(plan)]
    parent = subprocess.Popen([sys.executable, str(tmp_path / "fork.py"), str(tmp_path)]
                              + [f"{o},{mode}" for o, (_, mode) in zip(outs, plan)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=ROOT,
                              env=dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1"))
    ref = tmp_path / "ref"
    record_entry(entry, ref, mode="full")  # the same run, complete (no pauses: same values)
    pids = [int(parent.stdout.readline()) for _ in plan]
    lock_checked = None
    for (sig, mode), out, pid in zip(plan, outs, pids):
        _wait_for(out / "meta.json", parent)
        if lock_checked is None:
            # While it records, a second recording into its directory is refused at once, naming it.
            code, _, err = cli("record", entry, "--out", out, "--overwrite")
            assert code == 2 and f"is being recorded by process {pid}" in err, err
            lock_checked = out
        time.sleep(rng.uniform(0.0, 0.3))
        os.kill(pid, getattr(signal, sig))
    _, err = parent.communicate(timeout=120)
    assert parent.returncode == 0 and "Traceback" not in err and not err.strip(), err
    results = []
    for (sig, mode), out in zip(plan, outs):
        t = Trace(out)
        complete = t.complete  # the signal may come after the end: then identical is the truth
        results.append((sig, t.meta["status"], len(t.calls)))
        for a, b in ((ref, out), (out, ref)):
            code, stdout, err = cli("bisect", a, b, "--json")
            assert "Traceback" not in err and "internal error" not in err, err
            r = json.loads(stdout)
            if complete:
                assert code == 0 and r["verdict"] == "identical"
            else:
                assert code == 3 and r["verdict"] == "inconclusive", (sig, mode, code, r["verdict"])
                assert f"trace {out} is incomplete" in r["reason"] and r["coverage"]["final_compared"] is False
            if mode == "hash":  # the human report too (rich tables take time: not for every pair)
                code, stdout, err = cli("bisect", a, b)
                assert "Traceback" not in err and (code == 0 if complete else stdout.startswith("INCONCLUSIVE: "))
    statuses = [s for _, s, _ in results]
    assert sum(s != "complete" for s in statuses) >= 4, results  # the kills did land inside the recordings
    assert "terminated" in statuses and "running" in statuses, results
    # A SIGKILL leaves its lock behind: the process is gone, so it blocks nothing.
    assert (lock_checked / LOCK).exists()
    code, _, err = cli("record", entry, "--out", lock_checked)
    assert code == 2 and "already holds a trace" in err, err
    code, _, err = cli("record", entry, "--out", lock_checked, "--overwrite")
    assert code == 0, err
    assert Trace(lock_checked).complete and not (lock_checked / LOCK).exists()
