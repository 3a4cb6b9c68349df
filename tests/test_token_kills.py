"""Issue 33: a KV-cache rollout SIGKILLed at any point is inconclusive (exit 3), never an internal error, in
bisect (both orders, against the complete rollout and against the trainer) and in repro.

Before, token files were appended at each root call's end while records.jsonl was flushed every 4096 records,
so a kill left tokens.jsonl naming calls records.jsonl never got: `internal error: KeyError: 0`. Now the token
files are written in step with the records under the same checksums; a kill leaves both cut at the same flush.

One process imports torch and transformers once and forks a recording per kill point (the existing fork pattern
of test_fault_injection.py); each child kills itself with SIGKILL at its point: the k-th module call of the run
(k drawn with a fixed seed), or half-way through its n-th write of one of the trace's files. Small flushes
(every 16 records) put many flushes inside the run, so kills land between, inside and right after them.
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from divtrace.trace.reader import Trace
from test_trace_fixtures import cli

sys.path.insert(0, str(Path(__file__).parent))
import token_cases as tc  # noqa: E402

pytest.importorskip("transformers")

FLUSH = 16

FORK = """
import os, signal, sys
import torch
torch.set_num_threads(1)
sys.path.insert(0, sys.argv[1])
import token_cases as tc

model = tc.llama(torch.bfloat16)
prompts = tc.prompts()
for spec in sys.argv[3:]:
    out, kind, arg = spec.split(",")
    pid = os.fork()
    if pid == 0:
        if kind == "call":  # SIGKILL as the k-th module call of the run begins
            seen = [0]
            def hook(m, a, k=int(arg)):
                seen[0] += 1
                if seen[0] == k:
                    os.kill(os.getpid(), signal.SIGKILL)
            for m in model.modules():
                m.register_forward_pre_hook(hook)
        else:  # SIGKILL half-way through the n-th write of one file (a kill mid-write: a torn last line)
            name, nth = arg.split(":")
            real_open, real_write, fds, writes = os.open, os.write, {}, [0]
            def opener(path, *a, **k):
                fd = real_open(path, *a, **k)
                fds[fd] = os.path.basename(str(path))
                return fd
            def write(fd, data):
                if fds.get(fd) == name and len(data) > 1:
                    writes[0] += 1
                    if writes[0] == int(nth):
                        real_write(fd, bytes(data)[:len(data) // 2])
                        os.kill(os.getpid(), signal.SIGKILL)
                return real_write(fd, data)
            os.open, os.write = opener, write
        tc.rollout(model, out, prompts, mode=sys.argv[2], flush_records=int(os.environ["FLUSH"]))
        os._exit(0)
    os.waitpid(pid, 0)
"""


def _kill_plan(total_calls: int) -> list[tuple[str, str]]:
    rng = random.Random(33)
    calls = sorted(rng.sample(range(2, total_calls + 1), 4))  # 1: before any record (tested elsewhere)
    writes = [("tokens.jsonl", rng.randint(2, 4)), ("rows.bin", rng.randint(2, 4)), ("records.jsonl", 3),
              ("checksums.jsonl", 3)]
    return [("call", str(k)) for k in calls] + [("write", f"{name}:{n}") for name, n in writes]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("token-kills")
    m = tc.llama(torch.bfloat16)
    seqs = tc.rollout(m, d / "rollout", tc.prompts(), mode="full", flush_records=FLUSH)
    tc.trainer(m, d / "train", seqs, mode="full")
    plan = _kill_plan(len(Trace(d / "rollout").calls))
    killed = [d / f"killed-{i}-{kind}-{arg.replace(':', '-')}" for i, (kind, arg) in enumerate(plan)]
    (d / "fork.py").write_text(FORK)
    p = subprocess.run([sys.executable, str(d / "fork.py"), str(Path(__file__).parent), "full"]
                       + [f"{k},{kind},{arg}" for k, (kind, arg) in zip(killed, plan)],
                       capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, FLUSH=str(FLUSH), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"))
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr[-2000:]
    return {"dir": d, "rollout": d / "rollout", "train": d / "train", "killed": list(zip(plan, killed))}


def test_every_kill_left_an_incomplete_trace_whose_token_files_are_whole(runs):
    """Each kill landed inside its recording (status still `running`), and what it left reads: the token files
    as far as a checkpoint vouches for them, no token line of a call or value the records do not hold."""
    for (kind, arg), k in runs["killed"]:
        t = Trace(k)
        assert t.meta["status"] == "running" and not t.complete, (kind, arg)
        idx = t.token_index()
        idx.check()
        assert idx.verified and set(idx.grids) <= set(t.calls) and set(idx.index) <= set(t.vkey)
        for cid in idx.grids:  # each grid is of a root call the records hold
            assert t.calls[cid].parent is None
    # The kills are spread over the run: some before the first decode step's records, some inside decode steps.
    roots = [sum(c.parent is None for c in Trace(k).calls.values()) for _, k in runs["killed"]]
    assert min(roots) <= 1 < max(roots), roots


def test_killed_rollouts_are_inconclusive_in_bisect_and_repro(runs, tmp_path):
    outcomes = []
    for (kind, arg), k in runs["killed"]:
        for ref in (runs["rollout"], runs["train"]):
            for a, b in ((ref, k), (k, ref)):
                code, out, err = cli("bisect", a, b, "--json")
                assert "internal error" not in err and "Traceback" not in err, (kind, arg, err)
                r = json.loads(out)
                assert code == 3 and r["verdict"] == "inconclusive", (kind, arg, ref.name, code, r["reason"])
                assert f"trace {k} is incomplete (status: running" in r["reason"]
                outcomes.append(code)
        code, out, err = cli("repro", runs["train"], k, "--out", tmp_path / "repro", "--overwrite")
        assert code == 3 and "internal error" not in err and "no divergence found to reproduce" in err, (kind, arg, err)
        assert not (tmp_path / "repro" / "repro.py").exists()
        outcomes.append(code)
    assert outcomes == [3] * (5 * len(runs["killed"]))


def test_a_torn_last_line_after_the_last_checkpoint_is_cut_back(runs, tmp_path):
    """A kill in the middle of a write leaves half a line past what checksums.jsonl vouches for: read as
    nothing (the trace is inconclusive), never as damage and never as data."""
    import shutil

    (_, _), k = runs["killed"][2]
    t = shutil.copytree(k, tmp_path / "torn")
    with open(t / "tokens.jsonl", "ab") as f:
        f.write(b'{"c":9999,"n":9,"shape":[2,1],"kv":40,"src":"hf","keys":[1')
    with open(t / "rows.bin", "ab") as f:
        f.write(b"\x01\x02\x03")
    code, out, err = cli("bisect", runs["train"], t, "--json")
    assert code == 3 and json.loads(out)["verdict"] == "inconclusive", err
    assert 9999 not in Trace(t).token_index().grids


def _truth(t: Trace):
    """What a stopped trace holds, read with plain code: root calls (the last one's number and whether it
    returned), module calls, the module of the last call entered that never returned (or of the last call)."""
    calls = sorted(t.calls.values(), key=lambda c: c.enter_index)
    roots = [c for c in calls if c.parent is None]
    open_ = [c for c in calls if c.exit_index is None]
    return roots, calls, (open_[-1] if open_ else calls[-1]).module or "<root>"


def test_the_reason_says_how_far_it_got_and_only_what_is_true(runs):
    """Against the complete rollout (the same calls), how far it got is measured in the rollout's calls; against
    the trainer (one root call of other calls), a rollout killed in a decode step is not "root call 4 of 1 after
    97 of the reference's 32 module calls": the reason says it in the killed trace's own terms."""
    ref, train = Trace(runs["rollout"]), Trace(runs["train"])
    ref_roots, ref_calls, _ = _truth(ref)
    train_roots, train_calls, _ = _truth(train)
    seen_other_work = 0
    for (kind, arg), k in runs["killed"]:
        t = Trace(k)
        if not t.calls:
            continue
        roots, calls, last = _truth(t)
        where = (f"in root call {len(roots)}" if roots[-1].exit_index is None else f"after root call {len(roots)}")
        code, out, _ = cli("bisect", runs["rollout"], k, "--json")
        assert (f"stopped {where} of {len(ref_roots)} after {len(calls)} of the reference's {len(ref_calls)} "
                f"module calls; last module {last}") in json.loads(out)["reason"], (kind, arg)
        code, out, _ = cli("bisect", runs["train"], k, "--json")
        reason = json.loads(out)["reason"]
        same_work = [(c.module, c.call) for c in calls] == [(c.module, c.call) for c in train_calls[:len(calls)]]
        if same_work:  # killed inside the prefill, which is the trainer's forward so far
            assert (f"stopped {where} of {len(train_roots)} after {len(calls)} of the reference's "
                    f"{len(train_calls)} module calls") in reason
        else:
            seen_other_work += 1
            its = where.replace("root call", "its root call")
            assert (f"stopped {its} after {len(calls)} module calls; last module {last} (the reference holds "
                    f"{len(train_roots)} root call{'s' * (len(train_roots) != 1)} and {len(train_calls)} module "
                    "calls, not these: how far it got cannot be measured against it)") in reason, reason
            assert f" of {len(train_roots)} after" not in reason and "of the reference's" not in reason
    assert seen_other_work >= 2


def test_an_older_killed_trace_whose_token_files_ran_ahead_is_inconclusive(runs, tmp_path):
    """What a kill left before this change: token files appended at each root call's end, records.jsonl flushed
    later, so tokens.jsonl and rows.jsonl name calls and values records.jsonl never got (bisect said `internal
    error: KeyError: 0`). Made from the complete rollout: meta.json as at the start of a recording, records.jsonl
    cut back to a checkpoint half-way, the token files whole and without checksums. The token lines past the
    records are cut back; the trace is inconclusive, with one warning that its token files are unverified."""
    import shutil

    t = shutil.copytree(runs["rollout"], tmp_path / "old-killed")
    meta = json.loads((t / "meta.json").read_text())
    for k in ("checksums", "file_checksums", "records", "shards", "finished", "tokens", "unfinished_calls"):
        meta.pop(k, None)
    meta.update(status="running", complete=False, error=None)
    (t / "meta.json").write_text(json.dumps(meta))
    sums = [json.loads(x) for x in (t / "checksums.jsonl").read_text().splitlines()]
    keep = sums[: len(sums) // 2]
    (t / "checksums.jsonl").write_text("".join(json.dumps({"records": d["records"], "sha256": d["sha256"]}) + "\n"
                                               for d in keep))
    with open(t / "records.jsonl", "r+b") as f:
        f.truncate(keep[-1]["records"])
    cut = Trace(t)
    grids = [json.loads(x)["c"] for x in (t / "tokens.jsonl").read_text().splitlines() if x.startswith('{"c"')]
    assert any(c not in cut.calls for c in grids)  # token lines ahead of the records, as a kill left them
    assert set(cut.token_index().grids) == {c for c in grids if c in cut.calls}
    for ref in (runs["rollout"], runs["train"]):
        for a, b in ((ref, t), (t, ref)):
            code, out, err = cli("bisect", a, b, "--json")
            assert "internal error" not in err, err
            r = json.loads(out)
            assert code == 3 and r["verdict"] == "inconclusive", (ref.name, code, r["reason"])
            assert sum("token files written before divtrace checked them" in w for w in r["warnings"]) == 1
