"""The fixed part of every repro.py: loading inputs, settings per side, bitwise comparison, the CLI.

Plain torch + safetensors + the standard library: the script must run where divtrace is not installed.
"""

# Right after the standard-library imports of every repro.py, before torch: a script that cannot run (no torch, a
# custom op's module missing under this interpreter, a side that raises) exits 2, never 1, which means only that
# the sides differ. Installed only when run as a script: `divtrace verify` imports it and reports the error itself.
CRASH_GUARD = r'''
def _crashed(kind, exc, tb):
    """An uncaught exception: print it and exit 2 (1 means the sides differ, 0 that they are equal)."""
    if issubclass(kind, KeyboardInterrupt):
        return sys.__excepthook__(kind, exc, tb)
    import traceback

    traceback.print_exception(kind, exc, tb)
    wrote = None
    try:
        wrote = (json.loads((Path(__file__).resolve().parent / "manifest.json").read_text()).get("python") or {})
    except Exception:
        pass
    hint = ""
    if wrote and wrote.get("executable") and wrote["executable"] != sys.executable:
        hint = f"; it was written under {wrote['executable']} (torch {wrote.get('torch')}): run it with that"
    print(f"repro.py: cannot run under {sys.executable}: {kind.__name__}: {exc}{hint} (exit 2: the script failed; "
          "exit 1 would mean the sides differ)", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(2)


if __name__ == "__main__":
    sys.excepthook = _crashed
'''

