"""How long `python DIR/repro.py` takes, as a ratio against starting Python and importing what the script imports.

The repro of HF LlamaForCausalLM eager against SDPA attention (fp32, 2 layers, hidden 128, 16 tokens), written by
`divtrace repro`, run with `python -I` (no site customisation, as a user copying the directory elsewhere would),
against `python -I -c "import torch, safetensors.torch"` in interleaved rounds. Target: the script costs at most
1.5x its imports (it used to be a wall-clock bound of 5 s in the test suite, which a loaded machine broke).

    python bench/bench_repro.py [--repeats 5]
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def _time(argv, cwd) -> float:
    t0 = time.perf_counter()
    p = subprocess.run(argv, capture_output=True, text=True, cwd=cwd, timeout=300)
    elapsed = time.perf_counter() - t0
    assert p.returncode in (0, 1), p.stderr
    return elapsed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    from divtrace.cli.app import main as cli
    from helpers import hf_llama, record_model

    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        for attn in ("eager", "sdpa"):
            model, ids = hf_llama(attn)
            record_model(model, ids, d / attn, label=attn)  # (ids: the keyword inputs)
        assert cli(["repro", str(d / "eager"), str(d / "sdpa"), "--out", str(d / "repro")]) == 0
        script = [sys.executable, "-I", str(d / "repro" / "repro.py")]
        imports = [sys.executable, "-I", "-c", "import torch, safetensors.torch"]
        runs, base = [], []
        for _ in range(args.repeats):
            runs.append(_time(script, d))
            base.append(_time(imports, d))
    r, b = statistics.median(runs), statistics.median(base)
    print(f"repro.py: median {r:.2f} s; python + imports: median {b:.2f} s; ratio {r / b:.2f}x (target <= 1.5x)")
    return 0 if r / b <= 1.5 else 1


if __name__ == "__main__":
    sys.exit(main())
