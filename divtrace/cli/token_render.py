"""The token-aligned parts of `divtrace bisect`'s report (rich for people; --json is the result's to_dict): the
verdict line, which leads with the final values (logprobs), the origins with their token counts, the absorbed
differences, the per-module counts and the RL figures per token."""
from __future__ import annotations

from divtrace.cli.output import Output


def _ops_text(x: dict) -> str:
    """Each side's parting op, or the one both ran ("a: aten.mul.Tensor / b: _C.rotary_embedding.default")."""
    a, b = x.get("op"), x.get("op_b")
    if a and b and a != b:
        return f"a: {a} / b: {b}"
    return a or b or "-"


def origin_words(f, token: dict | None = None) -> str:
    """"model.layers.0.self_attn call 0 op X (a) / Y (b) at token position 12 of sequence 2c527a56"."""
    ops = f" op {f.op}" + (f" (a) / {f.op_b} (b)" if f.op_b and f.op_b != f.op else "") if f.op or f.op_b else ""
    routed = (getattr(f, "shards", None) or {}).get("op")
    if routed:  # expert parallelism: the op on the rank that computed the first differing row (docs/sharded.md)
        ops = f" op {routed['op_a']} on rank {routed['rank_a']} of a (record {routed['index_a']})"
    at = f" at token position {token['position']} of sequence {token['seq']['id']}" if token else ""
    return f"{f.module or '<root>'} call {f.call}{ops}{at}"


def token_text(t: dict) -> str:
    seq = t["seq"]
    return (f"position {t['position']} (id {t['id']}) of sequence {seq['id']} (first ids "
            f"{', '.join(map(str, seq['first_ids']))}): a {_cell(t['a'])}, b {_cell(t['b'])}")


def _cell(w: dict) -> str:
    """Where a side holds the token: its root call and row, and the rank that holds it alone (data parallel)."""
    rank = f" (rank {w['rank']}'s root call {w['rank_call']})" if w.get("rank") is not None else ""
    return f"root call {w['call']}{rank} row {w['row']}"


def token_verdict_line(o: Output, r, d: dict) -> None:
    """The first line: PASSED / FAILED / INCONCLUSIVE, leading with the final values per token."""
    la, lb = r.labels
    tk = d["tokens"]
    n, k = tk["final_compared"], tk["final_differing"]
    if r.verdict == "identical":
        o.passed(f"identical: logprobs bitwise identical on {n}/{n} tokens; {tk['shared']} shared tokens, every "
                 f"compared row bitwise equal ({r.compared} row pairs) [{la} vs {lb}]")
    elif r.verdict == "absorbed":
        o.passed(f"final outputs identical on {n}/{n} tokens; {len(d['absorbed'])} internal differences absorbed "
                 f"[{la} vs {lb}: {tk['shared']} shared tokens; exit 4: the differences never reach a logprob]")
    elif r.verdict == "inconclusive":
        o.inconclusive(f"{r.reason} [{la} vs {lb}: {tk['shared']} shared tokens, {tk['differing']} differ; "
                       f"logprobs compared on {n} ({k} differ); {tk['only_a']} tokens only in a, {tk['only_b']} only "
                       "in b]")
    else:
        f = d["first"]
        lead = f"logprobs differ on {k} of {n} tokens" if n else "logprobs not compared"
        if f["kind"] in ("positions", "derivation"):
            o.failed(f"{lead}; first: {f['cause_text']} [cause: {f['cause']}]")
        else:
            o.failed(f"{lead}; first divergence originates in {origin_words(r.first, f.get('token'))} "
                     f"[cause: {f['cause']}]")
        if not all(r.complete) or r.coverage.parted:  # the reason says what may be missing past the origin
            o.line(f"note: {r.reason}")


def render_token_parts(o: Output, d: dict) -> None:
    """The parts of a token-aligned result that a call-aligned one has not: tokens, rows, origins, absorbed
    differences, per-module counts, final per token."""
    tk = d["tokens"]
    o.line(f"tokens: {tk['shared']} shared, {tk['only_a']} only in a, {tk['only_b']} only in b, {tk['differing']} "
           f"differ somewhere; logprobs compared for {tk['final_compared']} ({tk['final_differing']} differ)")
    f = d["first"]
    if f is not None and f.get("token"):
        rows = [["token", token_text(f["token"])]]
        if f.get("rows"):
            rows.append(["op rows", f"a: {f['rows']['a']}   b: {f['rows']['b']}"])
        if f.get("cause_text"):
            rows.append(["cause", f["cause_text"]])
        if f.get("batch_invariance"):
            bi = f["batch_invariance"]
            rows.append(["cause", ("not batch-invariant: " if bi["batch_invariant"] is False else "") + bi["note"]])
        if f.get("note"):
            rows.append(["reaches", f["note"]])
        o.table("first diverging token", ["field", "value"], rows)
    if d["origins"]:
        o.table("origins (each reaches a differing logprob), earliest op first; tokens: how many it is the first "
                "difference of", ["module", "call", "op", "cause", "tokens"],
                [[x["module"] or "<root>", x["call"], _ops_text(x) if x["kind"] not in ("positions", "derivation")
                  else x["tensor"], x["cause"], x["tokens"]] for x in d["origins"]])
    if d.get("absorbed"):
        o.table("absorbed (differ inside, never reach a differing logprob; not origins: latent batch variance)",
                ["module", "call", "kind", "op", "tokens"],
                [[x["module"] or "<root>", "-" if x["call"] is None else x["call"], x["kind"],
                  x.get("name") or _ops_text(x), "-" if x["tokens"] is None else x["tokens"]]
                 for x in d["absorbed"][:12]])
    if tk.get("modules"):
        o.table("tokens whose output differs, per module (forward order)", ["module", "tokens"],
                [[m or "<root>", n] for m, n in list(tk["modules"].items())[:16]])
    fin = d.get("final")
    if fin:
        rows = [["tokens compared / differing", f"{fin['tokens_compared']} / {fin['tokens_differing']}"]]
        if fin.get("only_a") or fin.get("only_b"):
            rows.append(["final value on one side only", f"a: {fin['only_a']}   b: {fin['only_b']}"])
        if fin.get("derived"):
            rows.append(["derived", fin["derivation"]])
        if fin.get("first_differing_token"):
            rows.append(["first differing token", token_text(fin["first_differing_token"])])
        for k, label in (("max_abs_logprob_diff", "max |dlogprob| (next token)"),
                         ("mean_abs_logprob_diff", "mean |dlogprob|"),
                         ("kl", f"KL({fin.get('kl_direction', 'a||b')}) mean per token"),
                         ("kl_reverse", "KL reverse, mean per token"),
                         ("kl_k3", "k3 KL estimate (mean of e^r - 1 - r)"),
                         ("token_mult_prob_error", "token_mult_prob_error (mean of e^|r|)")):
            if fin.get(k) is not None:
                rows.append([label, fin[k]])
        o.table(f"final values per shared token ({fin['tensor']}; r = logp_train - logp_infer of the next token; "
                "docs/numbers.md)", ["metric", "value"], rows)
        if fin.get("caveat"):
            o.line(f"caveat: {fin['caveat']}")
