"""A repro of a divergence where a side is a sharded run (docs/sharded.md): each side's parting region runs in one
process, with each rank's shards (simulated ranks, no process group), and returns the global value.

The region's ops run for every rank of the group in lockstep, record by record (the ranks ran the same program);
each rank's inputs are its own recorded tensors. A collective in the region is done by the script on the ranks'
values: an all-reduce sums them in rank order, an all-gather concatenates them, a reduce-scatter sums and gives
each rank its block; the fidelity check then says whether that reproduces what the run's collective gave, bit
for bit. The side returns the global value: its blocks put where the layout says, or the replicas' value. A side
that is a one-process trace runs as one rank.

A data-parallel run (its ranks hold different inputs) needs none of this: its repro is the ordinary one of the
rank holding the token (`write_sharded_repro` hands it to divtrace.repro.writer).

In: two traces or run views (divtrace.align.shards) and their first divergence. Out: a repro directory in the
usual layout (repro.py, inputs.safetensors, expected.safetensors, manifest.json), which `divtrace verify` reads.
"""
from __future__ import annotations

import json
from pathlib import Path

from divtrace.errors import DivtraceError
from divtrace.repro.codegen import Ctx, SideCode, _out_paths, _written_arg, op_call, render
from divtrace.repro.region import op_short

_IDENTITY = {"wait_tensor", "_wrap_tensor_autograd"}


class RankedSide:
    """One side's region: its ranks (rank, trace) and record indices, leaves per rank, the output per rank."""

    def __init__(self, letter: str, t, region: list[int], row_index: list | None = None):
        self.letter, self.view, self.ops = letter, t, sorted(region)
        self.row_index = row_index  # token alignment: the token's row of the (global) output; None: all of it
        self.flat_row = False  # rows of another shape on the other side: compared flat
        run = getattr(t, "run", None)
        if run is not None:
            g = t.groups[0]
            self.ranks = [(r, run.traces[r]) for r in g.ranks]
            self.layouts = run.layouts
        else:
            self.ranks, self.layouts = [(None, t)], {}
        rep = self.ranks[0][1]
        consumed = {v for i in self.ops for v in rep.rin[i]}
        last = max(self.ops)
        sinks = [v for v in rep.rout[last] if v not in consumed] or list(rep.rout[last])
        self.output = sinks[0]  # the representative's vid of the value the region ends with
        self.leaves = {}
        for r, tr in self.ranks:
            made, seen = set(), []
            for i in self.ops:
                for v in tr.rin[i]:
                    if v not in made and v not in seen:
                        seen.append(v)
                made.update(tr.rout[i])
            self.leaves[r] = seen

    def collective(self, r, i):
        lay = self.layouts.get(r)
        return lay.collectives.get(i) if lay is not None else None


def _name(letter: str, r, vid: int) -> str:
    return f"{letter}_v{vid}" if r is None else f"{letter}_r{r}_v{vid}"


def _emit_collective(side: RankedSide, i: int, refs: dict, lines: list, fresh) -> None:
    """The script's own doing of collective record `i` over the ranks' values."""
    rep_rank, rep = side.ranks[0]
    c = side.collective(rep_rank, i)
    kind = c.kind if c is not None else "?"
    op = op_short(rep.rop[i])
    if kind == "all_reduce" and (c.op in (None, "sum")):
        ins = [refs[r][tr.rin[i][0]] for r, tr in side.ranks]
        var = fresh()
        lines.append(f"    {var} = {' + '.join(ins)}  # record {i}: {op}, simulated: the ranks' values summed in "
                     "rank order")
        for r, tr in side.ranks:
            for v in tr.rout[i]:
                refs[r][v] = var
        return
    if kind == "all_gather":
        ins = [refs[r][tr.rin[i][0]] for r, tr in side.ranks]
        var = fresh()
        lines.append(f"    {var} = torch.cat([{', '.join(ins)}])  # record {i}: {op}, simulated: the ranks' values "
                     "one after the other")
        for r, tr in side.ranks:
            outs = tr.rout[i]
            if len(outs) == 1:
                refs[r][outs[0]] = var
            else:  # a list of each rank's piece
                for k, v in enumerate(outs):
                    refs[r][v] = ins[k % len(ins)]
        return
    raise DivtraceError(f"record {i} ({rep.rop[i]}): a {kind} in the parting region of a sharded run; its repro "
                        "cannot do it on simulated ranks yet")


