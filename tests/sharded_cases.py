"""What the sharded-run tests run in each rank (spawned: module-level functions) and the ground truth they are held
to: every module's input and output captured with plain forward hooks, in a forward that divtrace does not record,
put together into global values (column blocks concatenated, replicas checked equal), and the origin found from
them the way a person would: the first module, innermost, whose input is bitwise equal on both sides while its
output is not.
"""
from __future__ import annotations

import os

COLWISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROWWISE = ("o_proj", "down_proj")
IDS = [[1, 5, 9, 3, 7, 2, 11, 4], [8, 6, 2, 14, 3, 9, 1, 12]]


def tiny_llama(path, layers: int = 2) -> str:
    """A small random Llama saved where HF's from_pretrained (and its TP plan) can load it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if not os.path.exists(os.path.join(path, "config.json")):
        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
        LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def bits_equal(a, b) -> bool:
    """Bitwise equality: dtype, shape and raw bytes (-0.0 != 0.0, NaNs by their bits)."""
    import torch

    if a is None or b is None:
        return a is None and b is None
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _first_tensor(x):
    import torch

    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, (tuple, list)) and x and isinstance(x[0], torch.Tensor):
        return x[0]
    return getattr(x, "logits", None)


def capture(model, ids):
    """{module path: (input 0, output)} of one unrecorded forward, and the paths in call order (plain hooks)."""
    import torch

    caps, order, handles = {}, [], []
    for path, m in model.named_modules():
        def pre(mod, args, kwargs, path=path):
            x = args[0] if args else kwargs.get("hidden_states", kwargs.get("input_ids"))
            order.append(path)
            caps[path] = [x.detach().clone() if isinstance(x, torch.Tensor) else None, None]

        def post(mod, args, kwargs, out, path=path):
            t = _first_tensor(out)
            caps[path][1] = t.detach().clone() if t is not None else None
        handles += [m.register_forward_pre_hook(pre, with_kwargs=True),
                    m.register_forward_hook(post, with_kwargs=True)]
    try:
        with torch.no_grad():
            model(torch.tensor(ids))
    finally:
        for h in handles:
            h.remove()
    return caps, order


def _hf_block(leaf: str, i: int) -> bool:
    return (leaf in COLWISE and i == 1) or (leaf in ROWWISE and i == 0) or leaf == "act_fn"


def unshard_tp(caps, is_block=_hf_block, is_partial=lambda leaf, i: False):
    """The global values of a TP rank's captures: where `is_block(leaf, i)` (i: 0 the input, 1 the output; by
    default HF's colwise outputs, rowwise inputs and the MLP's activation between them) column blocks of the last
    dim (gathered from every rank and concatenated); where `is_partial`, a partial sum (None: no global value of its
    own); everything else must be the same on every rank."""
    import torch
    import torch.distributed as dist

    out = {}
    for path in sorted(caps):
        x, y = caps[path]
        leaf = path.rsplit(".", 1)[-1]
        got = []
        for i, t in enumerate((x, y)):
            if t is None or is_partial(leaf, i):
                got.append(None)
                continue
            parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
            dist.all_gather(parts, t.contiguous())
            if is_block(leaf, i):
                got.append(torch.cat(parts, dim=-1))
            else:
                assert all(bits_equal(parts[0], p) for p in parts), f"{path}: replicas differ in the ground truth"
                got.append(parts[0])
        out[path] = tuple(got)
    return out


def truth_origin(order, caps_a, caps_b):
    """The ground-truth origin: the first module (in call order) whose input is equal on both sides and whose
    output is not, and none of whose submodules is such a module; None when every output is equal."""
    cands = [p for p in order if p in caps_b and bits_equal(caps_a[p][0], caps_b[p][0])
             and not bits_equal(caps_a[p][1], caps_b[p][1])]
    for p in cands:
        if not any(q != p and (p == "" or q.startswith(p + ".")) for q in cands):
            return p
    return None


def scale_q_proj(model, scale: float) -> None:
    """The planted difference: layer 0's q_proj multiplies its output by `scale` (1.0: the same ops, no change)."""
    mod = model.model.layers[0].self_attn.q_proj
    orig = mod.forward

    def forward(x, *a, **k):
        return orig(x, *a, **k) * scale
    mod.forward = forward


