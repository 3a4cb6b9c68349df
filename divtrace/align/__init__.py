"""Aligning two traces: which module call, and which token row, of one run is which of the other.

- paths.py: path maps (`--map FILE`, the built-in `vllm-hf`), whose rules rename, hide or split module calls so
  two stacks that name or fuse modules differently line up;
- calls.py: call pairing by (mapped path, call number);
- tokens.py: token pairing by content (a token is its sequence's ids up to it), and a trace seen through one
  token's rows (`TokenView`), whatever the batch layout, padding or decode step.

In: two traces read by divtrace.trace (their calls, values and token files). Out: pairings and views that the
comparison (divtrace.compare) walks, and repro (divtrace.repro) cuts regions from. Nothing here imports torch.
"""