def _emit_op(side: RankedSide, r, tr, i: int, refs: dict, lines: list, fresh, code: SideCode) -> None:
    rec = tr.records[i]
    ref = refs[r]
    who = "" if r is None else f" (rank {r})"
    if op_short(rec.op) in _IDENTITY:
        for v in rec.outputs:
            ref[v] = ref[rec.inputs[0]]
        return
    call = op_call(i, rec, Ctx(ref, "cpu"), code, who=who)
    comment = f"  # record {i}{who}"
    if isinstance(rec.out, dict) and set(rec.out) == {"$writes"}:
        lines.append(f"    {call}{comment}")
        for where, vid in zip(rec.out["$writes"], rec.outputs):
            arg = _written_arg(rec, where)
            ref[vid] = ref.get(arg, "None")
        return
    outs = list(_out_paths(rec.out)) if rec.out is not None else [((k,), v) for k, v in enumerate(rec.outputs)]
    if len(outs) == 1 and outs[0][0] == ():
        var = fresh()
        ref[outs[0][1]] = var
        lines.append(f"    {var} = {call}{comment}")
        return
    lines.append(f"    _r = {call}{comment}")
    for path, vid in outs:
        var = fresh()
        ref[vid] = var
        lines.append(f"    {var} = _r{''.join(f'[{k}]' for k in path)}")


def gen_ranked_side(side: RankedSide, params: list[str], names: dict) -> SideCode:
    """`def side_<letter>(<params>):` the region on every rank, in lockstep, returning the global value."""
    letter = side.letter
    lines = [f"def side_{letter}({', '.join(params)}):"]
    n_ranks = len(side.ranks)
    lines.append(f"    # {len(side.ops)} recorded ops of {letter} ({ascii(str(side.view.label))})"
                 + (f" on each of its {n_ranks} ranks, simulated in this process" if side.ranks[0][0] is not None
                    else ""))
    code = SideCode("", [], [], [])
    refs = {r: {v: names[(r, v)] for v in side.leaves[r]} for r, _ in side.ranks}
    counter = [0]

    def fresh():
        counter[0] += 1
        return f"t{counter[0]}"
    rep = side.ranks[0][1]
    for i in side.ops:
        code.ops.append(op_short(rep.rop[i]))
        if side.collective(side.ranks[0][0], i) is not None:
            _emit_collective(side, i, refs, lines, fresh)
            continue
        for r, tr in side.ranks:
            _emit_op(side, r, tr, i, refs, lines, fresh, code)
    lines += _assemble(side, refs)
    code.source = "\n".join(lines) + "\n"
    return code


def _assemble(side: RankedSide, refs: dict) -> list[str]:
    """The return statement: the global value from the ranks' outputs (token alignment: the token's row of it)."""
    rep_rank, _ = side.ranks[0]
    if rep_rank is None:
        return [f"    return {refs[None][side.output]}{_row(side)}"]
    vp = side.view.groups[0].values[side.output]
    if vp.kind != "blocks":
        return [f"    return {refs[rep_rank][side.output]}{_row(side)}  # the same on every rank"]
    out = [f"    out = torch.empty({list(vp.gshape)}, dtype={refs[rep_rank][side.output]}.dtype)  # the global value"]
    for r, q, off in vp.blocks:
        local = refs[r][q]
        if vp.routed:  # routed rows: each at its global row (token * top_k + slot)
            out.append(f"    out[{list(off)}] = {local}  # rank {r}'s routed rows")
            continue
        idx = ", ".join(f"{o}:{o} + {local}.shape[{d}]" for d, o in enumerate(off))
        out.append(f"    out[{idx}] = {local}  # rank {r}'s block")
    out.append(f"    return out{_row(side)}")
    return out


def _row(side: RankedSide) -> str:
    """The indexing that takes the token's row of the side's output (token alignment: each side ran its own batch,
    so only the token's rows compare), "" for the whole value."""
    if side.row_index is None:
        return ""
    idx = ", ".join(":" if i == ":" else str(i) for i in side.row_index)
    return f"[{idx}]" + (".reshape(-1)" if side.flat_row else "") + "  # the token's row"


def _row_of(side: RankedSide, x):
    """The recorded output as the side returns it."""
    if side.row_index is None:
        return x
    from divtrace.repro.codegen import select_row

    x = select_row(x, side.row_index)
    return x.reshape(-1) if side.flat_row else x