def tp_worker(rank, world, model_dir, root, cases):
    """Record each case (name, dtype name, mode, plant) at TP=`world` with HF's TP plan; rank 0 returns the ground
    truth (unsharded captures) of each full-mode case."""
    import torch

    import divtrace
    from transformers import LlamaForCausalLM

    torch.set_num_threads(1)
    truth = {}
    for name, dtype, mode, plant in cases:
        m = LlamaForCausalLM.from_pretrained(model_dir, tp_plan="auto", dtype=getattr(torch, dtype)).eval()
        if plant:
            scale_q_proj(m, 1.0 + 2.0 ** -20 if rank == world - 1 else 1.0)
        with torch.no_grad(), divtrace.record(m, os.path.join(root, name), mode=mode):
            m(torch.tensor(IDS))
        caps, order = capture(m, IDS)
        g = unshard_tp(caps)
        if rank == 0:
            truth[name] = ({k: tuple(None if t is None else t.clone() for t in v) for k, v in g.items()}, order)
    return truth if rank == 0 else None


def single(model_dir, out, dtype: str, mode: str, plant: bool = False, ids=None, params=None):
    """The one-process run of the same model (on `ids`, IDS by default): recorded into `out` (record's `params`);
    its captures returned."""
    import torch

    import divtrace
    from transformers import LlamaForCausalLM

    m = LlamaForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    if plant:
        scale_q_proj(m, 1.0)
    ids = IDS if ids is None else ids
    with torch.no_grad(), divtrace.record(m, out, mode=mode, params=params):
        m(torch.tensor(ids))
    return capture(m, ids)


FSDP_IDS = [[[1, 5, 9, 3, 7, 2, 11, 4]], [[8, 6, 2, 14, 3, 9, 1, 12]]]  # one sequence per rank


def fsdp_worker(rank, world, model_dir, root, modes, dtype="float32"):
    """FSDP2 (`fully_shard` on each decoder layer and the model), each rank its own sequence: record one forward
    per mode; return the captures of an unrecorded forward (module inputs and outputs are the rank's rows)."""
    import torch
    from torch.distributed.fsdp import fully_shard

    import divtrace
    from transformers import LlamaForCausalLM

    torch.set_num_threads(1)
    m = LlamaForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    for layer in m.model.layers:
        fully_shard(layer)
    fully_shard(m)
    ids = FSDP_IDS[rank]
    for mode in modes:
        with torch.no_grad(), divtrace.record(m, os.path.join(root, mode), mode=mode):
            m(torch.tensor(ids))
    caps, order = capture(m, ids)
    scale_q_proj(m, 1.0 + 2.0 ** -20 if rank == world - 1 else 1.0)  # planted in the last rank's sequence only
    for mode in ("full", "hash"):
        with torch.no_grad(), divtrace.record(m, os.path.join(root, "plant" if mode == "full" else "plant-hash"),
                                              mode=mode):
            m(torch.tensor(ids))
    return {k: tuple(None if t is None else t.clone() for t in v) for k, v in caps.items()}, order


def stopped_worker(rank, world, model_dir, root, name, kill_at, mode):
    """TP=2 with the planted difference in layer 0's q_proj; the last rank kills itself (SIGKILL, nothing closed)
    when module `kill_at` is entered. Records are flushed one by one, so what ran before the kill is on disk. The
    other rank's next collective then fails: its trace closes with that error."""
    import signal

    import torch

    import divtrace
    from transformers import LlamaForCausalLM

    torch.set_num_threads(1)
    m = LlamaForCausalLM.from_pretrained(model_dir, tp_plan="auto", dtype=torch.float32).eval()
    scale_q_proj(m, 1.0 + 2.0 ** -20 if rank == world - 1 else 1.0)
    if rank == world - 1:
        m.get_submodule(kill_at).register_forward_pre_hook(lambda *a: os.kill(os.getpid(), signal.SIGKILL))
    try:
        with torch.no_grad(), divtrace.record(m, os.path.join(root, name), mode=mode, flush_records=1):
            m(torch.tensor(IDS))
    except Exception as e:
        return type(e).__name__
    return "finished"


def mlp(seed: int = 0):
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32, bias=False), torch.nn.ReLU(), torch.nn.Linear(32, 16, bias=False))


