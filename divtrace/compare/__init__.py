"""Comparing two aligned traces: is every compared tensor bitwise equal, and if not, where does the difference
originate?

- values.py: value comparators (fingerprints, or a tolerance on the bytes), per token row over token views;
- metrics.py, diffs.py: what a differing pair measures (ulps, sign flips, first differing element);
- op_kinds.py: what an op does to values (computes, moves, casts exactly, writes in place);
- walker.py: `OriginWalker`, from a differing pair of calls down to the innermost call and first op where it
  originates;
- bisect.py (by calls) and token_bisect.py (by tokens): the sweep and the walk, with results.py (`BisectResult`),
  final_outputs.py / final.py / token_final.py (the final logits) and verdict.py (identical, diverged,
  within_tolerance or inconclusive);
- plot.py, token_plot.py, compiled_report.py: what bisect draws and says about compiled traces.

In: two traces (divtrace.trace) and their alignment (divtrace.align). Out: a BisectResult (`divtrace.bisect`,
`divtrace bisect --json`), whose first divergence repro (divtrace.repro) reproduces. A hash-trace bisect imports
no torch.
"""
