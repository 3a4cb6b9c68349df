"""Same function, not just the same bits: each side and the patch against an fp64 reference of the computation.

The reference is side a's own code run with every float tensor upcast to float64 and every floating dtype argument
(`.to(bf16)`, `.float()`, `dtype=` of factories and reductions) and result forced to float64, by a
TorchDispatchMode. So it is the region's math with the roundings taken out, not a separate implementation. (Python
code that branches on `x.dtype` sees float64 and may take another branch; a side that cannot run in float64 falls
back to side b's code, then to no reference.)

The gate is the torchtitan kernel-numerics-verifier one: err_patch <= 2 * max(err_a, err_b) + floor, with err the
max abs error over positions finite in both, and floor = FLOOR_EPS * eps(output dtype) * max|ref| (about two to
four ULPs of the output's largest value: what rounding the result alone can cost). NaN/Inf positions (and which
of NaN, +Inf, -Inf) must match the reference's, or else those of the other side.
"""
from __future__ import annotations

import functools

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from divtrace.verify.checks import FAILED, INFO, PASSED, SKIPPED, Check, Side, _err, flatten

F64, C128 = torch.float64, torch.complex128
FLOOR_EPS = 2.0
_NO_UPCAST = {torch.ops.aten.view.dtype}  # a bit reinterpretation, not a rounding


def _up(x):
    if isinstance(x, torch.Tensor):
        if x.is_complex() and x.dtype != C128:
            return x.to(C128)
        if x.is_floating_point() and x.dtype != F64:
            return x.to(F64)
    elif isinstance(x, torch.dtype):
        if x.is_complex:
            return C128
        if x.is_floating_point:
            return F64
    return x


def _writes_low_precision(func, args, kwargs) -> bool:
    """An in-place/out= op on a tensor that is not float64 (made outside the mode) must run as it is: upcasting
    would write into a copy and lose the write."""
    schema = func._schema
    for i, a in enumerate(schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            v = args[i] if i < len(args) else kwargs.get(a.name)
            if isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex()) and _up(v) is not v:
                return True
    return False


class Float64Mode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _NO_UPCAST or _writes_low_precision(func, args, kwargs):
            return func(*args, **kwargs)
        return tree_map(_up, func(*tree_map(_up, args), **tree_map(_up, kwargs)))


def run_fp64(repro, fn, side: str, inputs: dict):
    @functools.wraps(fn)
    def wrapped(*a, **k):
        with Float64Mode():
            return fn(*a, **k)

    return repro.run(wrapped, side, {k: _up(v) for k, v in inputs.items()})


def _classes(t: torch.Tensor) -> torch.Tensor:
    """0 finite, 1 NaN, 2 +Inf, 3 -Inf."""
    c = torch.zeros(t.shape, dtype=torch.int8, device=t.device)
    c[t.isnan()] = 1
    c[t == float("inf")] = 2
    c[t == float("-inf")] = 3
    return c


def _error(out: torch.Tensor, ref: torch.Tensor) -> float:
    o, r = out.to(ref.dtype), ref
    fin = torch.isfinite(o) & torch.isfinite(r)
    return float((o - r).abs()[fin].max()) if fin.any() else 0.0


def _floor(dtype: torch.dtype, ref: torch.Tensor) -> float:
    fin = ref[torch.isfinite(ref)]
    scale = float(fin.abs().max()) if fin.numel() else 0.0
    eps = torch.finfo(dtype).eps if dtype.is_floating_point else 0.0
    return FLOOR_EPS * eps * scale


