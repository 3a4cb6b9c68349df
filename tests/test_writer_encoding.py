"""The writer's fast encoders must write exactly what the plain json module and the old rounding wrote."""
from __future__ import annotations

import json
import math
import random

import pytest

from divtrace.trace.records import (ModuleEnter, ModuleExit, OpRecord, TensorValue, _short_stats, _value_compact,
                                    contiguous_stride, json_safe, record_compact, record_line)
from divtrace.trace.files import compact_encoder, readable_json


CASES = [{"b": [1, 2.5, -0.0, "x\u00e9\n", None, True], "a": {"k": 1e300, "j": [[]]}}, [], "s", 3, 0.1,
         {"$v": 3}, [{"$tuple": [1, 2]}, {"$float": "nan"}], {"deep": [[[[1e-320, 5e-324]]]]}]


@pytest.mark.parametrize("obj", CASES)
def test_compact_encoder_matches_json(obj):
    assert compact_encoder()(obj) == json.dumps(obj, separators=(",", ":"), allow_nan=False)
    assert compact_encoder(sort_keys=True)(obj) == json.dumps(obj, separators=(",", ":"), sort_keys=True)


def test_compact_encoder_keeps_errors_and_default():
    with pytest.raises(ValueError):
        compact_encoder()({"x": math.nan})
    with pytest.raises(TypeError):
        compact_encoder()({"x": object()})
    enc = compact_encoder(default=str, allow_nan=True)
    obj = [math.inf, {"d": complex(1, 2)}]
    assert enc(obj) == json.dumps(obj, default=str, separators=(",", ":"))


def test_readable_meta_json_round_trips_one_key_per_line():
    meta = {"z": 1, "module_tree": [["", "M"], ["a", "Linear"]], "settings": {"b": None, "a": "high"}}
    text = readable_json(meta)
    assert json.loads(text) == meta
    lines = text.splitlines()
    assert lines[0] == "{" and lines[-1] == "}" and len(lines) == len(meta) + 2
    assert lines[1].startswith(' "module_tree"')  # keys sorted


def test_short_stats_rounds_as_before():
    rng = random.Random(0)
    for _ in range(2000):
        st = {"min": rng.uniform(-1e6, 1e6) * 10 ** rng.randint(-40, 30), "max": rng.random(),
              "mean": rng.gauss(0, 1) * 10 ** rng.randint(-10, 10), "absmax": 1.0, "nan": rng.randint(0, 3), "inf": 0}
        old = [float(f"{st[k]:.{7 if k == 'mean' else 9}g}") if isinstance(st[k], float) else st[k]
               for k in ("min", "max", "mean", "nan", "inf")]
        assert _short_stats(st) == old
    st = {"min": "nan", "max": "nan", "mean": "nan", "absmax": "nan", "nan": 4, "inf": 0}
    assert _short_stats(st) == ["nan", "nan", "nan", 4, 0]


def test_value_compact_omits_contiguous_stride_only():
    v = TensorValue(1, "torch.float32", [2, 3], [3, 1], "0" * 32)
    assert "t" not in _value_compact(v)
    v = TensorValue(1, "torch.float32", [2, 3], [1, 2], "0" * 32)
    assert _value_compact(v)["t"] == [1, 2]
    v = TensorValue(1, "torch.float32", [2, 3], [3, 1], "0" * 32)  # the cached stride is not shared out
    _value_compact(v)
    assert _value_compact(TensorValue(2, "torch.float32", [2, 3], [3, 1], "0" * 32)).get("t") is None


def _old_line(rec, values) -> str:
    """What the writer wrote before records.record_line: the compact dict through the encoder (json_safe on a
    non-finite float)."""
    d = record_compact(rec, values)
    try:
        return json.dumps(d, separators=(",", ":"), allow_nan=False)
    except ValueError:
        return json.dumps(json_safe(d), separators=(",", ":"), allow_nan=False)


def _random_value(rng: random.Random, vid: int) -> TensorValue:
    shape = [rng.randint(0, 5) for _ in range(rng.randint(0, 4))]
    stride = contiguous_stride(shape) if rng.random() < 0.6 else [rng.randint(0, 9) for _ in shape]

    def num():
        k = rng.random()
        if k < 0.4:  # fixed notation (a decimal exponent from -4 to 8) and the edges around it
            return rng.uniform(-1, 1) * 10.0 ** rng.randint(-6, 10)
        if k < 0.6:
            return rng.uniform(-1, 1) * 10.0 ** rng.randint(-320, 307)
        if k < 0.75:
            return float(rng.randint(-10**12, 10**12))
        if k < 0.85:
            return rng.choice([math.nan, math.inf, -math.inf, -0.0, 0.0, "nan", 5e-324, 1e9, 999999999.5])
        return rng.randint(-5, 5) if rng.random() < 0.5 else rng.choice([True, None])

    stats = {}
    k = rng.random()
    if k < 0.8:
        stats = {"min": num(), "max": num(), "mean": num(), "absmax": 1.0, "nan": rng.choice([0, 3, True, 2.0]),
                 "inf": 0}
    elif k < 0.9:
        stats = {"min": 1.0, "max": math.nan, "count": 4}
    if shape and rng.random() < 0.05:  # (not from a tensor: the text path must leave them to the encoder)
        (shape if rng.random() < 0.5 else stride)[0] = rng.choice([True, False, 2.0])
    v = TensorValue(vid, rng.choice(["torch.float32", "torch.bfloat16", "torch.int64", "float8_e4m3fn"]), shape,
                    stride, rng.choice(["0123456789abcdef" * 2, "h\u00e9\"x", "deadbeef"]),
                    rng.choice(["cpu", "cpu", "cuda:0", "meta"]), stats, rng.choice([None, vid - 1, 0, True]))
    if rng.random() < 0.3:
        v.blob, v.shard = f"float32-{vid}-abc", rng.choice(["tensors-00000.safetensors", None])
    v.derived = rng.random() < 0.3
    return v


def test_record_line_is_the_compact_dict_encoded():
    rng = random.Random(7)
    for i in range(6000):
        values = [_random_value(rng, 10 * i + j) for j in range(rng.randint(0, 3))]
        k = i % 3
        keyed = rng.choice([[("args.0", 5), ("kwargs.mask", 6)], [], [("out.\u00e9\"", 7)], [["out", 7]],
                            [("out", True)], [("out", 7, 8)]])
        if k == 0:
            rec = ModuleEnter(rng.choice([i, True]), 3, rng.choice(["model.layers.0", "m\u00e9\"q"]), 1,
                              rng.choice([None, 2]), keyed)
        elif k == 1:
            rec = ModuleExit(i, 3, keyed, rng.choice([None, "boom\n\u00e9"]))
        else:
            rec = OpRecord(i, 3, "aten.mm.default", [{"$v": 1}, rng.choice([2, math.nan, 0.5, "x"])],
                           rng.choice([{}, {"alpha": math.inf}, {"dim": 1}]), [1], [2], {"$v": 2})
        assert record_line(rec, values) == _old_line(rec, values), (rec, values)
