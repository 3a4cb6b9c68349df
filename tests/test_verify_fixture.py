"""Hand-written repro directories in the `divtrace repro` layout, for testing `divtrace verify` on planted cases.

`write_repro(tmp, case)` writes DIR/repro.py, inputs.safetensors, expected.safetensors and manifest.json for:
  rmsnorm_cast  side a = HF RMSNorm `w * x_hat.to(bf16)`, side b = `(w.float() * x_hat).to(bf16)`
  split_k       side a = one bf16 linear, side b = a sum of 32-column K-chunks, every partial rounded to bf16
  fixed_shape   rmsnorm_cast with the batch size hard-coded in both sides (the sweep must SKIP, not FAIL)
Patches for them live in PATCHES (file text) and are written next to the repro by `write_patch`.
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import torch
from safetensors.torch import save_file

SIDES = {
    "rmsnorm_cast": ("x, w", """
        def side_a(x, w):
            xf = x.float()
            x_hat = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)
            return w * x_hat.to(torch.bfloat16)


        def side_b(x, w):
            xf = x.float()
            x_hat = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)
            return (w.float() * x_hat).to(torch.bfloat16)
        """),
    "split_k": ("x, w", """
        def side_a(x, w):
            return torch.nn.functional.linear(x, w)


        def side_b(x, w):
            out = None
            for j in range(0, x.shape[-1], 32):
                part = torch.nn.functional.linear(x[..., j:j + 32], w[:, j:j + 32])
                out = part if out is None else out + part
            return out
        """),
    "fixed_shape": ("x, w", """
        def side_a(x, w):
            xf = x.float().reshape(2, 16, 128)
            x_hat = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)
            return w * x_hat.to(torch.bfloat16)


        def side_b(x, w):
            xf = x.float().reshape(2, 16, 128)
            x_hat = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)
            return (w.float() * x_hat).to(torch.bfloat16)
        """),
}

TEMPLATE = '''"""divtrace repro (hand-written test fixture in the generated layout): {case}."""
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

HERE = Path(__file__).resolve().parent
INPUT_NAMES = {names!r}
SETTINGS_A = {{"num_threads": None}}
SETTINGS_B = {{"num_threads": None}}
DEVICE = {device!r}

{sides}

def load_inputs():
    t = load_file(str(HERE / "inputs.safetensors"))
    return {{k: t[k].to(DEVICE) for k in INPUT_NAMES}}


def random_inputs(seed, shapes=None):
    manifest = json.loads((HERE / "manifest.json").read_text())
    g = torch.Generator().manual_seed(int(seed))
    out = {{}}
    for spec in manifest["inputs"]:
        shape = list((shapes or {{}}).get(spec["name"], spec["shape"]))
        dtype = getattr(torch, spec["dtype"].removeprefix("torch."))
        lo, hi = spec["min"], spec["max"]
        x = torch.rand(shape, generator=g, dtype=torch.float64) * (hi - lo) + lo
        out[spec["name"]] = x.to(dtype).to(DEVICE)
    return out


def run_side(fn, settings, inputs):
    with torch.no_grad():
        return fn(*[inputs[n] for n in INPUT_NAMES])


def compare(a, b):
    ia, ib = a.contiguous().view(torch.int16), b.contiguous().view(torch.int16)
    bad = int((ia != ib).sum())
    return {{"equal": bad == 0 and a.shape == b.shape, "mismatched": bad, "numel": a.numel()}}


def main(argv=None):
    inputs = load_inputs()
    r = compare(run_side(side_a, SETTINGS_A, inputs), run_side(side_b, SETTINGS_B, inputs))
    print(r)
    return 0 if r["equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
'''


def write_repro(tmp: Path, case: str = "rmsnorm_cast", device: str = "cpu", batch: int = 2) -> Path:
    names, sides = SIDES[case]
    d = Path(tmp) / f"repro-{case}"
    d.mkdir(parents=True)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(batch, 16, 128, generator=g).to(torch.bfloat16)
    w = ((1 + 0.1 * torch.randn(128, generator=g)) if case != "split_k" else 0.02 * torch.randn(128, 128, generator=g))
    w = w.to(torch.bfloat16)
    inputs = {"x": x, "w": w}
    (d / "repro.py").write_text(TEMPLATE.format(case=case, names=[n.strip() for n in names.split(",")],
                                                sides=textwrap.dedent(sides).strip() + "\n", device=device))
    save_file(inputs, str(d / "inputs.safetensors"))
    specs = [{"name": k, "dtype": str(v.dtype), "shape": list(v.shape),
              "role": "activation" if k == "x" else "parameter", "min": float(v.float().min()),
              "max": float(v.float().max()), "batch_dim": 0 if k == "x" else None} for k, v in inputs.items()]
    manifest = {"format": "divtrace-repro", "version": 1, "inputs": specs,
                "origin": {"module": f"planted.{case}", "call": 0},
                "ops": {}, "settings": {"a": {}, "b": {}}, "custom_ops": [], "fidelity": {},
                "batch_symbolic": case != "fixed_shape"}
    # expected = what each side gave when it was "recorded"
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"_fixture_{case}_{id(d)}", d / "repro.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    a, b = (mod.run_side(f, {}, mod.load_inputs()).cpu() for f in (mod.side_a, mod.side_b))
    manifest["output"] = {k: {"dtype": str(v.dtype), "shape": list(v.shape)} for k, v in (("a", a), ("b", b))}
    save_file({"a": a.contiguous(), "b": b.contiguous()}, str(d / "expected.safetensors"))
    (d / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return d


PATCHES = {
    # the right fix for side b of rmsnorm_cast: the training (HF) cast order
    "rmsnorm_right": """
        def fix(x, w):
            xf = x.float()
            x_hat = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)
            return w * x_hat.to(torch.bfloat16)
        """,
    # exact at the recorded batch size 2, the old cast order at any other (a batch-dependent code path)
    "rmsnorm_batch_only": """
        def fix(x, w):
            xf = x.float()
            x_hat = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)
            if x.shape[0] != 2:
                return (w.float() * x_hat).to(torch.bfloat16)
            return w * x_hat.to(torch.bfloat16)
        """,
    # more accurate than either side (one rounding at the end), so not bitwise equal but passes the fp64 gate
    "rmsnorm_fp64": """
        def fix(x, w):
            xd = x.double()
            x_hat = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6)
            return (w.double() * x_hat).to(torch.bfloat16)
        """,
    # plausible but wrong: eps inside the sqrt a thousand times too big, and a 1% scale
    "rmsnorm_wrong": """
        def fix(x, w):
            xf = x.float()
            x_hat = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-3)
            return (w * x_hat.to(torch.bfloat16)) * 1.01
        """,
    "rmsnorm_bad_signature": """
        def fix(x, weight):
            return weight * x
        """,
    "split_k_right": """
        def fix(x, w):
            return torch.nn.functional.linear(x, w)
        """,
    # one matmul at the recorded batch size, the split-K partial sums at any other (a batch-dependent reduction)
    "split_k_batch_only": """
        def fix(x, w):
            if x.shape[0] != 2:
                out = None
                for j in range(0, x.shape[-1], 32):
                    part = torch.nn.functional.linear(x[..., j:j + 32], w[:, j:j + 32])
                    out = part if out is None else out + part
                return out
            return torch.nn.functional.linear(x, w)
        """,
    "split_k_unchanged": """
        def fix(x, w):
            out = None
            for j in range(0, x.shape[-1], 32):
                part = torch.nn.functional.linear(x[..., j:j + 32], w[:, j:j + 32])
                out = part if out is None else out + part
            return out
        """,
}


def write_patch(d: Path, name: str) -> str:
    p = Path(d) / f"patch_{name}.py"
    p.write_text("import torch\n\n\n" + textwrap.dedent(PATCHES[name]).strip() + "\n")
    return f"{p}:fix"


def test_fixture_repro_script_runs_standalone(tmp_path):
    """The fixture behaves as the contract says a repro does: exit 1 while the sides differ."""
    for case in ("rmsnorm_cast", "split_k"):
        d = write_repro(tmp_path, case)
        p = subprocess.run([sys.executable, str(d / "repro.py")], capture_output=True, text=True, timeout=120)
        assert p.returncode == 1, p.stdout + p.stderr
