"""A small harness for tests that run a torch.distributed group of processes on the CPU (gloo).

`run_ranks(fn, world, *args)` spawns `world` processes, each joining one gloo group on a free local port, calls
`fn(rank, world, *args)` in each, and returns what each returned (picklable), in rank order. A rank that raises
is reported with its traceback (every rank's, in one failure); a rank may also end itself on purpose
(`expect_exit={rank: code}`). Each rank waits at a barrier before tearing the group down: gloo aborts a process
whose peer leaves while it still talks. `fn` must be importable by name (a module-level function), since the
ranks are spawned.

The port is picked free, then bound by rank 0's rendezvous store a moment later: another process may take it in
between. Only that failure is retried (`port_taken`: init_process_group failed with EADDRINUSE, before `fn` ran),
on a new port, at most `PORT_TRIES` tries; any other failure fails at once.

A rank's result counts once it is sent: its exit code is not checked after that (unless `expect_exit` names it).
torch 2.13's gloo aborts a process now and then at interpreter exit ("terminate called without an active
exception"; backtrace: a `ProcessGroupGloo::runLoop` worker thread dropping a collective's tensor asks for the GIL
while the interpreter finalizes, and Python ends it with `pthread_exit`): after the rank's work, and not divtrace's
(docs/sharded.md, Limits). A test that spawns ranks runs them here, so that race cannot fail a rank that passed.
"""
from __future__ import annotations

import datetime
import os
import pickle
import queue as queue_mod
import re
import socket
import time
import traceback


PORT_TRIES = 3
_PORT_TAKEN = re.compile(r"EADDRINUSE|address already in use", re.I)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_taken(output: str) -> bool:
    """Whether a rendezvous failed because its port was taken (torch's DistNetworkError: "... EADDRINUSE, message:
    address already in use"): the free port picked was bound by another process before the store could listen."""
    return bool(_PORT_TAKEN.search(output))


def _rank_main(rank, world, port, fn, args, queue, timeout_s, barrier):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    try:
        try:
            dist.init_process_group("gloo", rank=rank, world_size=world,
                                    timeout=datetime.timedelta(seconds=timeout_s))
        except BaseException:
            queue.put((rank, "init", traceback.format_exc()))  # (fn never ran: run_ranks may retry the port)
            barrier = False
            return
        out = fn(rank, world, *args)
        queue.put((rank, "ok", pickle.dumps(out)))  # (bytes: tensors travel by copy, not by a shared fd)
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
        barrier = False
    finally:
        if dist.is_initialized():
            if barrier:
                try:
                    dist.barrier()
                except Exception:
                    pass
            dist.destroy_process_group()


def run_ranks(fn, world: int = 2, *args, timeout_s: float = 60.0, join_s: float = 600.0, barrier: bool = True,
              expect_exit: dict | None = None) -> list:
    """Results of `fn(rank, world, *args)` per rank. Raises AssertionError with every failing rank's traceback."""
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        for tries in range(1, PORT_TRIES + 1):
            procs, got = _spawn(fn, world, args, timeout_s, join_s, barrier)
            taken = any(s == "init" and port_taken(out) for s, out in got.values())
            if taken:  # the port was taken before rank 0's store bound it: the others wait on it in vain
                for p in procs:
                    if p.is_alive():
                        p.kill()
                    p.join()
            if not taken or tries == PORT_TRIES:
                break
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    problems = []
    expect_exit = expect_exit or {}
    for r, p in enumerate(procs):
        if taken and r not in got:
            problems.append(f"rank {r}: killed: the rendezvous port was taken on each of {PORT_TRIES} tries")
        elif p.is_alive():
            p.kill()
            problems.append(f"rank {r}: still running after {join_s} s (killed)")
        elif r in expect_exit:
            if p.exitcode != expect_exit[r]:
                problems.append(f"rank {r}: exit code {p.exitcode}, expected {expect_exit[r]}")
        elif got.get(r, ("", ""))[0] != "ok":
            problems.append(f"rank {r}: exit code {p.exitcode}\n{got.get(r, ('', 'no result'))[1]}")
    if problems:
        raise AssertionError("\n".join(problems))
    return [got.get(r, (None, None))[1] for r in range(world)]


def _spawn(fn, world, args, timeout_s, join_s, barrier):
    """Start the ranks on a free port and collect what each sends: (processes, {rank: (status, result or
    traceback)}). Stops collecting when a rank's rendezvous found its port taken (the others would wait on it)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, fn, args, queue, timeout_s, barrier))
             for r in range(world)]
    for p in procs:
        p.start()
    got: dict = {}
    deadline = time.monotonic() + join_s
    while time.monotonic() < deadline and len(got) < world:  # read while they run: a full pipe blocks a rank
        try:
            rank, status, out = queue.get(timeout=0.5)
        except queue_mod.Empty:
            if not any(p.is_alive() for p in procs):
                break
            continue
        got[rank] = (status, pickle.loads(out) if status == "ok" else out)
        if status == "init" and port_taken(out):
            return procs, got
    for p in procs:
        p.join(max(1.0, deadline - time.monotonic()))
    return procs, got
