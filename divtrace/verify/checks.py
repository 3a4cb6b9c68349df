"""The bitwise checks: the candidate against the other side on the recorded inputs, N fresh random trials and a shape
sweep (batch 1, the recorded size, a larger size; another sequence length).

Batch-variant kernels are the commonest cause of a mismatch, so a fix that only agrees at the recorded shape must
fail here. A shape that the *original* side cannot run (hard-coded shapes) is SKIPPED, not FAILED; a shape that
the original runs and the patch cannot is a FAILED patch.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from divtrace.compare.metrics import compare_tensors

PASSED, FAILED, SKIPPED = "PASSED", "FAILED", "SKIPPED"
INFO = "INFO"  # a figure reported without a gate (the fp64 reference without --patch): neither passed nor failed
TRIAL_SEED0 = 1  # trials use seeds 1..N; the sweep uses 1001.. so its inputs are not the trials' again
SWEEP_SEED0 = 1001


@dataclass
class Check:
    name: str
    kind: str  # "recorded" | "trial" | "sweep" | "reference" | "end_to_end"
    status: str
    detail: str = ""
    metrics: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"name": self.name, "kind": self.kind, "status": self.status, "detail": self.detail, **self.metrics}


@dataclass
class Side:
    """One thing to run: a repro side or the patch, with the settings of the side it stands in for."""

    label: str  # "side a", "side b", "patch"
    fn: object
    settings_side: str  # "a" | "b"


def flatten(out, key: str = "out") -> list[tuple[str, object]]:
    """(key, leaf) for a tensor or any nest of tuples/lists/dicts of them."""
    if isinstance(out, (tuple, list)):
        return [kv for i, v in enumerate(out) for kv in flatten(v, f"{key}.{i}")]
    if isinstance(out, dict):
        return [kv for k, v in out.items() for kv in flatten(v, f"{key}.{k}")]
    return [(key, out)]


def compare_outputs(a, b) -> dict:
    """Bitwise comparison of two side outputs; metrics summed/maxed over their tensors."""
    fa, fb = flatten(a), flatten(b)
    if [k for k, _ in fa] != [k for k, _ in fb]:
        return {"equal": False, "reason": f"output structure differs: {[k for k, _ in fa]} vs {[k for k, _ in fb]}"}
    res = {"equal": True, "mismatched": 0, "numel": 0, "max_abs": 0.0, "max_ulp": 0, "reason": None}
    for (k, x), (_, y) in zip(fa, fb):
        if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)):
            if x != y:
                res.update(equal=False, reason=f"{k}: {x!r} vs {y!r}")
            continue
        d = compare_tensors(x, y)
        res["numel"] += d.numel
        if d.equal:
            continue
        res["equal"] = False
        if d.reason:  # dtype or shape
            res["reason"] = res["reason"] or f"{k}: {d.reason}"
            continue
        res["mismatched"] += d.mismatched or 0
        res["max_abs"] = max(res["max_abs"], d.max_abs or 0.0)
        res["max_ulp"] = max(res["max_ulp"], d.max_ulp or 0)
        res.setdefault("first", f"{k}[{','.join(map(str, d.first_index or []))}]: {d.first_a} vs {d.first_b}")
    if res["reason"] is None and not res["equal"]:
        res["reason"] = f"{res['mismatched']} of {res['numel']} elements differ (max ULP {res['max_ulp']})"
    return res


def _shapes(inputs: dict) -> dict:
    return {k: list(v.shape) for k, v in inputs.items() if isinstance(v, torch.Tensor)}


def _err(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0][:200] if msg else ''}"


def run_pair(repro, lhs: Side, rhs: Side, inputs: dict):
    """(lhs out, rhs out, None) or (None, None, (status, why)) when one of them raises."""
    try:
        a = repro.run(lhs.fn, lhs.settings_side, inputs)
    except Exception as e:
        return None, None, (SKIPPED, f"{lhs.label} cannot run here: {_err(e)}")
    try:
        b = repro.run(rhs.fn, rhs.settings_side, inputs)
    except Exception as e:
        if rhs.label == "patch":
            orig = repro.side_fn(rhs.settings_side)
            try:
                repro.run(orig, rhs.settings_side, inputs)
            except Exception:
                return None, None, (SKIPPED, f"side {rhs.settings_side} cannot run here either: {_err(e)}")
            return None, None, (FAILED, f"the patch raised where side {rhs.settings_side} runs: {_err(e)}")
        return None, None, (SKIPPED, f"{rhs.label} cannot run here: {_err(e)}")
    return a, b, None


def _pair_check(name, kind, repro, lhs, rhs, inputs, **extra) -> Check:
    a, b, fail = run_pair(repro, lhs, rhs, inputs)
    metrics = {"shapes": _shapes(inputs), **extra}
    if fail is not None:
        return Check(name, kind, fail[0], fail[1], metrics)
    c = compare_outputs(a, b)
    metrics.update({k: c.get(k) for k in ("mismatched", "numel", "max_abs", "max_ulp")})
    if c["equal"]:
        return Check(name, kind, PASSED, f"{rhs.label} bitwise equal to {lhs.label}", metrics)
    return Check(name, kind, FAILED, c["reason"] + (f"; first at {c['first']}" if c.get("first") else ""), metrics)


def recorded_check(repro, lhs: Side, rhs: Side) -> list[Check]:
    """The recorded inputs, each side run twice: a candidate that is not run-to-run deterministic cannot hold."""
    from divtrace.errors import DivtraceError

    inputs = repro.recorded_inputs()
    out = [_pair_check("recorded inputs", "recorded", repro, lhs, rhs, inputs)]
    if out[0].status == SKIPPED:  # the unpatched side raising on its own recorded inputs: the repro is broken
        raise DivtraceError(f"{repro.path / 'repro.py'}: {out[0].detail} (on the recorded inputs)")
    for s in (lhs, rhs):
        try:
            first, again = repro.run(s.fn, s.settings_side, inputs), repro.run(s.fn, s.settings_side, inputs)
        except Exception:
            continue  # already reported by the check above
        c = compare_outputs(first, again)
        if not c["equal"]:
            out.append(Check(f"recorded inputs, {s.label} run twice", "recorded", FAILED,
                             f"{s.label} is not run-to-run deterministic: {c['reason']}", {"shapes": _shapes(inputs)}))
    exp = repro.expected()
    if lhs.label == "side a" and "a" in exp:
        a = repro.run(lhs.fn, "a", inputs)
        if not (isinstance(a, torch.Tensor) and compare_tensors(a, exp["a"]).equal):
            repro.notes.append("side a recomputed here does not reproduce expected.safetensors 'a' bitwise (another "
                               "machine, build or thread count?): the checks compare today's side a")
    return out


def trial_checks(repro, lhs: Side, rhs: Side, n: int) -> list[Check]:
    return [_pair_check(f"trial seed={s}", "trial", repro, lhs, rhs, repro.random_inputs(s), seed=s)
            for s in range(TRIAL_SEED0, TRIAL_SEED0 + n)]


# -- shape sweep -----------------------------------------------------------------------------------------------
def sweep_plan(manifest: dict) -> tuple[list[tuple[str, dict]], str | None]:
    """[(name, {input: shape})] for batch 1 / recorded / larger and another sequence length, or ([], why not)."""
    specs = [s for s in manifest["inputs"] if s.get("batch_dim") is not None]
    if not specs:
        return [], "no input has a batch dimension (batch_dim is null for every input in manifest.json)"
    ref = specs[0]
    bd = int(ref["batch_dim"])
    big = int(ref["shape"][bd])

    def with_batch(n: int) -> dict:
        shapes = {}
        for s in specs:
            shape, d = list(s["shape"]), int(s["batch_dim"])
            # an input whose leading dim is a multiple of the batch (tokens = batch * seq) scales with it
            if shape[d] == big or (big and shape[d] % big == 0):
                shape[d] = shape[d] // big * n if big else n
            shapes[s["name"]] = shape
        return shapes

    plan = []
    for n in dict.fromkeys((1, big, 2 * big + 1)):
        tag = " (recorded)" if n == big else ("" if n == 1 else " (larger)")
        plan.append((f"{ref['name']} dim {bd} = {n}{tag}", with_batch(n)))
    seq_specs = [s for s in specs if s.get("seq_dims")]
    if seq_specs:  # the repro marked where the sequence length is (its code reads it from the inputs)
        first = seq_specs[0]
        d0 = int(first["seq_dims"][0])
        seq = int(manifest.get("seq") or first["shape"][d0])
        new = 2 * seq - 1 if seq > 1 else 2
        shapes = with_batch(big)
        for s in seq_specs:
            for d in s["seq_dims"]:
                shapes[s["name"]][int(d)] = new
        plan.append((f"{first['name']} dim {d0} = {new} (another sequence length, was {seq})", shapes))
    elif len(ref["shape"]) > bd + 1:
        seq = int(ref["shape"][bd + 1])
        new = 2 * seq - 1 if seq > 1 else 2
        shapes = with_batch(big)
        for s in specs:
            d = int(s["batch_dim"]) + 1
            if len(s["shape"]) > d and s["shape"][d] == seq:
                shapes[s["name"]][d] = new
        plan.append((f"{ref['name']} dim {bd + 1} = {new} (another sequence length, was {seq})", shapes))
    return plan, None


def sweep_checks(repro, lhs: Side, rhs: Side, seeds_per_shape: int = 3) -> tuple[list[Check], str | None]:
    plan, why = sweep_plan(repro.manifest)
    out = []
    for i, (name, shapes) in enumerate(plan):
        seeds = [SWEEP_SEED0 + 100 * i + k for k in range(seeds_per_shape)]
        last = None
        for s in seeds:
            try:
                inputs = repro.random_inputs(s, shapes)
            except Exception as e:
                last = Check(f"sweep {name}", "sweep", SKIPPED, f"random_inputs cannot build this shape: {_err(e)}",
                             {"shapes": shapes, "seed": s})
                break
            last = _pair_check(f"sweep {name}", "sweep", repro, lhs, rhs, inputs, seed=s)
            if last.status != PASSED:
                break
        last.metrics["seeds"] = seeds
        out.append(last)
    others = [c for c in out if "(recorded)" not in c.name]
    if others and all(c.status == SKIPPED for c in others):
        why = ("every swept shape other than the recorded one was SKIPPED (the region's code fixes its shapes): "
               "batch invariance was NOT checked")
    return out, why
