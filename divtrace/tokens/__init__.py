"""Token identity: which token each row of a recorded tensor is.

Record time: `identity` turns a root call's inputs (HF-style `input_ids`, `attention_mask`, `position_ids`, a
cache) or a declaration (`rec.tokens(ids, positions, seqs)`) into a token grid, one content key per row;
`layout` finds the token dims of every tensor of the call; `rowhash` fingerprints each token row; `store` writes
both beside the trace (tokens.jsonl, rows.jsonl, rows.bin) and reads them back. Compare time lives in
divtrace/compare/token_align.py and token_bisect.py.
"""
