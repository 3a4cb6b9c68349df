"""The two runs' parameters and buffers, compared by name (bisect --json's `parameters`).

Parameters are op inputs from outside: no op produced them, so the walk along values never compares them, and a
weight that differs where no output of this batch reads it (an embedding row no token of the batch looks up, an
MoE expert no token was routed to: a weight-sync bug that bites at the next step) would leave the runs
"identical". Each trace names them (params.jsonl: divtrace.trace.param_names); here a name held on both sides with
the same dtype and shape is compared by fingerprint, value by value in recording order (full mode also counts the
elements whose bytes differ, from the stored bytes). Never a difference where the names do not pair: a name on
one side only, or of another dtype or shape (vLLM's fused qkv_proj against HF's q/k/v), is counted as not
compared. Run directories of one world size: rank r against rank r (names of equal local shape). Runs of other
layouts (TP=2 against one process, FSDP2 against one process, TP=2 against TP=4): each name put together in global
coordinates from its ranks' blocks and compared there (divtrace.compare.param_global: the blocks' partial
fingerprints, no bytes moved; full mode puts the bytes together), naming the ranks whose block differs. In every
run, the ranks that hold the same place of a value (a replica) are checked equal to each other: a copy that
differs is listed in `replicas`, a difference of that run on its own.

What bisect does with it (divtrace.compare.verdict): a compared parameter that differs, or a replica that differs,
while every final output is equal makes the verdict `absorbed` (listed in `absorbed`), never `identical`; where the
runs diverged, the origin stays what the walk found, and `parameters` (and a line of the report) says which
parameters differ.

In: two Traces or RunViews. Out: the `parameters` dict (docs/json.md).
"""
from __future__ import annotations

from math import prod

_COUNT_MISMATCHED = 16  # differing parameters whose mismatched elements are counted (each a read of both tensors)
NO_NAMES = "a trace holds no parameter names"


def compare_parameters(ta, tb, path_map=None) -> dict:
    """`parameters`: {"compared", "equal", "differ", "not_compared", "only_a", "only_b", "other_shape", "why",
    "how", "replicas"}. `path_map` (--map) renames each name's module path as it renames module calls (its per-side
    regexes)."""
    run_a, run_b = getattr(ta, "run", None), getattr(tb, "run", None)
    out = {"compared": 0, "equal": 0, "differ": [], "not_compared": 0, "only_a": 0, "only_b": 0, "other_shape": 0,
           "why": None, "how": "whole", "replicas": []}
    if run_a is None and run_b is None:
        pairs = [(None, ta, tb)]
    elif run_a is not None and run_b is not None and run_a.world_size == run_b.world_size:
        pairs = [(r, run_a.traces[r], run_b.traces[r]) for r in sorted(set(run_a.traces) & set(run_b.traces))]
        out["how"] = "ranks"
    else:
        out["how"] = "global"
        return _compare_global(ta, tb, path_map, out)
    missing = []
    for rank, a, b in pairs:
        na, nb = _mapped(_read(a), path_map, "a"), _mapped(_read(b), path_map, "b")
        if na is None or nb is None:
            missing += [t for t, n in ((a, na), (b, nb)) if n is None]
            out["not_compared"] += len(set((na or nb).values) if (na or nb) is not None else ())
            continue
        _compare(a, b, na, nb, rank, out)
    out["differ"].sort(key=lambda d: (d.get("rank") or 0, d["name"]))
    for d in out["differ"][:_COUNT_MISMATCHED]:
        d["mismatched"] = _mismatched(d, pairs)
    if out["how"] == "ranks":  # each run's replicas (values whose layout puts them in one place on several ranks)
        for side, label in ((ta, "a"), (tb, "b")):
            got = _sides(side, path_map, label)
            if got is not None:
                out["replicas"] += _replicas(side, got, label, laid_only=True)
    why = []
    if missing:
        why.append(f"{NO_NAMES} ({missing[0].path}: {_why_missing(missing[0])})")
    _unpaired_why(out, why, "shape (a fused projection against its parts, a rank's block against a whole weight, a "
                  "weight no op read where unread ones were not fingerprinted)")
    return out


def _unpaired_why(out: dict, why: list, other: str) -> None:
    """Set out["why"]: the reasons in `why`, and the names that did not pair (`other`: what another shape means)."""
    if out["only_a"] or out["only_b"] or out["other_shape"]:
        why.append(f"{out['only_a']} names only in a, {out['only_b']} only in b, {out['other_shape']} of another "
                   f"dtype or {other}")
    out["why"] = ("parameters not compared: " + "; ".join(why)) if why else None


def _read(t):
    """The names of one trace, or None where it holds none (recorded before names, or with params='none')."""
    from divtrace.trace.param_names import read_param_names

    if (getattr(t, "meta", None) or {}).get("params") == "none":
        return None
    return read_param_names(t)