def write_sharded_repro(ta, tb, d, out, *, overwrite: bool = False, rows: dict | None = None):
    """Write a repro of divergence `d` (from bisect) between `ta` and `tb`, either of them a run view. `rows`
    (token alignment): {side: the token's row index in its output}; each side then returns that row."""
    from divtrace.repro.inputs import _range
    from divtrace.repro.interpreter import interpreter
    from divtrace.repro.script import ReproResult, _check, _prepare_out, _settings

    if not d.region_a or not d.region_b:
        raise DivtraceError(f"{ta.path} vs {tb.path}: the divergence in {d.module or '<root>'} has no op region on "
                            "both sides (recorded with ops=False, or the value came from outside): nothing to run")
    rows = rows or {}
    sides = {s: RankedSide(s, t, [i for i, _ in region], rows.get(s))
             for s, t, region in (("a", ta, d.region_a), ("b", tb, d.region_b))}
    if rows:
        outs = {s: _row_of(sides[s], _global_output(sides[s])) for s in sides}
        if outs["a"].shape != outs["b"].shape:  # (HF's [H, D] head rows against [H*D]: compared flat, as bisect does)
            sides["a"].flat_row = sides["b"].flat_row = True
    names, specs, tensors, by_key, order = {}, {}, {}, {}, []
    for s in ("a", "b"):
        for r, tr in sides[s].ranks:
            for v in sides[s].leaves[r]:
                key = tr.vkey[v]
                if key not in by_key:  # one input per distinct recorded value: replicas and shared values are one
                    name = _name(s, r, v)
                    by_key[key] = name
                    order.append(name)
                    x = tr.tensor(v)
                    val = tr.values[v]
                    lo, hi = _range(x)
                    tensors[name] = x.contiguous()
                    role = "parameter" if v not in tr.vprod and not _root_input(tr, v) else "activation"
                    specs[name] = {"dtype": val.dtype, "shape": list(val.shape), "stride": list(val.stride),
                                   "device": val.device, "role": role, "min": lo, "max": hi, "batch_dim": None}
                names[(s, r, v)] = by_key[key]
    # Random trials vary only inputs both sides share bit for bit (a rank's block has no counterpart to vary with)
    shared = {names[("a", r, v)] for r, _ in sides["a"].ranks for v in sides["a"].leaves[r]} & \
        {names[("b", r, v)] for r, _ in sides["b"].ranks for v in sides["b"].leaves[r]}
    ties = _block_ties(sides, names)
    tied = {t[0] for t in ties}
    keep = [k for k in order if specs[k]["role"] == "activation" and k not in shared and k not in tied
            and k not in {t[1] for t in ties}]
    codes = {s: gen_ranked_side(sides[s], order, {(r, v): names[(s, r, v)] for r, _ in sides[s].ranks
                                                  for v in sides[s].leaves[r]}) for s in ("a", "b")}
    outputs = {s: _row_of(sides[s], _global_output(sides[s])) for s in ("a", "b")}
    origin = {"module": d.module, "call": d.call, "module_b": d.module_b, "op_a": d.op, "op_b": d.op_b,
              "record": d.index, "record_b": d.index_b, "tensor": d.tensor, "cause": d.cause,
              "trace_a": str(ta.path), "trace_b": str(tb.path), "label_a": ta.label, "label_b": tb.label,
              "shards": d.shards}
    settings = {"a": _settings(ta), "b": _settings(tb)}
    src = render(device="cpu", origin=origin, input_names=order, specs=specs, batch=None, settings=settings,
                 side_codes=codes, custom_imports=[], counts={s: codes[s].ops for s in codes}, keep_recorded=keep,
                 block_ties=ties)
    out = Path(out)
    _prepare_out(out, overwrite)
    from safetensors.torch import save_file

    save_file(tensors, str(out / "inputs.safetensors"))
    save_file({s: x.contiguous() for s, x in outputs.items()}, str(out / "expected.safetensors"))
    path = out / "repro.py"
    fid = _check(path, src)[1]
    path.write_text(src)
    manifest = {
        "format": "divtrace-repro", "version": 1, "inputs": [{"name": k, **specs[k]} for k in order],
        "output": {s: {"dtype": str(outputs[s].dtype), "shape": list(outputs[s].shape)} for s in ("a", "b")},
        "origin": origin,
        "ops": {s: {"before": len(sides[s].ops), "after": len(sides[s].ops), "records": sides[s].ops}
                for s in ("a", "b")},
        "ranks": {s: [r for r, _ in sides[s].ranks if r is not None] for s in ("a", "b")},
        "settings": settings, "custom_ops": [], "fidelity": {s: fid[s]["ok"] for s in ("a", "b")},
        "fidelity_errors": {s: fid[s]["error"] for s in ("a", "b") if not fid[s]["ok"]},
        "batch_symbolic": False, "batch": None, "seq_symbolic": False, "seq": None, "token_rows": rows or None,
        "token_ties": [], "keep_recorded": keep, "warnings": [], "python": interpreter(),
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2, default=str))
    notes = [f"side {s} runs its {len(sides[s].ranks)} ranks in this process (simulated: no process group)"
             for s in ("a", "b") if sides[s].ranks[0][0] is not None]
    explanation = [f"side {s} does not reproduce its recorded global output: {fid[s]['error']}"
                   for s in ("a", "b") if not fid[s]["ok"]]
    return ReproResult(out, manifest, fid, explanation, [], notes)


