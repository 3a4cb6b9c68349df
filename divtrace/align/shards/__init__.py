"""Sharded runs: the ranks' traces of a run directory put together into global values before anything is compared
(docs/sharded.md).

- plan.py: data groups, alignment of the ranks' records, and each value's global key from its layout (blocks
  tiled and summed, replicas checked, partial sums held back until reduced);
- view.py: `RunView`, the run as one Trace of global values;
- tokens.py: the run's token rows (row partials of blocks summed);
- tensors.py: a sharded value's bytes put together (full mode);
- keys.py: the keys of values with no global value to compare (`RankLocal`, `ReplicaMismatch`);
- open.py: `open_side`, a trace directory or a run directory, as what bisect and repro read.

In: run directories (divtrace.trace.run). Out: RunViews, which divtrace.compare and divtrace.repro read as traces.
"""
from divtrace.align.shards.open import open_side

__all__ = ["open_side"]
