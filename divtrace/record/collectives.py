"""Collectives as op records: c10d's (`dist.all_reduce`, `all_gather`, `reduce_scatter`, `all_to_all`, ...) and
the functional ones (`torch.distributed._functional_collectives`, which DTensor redistributes with).

A collective is recorded like any op: its inputs, and as its outputs the tensors it writes (c10d writes into its
arguments and returns a Work; a functional collective returns a new tensor). Its result is only there once the
collective is done, so the recorder waits for it where it is recorded, before reading it: `Work.wait()` for c10d
and `wait_tensor` for functional collectives. On a GPU both are stream waits (the current stream waits for the
communication stream; the host does not wait). The user's own wait later finds it done.

Each collective also gets a line in layouts.jsonl: its kind, its group (as a 1-D mesh of the group's global ranks)
and its place among this rank's collectives on that group. Its results' layouts: an all-reduce, an all-gather and
a broadcast leave the same value on every rank of the group (replicated); a reduce-scatter leaves each rank a
block of dim 0 of the reduced value; an all-to-all (expert parallelism, issue 32) has no layout here.

In: the op (an OpOverload), its arguments and what it returned. Out: what to record as its outputs, their layouts,
and the collective's line.
"""
from __future__ import annotations

from divtrace.record.shard_rules import Lay

# op name (namespace.name) -> (kind, position of the argument it writes (c10d) or None (functional: returns it))
_C10D = {
    "allreduce_": ("all_reduce", 0), "allreduce_coalesced_": ("all_reduce", 0), "allgather_": ("all_gather", 0),
    "_allgather_base_": ("all_gather", 0), "allgather_into_tensor_coalesced_": ("all_gather", 0),
    "allgather_coalesced_": ("all_gather", 0), "reduce_scatter_": ("reduce_scatter", 0),
    "_reduce_scatter_base_": ("reduce_scatter", 0), "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 0),
    "alltoall_base_": ("all_to_all", 0), "alltoall_": ("all_to_all", 0), "broadcast_": ("broadcast", 0),
    "reduce_": ("reduce", 0), "gather_": ("gather", 0), "scatter_": ("scatter", 0),
}
_FUNCTIONAL = {
    "all_reduce": "all_reduce", "all_reduce_": "all_reduce", "all_reduce_coalesced": "all_reduce",
    "all_gather_into_tensor": "all_gather", "all_gather_into_tensor_out": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter", "all_to_all_single": "all_to_all", "broadcast": "broadcast",
}
_REPLICATING = {"all_reduce", "all_gather", "broadcast"}


def kind_of(func) -> tuple[str, int | None] | None:
    """(kind, written argument position or None) of a collective op, or None for any other op."""
    ns = getattr(func, "namespace", None)
    if ns == "c10d":
        return _C10D.get(func._opname)
    if ns == "_c10d_functional":
        k = _FUNCTIONAL.get(func._opname)
        return (k, None) if k is not None else None
    return None


def settle(func, kind: tuple, out):
    """Wait for the collective `func` returned `out` from, and return what to record as its outputs: the tensors
    it returned, or None where it returned only a Work (its outputs are then the argument it wrote)."""
    import torch

    if func.namespace == "c10d":
        work = out[-1] if isinstance(out, tuple) else out
        wait = getattr(work, "wait", None)
        if callable(wait):
            wait()
        return out[0] if isinstance(out, tuple) else None
    if isinstance(out, torch.Tensor):
        torch.ops._c10d_functional.wait_tensor.default(out)
    elif isinstance(out, (list, tuple)):
        for t in out:
            if isinstance(t, torch.Tensor):
                torch.ops._c10d_functional.wait_tensor.default(t)
    return out


def group_of(func, args) -> tuple[str, list[int]] | None:
    """(group name, its global ranks) of the collective call, or None when it cannot be told."""
    import torch.distributed as dist

    try:
        if func.namespace == "c10d":
            from torch._C._distributed_c10d import ProcessGroup

            pg = next((ProcessGroup.unbox(a) for a in args if type(a).__name__ == "ScriptObject"
                       and "ProcessGroup" in str(getattr(a, "_type", lambda: "")())), None)
        else:
            from torch.distributed.distributed_c10d import _resolve_process_group

            name = next((a for a in reversed(args) if isinstance(a, str)), None)
            pg = _resolve_process_group(name) if name is not None else None
        if pg is None:
            return None
        return str(pg.group_name), [int(r) for r in dist.get_process_group_ranks(pg)]
    except Exception:
        return None


# c10d's ReduceOp.RedOpType values, named as the functional collectives name them
_REDUCE_OPS = {0: "sum", 1: "avg", 2: "product", 3: "min", 4: "max", 5: "band", 6: "bor", 7: "bxor", 8: "premul_sum"}


def reduce_op(func, args) -> str | None:
    """The reduction a collective applies: the functional ones' string, c10d's ReduceOp (a TorchScript object
    among the op's arguments; "?" when it cannot be read, so a repro never takes it for a sum). None where the op
    reduces nothing."""
    if func.namespace == "_c10d_functional" and len(args) > 1 and isinstance(args[1], str):
        return args[1]
    if func.namespace == "c10d":
        import torch

        for a in args:
            if isinstance(a, torch.ScriptObject) and "ReduceOp" in str(a._type()):
                try:
                    return _REDUCE_OPS.get(int(a.op()), "?")
                except Exception:
                    return "?"
    return None


class Collectives:
    """This rank's collectives: their order per group, their lines and their results' layouts."""

    def __init__(self, placements, rank: int):
        self.placements = placements
        self.rank = rank
        self._seq: dict[str, int] = {}

    def outputs(self, func, kind: tuple, args, plain_out, index: int) -> list:
        """Layouts of the collective's results (one per output), after writing its line (record `index`)."""
        none = [None] * len(plain_out)
        grp = group_of(func, args)
        if grp is None:
            return none
        name, ranks = grp
        mesh = self.placements.group_mesh(name, ranks)
        seq = self._seq.get(name, 0)
        self._seq[name] = seq + 1
        line = {"c": index, "kind": kind[0], "group": name, "M": mesh, "seq": seq}
        op = reduce_op(func, args)
        if op is not None:
            line["op"] = op
        self.placements.add_line(line)
        if kind[0] in _REPLICATING:
            return [Lay(mesh, ("R",), tuple(p.shape), (0,) * p.dim(), "collective", kind[0]) for p in plain_out]
        if kind[0] == "reduce_scatter" and len(plain_out) == 1 and plain_out[0].dim() >= 1 and self.rank in ranks:
            p = plain_out[0]
            n = p.shape[0]
            k = ranks.index(self.rank)
            g = (n * len(ranks),) + tuple(p.shape[1:])
            return [Lay(mesh, ("S0",), g, (k * n,) + (0,) * (p.dim() - 1), "collective", kind[0])]
        return none
