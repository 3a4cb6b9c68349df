"""The checks on one recorded op: the same call twice (determinism), then its rows alone, in splits and padded
into a larger batch, each compared bitwise with the same rows of the recorded batch (batch invariance)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from divtrace.audit.replay import RecordedCall
from divtrace.audit.rows import RowPlan
from divtrace.compare.metrics import FLOAT_DTYPES, bitwise_equal, raw_bits, ulp_distance

MAX_SINGLE_ROWS = 32  # rows computed one at a time (M=1); more rows than this are sampled evenly, ends included


@dataclass
class RowResult:
    """What the batch-invariance checks of one op found."""

    n: int
    checked: list[int] = field(default_factory=list)  # the batch sizes M each row was computed in
    differ_at: list[int] = field(default_factory=list)  # the M whose rows differ from the recorded batch's
    rows: list[int] = field(default_factory=list)  # rows (0..n-1) that differ in some M
    max_ulp: int | None = None  # worst element of any differing row (None: only non-float outputs differ)
    single_rows: int = 0  # rows computed alone
    notes: list[str] = field(default_factory=list)

    @property
    def invariant(self) -> bool:
        return not self.differ_at


def same_bytes(a: list, b: list) -> bool:
    return len(a) == len(b) and all(bitwise_equal(x, y) for x, y in zip(a, b))


def _row_diff(got: torch.Tensor, want: torch.Tensor, dim: int):
    """(indices of differing rows along `dim`, max ULP among them or None) of two same-shaped tensors."""
    if got.dtype != want.dtype or got.shape != want.shape:
        return list(range(want.shape[dim])), None
    want = want.to(got.device)
    bg, bw = raw_bits(got), raw_bits(want)
    if torch.equal(bg, bw):  # the common case, in one pass
        return [], 0
    diff = bg != bw
    if diff.dim() > want.dim():  # complex: (real, imag) as a trailing dim
        diff = diff.any(dim=-1)
    other = [d for d in range(diff.dim()) if d != dim]
    per_row = diff.any(dim=other) if other else diff
    rows = per_row.nonzero().reshape(-1).tolist()
    ulp = None
    if got.dtype in FLOAT_DTYPES:  # over the differing elements only
        u = ulp_distance(got.contiguous()[diff], want.contiguous()[diff])
        ulp = int(u.max())
        if ulp < 0:  # NaN against a number
            ulp = None
    return rows, ulp


def packed(part: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """Rows cut from `whole`, dense in whole's dim order, as an engine lays out a batch of these rows: a strided
    view of the batch would send elementwise kernels down their non-vectorized path (another result for gelu on
    a CPU), a difference of the view, not of the batch. Broadcast (stride-0) inputs stay views."""
    if 0 in whole.stride():
        return part
    if whole.is_contiguous():
        return part.contiguous()
    order = sorted(range(whole.dim()), key=lambda d: (-whole.stride()[d], d))
    return part.permute(order).contiguous().permute([order.index(d) for d in range(whole.dim())])


def _single_rows(n: int) -> list[int]:
    if n <= MAX_SINGLE_ROWS:
        return list(range(n))
    step = (n - 1) / (MAX_SINGLE_ROWS - 1)
    return sorted({round(i * step) for i in range(MAX_SINGLE_ROWS)})


def _causal_mask(s: int, e: int, dtype, device):
    """Rows [s, e) of a causal mask over keys [0, e), additive (0 or -inf) in the query's dtype, as the
    scaled-dot-product front end hands a mask to its kernels: a query row sees the keys up to its position."""
    keep = torch.arange(e, device=device)[None, :] <= torch.arange(s, e, device=device)[:, None]
    return torch.zeros(keep.shape, dtype=dtype, device=device).masked_fill(~keep, float("-inf"))


def check_rows(call: RecordedCall, plan: RowPlan, tensors: dict, ref: list, seed: int = 0) -> RowResult:
    """Each row of `plan` computed in other batches and compared bitwise with `ref` (the recorded batch's
    outputs, replayed)."""
    n = plan.n
    res = RowResult(n)
    variants: list[list[tuple[int, int]]] = []  # each: row ranges [s, e) computed as separate calls
    if n > 1:
        variants.append([(i, i + 1) for i in _single_rows(n)])
    half = n // 2
    if half > 1:
        variants.append([(0, half), (half, n)])
    if n - 1 > 1 and n - 1 != half:
        variants.append([(0, n - 1)])
    res.single_rows = len(variants[0]) if variants else 0
    diff_rows: set[int] = set()
    differ_at: set[int] = set()
    checked: set[int] = set()

    def record(sizes, rows, ulp):
        checked.update(sizes.values())
        if rows:
            differ_at.update(sizes[r] for r in rows)
            diff_rows.update(rows)
            if ulp is not None:
                res.max_ulp = ulp if res.max_ulp is None else max(res.max_ulp, ulp)

    skipped_chunks = 0
    for chunks in variants:
        done, sizes = [], {}
        for s, e in chunks:
            inputs = dict(tensors)
            overrides = {}
            for vid, d in plan.inputs.items():
                inputs[vid] = packed(tensors[vid].narrow(d, s, e - s), tensors[vid])
            if plan.causal is not None:
                c = plan.causal
                for vid in (c["k"], c["v"]):
                    inputs[vid] = packed(tensors[vid].narrow(c["kdim"], 0, e), tensors[vid])
                overrides["is_causal"] = False
                if e - s > 1:
                    if c["mask_arg"] is None:
                        skipped_chunks += 1
                        continue
                    q = tensors[next(iter(plan.inputs))]
                    overrides[c["mask_arg"]] = _causal_mask(s, e, q.dtype, q.device)
            done.append((s, e, call.run(inputs, overrides)))
            sizes.update({r: e - s for r in range(s, e)})
        if not done:
            continue
        # one comparison per variant: the chunks' rows side by side against the same rows of the batch
        order = [r for s, e, _ in done for r in range(s, e)]
        rows, ulp = set(), 0
        for i, d in plan.outputs.items():
            got = torch.cat([o[i] for _, _, o in done], dim=d) if len(done) > 1 else done[0][2][i]
            want = ref[i]
            if order != list(range(n)):
                want = want.index_select(d, torch.tensor(order, device=want.device))
            r, u = _row_diff(got, want, d)
            rows.update(order[x] for x in r)
            ulp = None if u is None or ulp is None else max(u, ulp)
        record(sizes, sorted(rows), ulp if rows else 0)
    if skipped_chunks:
        res.notes.append(f"{skipped_chunks} causal chunks of more than one row not run: the kernel takes no mask")

    if plan.causal is None:  # padded into 2n+1 rows: n rows before (the batch's rows in a random order), 1 after
        g = torch.Generator().manual_seed(seed)
        perm = torch.randperm(n, generator=g)
        after = torch.randint(0, n, (1,), generator=g)
        inputs = dict(tensors)
        for vid, d in plan.inputs.items():
            x = tensors[vid]
            inputs[vid] = packed(torch.cat([x.index_select(d, perm.to(x.device)), x,
                                            x.index_select(d, after.to(x.device))], dim=d), x)
        outs = call.run(inputs)
        rows, ulp = [], 0
        for i, d in plan.outputs.items():
            r, u = _row_diff(outs[i].narrow(d, n, n), ref[i], d)
            rows += r
            ulp = None if u is None or ulp is None else max(u, ulp)
        record({r: 2 * n + 1 for r in range(n)}, sorted(set(rows)), ulp if rows else 0)
    else:
        res.notes.append("causal attention: not padded (other query rows would change what a row may see)")
    res.checked = sorted(checked)
    res.differ_at = sorted(differ_at)
    res.rows = sorted(diff_rows)
    return res


def with_layout(t: torch.Tensor, shape, stride) -> torch.Tensor:
    """t's values in the recorded memory layout (kernels can depend on it), as repro.py's _with_layout does:
    exact strides where they can be written, else the same dim order; broadcast (stride-0) dims stay broadcast."""
    if stride is None or t.dim() != len(stride) or list(t.stride()) == list(stride) or t.numel() <= 1:
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
        except RuntimeError:  # overlapping layouts cannot be written to
            pass
    order = sorted(range(t.dim()), key=lambda d: (-stride[d], d))
    dense = base.permute(order).contiguous().permute([order.index(d) for d in range(t.dim())])
    return dense.expand(t.shape) if bcast else dense