def _why_missing(t) -> str:
    """Why trace `t` holds no names (its meta.json, read when it was opened, says whether params='none' did it)."""
    if (getattr(t, "meta", None) or {}).get("params") == "none":
        return "recorded with params='none' (--params none): record both runs naming them to compare them"
    return "recorded by a divtrace that did not name parameters; record both runs with this one to compare them"


def _sides(side, path_map, label):
    """[(rank, trace, names)] of one side (rank None: one process), or None where a trace holds no names."""
    run = getattr(side, "run", None)
    out = []
    for r, t in (sorted(run.traces.items()) if run is not None else [(None, side)]):
        names = _mapped(_read(t), path_map, label)
        if names is None:
            return None
        out.append((r, t, names))
    return out


def _layouts_of(*sides):
    """trace -> its RankLayouts: the run's, read when it was opened (trace/run.py), else read here."""
    from divtrace.trace.layouts import read_layouts

    cache: dict = {}
    for side in sides:
        run = getattr(side, "run", None)
        for r, t in (run.traces.items() if run is not None else ()):
            if r in getattr(run, "layouts", {}):
                cache[id(t)] = (t, run.layouts[r])

    def get(t):
        if id(t) not in cache:
            cache[id(t)] = (t, read_layouts(t))
        return cache[id(t)][1]
    return get


def _replicas(side, side_names, label: str, laid_only: bool) -> list[dict]:
    from divtrace.compare.param_global import gather, replicas

    held, kinds = gather(side_names, _layouts_of(side))
    out = []
    for name, hs in sorted(held.items()):
        for h in hs if not isinstance(hs, str) else ():
            if h.how == "blocks" or (h.how == "copies" and not laid_only):
                out += replicas(name, kinds[name], label, h)
    return out


def _compare_global(ta, tb, path_map, out: dict) -> dict:
    """Runs of other layouts: each name put together in global coordinates (compare/param_global.py)."""
    from divtrace.compare import param_global as pg
    from divtrace.trace.hashing import TENSOR_SCHEME

    sides = [_sides(ta, path_map, "a"), _sides(tb, path_map, "b")]
    if None in sides:
        bad = next(t for side in (ta, tb) for t in _traces(side) if _read(t) is None)
        names = [_read(t) for side in (ta, tb) for t in _traces(side)]
        out["not_compared"] = len({n for p in names if p is not None for n in p.values})
        out["why"] = f"parameters not compared: {NO_NAMES} ({bad.path}: {_why_missing(bad)})"
        return out
    layouts_of = _layouts_of(ta, tb)
    (ga, ka), (gb, kb) = (pg.gather(s, layouts_of) for s in sides)
    v2 = all(t.meta.get("hash_scheme") == TENSOR_SCHEME for s in sides for _, t, _ in s)
    reasons = []
    for name in sorted(set(ga) | set(gb)):
        if name not in gb or name not in ga:
            out["only_a" if name in ga else "only_b"] += 1
            out["not_compared"] += 1
            continue
        got = _global_name(name, ka[name], ga[name], gb[name], v2, out)
        if isinstance(got, str):
            out["not_compared"] += 1
            reasons.append(f"{name}: {got}")
    out["differ"].sort(key=lambda d: (d.get("rank") or 0, d["name"]))
    why = [f"{len(reasons)} not put together in global coordinates ({'; '.join(reasons[:3])}"
           f"{', and more' if len(reasons) > 3 else ''})"] if reasons else []
    _unpaired_why(out, why, "global shape (a fused projection against its parts, a weight no op read where unread "
                  "ones were not fingerprinted)")
    return out


def _global_name(name, kind, ha, hb, v2, out) -> str | None:
    """Compare one name's values in global coordinates into `out`; why it is not compared, or None."""
    from divtrace.compare import param_global as pg

    for h, side in ((ha, "a"), (hb, "b")):
        if isinstance(h, str):
            return f"{h} (side {side})"
    if len(ha) != len(hb):
        return "written in place a different number of times on the two sides"
    if any(x.dtype != y.dtype or x.shape != y.shape for x, y in zip(ha, hb)):
        out["other_shape"] += 1
        return "of another dtype or global shape"
    if any(x.how == y.how == "copies" for x, y in zip(ha, hb)):
        return "held with no layout on the ranks of both runs (not known to be whole)"
    found, diff = [], None
    for i, (x, y) in enumerate(zip(ha, hb)):
        found += pg.replicas(name, kind, "a", x) + pg.replicas(name, kind, "b", y)
        got = pg.compare(name, kind, x, y, v2)
        if isinstance(got, str):
            return got
        if got is not None and diff is None:
            diff = got
            if len(ha) > 1:
                diff["value"] = i
    out["compared"] += 1
    out["replicas"] += found
    if diff is None:
        out["equal"] += 1
    else:
        out["differ"].append(diff)
    return None


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
        if d.get("blocks"):
            from divtrace.compare.param_global import where

            note += "; " + _blocks_said(d, where)
        out.append({"module": module, "call": None, "kind": "parameter", "op": None, "op_b": None, "tensor": d["name"],
                    "name": d["name"], "rank": d.get("rank"), "tokens": None, "note": note})
    for x in (params or {}).get("replicas", []):
        out.append({"module": x["name"].rpartition(".")[0], "call": None, "kind": "parameter", "op": None,
                    "op_b": None, "tensor": x["name"], "name": x["name"],
                    "rank": x["differ"][0] if len(x["differ"]) == 1 else None, "tokens": None,
                    "note": _replica_said(x)})
    return out


