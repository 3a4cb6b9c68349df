"""Ranks whose op sequences part (tests/moe_part_cases.py): an MoE layer whose experts' loop runs only over the
experts that got rows (as HF Mixtral's does), its experts split over 2 gloo ranks by all_to_all, against the same
layer on a process group of one. A routing difference that empties an expert on one rank makes that rank run fewer
ops, so past that record the ranks' values cannot be put together.

Never a lie: divtrace saw those ops, so the verdict never says it "ran computation divtrace did not see".
- the router's weight planted (the token's ids differ, before the ranks part): diverged at the router, exit 1;
- the token rerouted inline after an equal router (nothing differs before the ranks part): inconclusive, exit 3,
  the reason naming the record where they part, each rank's op and the module.
Ground truth from plain forward hooks (the router's rows on both sides, the experts each rank ran)."""
from __future__ import annotations

import pytest

import divtrace
from dist_harness import run_ranks
from moe_part_cases import EXPERTS, find_plant, worker
from moe_ops_cases import merge
from sharded_cases import bits_equal

MODES = ("full", "hash")
PLANTS = (("none", None), ("router", "router"), ("inline", "inline"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("parted")
    ep2 = run_ranks(worker, 2, str(root / "ep2"), [(f"{n}-{m}", m, p) for m in MODES for n, p in PLANTS])
    ep1 = run_ranks(worker, 1, str(root / "ep1"), [(m, m, None) for m in MODES])
    return root, ep2, ep1[0]


def _bisect(root, name, mode):
    return divtrace.bisect(str(root / "ep2" / f"{name}-{mode}"), str(root / "ep1" / mode))


def _truth(ep2, ep1, name):
    """(tokens whose router ids differ, whether the router inputs are equal, the experts each EP rank ran, whether
    the outputs are bitwise equal)."""
    a, b = merge([r[name] for r in ep2], ("ran", "out")), ep1[name.split("-")[1]]
    same_x = all(bits_equal(a["x"][t], b["x"][t]) for t in b["x"])
    ids = sorted(t for t in b["ids"] if not bits_equal(a["ids"][t], b["ids"][t]))
    return ids, same_x, [r[name]["ran"] for r in ep2], bits_equal(ep2[0][name]["out"], b["out"])


def _fewer(ran):
    n = EXPERTS // 2
    counts = [len([e for e in ran[r] if r * n <= e < r * n + n]) for r in (0, 1)]
    assert counts[0] != counts[1], ran  # ground truth: the ranks ran different numbers of experts
    return min((0, 1), key=lambda r: counts[r])


@pytest.mark.gloo
@pytest.mark.parametrize("mode", MODES)
def test_unplanted_ranks_run_the_same_ops(runs, mode):
    root, ep2, ep1 = runs
    ids, same_x, ran, same_out = _truth(ep2, ep1, f"none-{mode}")
    assert not ids and same_x and same_out and len(ran[0]) == len(ran[1])
    r = _bisect(root, "none", mode)
    assert r.verdict == "identical" and not r.coverage.parted, r.reason


@pytest.mark.gloo
@pytest.mark.parametrize("mode", MODES)
def test_router_difference_before_the_ranks_part_is_diverged_at_the_router(runs, mode):
    root, ep2, ep1 = runs
    ids, same_x, ran, _ = _truth(ep2, ep1, f"router-{mode}")
    _, tok, _, _ = find_plant()
    assert same_x and ids == [tok]
    fewer = _fewer(ran)
    r = _bisect(root, "router", mode)
    assert r.verdict == "diverged" and r.exit_code == 1, r.reason
    assert r.first.module == "moe.router", r.to_dict()["first"]
    assert "did not see" not in r.reason and not r.coverage.unseen["a"]
    assert f"rank {fewer}: aten.cat.default in moe.experts (call 0)" in r.coverage.parted["a"][0]


@pytest.mark.gloo
@pytest.mark.parametrize("mode", MODES)
def test_ranks_that_part_with_no_origin_before_are_inconclusive_where_they_part(runs, mode):
    root, ep2, ep1 = runs
    ids, same_x, ran, same_out = _truth(ep2, ep1, f"inline-{mode}")
    assert same_x and not ids and not same_out  # the router agrees; the outputs do not: "identical" would be a lie
    fewer, other = _fewer(ran), 1 - _fewer(ran)
    r = _bisect(root, "inline", mode)
    assert r.verdict == "inconclusive" and r.exit_code == 3 and r.first is None, r.reason
    assert "did not see" not in r.reason and not r.coverage.unseen["a"], r.reason
    (part,) = r.coverage.parted["a"]
    assert part.startswith("ranks 0 and 1 run different ops from record "), part
    assert f"rank {fewer}: aten.cat.default in moe.experts (call 0)" in part, part  # its loop ended: the cat
    assert f"rank {other}: aten.slice.Tensor in moe.experts (call 0)" in part, part  # its next expert's rows
    assert part in r.reason and "no divergence was found before that" in r.reason, r.reason


@pytest.mark.gloo
def test_cli_exit_code_and_reason(runs):
    from test_trace_fixtures import cli

    root, _, _ = runs
    code, out, _ = cli("bisect", root / "ep2" / "inline-hash", root / "ep1" / "hash")
    flat = " ".join(out.split())
    assert code == 3 and "ran different ops" in flat and "did not see" not in flat, out


def _flat(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.gloo
@pytest.mark.parametrize("name", ["router", "inline"])
def test_past_the_parting_the_final_output_is_not_compared(runs, name):
    """The outputs differ (hooks), but past where the ranks part nothing can be put together: `coverage` never says
    the final outputs were compared (nor equal), and `final` holds no mismatch of a value never compared."""
    root, ep2, ep1 = runs
    assert not _truth(ep2, ep1, f"{name}-hash")[3]  # ground truth: the outputs differ
    r = _bisect(root, name, "hash")
    assert r.coverage.parted["a"] and r.coverage.final_compared is False and r.coverage.final_equal is None
    assert "its ranks' own pieces" in r.coverage.final_note and r.final is None, r.to_dict()["coverage"]


@pytest.mark.gloo
@pytest.mark.parametrize("name", ["router", "inline"])
def test_bisect_prints_where_the_ranks_part(runs, name):
    """`divtrace bisect` (rich) prints the parting on the verdict's lines (the FAILED line's `note:` when an origin
    came first; the INCONCLUSIVE line's reason otherwise), and `--json` holds the result's coverage as is."""
    import json

    from test_trace_fixtures import cli

    root, ep2, _ = runs
    r = _bisect(root, name, "hash")
    (part,) = r.coverage.parted["a"]
    assert f"rank {_fewer([g[f'{name}-hash']['ran'] for g in ep2])}: aten.cat.default in moe.experts" in part
    code, out, _ = cli("bisect", root / "ep2" / f"{name}-hash", root / "ep1" / "hash")
    assert code == r.exit_code == (1 if name == "router" else 3), out
    flat, lead = _flat(out), "note: " if name == "router" else "INCONCLUSIVE: "
    assert _flat(lead + r.reason) in flat and _flat(part) in flat, out
    assert "final mismatch" not in flat, out  # no table of a value never compared
    code, out, _ = cli("bisect", root / "ep2" / f"{name}-hash", root / "ep1" / "hash", "--json")
    d = json.loads(out)
    assert code == r.exit_code and d["coverage"] == r.coverage.to_dict() and d["coverage"]["parted"] == {"a": [part]}
    assert d["reason"] == r.reason and d["final"] is None, d["coverage"]


@pytest.mark.gloo
@pytest.mark.parametrize("name", ["none", "router", "inline"])
def test_show_of_the_run_directory_says_where_its_ranks_part(runs, name):
    """`divtrace show RUN`: a warning per parting rank pair, and `parted` in --json, the sentences bisect's
    coverage.parted holds for that side; none where the ranks ran the same ops (hooks: as many experts each)."""
    import json

    from test_trace_fixtures import cli

    root, ep2, _ = runs
    want = _bisect(root, name, "hash").coverage.parted.get("a", [])
    ran = [g[f"{name}-hash"]["ran"] for g in ep2]
    assert bool(want) == (len(ran[0]) != len(ran[1])), (want, ran)
    code, out, err = cli("show", root / "ep2" / f"{name}-hash", "--json")
    assert code == 0 and json.loads(out)["parted"] == want, out
    code, out, err = cli("show", root / "ep2" / f"{name}-hash")
    assert code == 0 and [x for x in _flat(err).split("warning: ") if x] == [
        _flat(f"{p}: past that record their values cannot be put together, so bisect compares nothing there")
        for p in want], err
