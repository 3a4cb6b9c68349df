"""The two runs' parameters and buffers, compared by name (bisect --json's `parameters`).

Parameters are op inputs from outside: no op produced them, so the walk along values never compares them, and a
weight that differs where no output of this batch reads it (an embedding row no token of the batch looks up, an
MoE expert no token was routed to: a weight-sync bug that bites at the next step) would leave the runs
"identical". Each trace names them (params.jsonl: divtrace.trace.param_names); here a name held on both sides with
the same dtype and shape is compared by fingerprint, value by value in recording order (full mode also counts the
elements whose bytes differ, from the stored bytes). Never a difference where the names do not pair: a name on
one side only, or of another dtype or shape (vLLM's fused qkv_proj against HF's q/k/v; a tensor-parallel rank's
block against a whole weight), is counted as not compared. Run directories: rank r against rank r, only where both
runs have the same world size (and then only names of equal local shape).

What bisect does with it (divtrace.compare.verdict): a compared parameter that differs while every final output is
equal makes the verdict `absorbed` (listed in `absorbed`), never `identical`; where the runs diverged, the
origin stays what the walk found, and `parameters` (and a line of the report) says which parameters differ.

In: two Traces or RunViews. Out: the `parameters` dict (docs/json.md).
"""
from __future__ import annotations

from math import prod

_COUNT_MISMATCHED = 16  # differing parameters whose mismatched elements are counted (each a read of both tensors)
NO_NAMES = "a trace holds no parameter names"


def compare_parameters(ta, tb, path_map=None) -> dict:
    """`parameters`: {"compared", "equal", "differ", "not_compared", "only_a", "only_b", "other_shape", "why"}.
    `path_map` (--map) renames each name's module path as it renames module calls (its per-side regexes)."""
    from divtrace.trace.param_names import read_param_names

    run_a, run_b = getattr(ta, "run", None), getattr(tb, "run", None)
    out = {"compared": 0, "equal": 0, "differ": [], "not_compared": 0, "only_a": 0, "only_b": 0, "other_shape": 0,
           "why": None}
    if run_a is None and run_b is None:
        pairs = [(None, ta, tb)]
    elif run_a is not None and run_b is not None and run_a.world_size == run_b.world_size:
        pairs = [(r, run_a.traces[r], run_b.traces[r]) for r in sorted(set(run_a.traces) & set(run_b.traces))]
    else:
        # Rank blocks never pair with whole weights (nor with another world size's blocks): not compared.
        names = [read_param_names(t) for side in (ta, tb) for t in _traces(side)]
        out["not_compared"] = len({n for p in names if p is not None for n in p.values})
        sizes = [f"{run.world_size} ranks" if run is not None else "a single process" for run in (run_a, run_b)]
        out["why"] = (f"parameters not compared: a is a run of {sizes[0]}, b of {sizes[1]} (rank blocks are compared "
                      "only rank against rank, between runs of one world size)")
        return out
    missing = []
    for rank, a, b in pairs:
        na, nb = _mapped(read_param_names(a), path_map, "a"), _mapped(read_param_names(b), path_map, "b")
        if na is None or nb is None:
            missing += [t.path for t, n in ((a, na), (b, nb)) if n is None]
            out["not_compared"] += len(set((na or nb).values) if (na or nb) is not None else ())
            continue
        _compare(a, b, na, nb, rank, out)
    out["differ"].sort(key=lambda d: (d.get("rank") or 0, d["name"]))
    for d in out["differ"][:_COUNT_MISMATCHED]:
        d["mismatched"] = _mismatched(d, pairs)
    why = []
    if missing:
        why.append(f"{NO_NAMES} ({missing[0]}: recorded by a divtrace that did not name parameters; record both "
                   "runs with this one to compare them)")
    if out["only_a"] or out["only_b"] or out["other_shape"]:
        why.append(f"{out['only_a']} names only in a, {out['only_b']} only in b, {out['other_shape']} of another "
                   "dtype or shape (a fused projection against its parts, a rank's block against a whole weight, a "
                   "weight no op read where unread ones were not fingerprinted)")
    out["why"] = ("parameters not compared: " + "; ".join(why)) if why else None
    return out


def _mapped(names, path_map, side: str):
    """`names` with each name's module path renamed by the map's regexes for `side` (as module calls are)."""
    if names is None or path_map is None or not path_map.rules[side]:
        return names
    from divtrace.trace.param_names import ParamNames

    out = ParamNames()
    for name, vals in names.values.items():
        module, dot, leaf = name.rpartition(".")
        new = f"{path_map.apply(side, module)}.{leaf}" if dot else name
        if new not in out.values:  # (two names mapped onto one: the first kept)
            out.values[new], out.kinds[new] = vals, names.kinds.get(name, "parameter")
    return out