def reference_check(repro, name: str, inputs: dict, other: Side, cand: Side, patched: bool) -> tuple[Check, dict]:
    """(check, per-input report). Without a patch the check only reports: its status is INFO (SKIPPED when the
    reference itself cannot be computed), never PASSED or FAILED."""
    ref, ref_from, why = None, None, []
    for s in ("a", "b"):
        try:
            ref, ref_from = run_fp64(repro, repro.side_fn(s), s, inputs), f"side {s}"
            break
        except Exception as e:
            why.append(f"side {s} in float64: {_err(e)}")
    if ref is None:
        return Check(name, "reference", SKIPPED, "no fp64 reference: " + "; ".join(why)), {"available": False}
    outs = {}
    for s in (other, cand):
        try:
            outs[s.label] = repro.run(s.fn, s.settings_side, inputs)
        except Exception as e:
            return Check(name, "reference", SKIPPED, f"{s.label} cannot run here: {_err(e)}"), {"available": False}
    if patched:
        outs[f"side {cand.settings_side}"] = repro.run(repro.side_fn(cand.settings_side), cand.settings_side, inputs)
    report = {"available": True, "from": ref_from, "outputs": {}}
    failures = []
    flat_ref = flatten(ref)
    flat = {label: dict(flatten(o)) for label, o in outs.items()}
    for key, r in flat_ref:
        if not isinstance(r, torch.Tensor) or not (r.is_floating_point() or r.is_complex()):
            continue  # integer outputs are settled by the bitwise checks
        row = {}
        for label, f in flat.items():
            o = f.get(key)
            if not isinstance(o, torch.Tensor) or o.shape != r.shape:
                failures.append(f"{label} {key}: shape {getattr(o, 'shape', None)} vs reference {list(r.shape)}")
                continue
            row[label] = {"max_abs_err": _error(o, r), "dtype": str(o.dtype),
                          "nonfinite_match": bool(torch.equal(_classes(o), _classes(r)))}
        errs = [row[f"side {s}"]["max_abs_err"] for s in ("a", "b") if f"side {s}" in row]
        dtype = getattr(flat[other.label].get(key), "dtype", torch.float32)
        floor = _floor(dtype, r)
        row["floor"], row["max_abs_ref"] = floor, float(r[torch.isfinite(r)].abs().max()) if r.isfinite().any() else 0.0
        if patched and "patch" in row and errs:
            p = row["patch"]
            bound = 2 * max(errs) + floor
            row["bound"] = bound
            if p["max_abs_err"] > bound:
                failures.append(f"{key}: patch error {p['max_abs_err']:.3g} > 2 * max(err_a, err_b) + floor = "
                                f"{bound:.3g} (err_a {row.get('side a', {}).get('max_abs_err', float('nan')):.3g}, "
                                f"err_b {row.get('side b', {}).get('max_abs_err', float('nan')):.3g})")
            other_cls = _classes(flat[other.label][key])
            if not p["nonfinite_match"] and not torch.equal(_classes(flat["patch"][key]), other_cls):
                failures.append(f"{key}: patch NaN/Inf positions match neither the reference nor {other.label}")
        report["outputs"][key] = row
    metrics = {"reference_from": ref_from}
    if report["outputs"]:
        key, row = next(iter(report["outputs"].items()))
        metrics.update({f"err_{lab.replace('side ', '')}": v["max_abs_err"] for lab, v in row.items()
                        if isinstance(v, dict)})
        metrics.update(floor=row["floor"], bound=row.get("bound"))
    if failures and patched:
        return Check(name, "reference", FAILED, "; ".join(failures), metrics), report
    e = lambda k: f"{metrics[k]:.3g}" if isinstance(metrics.get(k), float) else "-"
    if not patched:
        return Check(name, "reference", INFO, f"max abs error against an fp64 reference ({ref_from}'s code): side a "
                     f"{e('err_a')}, side b {e('err_b')}; for information (the gate applies to a --patch)"
                     + "".join(f"; {f}" for f in failures), metrics), report
    detail = f"patch error {e('err_patch')} <= bound {e('bound')} (fp64 reference: {ref_from}'s code)"
    return Check(name, "reference", PASSED, detail, metrics), report


SAME_FUNCTION_REL = 1e-9


def _rel_gap(a: torch.Tensor, b: torch.Tensor) -> float:
    fin = torch.isfinite(a) & torch.isfinite(b)
    if not fin.any():
        return 0.0
    scale = float(a[fin].abs().max()) or 1.0
    return float((a - b).abs()[fin].max()) / scale


def reference_checks(repro, other: Side, cand: Side, patched: bool, trial_seeds: list[int]) -> tuple[list[Check], dict]:
    from divtrace.verify.checks import _shapes

    checks, reports = [], {}
    sets = [("reference (recorded inputs)", repro.recorded_inputs())]
    sets += [(f"reference seed={s}", repro.random_inputs(s)) for s in trial_seeds]
    for name, inputs in sets:
        c, rep = reference_check(repro, name, inputs, other, cand, patched)
        c.metrics["shapes"] = _shapes(inputs)
        checks.append(c)
        reports[name] = rep
    # side a's and side b's code should be the same function: their fp64 references should agree to fp64 noise
    try:
        inputs = repro.recorded_inputs()
        ra, rb = (dict(flatten(run_fp64(repro, repro.side_fn(s), s, inputs))) for s in ("a", "b"))
        gaps = {k: _rel_gap(ra[k], rb[k]) for k in ra if isinstance(ra[k], torch.Tensor) and k in rb
                and ra[k].shape == getattr(rb[k], "shape", None) and ra[k].is_floating_point()}
        gap = max(gaps.values()) if gaps else None
        # fp64 reassociation noise is ~1e-16 relative; anything far above it is a different function
        agree = {"max_rel_gap": gap, "same_function": None if gap is None else gap < SAME_FUNCTION_REL}
    except Exception as e:
        agree = {"max_rel_gap": None, "same_function": None, "note": f"could not compute: {_err(e)}"}
    worst = {k: max((c.metrics[k] for c in checks if isinstance(c.metrics.get(k), float)), default=None)
             for k in ("err_a", "err_b", "err_patch")}
    ran = [c for c in checks if c.status != SKIPPED]
    worst["gate_passed"] = (all(c.status == PASSED for c in ran) if ran else None) if patched else None
    return checks, {"summary": worst, "floor_rule": f"{FLOOR_EPS:g} * eps(output dtype) * max|ref|",
                    "gate": "err_patch <= 2 * max(err_a, err_b) + floor; NaN/Inf positions must match",
                    "sides_fp64_agreement": agree, "inputs": reports}
