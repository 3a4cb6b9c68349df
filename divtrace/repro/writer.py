"""`write_repro`: choose the region, write DIR/repro.py + tensors + manifest, and check replay fidelity.

Fidelity is checked on the file as written: repro.py is executed here (as a module, not as __main__) and each
side, run on the recorded inputs under its recorded settings, must give that side's recorded output bit for
bit. A repro that cannot is still written, so it can be inspected, but the result says so and why.
"""
from __future__ import annotations

import importlib
import json
import math
import sys
from collections import Counter
from pathlib import Path

import torch

from divtrace.align.paths import PathMap
from divtrace.record.engines import custom_op_module
from divtrace.errors import DivtraceError
from divtrace.oserrors import cannot_write, is_write_error
from divtrace.repro import codegen, seqlen
from divtrace.repro.interpreter import interpreter
from divtrace.repro.inputs import Inputs, save_tensors, token_ties
from divtrace.repro.narrow import engine_only_ops, narrow_to_parting_op
from divtrace.repro.region import (RANDOM_OPS, Side, Target, build_side, check_values, common_suffix_start,
                                   find_target, flatten_rows, op_short, parting_record)
from divtrace.record.settings import numerics_settings
from divtrace.trace.reader import Trace
from divtrace.repro.script import (FILES, SETTINGS_KNOWN, ReproResult, _check, _load,  # noqa: F401
                                   _prepare_out, _settings)

def _batch(specs: dict) -> int | None:
    lead = Counter(s["shape"][0] for s in specs.values()
                   if s["role"] == "activation" and len(s["shape"]) >= 2 and s["shape"][0] > 0)
    if not lead:
        lead = Counter(s["shape"][0] for s in specs.values() if s["role"] != "parameter" and s["shape"]
                       and s["shape"][0] > 0)
    return lead.most_common(1)[0][0] if lead else None


