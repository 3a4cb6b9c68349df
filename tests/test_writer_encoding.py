"""The writer's fast encoders must write exactly what the plain json module and the old rounding wrote."""
from __future__ import annotations

import json
import math
import random

import pytest

from divtrace.trace.records import TensorValue, _short_stats, _value_compact
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