HARNESS = r'''
# ---- harness (the same in every repro) -------------------------------------------------------------------
def _unreplayable(why):
    raise RuntimeError("divtrace could not turn this recorded op into code: " + why)


_SETTINGS_API = {
    "float32_matmul_precision": (torch.get_float32_matmul_precision, torch.set_float32_matmul_precision),
    "num_threads": (torch.get_num_threads, torch.set_num_threads),
    "cuda_matmul_allow_tf32": (lambda: torch.backends.cuda.matmul.allow_tf32,
                               lambda v: setattr(torch.backends.cuda.matmul, "allow_tf32", v)),
    "cudnn_allow_tf32": (lambda: torch.backends.cudnn.allow_tf32,
                         lambda v: setattr(torch.backends.cudnn, "allow_tf32", v)),
    "allow_fp16_reduced_precision_reduction": (
        lambda: torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction,
        lambda v: setattr(torch.backends.cuda.matmul, "allow_fp16_reduced_precision_reduction", v)),
    "allow_bf16_reduced_precision_reduction": (
        lambda: torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
        lambda v: setattr(torch.backends.cuda.matmul, "allow_bf16_reduced_precision_reduction", v)),
}


def _get(k):
    try:
        return _SETTINGS_API[k][0]()
    except RuntimeError:  # torch refuses to read a precision set through a mix of old and new APIs
        return None


def _apply(settings):
    """Set each recorded setting, in order; returns what they were before (apply that to restore). Settings
    depend on each other (the matmul precision sets the TF32 flags), so all are read first and one is set only
    where it still differs."""
    keys = [k for k, v in settings.items() if v is not None and k in _SETTINGS_API]
    old = {k: _get(k) for k in keys}
    for k in keys:
        if _get(k) != settings[k]:
            _SETTINGS_API[k][1](settings[k])
    return old


def _with_layout(t, shape, stride):
    """t's values in the recorded memory layout: exact strides at the recorded shape (kernels can depend on
    them), else the same dim order; broadcast (stride-0) dims stay broadcast."""
    if stride is None or t.dim() != len(stride) or list(t.stride()) == list(stride):
        return t
    bcast = [d for d in range(t.dim()) if stride[d] == 0 and t.shape[d] > 1]
    base = t
    for d in bcast:
        base = base.narrow(d, 0, 1)
    if list(t.shape) == list(shape):
        try:
            buf = torch.empty_strided(base.shape, stride, dtype=t.dtype, device=t.device)
            buf.copy_(base)
            return buf.expand(t.shape) if bcast else buf
        except RuntimeError:  # overlapping layouts cannot be written to; fall through to the dim order
            pass
    order = sorted(range(t.dim()), key=lambda d: (-stride[d], d))
    dense = base.permute(order).contiguous().permute([order.index(d) for d in range(t.dim())])
    return dense.expand(t.shape) if bcast else dense


def _device(spec):
    """DEVICE for inputs that lived on the recording's device; any other device (a CPU tensor of a GPU model) stays."""
    d = spec.get("device", RECORDED_DEVICE)
    return DEVICE if d == RECORDED_DEVICE else torch.device(d)


def load_inputs():
    """The region's inputs exactly as recorded (values and memory layout), on their devices."""
    raw = load_file(str(HERE / "inputs.safetensors"))
    return {k: _with_layout(raw[k].to(_device(INPUT_SPECS[k])), INPUT_SPECS[k]["shape"], INPUT_SPECS[k]["stride"])
            for k in INPUT_NAMES}


def _draw(g, shape, dtype, lo, hi):
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) < 0.5
    if dtype.is_floating_point or dtype.is_complex:
        if not (math.isfinite(lo) and math.isfinite(hi)):
            lo, hi = -1.0, 1.0
        x = torch.rand(shape, generator=g, dtype=torch.float64) * (hi - lo) + lo
        return x.to(dtype)
    return torch.randint(int(lo), int(hi) + 1, shape, generator=g, dtype=torch.int64).to(dtype)


def random_inputs(seed, shapes=None):
    """Fresh activations with the recorded dtypes and value ranges (uniform in [min, max]); parameters and
    constants (masks, positions) stay as recorded. `shapes` overrides shapes per input: a batched constant
    repeats its recorded rows, anything else is drawn."""
    shapes = shapes or {}
    rec = load_inputs()
    g = torch.Generator().manual_seed(int(seed))
    out = {}
    for k in INPUT_NAMES:
        spec = INPUT_SPECS[k]
        shape = [int(s) for s in shapes.get(k, spec["shape"])]
        dtype = getattr(torch, spec["dtype"].removeprefix("torch."))
        same = shape == list(spec["shape"])
        if (spec["role"] != "activation" or k in (globals().get("KEEP_RECORDED") or ())) and same:
            out[k] = rec[k]
            continue
        if (spec["role"] == "constant" and spec["batch_dim"] == 0 and shape[1:] == list(spec["shape"][1:])
                and spec["shape"][0] > 0):
            idx = torch.arange(shape[0], device=rec[k].device) % spec["shape"][0]
            x = rec[k].index_select(0, idx)
        else:
            x = _draw(g, shape, dtype, spec["min"], spec["max"]).to(_device(spec))
        out[k] = _with_layout(x, spec["shape"], spec["stride"])
    for nb, ib, na, ia in globals().get("TOKEN_TIES") or ():  # the token's input row, the same on both sides
        sel = lambda idx: tuple(slice(None) if i == ":" else i for i in idx)  # noqa: E731
        try:
            out[nb][sel(ib)] = out[na][sel(ia)]
        except (IndexError, RuntimeError):  # a swept shape without that row: the sides are not tied there
            pass
    for name, src, box in globals().get("BLOCK_TIES") or ():  # a rank's block of the other side's global input
        try:
            x = out[src][tuple(slice(lo, hi) for lo, hi in box)].clone()
            out[name] = _with_layout(x, INPUT_SPECS[name]["shape"], INPUT_SPECS[name]["stride"])
        except (IndexError, RuntimeError):  # a swept shape the block no longer fits: drawn on its own
            pass
    return out


def run_side(fn, settings, inputs):
    """fn(**inputs) under `settings` (restored afterwards), on private copies in the recorded layouts."""
    args = {}
    for k in INPUT_NAMES:
        spec = INPUT_SPECS[k]
        args[k] = _with_layout(inputs[k].clone(), spec["shape"], spec["stride"])
    old = _apply(settings)
    try:
        with torch.no_grad():
            return fn(**args)
    finally:
        _apply(old)


_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t):
    t = t.detach().contiguous().reshape(-1)
    if t.dtype == torch.bool:
        t = t.view(torch.uint8)
    elif t.is_complex():
        t = torch.view_as_real(t).reshape(-1)
    return t.view(_INT[t.element_size()]).to(torch.int64)


def _ordered(bits, nbits):
    """Sign-magnitude float bits -> integers in the floats' order (both zeros -> 0), for ULP distances."""
    mag = (1 << (nbits - 1)) - 1
    k = torch.where(bits < 0, -(bits & mag), bits)
    return k.double() if nbits == 64 else k


def compare(a, b):
    """Bitwise comparison (through a reshape when only the shapes differ) and how far apart the values are."""
    a, b = a.detach().cpu(), b.detach().cpu()
    r = {"equal": False, "dtype_a": str(a.dtype), "dtype_b": str(b.dtype), "shape_a": list(a.shape),
         "shape_b": list(b.shape), "aligned": list(a.shape) != list(b.shape), "numel": a.numel(), "reason": None,
         "mismatched": None, "max_abs": None, "max_ulp": None, "sign_flips": None, "first_index": None, "first_a": None,
         "first_b": None, "first_a_bits": None, "first_b_bits": None}
    if a.numel() != b.numel():
        r["reason"] = f"sizes differ: {list(a.shape)} vs {list(b.shape)}"
        return r
    fa, fb = a.reshape(-1), b.reshape(-1)
    if a.dtype != b.dtype:
        r["reason"] = f"dtypes differ: {a.dtype} vs {b.dtype} (values compared as float64)"
        diff = fa.to(torch.float64) != fb.to(torch.float64)
    else:
        ba, bb = _bits(fa), _bits(fb)
        diff = (ba != bb).reshape(fa.numel(), -1).any(dim=1)
    idx = diff.nonzero().reshape(-1)
    r["mismatched"] = int(idx.numel())
    r["equal"] = r["mismatched"] == 0 and a.dtype == b.dtype
    if r["mismatched"] == 0:
        r["max_abs"], r["max_ulp"] = 0.0, 0 if a.is_floating_point() else None
        r["sign_flips"] = r["max_ulp"]
        return r
    sa, sb = fa[idx], fb[idx]
    if a.is_complex():
        sa, sb = torch.view_as_real(sa), torch.view_as_real(sb)
    da, db = sa.to(torch.float64), sb.to(torch.float64)
    nan = da.isnan() | db.isnan()
    absd = (da - db).abs().masked_fill(da == db, 0.0).masked_fill(nan, 0.0)
    r["max_abs"] = float(absd.max()) if absd.numel() else 0.0
    if a.dtype == b.dtype and a.is_floating_point():
        nbits = a.element_size() * 8
        ia, ib = _bits(sa), _bits(sb)
        ulp = (_ordered(ia, nbits) - _ordered(ib, nbits)).abs().masked_fill(nan, -1)
        # non-zero values of opposite sign: counted apart, not as the ~30000 ULP between two tiny bf16 values
        flips = ((ia < 0) != (ib < 0)) & (da != 0) & (db != 0) & ~nan
        r["sign_flips"] = int(flips.sum())
        r["max_ulp"] = int(ulp.masked_fill(flips, 0).max())
    first = int(idx[0])
    index, rest = [], first
    for n in reversed(list(a.shape)):
        index.append(rest % n)
        rest //= n
    r["first_index"] = index[::-1]
    va, vb = fa[first], fb[first]
    r["first_a"], r["first_b"] = repr(va.item()), repr(vb.item())
    for key, v in (("first_a_bits", va), ("first_b_bits", vb)):
        w = v.element_size() * 8 if not v.is_complex() else v.element_size() * 4
        r[key] = ",".join(f"0x{int(x) & ((1 << w) - 1):0{w // 4}x}" for x in _bits(v.reshape(1)).tolist())
    return r


def fidelity():
    """Each side on the recorded inputs against the output that side recorded: must be bitwise identical."""
    expected = load_file(str(HERE / "expected.safetensors"))
    inputs = load_inputs()
    out = {}
    for s, fn, settings in (("a", side_a, SETTINGS_A), ("b", side_b, SETTINGS_B)):
        try:
            got = run_side(fn, settings, inputs)
        except Exception as e:  # the report says which side and why
            out[s] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
            continue
        if not isinstance(got, torch.Tensor):
            out[s] = {"ok": False, "error": f"side_{s} returned {type(got).__name__}, not a tensor"}
            continue
        r = compare(got, expected[s])
        ok = r["equal"] and not r["aligned"]
        out[s] = {"ok": ok, "error": None if ok else (r["reason"] or (
            f"{r['mismatched']} of {r['numel']} elements differ from the recorded output (max abs {r['max_abs']}, "
            f"max ULP {r['max_ulp']})" if r["mismatched"] else f"shape {r['shape_a']} != recorded {r['shape_b']}"))}
    return out


def _fmt(v):
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


def _report(rows):
    print(f"divtrace repro: {ORIGIN['module'] or '<root>'} call {ORIGIN['call']}  "
          f"(a: {ORIGIN['label_a']}, b: {ORIGIN['label_b']}; {ORIGIN['tensor']})")
    for s, names in (("a", OPS["a"]), ("b", OPS["b"])):
        print(f"  side {s}: {len(names)} op{'' if len(names) == 1 else 's'}: "
              f"{', '.join(names) if names else '(returns its input)'}")
    if SETTINGS_A == SETTINGS_B:
        print("  settings (both sides): " + (", ".join(f"{k}={v}" for k, v in SETTINGS_A.items()) or "-"))
    else:
        for s, st in (("a", SETTINGS_A), ("b", SETTINGS_B)):
            print(f"  settings {s}: " + (", ".join(f"{k}={v}" for k, v in st.items()) or "-"))
    head = ["inputs", "equal", "mismatched", "max abs", "max ULP", "first mismatch", "a (bits)", "b (bits)"]
    table = [head]
    for name, r in rows:
        table.append([name, "yes" if r["equal"] else "NO",
                      f"{r['mismatched']}/{r['numel']}" if r["mismatched"] is not None else (r["reason"] or "-"),
                      _fmt(r["max_abs"]),
                      _fmt(r["max_ulp"]) + (f" (+{r['sign_flips']} sign flips)" if r["sign_flips"] else ""),
                      _fmt(r["first_index"]) + (" (reshaped)" if r["aligned"] else ""),
                      f"{r['first_a']} ({r['first_a_bits']})" if r["first_a"] is not None else "-",
                      f"{r['first_b']} ({r['first_b_bits']})" if r["first_b"] is not None else "-"])
    widths = [max(len(str(row[i])) for row in table) for i in range(len(head))]
    for row in table:
        print("  " + "  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip())
    for why in dict.fromkeys(r["reason"] for _, r in rows if r["reason"]):
        print(f"  note: {why}")


def main(argv=None):
    p = argparse.ArgumentParser(description="Run both sides of a divtrace divergence and compare them bitwise. "
                                            "Exit 1 while they differ, 0 once they are equal.")
    p.add_argument("--trials", type=int, default=0, help="also compare on N random inputs (same shapes/dtypes/ranges)")
    p.add_argument("--seed", type=int, default=1, help="first seed of the random trials")
    p.add_argument("--fidelity", action="store_true", help="check each side against its recorded output instead")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--device", help=f"run on this device instead of the recorded {RECORDED_DEVICE}")
    args = p.parse_args(argv)
    if args.device:
        global DEVICE
        DEVICE = torch.device(args.device)
    if args.fidelity:
        res = fidelity()
        print(json.dumps(res) if args.json else "\n".join(
            f"side {s}: {'reproduces its recorded output bitwise' if r['ok'] else 'DOES NOT reproduce: ' + r['error']}"
            for s, r in res.items()))
        return 0 if all(r["ok"] for r in res.values()) else 1
    inputs = load_inputs()
    rows = [("recorded", compare(run_side(side_a, SETTINGS_A, inputs), run_side(side_b, SETTINGS_B, inputs)))]
    for i in range(args.trials):
        x = random_inputs(args.seed + i)
        rows.append((f"random seed={args.seed + i}", compare(run_side(side_a, SETTINGS_A, x), run_side(side_b, SETTINGS_B, x))))
    differ = sum(not r["equal"] for _, r in rows)
    if args.json:
        print(json.dumps({"differ": differ, "rows": [{"inputs": n, **r} for n, r in rows]}))
    else:
        _report(rows)
        print(f"FAILED: side_a and side_b differ on {differ} of {len(rows)} input sets" if differ else
              f"PASSED: side_a and side_b are bitwise equal on all {len(rows)} input sets")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
'''
