"""verify on a repro directory: the bitwise checks, the fp64 gate and (optionally) the profile, as one result."""
from __future__ import annotations

from dataclasses import dataclass, field

from divtrace.errors import DivtraceError
from divtrace.verify.checks import FAILED, PASSED, SKIPPED, Check, Side, recorded_check, sweep_checks, trial_checks
from divtrace.verify.loading import Repro, load_patch

REFERENCE_TRIALS = 3  # the fp64 gate runs on the recorded inputs and the first few trials


@dataclass
class VerifyResult:
    repro: str
    region: str
    patch: str | None
    side: str | None
    checks: list[Check]
    reference: dict
    profile: dict | None
    profile_skipped: str | None = None
    notes: list[str] = field(default_factory=list)
    sweep_warning: str | None = None
    warnings: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(c.status != FAILED for c in self.checks) and any(
            c.status == PASSED and c.kind == "recorded" for c in self.checks)

    @property
    def bitwise_passed(self) -> bool:
        return all(c.status != FAILED for c in self.checks if c.kind != "reference")

    def to_dict(self) -> dict:
        return {"verdict": "passed" if self.passed else "failed", "repro": self.repro, "region": self.region,
                "patch": self.patch, "side": self.side, "checks": [c.to_dict() for c in self.checks],
                "reference": self.reference, "profile": self.profile, "profile_skipped": self.profile_skipped,
                "sweep_warning": self.sweep_warning, "warnings": self.warnings, "notes": self.notes}


def sides_for(repro: Repro, patch: str | None, side: str | None) -> tuple[Side, Side]:
    """(other, candidate): what the candidate must equal, and the candidate (the patch, or side b)."""
    if patch is None:
        if side is not None:
            raise DivtraceError("--side needs --patch (it names the side the patch replaces)")
        return Side("side a", repro.side_fn("a"), "a"), Side("side b", repro.side_fn("b"), "b")
    if side is None:
        raise DivtraceError(f"--patch {patch}: say which side it replaces with --side a or --side b")
    fn = load_patch(patch, repro, side)
    other = "b" if side == "a" else "a"
    return Side(f"side {other}", repro.side_fn(other), other), Side("patch", fn, side)


def verify_repro(path, *, patch: str | None = None, side: str | None = None, trials: int = 20,
                 profile: bool = False, force_profile: bool = False, threads: int | None = 1) -> VerifyResult:
    if trials < 0:
        raise DivtraceError(f"--trials must be >= 0, got {trials}")
    repro = Repro.load(path)
    other, cand = sides_for(repro, patch, side)
    checks = recorded_check(repro, other, cand)
    trial = trial_checks(repro, other, cand, trials)
    checks += trial
    warnings = []
    if trial and all(c.status == SKIPPED for c in trial):
        warnings.append(f"every random trial was SKIPPED ({trial[0].detail}): only the recorded inputs were checked")
    sweep, sweep_warning = sweep_checks(repro, other, cand)
    checks += sweep
    if sweep_warning:
        warnings.append(f"shape sweep: {sweep_warning}")
    if repro.manifest.get("batch_symbolic") is False and sweep:
        repro.notes.append("manifest says batch_symbolic: false (the region's code may fix the batch size): "
                           "swept shapes it cannot run are SKIPPED")
    from divtrace.verify.reference import reference_checks

    seeds = list(range(1, 1 + min(REFERENCE_TRIALS, trials)))
    ref_checks, reference = reference_checks(repro, other, cand, patch is not None, seeds)
    checks += ref_checks
    if any(c.status == SKIPPED for c in ref_checks) and all(c.status == SKIPPED for c in ref_checks):
        warnings.append("no fp64 reference could be computed: the 'same function' gate did not run")
    res = VerifyResult(str(repro.path), repro.region(), patch, side if patch else None, checks, reference, None,
                       notes=repro.notes, sweep_warning=sweep_warning, warnings=warnings)
    if profile:
        if res.bitwise_passed or force_profile:
            from divtrace.verify.profile import profile_candidates

            cands = [Side("side a", repro.side_fn("a"), "a"), Side("side b", repro.side_fn("b"), "b")]
            if patch is not None:
                cands.append(cand)
            res.profile = profile_candidates(repro, cands, repro.recorded_inputs(), threads=threads)
            res.profile["bitwise_passed"] = res.bitwise_passed
        else:
            res.profile_skipped = ("not profiled: the bitwise checks FAILED, and the speed of a fix that does not "
                                   "hold means nothing (--force-profile times it anyway)")
    return res
