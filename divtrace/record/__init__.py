"""Recording: one run of a model, as it runs, into a trace directory.

In: a `torch.nn.Module` (or an inference engine object an adapter knows: `vllm.LLM`) and the code the user runs
inside `with divtrace.record(model, path):`. Out: a trace directory written through `divtrace.trace.writer`
(records.jsonl, checksums.jsonl, meta.json, shards in full mode, token files), which `divtrace.trace` reads.

`Recorder` (recorder.py) is the block: a coordinator that holds one part per job. The parts, the engine adapters
(engines/), the torch.compile session (compiled/) and what else is recorded are listed in docs/architecture.md.
This package's own import is light (torch is imported when `record` is called).
"""
from __future__ import annotations

__all__ = ["record", "routed"]


def routed(rows, *, tokens, slots, n_tokens: int, top_k: int, experts=None) -> None:
    """Declare the routing of `rows` (expert parallelism: the rows an all_to_all moved to this rank), for a module
    side declared `T@group` in record's `layouts=`: row i is token `tokens[i]` (its index among the `n_tokens`
    tokens of the batch, all ranks counted), slot `slots[i]` of its `top_k`, for expert `experts[i]` (optional).
    For every recording active now (a no-op outside one). docs/sharded.md, "Routed rows"."""
    from divtrace.record.lifecycle import ACTIVE

    for rec in list(ACTIVE):
        rec.routed(rows, tokens=tokens, slots=slots, n_tokens=n_tokens, top_k=top_k, experts=experts)


def record(model, path, *, mode="full", ops=None, label=None, include=None, exclude=None, overwrite=False,
           shard_bytes=128 << 20, extra_meta=None, flush_records=4096, durable=False, tokens=True,
           token_layouts=None, compiled=None, layouts=None, mesh=None, params=None) -> Recorder:
    """Record every module call (and, with ops=True, every aten op) of `model` run inside the block into `path`.
    `model` is a `torch.nn.Module`, or a `vllm.LLM` (in-process, eager: see divtrace/record/engines/vllm.py).

    `flush_records` bounds how many records may be lost if the process is killed (they are written in
    batches of that many). `shard_bytes` is the size of a full-mode shard file; full mode holds no tensor
    bytes in memory (each value is written into the open shard when it is produced).

    A trace is readable after the process crashes or is killed at any point (atomic renames, checksummed
    records). `durable=True` also fsyncs the trace at close (records.jsonl, the shards, then meta.json and the
    directory entries), so a finished trace survives an OS crash or power loss right after; it is off by
    default because fsync on a busy disk can stall for hundreds of milliseconds, and a trace cut short that
    way reads as an error, never as a wrong trace.

    Token identity (for `bisect --align tokens`): HF-style root calls (`input_ids` with `attention_mask`,
    `position_ids`, a cache; `model.generate()`) are read automatically; engines and custom loops declare each
    root call's tokens with `rec.tokens(ids, positions, seqs)`. Each token row of every recorded tensor then gets an
    8-byte fingerprint beside the whole-tensor one. `tokens=False` records none of it. `token_layouts` overrides
    the inferred token dims where a shape fools the inference: `{module path regex: "bt" | "bht" | "n" | "none"}`
    applies to the values made inside a matching module and to its inputs and outputs.

    Sharded runs: inside an initialized `torch.distributed` process group, `path` is a run directory and this
    process records into `path/rank-K` (K its global rank), with each value's place in its global value (DTensor
    placements, TP styles, collectives; docs/sharded.md). Every command that takes a trace takes the run directory.
    Plain tensors of a hand-sharded model (Megatron's column- and row-parallel layers) get theirs declared:
    `layouts={module path or parameter name regex: spec}` with specs such as "S(-1)@tp" (a block of the last dim),
    "P@tp" (a partial sum), "R@tp" (replicated), over the process groups `mesh={"tp": group}` names (default: the
    whole world, as "world"); a dict {"output": spec, "input": spec} declares a module's first input too
    (divtrace/record/declared.py). Outside a process group they are checked and ignored.

    Parameters and buffers: each one an op reads is named in the trace (params.jsonl), so bisect compares the two
    runs' weights by name (no extra read: the recording fingerprints what ops read anyway). `params="all"` (the
    default with ops=True) also fingerprints, at the block's end, those no op read (an MoE expert no token was
    routed to); `params="read"` names only what was read (the default with ops=False, where no op is recorded);
    `params="none"` names none (bisect then compares no parameters and says so). `params="blocks"` is "all" and,
    in hash mode, each parameter that is not a DTensor (full mode: each one no op read) also gets its chunk
    partials at the block's end (a read of each weight per chunk dim, +0.23x on bench_record's model), so a
    sharded run's blocks are compared with it block by block and the rank whose block differs is named; without
    it such a weight is compared whole (differs or not, no block named).

    Example::

        with divtrace.record(model, "runs/train", mode="hash", label="train"):
            model(input_ids)
    """
    import torch

    from divtrace.record.recorder import Recorder

    kwargs = dict(mode=mode, ops=ops, label=label, include=include, exclude=exclude, overwrite=overwrite,
                  shard_bytes=shard_bytes, extra_meta=extra_meta, flush_records=flush_records, durable=durable,
                  tokens=tokens, token_layouts=token_layouts, compiled=compiled, layouts=layouts, mesh=mesh,
                  params=params)
    if not isinstance(model, torch.nn.Module):  # an inference engine (a vllm.LLM): its adapter, if there is one
        from divtrace.record.engines import engine_recorder

        rec = engine_recorder(model, path, **kwargs)
        if rec is not None:
            return rec
    return Recorder(model, path, **kwargs)