def _block_ties(sides: dict, names: dict) -> list:
    """[rank input, the other side's global input, box] where a sharded side's leaf is a block of a value the other
    side takes whole: random trials then draw the global value once and give each rank its block."""
    ties = []
    for s, o in (("a", "b"), ("b", "a")):
        side, other = sides[s], sides[o]
        if side.ranks[0][0] is None:
            continue
        rep_rank, rep = side.ranks[0]
        plans = side.view.groups[0].values
        whole = {tr.vkey[v]: names[(o, r, v)] for r, tr in other.ranks for v in other.leaves[r]
                 if type(tr.vkey[v]) is tuple}
        for v in side.leaves[rep_rank]:
            vp = plans.get(v)
            if vp is None or vp.kind != "blocks" or vp.routed or vp.key not in whole:
                continue
            for r, q, off in vp.blocks:
                name = names.get((s, r, q))
                if name is None:
                    continue
                shape = side.view.run.traces[r].vkey[q][1]
                ties.append([name, whole[vp.key], [[a, a + n] for a, n in zip(off, shape)]])
    return ties


def _root_input(t, vid: int) -> bool:
    return any(v == vid for c in t.calls.values() if c.parent is None for _, v in c.inputs)


def _global_output(side: RankedSide):
    """The recorded global value the side's region ends with (a run's blocks put together)."""
    t = side.view
    if side.ranks[0][0] is None:
        return t.tensor(side.output)
    seg = t.segments[0]
    return t.tensor(side.output + seg.vbase)


def write_run_repro(ta, tb, out, *, at=None, path_map=None, overwrite: bool = False):
    """`divtrace repro` where a side is a run directory: a tensor-parallel run's divergence is reproduced on simulated
    ranks (`write_sharded_repro`, returns its ReproResult); a data-parallel run's from the rank that holds the token:
    then the pair of traces to reproduce instead is returned (an ordinary repro of that rank's trace)."""
    from divtrace.compare.bisect import bisect
    from divtrace.compare.verdict import Inconclusive

    if at is not None:
        raise DivtraceError("--at with a run directory is not supported yet: reproduce the first divergence, or pass "
                            "one rank's trace (RUN/rank-K)")
    r = bisect(ta, tb, path_map=path_map, n_next=0)
    if r.first is None:
        if r.verdict == "inconclusive":
            raise Inconclusive(f"{ta.path} and {tb.path}: no divergence found to reproduce, and the comparison is "
                               f"inconclusive: {r.reason}")
        raise DivtraceError(f"{ta.path} and {tb.path}: no divergence ({r.verdict}); there is nothing to reproduce")
    d = r.first
    multi = [getattr(t, "run", None) is not None and len(t.groups) > 1 for t in (ta, tb)]
    if any(multi):
        pick = []
        for t, is_multi, index in ((ta, multi[0], d.index), (tb, multi[1], d.index_b)):
            if not is_multi:
                pick.append(t)
                continue
            if index is None:
                raise DivtraceError(f"{t.path}: cannot tell which rank holds the diverging token; pass that rank's "
                                    "trace (RUN/rank-K) to divtrace repro")
            pick.append(t.run.traces[t.segment_of_index(index).rank])
        return tuple(pick)
    rows = None
    if getattr(r, "alignment", "calls") == "tokens":  # each side at its own batch: the token's row compared
        from divtrace.repro.region import _token_target

        rows = _token_target(ta, tb, r, path_map).row_index
    return write_sharded_repro(ta, tb, d, out, overwrite=overwrite, rows=rows)