def _traces(side) -> list:
    run = getattr(side, "run", None)
    return list(run.traces.values()) if run is not None else [side]


def _compare(a, b, na, nb, rank, out: dict) -> None:
    names_a, names_b = set(na.values), set(nb.values)
    out["only_a"] += len(names_a - names_b)
    out["only_b"] += len(names_b - names_a)
    out["not_compared"] += len(names_a ^ names_b)
    for name in sorted(names_a & names_b):
        va, vb = na.values[name], nb.values[name]
        if any(x.key[:2] != y.key[:2] for x, y in zip(va, vb)):
            out["other_shape"] += 1
            out["not_compared"] += 1
            continue
        out["compared"] += 1
        diff = next(((x, y) for x, y in zip(va, vb) if x.key[2] != y.key[2]), None)
        if diff is None:
            out["equal"] += 1
            continue
        x, y = diff
        entry = {"name": name, "kind": na.kinds.get(name, "parameter"), "dtype": x.key[0], "shape": list(x.key[1]),
                 "a": {"vid": x.vid, "hash": x.key[2]}, "b": {"vid": y.vid, "hash": y.key[2]},
                 "read": {"a": x.vid is not None, "b": y.vid is not None}, "mismatched": None}
        if len(va) > 1 or len(vb) > 1:  # written in place during the recording: which value differs
            entry["value"] = va.index(x)
        if rank is not None:
            entry["rank"] = rank
        out["differ"].append(entry)


def _mismatched(d: dict, pairs) -> int | None:
    """How many elements of a differing parameter differ bitwise, from the stored bytes (full mode, both read by
    an op); None where there are no bytes."""
    ta, tb = next((a, b) for r, a, b in pairs if r == d.get("rank"))
    va, vb = d["a"]["vid"], d["b"]["vid"]
    if va is None or vb is None or ta.mode != "full" or tb.mode != "full":
        return None
    try:
        x, y = ta.tensor(va), tb.tensor(vb)
    except Exception:  # (bytes that do not load are the stored-bytes check's to report, not this count's)
        return None
    if not x.numel():
        return 0
    from divtrace.compare.metrics import raw_bits  # (each element's bits: a complex one's two parts, a bool's byte)

    n = x.numel()
    return int((raw_bits(x).reshape(n, -1) != raw_bits(y).reshape(n, -1)).any(dim=1).sum())


def absorbed_entries(params: dict | None) -> list[dict]:
    """The differing parameters as `absorbed` entries (where every final output is equal): the module holding it,
    `kind` "parameter", its name."""
    out = []
    for d in (params or {}).get("differ", []):
        module = d["name"].rpartition(".")[0]
        read = d["read"]["a"] or d["read"]["b"]
        note = ("the parameter differs; every output of the run is equal: no output reads the elements that differ"
                if read else "the parameter differs; no recorded op read it (fingerprinted at the block's end)")
        out.append({"module": module, "call": None, "kind": "parameter", "op": None, "op_b": None, "tensor": d["name"],
                    "name": d["name"], "rank": d.get("rank"), "tokens": None, "note": note})
    return out


def param_line(params: dict | None) -> str | None:
    """The report's line on parameters (greppable: `parameters differ:` / `parameters not compared:`), or None
    where every name paired and none differs."""
    if not params:
        return None
    if params["differ"]:
        names = []
        for d in params["differ"][:6]:
            at = f" on rank {d['rank']}" if d.get("rank") is not None else ""
            n = f" ({d['mismatched']} of {prod(d['shape'])} elements)" if d.get("mismatched") is not None else ""
            names.append(f"{d['name']}{at}{n}")
        more = f", and {len(params['differ']) - 6} more" if len(params["differ"]) > 6 else ""
        return (f"parameters differ: {len(params['differ'])} of {params['compared']} compared by name: "
                + ", ".join(names) + more)
    if params["why"] and params["compared"] == 0 and NO_NAMES in params["why"]:
        return params["why"]
    return None


def name_of_value(t, vid: int) -> tuple[str, str] | None:
    """(kind, name) of value `vid` of `t` (a Trace or a run view) where it is a parameter or buffer the trace names,
    else None (no names, a damaged names file: the comparison of parameters says so, not this)."""
    from divtrace.errors import DivtraceError
    from divtrace.trace.param_names import read_param_names

    if getattr(t, "tokens", None) is not None and getattr(t, "trace", None) is not None:
        t = t.trace  # (a token view: the trace's own vids)
    if getattr(t, "segments", None) is not None:  # a run view: the value's rank trace, its own vid there
        try:
            seg = t.segment_of_vid(vid)
        except KeyError:
            return None
        t, vid = seg.trace, vid - seg.vbase
    try:
        names = read_param_names(t)  # (read once per trace: compare_parameters has read it already)
    except DivtraceError:
        return None
    return names.name_of(vid) if names is not None else None
