"""record/shard_rules.ruled_layouts keeps the rules' answer per op, keyed by the arguments with tensors marked and
each tensor argument's shape and layout: each answer must equal the rules' own (`_arg_items` + `propagate`, built
afresh) for the same call, whatever calls came before it (the same op with its tensors at other places, in a
list, another layout, a plain input)."""
import torch

from divtrace.record import shard_rules
from divtrace.record.shard_rules import Lay, _arg_items, _propagate, ruled_layouts


def _direct(func, args, tensors, lays):
    vids = list(range(len(tensors)))
    by_vid = {v: lay for v, lay in zip(vids, lays) if lay is not None}
    items = _arg_items(args, tensors, tensors, vids, by_vid)
    if items is None:
        return None
    pointwise = torch.Tag.pointwise in func.tags
    outs = func(*args)
    outs = [outs] if isinstance(outs, torch.Tensor) else list(outs)
    return tuple(_propagate(str(func), pointwise, args, items, [tuple(o.shape) for o in outs]))


def _memo(func, args, tensors, lays):
    vids = list(range(len(tensors)))
    by_vid = {v: lay for v, lay in zip(vids, lays) if lay is not None}
    outs = func(*args)
    outs = [outs] if isinstance(outs, torch.Tensor) else list(outs)
    ins = tuple((t.shape, by_vid.get(v)) for t, v in zip(tensors, vids))
    return ruled_layouts(func, str(func), args, ins, tensors, tensors, vids, by_vid, outs)


def test_kept_answers_equal_the_rules_own():
    shard_rules._RULED.clear()
    aten = torch.ops.aten
    cols = Lay(0, ("S1",), (4, 16), (0, 8))  # a column block of a [4, 16] value
    rows = Lay(0, ("S0",), (16, 8), (8, 0))  # the matching row block of a [16, 8] value
    x, y, w = torch.randn(4, 8), torch.randn(4, 8), torch.randn(8, 8)
    calls = [
        (aten.add.Tensor, (x, y), [x, y], [cols, None]),
        (aten.add.Tensor, (y, x), [y, x], [None, cols]),  # the laid tensor at the other place
        (aten.add.Tensor, (x, y), [x, y], [cols, None]),  # met again: the kept answer
        (aten.mm.default, (x, w), [x, w], [cols, None]),
        (aten.mm.default, (x, w), [x, w], [None, rows]),
        (aten.mm.default, (x, w), [x, w], [cols, rows]),  # contraction over the block: a partial sum
        (aten.cat.default, ([x, y], 1), [x, y], [cols, None]),
        (aten.cat.default, ([x, y], 0), [x, y], [cols, cols]),
        (aten.cat.default, ([x, y], 0), [x, y], [cols, cols]),
        (aten.t.default, (x,), [x], [cols]),
        (aten.transpose.int, (x, 0, 1), [x], [cols]),
        (aten.transpose.int, (x, 1, 0), [x], [cols]),
        (aten.add.Tensor, (x, y), [x, y], [None, None]),  # no input with a layout
    ]
    seen = []
    for func, args, tensors, lays in calls * 2:
        got = _memo(func, args, tensors, lays)
        want = _direct(func, args, tensors, lays)
        assert got == want, (func, lays)
        seen.append(got)
    assert any(g is not None and g[0] is not None and g[0].placements == ("P",) for g in seen)  # (mm over the block)
    assert any(g is not None and g[0] is not None and g[0].placements == ("S1",) for g in seen)
    assert len({g for g in seen}) > 3  # (the calls do not all answer alike)