class CountCollectives:
    """A dispatch mode (entered outside divtrace's, so it sees what runs below it) counting collectives and the
    tensor bytes they are handed."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        outer = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                import torch

                if getattr(func, "namespace", "") in ("c10d", "_c10d_functional") and "wait" not in func._opname:
                    outer.calls.append(func._opname)
                    stack = list(args)
                    while stack:
                        x = stack.pop()
                        if isinstance(x, torch.Tensor):
                            outer.bytes += x.numel() * x.element_size()
                        elif isinstance(x, (list, tuple)):
                            stack.extend(x)
                return func(*args, **(kwargs or {}))
        self.mode = _Mode()
        self.calls, self.bytes = [], 0

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)


def parallel_mlp_worker(rank, world, root):
    """torch's parallelize_module (ColwiseParallel, then RowwiseParallel: DTensors inside) on a 2-layer MLP: one
    forward counted without divtrace and one recorded in hash mode, counted the same way; rank 0 returns the counts
    and the hooks' global values."""
    import torch
    from torch.distributed.tensor import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import divtrace

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    m = mlp()
    parallelize_module(m, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    with CountCollectives() as plain, torch.no_grad():
        m(x)
    with CountCollectives() as recorded, torch.no_grad():
        for mode in ("hash", "full"):
            with divtrace.record(m, os.path.join(root, mode), mode=mode):
                m(x)
    caps, order = capture_mlp(m, x)
    from divtrace.record.device import forced_device_path

    with forced_device_path(), torch.no_grad(), divtrace.record(m, os.path.join(root, "device"), mode="hash"):
        m(x)  # the device path's code (partials through its batches and writer thread), run on the CPU
    # A value declared replicated (a Replicate DTensor) whose ranks hold other bytes: a finding of its own
    rep = Replicated(mesh, 2.0 ** -10 if rank == world - 1 else 0.0)
    with torch.no_grad(), divtrace.record(rep, os.path.join(root, "replicas"), mode="hash"):
        rep(x)
    colls = Collectives()
    for again in (False, True):  # recorded again over the first (overwrite): its layouts replace the first's
        with torch.no_grad(), divtrace.record(colls, os.path.join(root, "collectives"), mode="full", overwrite=again):
            got = colls(torch.arange(8.0) + 10 * rank)
    refused = None
    one = os.path.join(root, f"one-trace-{rank}")  # a directory that holds one (single-process) trace
    os.makedirs(one)
    with open(os.path.join(one, "meta.json"), "w") as f:
        f.write("{}")
    try:
        divtrace.record(mlp(), one, mode="hash")
    except divtrace.DivtraceError as e:
        refused = str(e)
    return (plain.calls, plain.bytes, recorded.calls, recorded.bytes, caps, order, refused, got) if rank == 0 \
        else got


def Replicated(mesh, offset: float):
    """A module whose forward wraps `x + offset` as a Replicate DTensor (no check) and doubles it."""
    import torch
    from torch.distributed.tensor import DTensor, Replicate

    class Rep(torch.nn.Module):
        def forward(self, x):
            d = DTensor.from_local(x + offset, mesh, [Replicate()], run_check=False)
            return (d * 2).to_local()
    return Rep()


def capture_mlp(m, x):
    """The MLP's module inputs and outputs as global values (the first layer's output and the second's input are
    column blocks: gathered), from plain hooks on an unrecorded forward."""
    import torch
    import torch.distributed as dist

    caps, order, hs = {}, [], []
    for path, mod in m.named_modules():
        def pre(mod, args, path=path):
            order.append(path)
            caps[path] = [args[0], None]

        def post(mod, args, out, path=path):
            caps[path][1] = out
        hs += [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)]
    with torch.no_grad():
        m(x)
    for h in hs:
        h.remove()
    out = {}
    for path, vals in caps.items():
        got = []
        for t in vals:
            t = t.full_tensor() if hasattr(t, "full_tensor") else t
            t = t.wait() if hasattr(t, "wait") and not isinstance(t, torch.Tensor) else t
            parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
            dist.all_gather(parts, t.contiguous())
            same = all(bits_equal(parts[0], p) for p in parts)
            got.append(parts[0].clone() if same else torch.cat(parts, dim=-1))
        out[path] = tuple(got)
    return out, order


def Collectives():
    """A module whose forward runs c10d's reduce_scatter, all_to_all and all_gather, a functional all_reduce (a sum)
    and a c10d all_reduce (a max)."""
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as fc

    class C(torch.nn.Module):
        def forward(self, x):
            world = dist.get_world_size()
            rs = torch.empty(x.numel() // world)
            dist.reduce_scatter_tensor(rs, x * 1.0)
            a2a = torch.empty_like(x)
            dist.all_to_all_single(a2a, x + 1)
            parts = [torch.empty_like(rs) for _ in range(world)]
            dist.all_gather(parts, rs * 2)
            ar = fc.all_reduce(x * 3, "sum", dist.group.WORLD)
            mx = x * 4
            dist.all_reduce(mx, op=dist.ReduceOp.MAX)
            return {"rs": rs, "a2a": a2a, "gathered": torch.cat(parts), "ar": ar + 0, "mx": mx + 0}
    return C()