def _blocks_said(d: dict, where) -> str:
    """`a's block of rank 1 (rows 32-63) differs`, for the blocks of a differing parameter."""
    said = [f"{b['side']}'s whole value" if b["rank"] is None else f"{b['side']}'s copy on rank {b['rank']}"
            if b["block"] == d["shape"] else f"{b['side']}'s block of rank {b['rank']} ({where(b, d['shape'])})"
            for b in d["blocks"][:4]]
    more = f" and {len(d['blocks']) - 4} more" if len(d["blocks"]) > 4 else ""
    return ", ".join(said) + more + (" differ" if len(d["blocks"]) > 1 else " differs")


def _replica_said(x: dict) -> str:
    ranks = ", ".join(map(str, x["differ"]))
    return (f"replicas differ in run {x['side']}: the copy on rank{'s' if len(x['differ']) > 1 else ''} {ranks} "
            f"differs from rank {x['reference']}'s (ranks {x['ranks']} hold the same place of it): a difference of "
            "that run on its own")


def param_line(params: dict | None) -> str | None:
    """The report's line on parameters (greppable: `parameters differ:` / `parameters not compared:`), or None
    where every name paired and none differs."""
    if not params:
        return None
    if params["differ"] or params.get("replicas"):
        names = []
        for d in params["differ"][:6]:
            at = f" on rank {d['rank']}" if d.get("rank") is not None else ""
            if d.get("rank") is None and len(d.get("ranks") or ()) > 1:
                at = f" on ranks {', '.join(map(str, d['ranks']))}"
            n = f" ({d['mismatched']} of {prod(d['shape'])} elements)" if d.get("mismatched") is not None else ""
            if d.get("blocks"):
                from divtrace.compare.param_global import where

                n += f" [{_blocks_said(d, where)}]"
            elif params.get("how") == "global" and d.get("mismatched") is None and any(
                    str(x).startswith("blocks") for x in (d.get("layout") or {}).values()):
                # (the blocks' sum differs from a whole weight's one fingerprint: no place of it is known)
                n += (" [which rank's block differs is not known: the whole weight has one fingerprint; record it "
                      "with params=\"blocks\" or in full mode]")
            names.append(f"{d['name']}{at}{n}")
        more = f", and {len(params['differ']) - 6} more" if len(params["differ"]) > 6 else ""
        how = " in global coordinates" if params.get("how") == "global" else ""
        line = (f"parameters differ: {len(params['differ'])} of {params['compared']} compared by name{how}: "
                + ", ".join(names) + more) if params["differ"] else ""
        reps = [f"{x['name']} in {x['side']} on rank{'s' if len(x['differ']) > 1 else ''} "
                f"{', '.join(map(str, x['differ']))} (against rank {x['reference']})"
                for x in params.get("replicas", [])[:4]]
        if reps:
            line += ("; " if line else "") + "parameter replicas differ: " + ", ".join(reps)
        return line
    if params["why"] and params["compared"] == 0 and NO_NAMES in params["why"]:
        return params["why"]
    return None


def name_of_value(t, vid: int) -> tuple[str, str] | None:
    """(kind, name) of value `vid` of `t` (a Trace or a run view: the name then says `on rank R`, the rank whose
    trace holds the value) where it is a parameter or buffer the trace names, else None (no names, a damaged names
    file: the comparison of parameters says so, not this)."""
    from divtrace.errors import DivtraceError
    from divtrace.trace.param_names import read_param_names

    if getattr(t, "tokens", None) is not None and getattr(t, "trace", None) is not None:
        t = t.trace  # (a token view: the trace's own vids)
    rank = None
    if getattr(t, "segments", None) is not None:  # a run view: the value's rank trace, its own vid there
        try:
            seg = t.segment_of_vid(vid)
        except KeyError:
            return None
        t, vid = seg.trace, vid - seg.vbase
        rank = getattr(seg, "rank", None)
    try:
        names = read_param_names(t)  # (read once per trace: compare_parameters has read it already)
    except DivtraceError:
        return None
    got = names.name_of(vid) if names is not None else None
    if got is None or rank is None:
        return got
    return got[0], f"{got[1]} on rank {rank}"  # (the rank whose copy or block it is: FSDP2's gathered weight)
