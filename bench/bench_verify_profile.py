"""`divtrace verify --profile`'s kernel ratio for a patch written differently that runs the same kernels.

The rmsnorm_cast example (tests/helpers.record_pair) recorded, `divtrace repro` written, and the fix in
examples/fixes/rmsnorm_cast_patch.py (`param * mul_out.to(param.dtype)`: tensor methods, the kernels side a runs)
profiled against side a, `--repeats` times. Issue 26 snag 2: it read 150-158% of side a when the per-op Python of
the generated code was timed; measured by kernel time it must read about 100% (target 75%-133%, and side a against
itself, the noise band, near 100%). This used to be an assertion in tests/test_verify_repro.py, which a loaded
machine broke (69.9%): wall-clock figures belong here, the test keeps what does not depend on the machine's load.

    python bench/bench_verify_profile.py [--repeats 5]
"""
from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import tempfile
from contextlib import redirect_stdout
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    from helpers import record_pair

    from divtrace.cli.app import main as cli
    from divtrace.verify.profile import kernel_ratios

    fix = ROOT / "examples" / "fixes" / "rmsnorm_cast_patch.py"
    vs_a, bands = [], []
    with tempfile.TemporaryDirectory(prefix="divtrace-bench-verify-") as d:
        a, b = record_pair(Path(d), "rmsnorm_cast")
        repro = Path(d) / "repro"
        assert cli(["repro", str(a), str(b), "--out", str(repro)]) == 0
        for _ in range(args.repeats):
            buf = io.StringIO()
            with redirect_stdout(buf):
                code = cli(["verify", str(repro), "--patch", f"{fix}:side_b", "--side", "b", "--trials", "1",
                            "--profile", "--json"])
            assert code == 0, buf.getvalue()[-2000:]
            k = json.loads(buf.getvalue())["profile"]["kernel"]
            (_, _, _), (_, against, pct) = kernel_ratios(k, "b")
            assert against == "side a"
            vs_a.append(pct)
            bands.append(k["noise_band_pct"])
    ok = all(75 <= x <= 133 for x in vs_a)
    print(json.dumps({"patch_vs_side_a_pct": [round(x, 1) for x in vs_a],
                      "median_pct": round(statistics.median(vs_a), 1),
                      "noise_band_pct": [[round(x, 1) for x in b] for b in bands if b]}))
    print(f"{'PASSED' if ok else 'FAILED'}: patch kernel time {min(vs_a):.1f}%-{max(vs_a):.1f}% of side a's "
          "(target 75%-133%)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
