"""Replay one step of a TRL GRPO run from its ledger, recording both sides with token identity.

    python -m divtrace.cert.trl_replay LEDGER/replay/step-000037 --out runs/step37
    divtrace bisect runs/step37/trainer runs/step37/rollout --align tokens

`divtrace.cert.trl.save_replay` (for the first parting step, and for `replay_steps`) writes the step's
generate inputs and settings, the sampled sequences, the trainer micro-batch holding the parting sequence, the
weights each side used (or the `weights_ref` path you gave) and the ledger's logprobs. The replay rebuilds the
model from config.json with TRL's fused LM head, runs generate forced onto the sampled tokens (so the rollout's
forwards are the ones that ran: the same prefill and decode calls) and the trainer's recompute of the
micro-batch, each under `divtrace.record`, and checks that both reproduce the ledger's logprobs bit for bit
before you bisect them (PASSED / FAILED lines; exit 1 when a side does not reproduce).
"""
from __future__ import annotations

import argparse
import json
import sys
from contextlib import nullcontext
from pathlib import Path

import torch

from divtrace.errors import DivtraceError


def _model(d: Path, m: dict, weights: str):
    from safetensors.torch import load_model
    from transformers import AutoConfig, AutoModelForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    config = AutoConfig.from_pretrained(str(d))
    attn = m.get("attn_implementation")  # (None in replays saved before it: the default)
    kw = {"attn_implementation": attn} if attn else {}
    model = AutoModelForCausalLM.from_config(config, **kw).to(getattr(torch, m["dtype"]))
    src = m["weights_ref"] or str(d / weights)
    if src.endswith(".safetensors"):
        load_model(model, src)
    else:  # a checkpoint folder the user gave
        model = AutoModelForCausalLM.from_pretrained(src, torch_dtype=getattr(torch, m["dtype"]), **kw)
    add_fused_lm_head(model, temperature=m["temperature"], cast_lm_head_to_fp32=m["cast_lm_head_to_fp32"],
                      outputs=("log_probs", "entropy"))
    return model


def _autocast(m: dict):
    mp = m["mixed_precision"]
    if mp in ("bf16", "fp16"):
        return torch.autocast("cpu", dtype=torch.bfloat16 if mp == "bf16" else torch.float16)
    return nullcontext()


def replay(d, out, mode: str = "full") -> int:
    import divtrace
    from safetensors.torch import load_file
    from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

    from divtrace.cert.trl import trl_logprobs

    d, out = Path(d), Path(out)
    try:
        m = json.loads((d / "manifest.json").read_text())
    except (OSError, ValueError) as e:
        raise DivtraceError(f"{d}: not a saved replay ({e})") from None
    torch.set_num_threads(m["num_threads"])
    roll = load_file(str(d / "rollout.safetensors"))
    train = load_file(str(d / "trainer.safetensors"))
    expected = load_file(str(d / "expected.safetensors"))
    width = roll["input_ids"].shape[1]
    forced = roll["sequences"][:, width:]

    class Forced(LogitsProcessor):
        """Every step's scores say: the token that was sampled (the model's forwards are untouched)."""
        def __call__(self, input_ids, scores):
            t = input_ids.shape[1] - width
            keep = torch.full_like(scores, float("-inf"))
            keep.scatter_(1, forced[:, t:t + 1].to(scores.device), 0.0)
            return keep

    ok = True
    model = _model(d, m, m["rollout_weights"] or "weights.safetensors")
    model.train(m["trainer_training"])
    cfg = GenerationConfig.from_dict(m["generation_config"])
    head = model.get_output_embeddings().weight.dtype
    same = True
    with torch.no_grad(), divtrace.record(model, out / "rollout", mode=mode, label="rollout", overwrite=True) as rec:
        got = model.generate(input_ids=roll["input_ids"], attention_mask=roll["attention_mask"], generation_config=cfg,
                             logits_processor=LogitsProcessorList([Forced()]))
        same = torch.equal(got.sequences, roll["sequences"])
        per_step: dict = {}  # generate step -> [(batch row, logprob)]: the rollout's logprobs, TRL's fold
        for key, want in sorted(expected.items()):
            if not key.startswith("rollout."):
                continue
            b = int(key.split(".")[1])
            n = want.numel()
            lps = torch.stack([trl_logprobs(got.logits[t][b:b + 1], forced[b, t:t + 1], temperature=m["temperature"],
                                            compute_dtype=head, config=model.config)[0] for t in range(n)])
            same = same and torch.equal(lps.view(torch.int32), want.view(torch.int32))
            for t in range(n):
                per_step.setdefault(t, []).append((b, lps[t]))
        # ... declared as the rollout's final values (what the ledger holds), each of the token that predicts it: the
        # last cell of its sequence in that step's call; bisect compares them to the trainer's
        for t, got_t in sorted(per_step.items()):
            cells = rec.last_rows(call=t)
            rec.final(torch.stack([v for _, v in got_t]), rows=[cells[b] for b, _ in got_t], kind="logprobs",
                      targets=[int(forced[b, t]) for b, _ in got_t], call=t)
    print(("PASSED" if same else "FAILED") + f": rollout replay of step {m['step']}: the sampled sequences and the "
          f"ledger's rollout logprobs {'reproduced bitwise' if same else 'NOT reproduced'}")
    ok = ok and same
    model = _model(d, m, "weights.safetensors")
    model.train(m["trainer_training"])
    c, bs = m["logits_to_keep"], m["batch_size"] or train["input_ids"].shape[0]
    ids, mask = train["input_ids"], train["attention_mask"]
    outs = []
    with torch.set_grad_enabled(m["trainer_grad_enabled"]), \
            divtrace.record(model, out / "trainer", mode=mode, label="trainer", overwrite=True):
        for s in range(0, ids.shape[0], bs):
            i, a = ids[s:s + bs], mask[s:s + bs]
            labels = i.masked_fill(a == 0, -100)
            labels[:, :-c] = -100
            with _autocast(m):
                outs.append(model(input_ids=i, attention_mask=a, labels=labels, fused_lm_head=True).log_probs[:, -c:])
    lp = torch.cat(outs)
    same = True
    for key, want in expected.items():
        if key.startswith("trainer."):
            r = int(key.split(".")[1])
            got_r = lp[r][mask[r, -c:].bool()].detach().float()
            same = same and torch.equal(got_r.view(torch.int32), want.view(torch.int32))
    print(("PASSED" if same else "FAILED") + f": trainer replay of step {m['step']}: the ledger's trainer logprobs "
          f"{'reproduced bitwise' if same else 'NOT reproduced'} ({ids.shape[0]} sequences, micro-batches of {bs})")
    ok = ok and same
    print(f"recorded: {out / 'rollout'} and {out / 'trainer'}; next: divtrace bisect {out / 'trainer'} "
          f"{out / 'rollout'} --align tokens")
    return 0 if ok else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m divtrace.cert.trl_replay", description=__doc__.split("\n\n")[0])
    p.add_argument("replay_dir")
    p.add_argument("--out", required=True, help="where the two traces go (OUT/rollout, OUT/trainer)")
    p.add_argument("--mode", default="full", choices=("full", "hash"))
    a = p.parse_args(argv)
    try:
        return replay(a.replay_dir, a.out, a.mode)
    except DivtraceError as e:
        print(f"divtrace: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
