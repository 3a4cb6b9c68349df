"""One-shot GPU check of compiled recording (run on a CUDA machine): Triton kernels, CUDA graphs, bf16.

    PYTHONPATH=. python bench/gpu_check_compiled.py RESULTS_DIR
Prints one JSON line per case: recorded logits bitwise equal to the unrecorded compiled logits, bisect against
eager, kernel names, unseen."""
import json
import sys
import time
from pathlib import Path

import torch

import divtrace


def llama(dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=512, max_position_embeddings=128)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to("cuda", dtype).eval()


def case(out: Path, name: str, dtype, **compile_kw):
    t0 = time.time()
    m = llama(dtype)
    ids = torch.randint(0, 512, (2, 64), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    res = {"case": name}
    try:
        with torch.no_grad():
            with divtrace.record(m, out / f"{name}-eager", mode="full", compiled=False):
                eager = m(ids).logits.clone()
            c = torch.compile(m, **compile_kw)
            c(ids)
            ref = c(ids).logits.clone()
            with divtrace.record(c, out / f"{name}-comp", mode="full") as rec:
                got = c(ids).logits.clone()
                got2 = c(ids).logits.clone()
            after = c(ids).logits.clone()
        res.update(compiled_vs_eager_equal=bool(torch.equal(ref, eager)), recorded_equal=bool(torch.equal(got, ref)),
                   recorded2_equal=bool(torch.equal(got2, ref)), after_equal=bool(torch.equal(after, ref)),
                   warnings=rec.warnings)
        meta = json.loads((out / f"{name}-comp" / "meta.json").read_text())
        comp = meta["compiled"]
        res.update(unseen=meta["unseen"], taps_run=comp.get("taps_run"), graph_breaks=comp.get("graph_breaks"),
                   kernels={k: v for k, v in list((comp.get("kernels") or {}).items())[:4]}, notes=comp.get("notes"),
                   settings={k: v for k, v in meta["settings"].items() if "inductor" in k or "compile" in k})
        r = divtrace.bisect(out / f"{name}-eager", out / f"{name}-comp")
        res.update(verdict=r.verdict, first=r.first.module if r.first else None,
                   cause=r.first.cause if r.first else None, hint=r.hint, kernel=(r.compiled or {}).get("kernel"))
    except Exception as e:
        import traceback

        res["error"] = f"{type(e).__name__}: {e}"[:2000]
        res["tb"] = traceback.format_exc()[-3000:]
    res["seconds"] = round(time.time() - t0, 1)
    print(json.dumps(res, default=str), flush=True)
    return res


def main():
    out = Path("/tmp/divtrace_gpu_traces")
    out.mkdir(parents=True, exist_ok=True)
    res_dir = Path(sys.argv[1])
    res_dir.mkdir(parents=True, exist_ok=True)
    print(json.dumps({"torch": torch.__version__, "gpu": torch.cuda.get_device_name()}), flush=True)
    rs = [case(out, "fp32", torch.float32), case(out, "bf16", torch.bfloat16),
          case(out, "cudagraphs", torch.float32, mode="reduce-overhead")]
    (res_dir / "results.json").write_text(json.dumps(rs, indent=1, default=str))


if __name__ == "__main__":
    main()
