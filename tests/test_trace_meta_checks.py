"""meta.json is checked against the records (issue 22 item 4): a meta.json edited to say what the records
contradict (status, module tree, calls left running) is a damaged trace, exit 2 with one line naming meta.json,
in `show --check` and `bisect`. And every trace the recorder writes, interrupted ones included, still opens."""
from __future__ import annotations

import json

import pytest
import torch

import divtrace
from divtrace.errors import DivtraceError
from divtrace.trace.reader import Trace
from test_trace_fixtures import Tiny, cli, copy_trace, edit_meta, record_tiny, tiny_input


def one_line_error(code, out, err, *needles):
    assert code == 2, out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    for n in needles:
        assert n in lines[0], lines[0]


def record_interrupted(path, *, catch_inside=False, call_again=False, **kw):
    """Tiny recorded while its `act` raises KeyboardInterrupt on its first call (the user's Ctrl-C in the
    forward): it propagates out of the block, or is caught inside it (`catch_inside`), where the model may be
    called again (`call_again`, which drops the interrupted calls)."""
    model = Tiny(0)
    real, calls = model.act.forward, []

    def act(x):
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return real(x)

    model.act.forward = act
    try:
        with torch.no_grad(), divtrace.record(model, path, **kw):
            try:
                model(tiny_input())
            except KeyboardInterrupt:
                if not catch_inside:
                    raise
            if call_again:
                model(tiny_input())
    except KeyboardInterrupt:
        pass
    return path


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    d = tmp_path_factory.mktemp("meta")
    return {"a": record_tiny(d / "a"), "b": record_tiny(d / "b"), "interrupted": record_interrupted(d / "intr")}


def meta_of(path):
    return json.loads((path / "meta.json").read_text())


# edit of meta.json -> what the one-line error must name
EDITS = {
    "module_dropped_from_tree": (lambda m: {"module_tree": [e for e in m["module_tree"] if e[0] != "act"]},
                                 "module_tree has no module 'act'"),
    "root_dropped_from_tree": (lambda m: {"module_tree": m["module_tree"][1:]}, "module_tree has no module '<root>'"),
    "status_running_but_closed": (lambda m: {"status": "running", "complete": False}, "status is running"),
    "status_complete_but_not_complete": (lambda m: {"complete": False}, "complete is False"),
    "complete_with_an_error": (lambda m: {"error": "SIGTERM"}, "records an error"),
    "calls_left_running_invented": (lambda m: {"unfinished_calls": 2}, "says 2 module calls were left running"),
}


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_edited_meta_of_a_complete_trace_is_a_damaged_trace(traces, tmp_path, edit):
    change, needle = EDITS[edit]
    t = copy_trace(traces["a"], tmp_path / "t")
    edit_meta(t, **change(meta_of(t)))
    one_line_error(*cli("show", t, "--check"), "damaged trace", str(t / "meta.json"), needle)
    one_line_error(*cli("bisect", traces["b"], t), "damaged trace", str(t / "meta.json"), needle)
    one_line_error(*cli("bisect", t, traces["b"], "--json"), "damaged trace", needle)
    with pytest.raises(DivtraceError, match="damaged trace"):
        Trace(t)


def test_interrupted_trace_marked_complete_is_a_damaged_trace(traces, tmp_path):
    """An interrupted recording edited to say it completed with nothing left running: its records end inside
    `act`, which never returned."""
    src = traces["interrupted"]
    m = meta_of(src)
    assert (m["status"], m["complete"], m["unfinished_calls"]) == ("interrupted", False, 2)
    assert cli("show", src, "--check")[0] == 1  # as recorded: incomplete (FAILED), not damaged
    t = copy_trace(src, tmp_path / "t")
    edit_meta(t, status="complete", complete=True, error=None, unfinished_calls=0)
    one_line_error(*cli("show", t, "--check"), "damaged trace", "ends inside act call 0, which never returned")
    one_line_error(*cli("bisect", traces["a"], t), "damaged trace", "act call 0")
    t2 = copy_trace(src, tmp_path / "t2")
    edit_meta(t2, unfinished_calls=1)
    one_line_error(*cli("show", t2, "--check"), "says 1 module calls were left running, records.jsonl leaves 2")


def test_record_count_edit_is_still_refused(traces, tmp_path):
    t = copy_trace(traces["a"], tmp_path / "t")
    edit_meta(t, records=meta_of(t)["records"] + 1)
    one_line_error(*cli("show", t, "--check"), str(t / "meta.json"), "records")


@pytest.mark.parametrize("case", ["caught_at_end", "caught_then_called_again", "include", "exclude",
                                  "include_caught_at_end", "no_module_tree", "no_unfinished_calls"])
def test_traces_the_recorder_writes_are_not_called_damaged(traces, tmp_path, case):
    """Every check holds for what divtrace writes: an interrupt caught inside the block leaves calls running in
    a trace marked complete (at its end: unfinished_calls counts them; before a later call of the root: dropped,
    so 0), filters leave modules of the tree uncalled, older traces lack fields."""
    p = tmp_path / case
    if case == "caught_at_end":
        record_interrupted(p, catch_inside=True)
        assert meta_of(p)["unfinished_calls"] == 2
    elif case == "caught_then_called_again":
        record_interrupted(p, catch_inside=True, call_again=True)
        assert meta_of(p)["unfinished_calls"] == 0
        assert any(c.exit_index is None for c in Trace(p).calls.values())  # the dropped ones stay open
    elif case == "include":
        record_interrupted(p, include="act")
    elif case == "exclude":
        record_interrupted(p, exclude="lin")
    elif case == "include_caught_at_end":
        record_interrupted(p, include="act|out", catch_inside=True, call_again=True)
    else:
        copy_trace(traces["a"], p)
        edit_meta(p, **{case[3:]: None})
    meta = meta_of(p)
    t = Trace(p)
    assert t.meta_problems() == []
    code, out, err = cli("show", p, "--check")
    assert code == (0 if meta["complete"] else 1), out + err
    assert "damaged" not in out + err


def test_calls_left_running_names_the_interrupted_chain(traces):
    t = Trace(traces["interrupted"])
    assert [(t.calls[c].module, t.calls[c].call) for c in t.calls_left_running()] == [("", 0), ("act", 0)]
    assert Trace(traces["a"]).calls_left_running() == []