def _batch_runs(ns: dict, specs: dict, batch: int, out_shapes: dict) -> str | None:
    """None when both sides run at another batch size and their outputs scale with it; else why not."""
    new = batch + 1
    shapes = {k: [s["shape"][0] // batch * new] + list(s["shape"][1:]) for k, s in specs.items()
              if s["batch_dim"] == 0}
    try:
        x = ns["random_inputs"](0, shapes)
        for s, fn, st in (("a", ns["side_a"], ns["SETTINGS_A"]), ("b", ns["side_b"], ns["SETTINGS_B"])):
            got = list(ns["run_side"](fn, st, x).shape)
            want = list(out_shapes[s])
            if want and want[0] % batch == 0:
                want[0] = want[0] // batch * new
            if got != want:
                return f"side {s} at batch {new} gives shape {got}, expected {want}"
    except Exception as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None


def _custom_imports(ops: list[str], metas: list[dict], imports: list[str]) -> tuple[list, list[str]]:
    """(op, module, directory) for each custom op, and the ops whose module could not be found."""
    from torch._library import custom_ops

    found, missing = [], []
    for op in ops:
        ns, name = op.split(".")[:2]
        mod = None
        for meta in metas:
            known = meta.get("custom_ops")
            if isinstance(known, dict) and isinstance(known.get(op), str):
                mod = known[op]
            mod = mod or custom_op_module(meta, op)  # an engine's kernels (vLLM's _C ops)
        opdef = getattr(custom_ops, "OPDEFS", {}).get(f"{ns}::{name}")
        fn = getattr(opdef, "_init_fn", None)
        if mod is None and fn is not None and getattr(fn, "__module__", "__main__") != "__main__":
            mod = fn.__module__
        if mod is None and len(imports) == 1:
            mod = imports[0]
        if mod is None or not all(p.isidentifier() for p in mod.split(".")):
            missing.append(op)
            continue
        f = getattr(sys.modules.get(mod), "__file__", None)
        where = None
        if f:  # the directory to put on sys.path: the top package's parent
            p = Path(f).resolve()
            depth = mod.count(".") + (p.name == "__init__.py")
            where = str(p.parents[depth])
        found.append((op, mod, where))
    return found, missing


def _explain(letter: str, side: Side, fid: dict, unreplayable: list[str], missing_custom: list[str]) -> list[str]:
    t = side.trace
    why = [f"side {letter} ({t.path}) does not reproduce its recorded output: {fid.get('error')}"]
    known = engine_only_ops(t)
    held = sorted({t.records[i].op for i in side.ops} & set(known))
    why += [f"{op} replays only inside the engine that recorded it ({known[op]}); no script outside the engine "
            "can run it" for op in held]
    missing_custom = [op for op in missing_custom if op not in known]
    rnd = sorted({op_short(t.records[i].op) for i in side.ops} & RANDOM_OPS)
    if rnd:
        why.append(f"its region holds random ops ({', '.join(rnd)}): their RNG state is not recorded")
    empty = sorted({op_short(t.records[i].op) for i in side.ops} & {"empty", "empty_like", "new_empty",
                                                                     "empty_strided", "empty_permuted"})
    if empty:
        why.append(f"its region reads tensors made by {', '.join(empty)} that something outside PyTorch's dispatcher "
                   "filled (a raw Triton kernel or C extension?): divtrace never saw that write; register the kernel "
                   "with torch.library.custom_op / triton_op so it is recorded as an op")
    why += [f"an op could not be written as code: {u}" for u in unreplayable]
    if missing_custom:
        why.append(f"custom ops {', '.join(missing_custom)}: the module that defines them is unknown; pass "
                   "--import MODULE")
    env = {"device": t.meta.get("device"), "torch_version": t.meta.get("torch_version")}
    if env["torch_version"] and env["torch_version"] != torch.__version__:
        why.append(f"recorded with torch {env['torch_version']}, replayed with {torch.__version__}")
    dev = str(env["device"] or "cpu")
    if dev.startswith("cuda") and not torch.cuda.is_available():
        why.append(f"recorded on {dev}; this machine has no CUDA device")
    decisive = len(why) > 1
    here, rec = numerics_settings(), t.meta.get("settings") or {}
    unapplied = [k for k in rec if k not in SETTINGS_KNOWN and rec.get(k) != here.get(k)]
    if unapplied:
        why.append("settings the repro cannot re-apply differ from the recording's: "
                   + ", ".join(f"{k} (recorded {rec[k]!r}, now {here.get(k)!r})" for k in unapplied))
    strided = [v for v in side.leaves if t.values[v].stride != _dense_stride(t.values[v].shape)]
    if strided:
        why.append(f"{len(strided)} input(s) were strided views; their strides are restored, not their storage "
                   "offset or alignment")
    if not decisive:
        why.append("the recorded kernel depended on state divtrace does not capture (a Python-side state or cache, "
                   "thread count inside a library, CPU/GPU model, autotuning, memory alignment, a different code path "
                   "for these shapes)")
    return why


def _dense_stride(shape) -> list[int]:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return out[::-1]


def write_repro(a, b, out, *, at: int | None = None, path_map: PathMap | None = None, imports=(),
                overwrite: bool = False) -> ReproResult:
    """Write a standalone repro of the first divergence between traces `a` and `b` (or of record `at` of `a`)."""
    from divtrace.align.shards import open_side  # a run directory: docs/sharded.md

    ta, tb = open_side(a), open_side(b)
    if getattr(ta, "run", None) is not None or getattr(tb, "run", None) is not None:
        from divtrace.repro.shards import write_run_repro

        got = write_run_repro(ta, tb, out, at=at, path_map=path_map, overwrite=overwrite)
        if not isinstance(got, tuple):
            return got
        ta, tb = got  # a data-parallel run: the trace of the rank that holds the diverging token
    from divtrace.repro.compiled import is_compiled_pair, write_compiled_repro  # docs/compiled.md

    if at is None and is_compiled_pair(ta, tb):
        return write_compiled_repro(ta, tb, out, overwrite=overwrite, path_map=path_map)
    imports = list(imports)
    for m in imports:
        try:
            importlib.import_module(m)
        except Exception as e:
            raise DivtraceError(f"--import {m}: cannot import it: {type(e).__name__}: {e}") from None
    target = find_target(ta, tb, at, path_map)
    sides = _sides(ta, tb, target)
    if at is None and target.row_index is None:  # (token rows: the row is the target; the suffix is the batch's)
        pair = common_suffix_start(sides["a"], sides["b"])
        if pair is not None:
            full = (len(sides["a"].ops), len(sides["b"].ops))
            rec = ta.records[ta.values[pair[0]].producer]
            target.va, target.vb = pair
            target.tensor = f"output of {rec.op} (record {rec.index}), the first tensor that differs"
            sides = _sides(ta, tb, target)
            target.warnings.append(
                f"the diverging call's output differs only because an earlier tensor does: reproduced at that tensor "
                f"({target.tensor}); the common computation after it ({full[0] - len(sides['a'].ops)} ops) is left out")
    if target.row_index is not None:  # an engine side that only replays up to its parting op (repro/narrow.py)
        cut = narrow_to_parting_op(target, sides)
        if cut is not None:
            target, sides = cut
    flatten_rows(sides)
    check_values(target, sides["a"], sides["b"])
    out = Path(out)
    created = not out.exists()
    try:
        _prepare_out(out, overwrite)
        return _write(out, ta, tb, target, sides, imports)
    except BaseException as e:
        if not is_write_error(e):
            raise
        # A repro cut short by a failed write must not look whole: remove what was written (and the directory,
        # when this run made it), and say so.
        removed = _remove_partial(out, created)
        where = getattr(e, "filename", None) or out
        raise cannot_write(where, e, "cannot write the repro", removed) from None


def _remove_partial(out: Path, created: bool) -> str:
    """Remove a repro a failed write left half-written; what was done, in words."""
    if not out.is_dir():
        return "nothing was written"
    left = []
    for name in (*FILES, "__pycache__"):
        p = out / name
        try:
            if p.is_dir():
                import shutil

                shutil.rmtree(p)
            elif p.exists() or p.is_symlink():
                p.unlink()
        except OSError:
            left.append(name)
    if left:
        return f"could not remove the partial files {', '.join(left)} in {out}: delete them before using it"
    if created:
        try:
            out.rmdir()
            return f"the partial directory {out} was removed"
        except OSError:
            pass
    return f"the partial files in {out} were removed"


def _sides(ta: Trace, tb: Trace, target: Target) -> dict[str, Side]:
    if target.views is None:
        return {"a": build_side(ta, tb, target.va, target.call_a, target.vb),
                "b": build_side(tb, ta, target.vb, target.call_b, target.va)}
    ka, kb = target.views["a"].vkey.__getitem__, target.views["b"].vkey.__getitem__
    sides = {"a": build_side(ta, tb, target.va, target.call_a, target.vb, ka, kb),
             "b": build_side(tb, ta, target.vb, target.call_b, target.va, kb, ka)}
    for s in ("a", "b"):
        sides[s].row_index = target.row_index[s]
    return sides


def _parting(side: Side) -> str | None:
    i = parting_record(side)
    if i is not None:
        return side.trace.records[i].op
    return side.trace.records[side.ops[0]].op if side.ops else None


class _Script:
    """Everything repro.py is generated from; `build` renders one version of it (batch-symbolic or not)."""

    def __init__(self, ta: Trace, tb: Trace, target: Target, sides: dict[str, Side], inp: Inputs, specs: dict,
                 imports: list[str]):
        self.traces, self.sides, self.inp, self.specs, self.imports = {"a": ta, "b": tb}, sides, inp, specs, imports
        self.device = str(ta.meta.get("device") or "cpu")
        self.names = list(specs)
        self.settings = {"a": _settings(ta), "b": _settings(tb)}
        self.origin = {"module": target.call_a.module, "call": target.call_a.call, "module_b": target.call_b.module,
                       "op_a": _parting(sides["a"]), "op_b": _parting(sides["b"]), "record": target.record,
                       "record_b": target.record_b, "tensor": target.tensor, "cause": target.cause,
                       "trace_a": str(ta.path), "trace_b": str(tb.path), "label_a": ta.label, "label_b": tb.label}
        self.counts = {s: [op_short(side.trace.records[i].op) for i in side.ops] for s, side in sides.items()}
        self.batch = _batch(specs)
        self.out_shapes = {s: list(self.traces[s].values[v].shape) for s, v in (("a", target.va), ("b", target.vb))}
        # a side whose recorded layout of a shared input differs from the stored one re-lays it out itself
        self.relayout = {s: {v: (side.trace.values[v].shape, side.trace.values[v].stride) for v in side.leaves
                             if side.trace.values[v].stride != specs[inp.names[s][v]]["stride"]}
                         for s, side in sides.items()}

    def mark_batch(self, marking: str) -> None:
        """batch_dim 0 for inputs led by the batch ("exact") or by a multiple of it ("multiple": tokens)."""
        b = self.batch
        for sp in self.specs.values():
            lead = sp["shape"][0] if sp["shape"] else 0
            ok = b is not None and sp["role"] != "parameter" and lead > 0 and (
                lead == b or (marking == "multiple" and lead % b == 0))
            sp["batch_dim"] = 0 if ok else None

    def build(self, symbolic: bool, creation: bool = False, seq: int | None = None):
        codes, customs = {}, []
        s_input = seqlen.seq_input(self.specs) if seq is not None else None
        for s, side in self.sides.items():
            names = self.inp.names[s]
            sites = codegen.symbolic_sites(side, self.batch, creation) if symbolic and self.batch else set()
            batch_input = next((names[v] for v in side.leaves if self.specs[names[v]]["batch_dim"] == 0
                                and self.specs[names[v]]["shape"][0] == self.batch), None)
            codes[s] = codegen.gen_side(s, side, names, self.names, self.relayout[s], self.device, self.batch, sites,
                                        batch_input, seq=seq, seq_input=s_input)
            customs += [c for c in codes[s].custom_ops if c not in customs]
        found, missing = _custom_imports(customs, [t.meta for t in self.traces.values()], self.imports)
        src = codegen.render(device=self.device, origin=self.origin, input_names=self.names, specs=self.specs,
                             batch=self.batch, settings=self.settings, side_codes=codes, custom_imports=found,
                             counts=self.counts, token_ties=getattr(self, "ties", None),
                             keep_recorded=getattr(self, "keep", None))
        return src, codes, found, missing


def _write(out: Path, ta: Trace, tb: Trace, target: Target, sides: dict[str, Side], imports: list[str]) -> ReproResult:
    inp = Inputs(sides)
    specs, outputs = save_tensors(out, {"a": ta, "b": tb}, target, inp, sides["a"].flat_row)
    sc = _Script(ta, tb, target, sides, inp, specs, imports)
    sc.ties = token_ties(target, sides, inp)
    if target.keep_untied:  # (repro/narrow.py) untied activations: the sides' different forms of one quantity
        tied = {n for t in sc.ties for n in (t[0], t[2])}
        sc.keep = [k for k in sc.names if specs[k]["role"] == "activation" and k not in tied]
    path = out / "repro.py"
    notes: list[str] = []
    sc.mark_batch("exact")
    src, codes, found, missing = sc.build(symbolic=False)
    fid = _check(path, src)[1]
    # The batch-symbolic version is kept only if it reproduces too and both sides run at another batch size.
    symbolic, chosen_creation = False, False
    if all(r["ok"] for r in fid.values()) and sc.batch is not None and target.row_index is None:
        why = "no input has the batch as its leading dim"
        for marking, creation in (("multiple", True), ("multiple", False), ("exact", True), ("exact", False)):
            sc.mark_batch(marking)
            if not any(sp["batch_dim"] == 0 for sp in specs.values()):
                continue
            cand = sc.build(symbolic=True, creation=creation)
            cns, cfid = _check(path, cand[0])
            why = (_batch_runs(cns, specs, sc.batch, sc.out_shapes) if all(r["ok"] for r in cfid.values())
                   else "the batch-symbolic version does not reproduce")
            if why is None:
                (src, codes, found, missing), fid, symbolic, chosen_creation = cand, cfid, True, creation
                break
        if not symbolic:
            sc.mark_batch("exact")
            src, codes, found, missing = sc.build(symbolic=False)
            notes.append(f"the region's code keeps the recorded shapes (batch {sc.batch}): {why}")
    # The sequence length too (divtrace/repro/seqlen.py): kept only if it reproduces and runs at another length.
    # (a token-aligned repro runs each side at its own batch and length: neither is one symbol for both)
    seq = seqlen.seq_len(specs, sc.batch) if all(r["ok"] for r in fid.values()) and target.row_index is None else None
    seq_symbolic = False
    if seq is not None:
        seqlen.mark(specs, seq)
        cand = sc.build(symbolic=symbolic, creation=chosen_creation, seq=seq)
        cns, cfid = _check(path, cand[0])
        why = (seqlen.runs(cns, specs, seq, sc.out_shapes) if all(r["ok"] for r in cfid.values())
               else "the sequence-symbolic version does not reproduce")
        if why is None:
            (src, codes, found, missing), fid, seq_symbolic = cand, cfid, True
        else:
            seqlen.mark(specs, None)
            notes.append(f"the region's code keeps the recorded sequence length ({seq}): {why}")
    else:
        seqlen.mark(specs, None)
    path.write_text(src)
    explanation = []
    for s in ("a", "b"):
        if not fid[s]["ok"]:
            explanation += _explain(s, sides[s], fid[s], codes[s].unreplayable, missing)
    engine_only = engine_only_ops(ta, tb)
    manifest = {
        "format": "divtrace-repro", "version": 1,
        "inputs": [{"name": k, **specs[k]} for k in sc.names],
        "output": {s: {"dtype": str(outputs[s].dtype), "shape": list(outputs[s].shape)} for s in ("a", "b")},
        "origin": sc.origin,
        "ops": {s: {"before": sides[s].before, "after": len(sides[s].ops), "records": sides[s].ops}
                for s in ("a", "b")},
        "settings": sc.settings,
        "custom_ops": [{"op": op, "module": mod} for op, mod, _ in found] + [
            {"op": op, "module": None, **({"engine_only": engine_only[op]} if op in engine_only else {})}
            for op in missing],
        "fidelity": {s: fid[s]["ok"] for s in ("a", "b")},
        "fidelity_errors": {s: fid[s]["error"] for s in ("a", "b") if not fid[s]["ok"]},
        "batch_symbolic": symbolic,
        "batch": sc.batch,
        "seq_symbolic": seq_symbolic,
        "seq": seq,
        "token_rows": target.row_index,
        "token_ties": getattr(sc, "ties", []),
        "keep_recorded": getattr(sc, "keep", []),
        "warnings": target.warnings,
        "python": interpreter(),  # the interpreter that replayed both sides, so one that can run the script
    }
    (out / "manifest.json").write_text(json.dumps(_finite(manifest), indent=2))
    if found:
        notes.append("custom ops: " + ", ".join(f"{op} (the script imports {mod})" for op, mod, _ in found))
    return ReproResult(out, manifest, fid, explanation, list(target.warnings), notes)


def _finite(x):
    if isinstance(x, float) and not math.isfinite(x):
        return repr(x)
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite(v) for v in x]
    return x
