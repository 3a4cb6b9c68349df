"""Real TRL GRPO runs (trl 1.16, tiny random Llama, CPU) with the ledger on, through `divtrace.cert.trl.attach`.

Runs where trl is importable (CI's TRL venv stage in .ci/run); skipped cleanly elsewhere. The expected answers
come from an independent oracle written here: hooks on the policy capture the rollout's logits (its lm_head calls
inside generate) and the trainer's fused-head logprobs (`FusedCausalLMOutput.log_probs` of TRL's first recompute
of each sequence); the rollout's logprob of each sampled token is folded from its logits with TRL's one-tile
online logsumexp written out below; the first (step, generate row, token) whose bits differ is where the run
parts.
"""
from __future__ import annotations

import copy
import importlib.util
import json
import os
import shlex
import subprocess
import sys

import pytest

if importlib.util.find_spec("trl") is None:
    pytest.skip("trl is not installed (CI runs this module in a trl==1.16.0 venv)", allow_module_level=True)

import torch  # noqa: E402

from divtrace.cert.reader import read_ledger  # noqa: E402
from divtrace.cert.trl import attach  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from cert_grpo import EQUAL, PADDED, grpo_trainer, tiny_llama  # noqa: E402

PLANTED = "model.layers.1.mlp.down_proj.weight"


class Oracle:
    """Independent capture: the rollout's logits and fed ids per generate, the trainer's fused-head logprobs."""

    def __init__(self, gen_model, policy):
        self.step = None
        self.gen = {}  # step -> {"prefill": (ids, mask), "fed": [ids], "logits": [[B, V]]}
        self.train = {}  # step -> [(ids, mask, log_probs)]
        gen_model.lm_head.register_forward_hook(self._lm_head)
        gen_model.register_forward_pre_hook(self._gen_in, with_kwargs=True)
        policy.register_forward_hook(self._train_out, with_kwargs=True)

    def _lm_head(self, mod, args, out):
        self.gen[self.step]["logits"].append(out[:, -1, :].detach().clone())

    def _gen_in(self, mod, args, kwargs):
        if kwargs.get("fused_lm_head"):
            return
        g = self.gen.setdefault(self.step, {"prefill": None, "fed": [], "logits": []})
        if g["prefill"] is None:
            ids = kwargs["input_ids"]
            mask = kwargs.get("attention_mask")  # generate leaves it out when nothing is padded
            g["prefill"] = (ids.clone(), torch.ones_like(ids) if mask is None else mask.clone())
        else:
            g["fed"].append(kwargs["input_ids"][:, -1].clone())

    def _train_out(self, mod, args, kwargs, out):
        if kwargs.get("fused_lm_head"):
            self.train.setdefault(self.step, []).append(
                (kwargs["input_ids"].clone(), kwargs["attention_mask"].clone(), out.log_probs.detach().clone()))

    def first_parting(self):
        """(step, generate row, token) of the first bitwise difference, and the count of tokens compared."""
        compared = 0
        found = None
        for step in sorted(self.gen):
            g = self.gen[step]
            ids, mask = g["prefill"]
            trainer_rows, used = [], set()
            for ti, tm, lp in self.train[step]:
                for r in range(ti.shape[0]):
                    trainer_rows.append((ti[r], tm[r], lp[r]))
            for b in range(ids.shape[0]):
                prompt = ids[b][mask[b].bool()].tolist()
                fed = [int(f[b]) for f in g["fed"]]
                for j, (ti, tm, lp) in enumerate(trainer_rows):
                    seq = ti[tm.bool()].tolist()
                    comp = seq[len(prompt):]
                    if j in used or seq[:len(prompt)] != prompt or comp[:len(comp) - 1] != fed[:len(comp) - 1]:
                        continue
                    used.add(j)
                    width = int(tm.nonzero()[0]) + len(prompt)  # the left-padded prompt part's width
                    for k, tok in enumerate(comp):
                        want = lp[width + k - 1]  # log_probs[:, j] scores the token at position j + 1
                        got = self.fold(g["logits"][k][b], tok)
                        compared += 1
                        if found is None and got.view(torch.int32) != want.view(torch.int32):
                            found = (step, b, k)
                    break
        return found, compared

    @staticmethod
    def fold(row, tok):
        """TRL's online logsumexp over one vocabulary tile (temperature 1), written out: m = max z,
        log_z = m + log(sum exp(z - m)); the logprob is z[tok] - log_z."""
        z = row.float()[None]
        m = z.amax(-1)
        s = torch.zeros(1).mul_(torch.exp(torch.tensor([float("-inf")]) - m)).add_(torch.exp(z - m[:, None]).sum(-1))
        return (z[0, tok] - (m + torch.log(s)))[0]


def run(tmp_path, prompts, dtype=torch.bfloat16, plant=False, lr=1e-6, attn=None, **attach_kw):
    from transformers import TrainerCallback

    model = tiny_llama(dtype)
    if attn is not None:  # (the replay rebuilds it from the manifest: config.json leaves it out)
        model.set_attn_implementation(attn)
    rollout = copy.deepcopy(model) if plant else None
    trainer = grpo_trainer(model, prompts, tmp_path / "out", lr=lr)
    oracle = Oracle(rollout if plant else model, model)
    skipped = {}

    def sync(policy, copy_, step):
        for (name, p), q in zip(policy.named_parameters(), copy_.parameters()):
            if step == 2 and name == PLANTED:  # the planted weight-sync bug
                skipped[step] = not torch.equal(p, q)
                continue
            q.copy_(p)

    class Step(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            oracle.step = state.global_step

    trainer.add_callback(Step())
    led = tmp_path / "ledger"
    attach(trainer, led, **({"rollout_model": rollout, "sync_weights": sync} if plant else {}), **attach_kw)
    trainer.train()
    return led, oracle, skipped


def cert_json(led):
    p = subprocess.run([sys.executable, "-m", "divtrace", "cert", str(led), "--json"], capture_output=True, text=True)
    return p.returncode, json.loads(p.stdout) if p.stdout else None, p.stderr


def test_bf16_padding_mismatch_found_at_its_step_sequence_token_and_op(tmp_path):
    led, oracle, _ = run(tmp_path, PADDED)
    truth, compared = oracle.first_parting()
    assert truth is not None and compared > 0
    code, d, err = cert_json(led)
    assert code == 1, err
    assert d["tokens_compared"] == compared
    t = d["first"]["token"]
    assert (d["first"]["step"], t["sequence_index"], t["token"]) == truth
    assert d["first"]["cause"] == "numerics" and all(s["weights"]["equal"] for s in d["steps"])
    # the printed recipe, run as printed: replay the step with divtrace.record on both sides, then bisect
    assert d["replay"]["step"] == truth[0]
    human = subprocess.run([sys.executable, "-m", "divtrace", "cert", str(led)], capture_output=True, text=True).stdout
    cmds = [c for c in d["replay"]["command"]]
    for c in cmds:
        assert f"\n  {c}\n" in human
    rep = subprocess.run(shlex.split(cmds[0]), capture_output=True, text=True)
    assert rep.returncode == 0, rep.stdout + rep.stderr
    assert "PASSED: rollout replay" in rep.stdout and "PASSED: trainer replay" in rep.stdout
    argv = shlex.split(cmds[1])
    assert argv[0] == "divtrace"
    b = subprocess.run([sys.executable, "-m", "divtrace", *argv[1:], "--json"], capture_output=True, text=True)
    assert b.returncode == 1, b.stderr
    bj = json.loads(b.stdout)
    first = bj["first"]
    assert bj["alignment"] == "tokens" and bj["verdict"] == "diverged"
    # the cause: generate derives position ids from the attention mask, TRL's recompute feeds none (HF counts the
    # left padding); only a left-padded sequence can part there, and it is said as such (issue 28), never as a
    # RoPE multiply that is "not batch-invariant"
    assert first["kind"] == "positions" and first["cause_text"].startswith("position ids differ on "), first
    assert "not batch-invariant" not in b.stdout
    seq_first = first["token"]["seq"]["first_ids"]
    padded_prompts = [p for p in PADDED if len(p.split()) < max(len(q.split()) for q in PADDED)]
    assert any(seq_first[:len(p.split())] == [int(w[1:]) for w in p.split()] for p in padded_prompts)


# Prompts of one length are bitwise equal on both sides only where this CPU's kernels give a token the same bits
# whatever the sequence length around it: the rollout's prefill runs attention over the prompt, the trainer's
# recompute over prompt and completion. torch 2.13's CPU SDPA kernel does not (an AMD EPYC without AVX-512: rows
# differ for lengths 2-7 against 10), eager attention in bf16 did on both CPUs seen, so these tests run eager; where
# the oracle still sees a parting, they check that the ledger names that one.


def _numerics_first(oracle):
    truth, compared = oracle.first_parting()
    assert compared > 0
    return truth, compared


def test_weight_sync_bug_is_a_weight_mismatch_at_step_2(tmp_path):
    led, oracle, skipped = run(tmp_path, EQUAL, plant=True, lr=1e-2, attn="eager")
    assert skipped == {2: True}  # the tensor really was stale on the rollout copy at step 2
    truth, _ = _numerics_first(oracle)
    code, d, err = cert_json(led)
    assert code == 1, err
    assert d["steps"][2]["weights"]["differ"] == [PLANTED] and d["steps"][2]["status"] == "parts"
    assert d["steps"][2]["weights"]["versions"] == {"rollout": 2, "trainer": 2}
    if truth is not None and truth[0] < 2:  # (this CPU's kernels part the sides before the planted bug)
        t = d["first"]["token"]
        assert (d["first"]["step"], t["sequence_index"], t["token"]) == truth and d["first"]["cause"] == "numerics"
        return
    assert d["first"]["step"] == 2 and d["first"]["cause"] == "weights"
    assert d["first"]["weights_differ"] == [PLANTED]
    assert [s["status"] for s in d["steps"]] == ["equal", "equal", "parts"]


def test_control_bf16_without_padding_is_bitwise_equal_at_every_step(tmp_path):
    led, oracle, _ = run(tmp_path, EQUAL, replay_steps=(1,), processed=True, attn="eager")
    truth, compared = _numerics_first(oracle)
    code, d, err = cert_json(led)
    if truth is not None:  # (this CPU's kernels part the sides: the ledger must say where, as the oracle does)
        t = d["first"]["token"]
        assert code == 1 and (d["first"]["step"], t["sequence_index"], t["token"]) == truth, err
        assert d["tokens_compared"] == compared and d["first"]["cause"] == "numerics"
        return
    assert code == 0, (err, d and d["reason"])
    assert d["verdict"] == "certified" and d["steps_seen"] == 3 and d["tokens_compared"] == compared
    assert all(s["status"] == "equal" and s["tokens_equal"] == s["tokens_compared"] for s in d["steps"])
    assert all(s["processed_tokens"] == s["tokens_compared"] for s in d["steps"])  # stored apart, not compared
    # a chosen step's full recording: the replay reproduces the ledger and bisect finds no origin in it
    cmds = read_ledger(led).replays[1]["command"]
    rep = subprocess.run(shlex.split(cmds[0]), capture_output=True, text=True)
    assert rep.returncode == 0 and rep.stdout.count("PASSED:") == 2, rep.stdout + rep.stderr
    b = subprocess.run([sys.executable, "-m", "divtrace", *shlex.split(cmds[1])[1:], "--json"], capture_output=True,
                       text=True)
    bj = json.loads(b.stdout)
    # the logprobs themselves are compared (the replay declares the rollout's with rec.final): identical, exit 0
    assert bj["first"] is None and bj["tokens"]["differing"] == 0 and b.returncode == 0, b.stdout[-2000:]
    step1 = next(s for s in d["steps"] if s["step"] == 1)
    assert bj["verdict"] == "identical" and bj["final"]["tokens_compared"] == step1["tokens_compared"], bj["final"]


def test_unsupported_trl_version_is_a_clear_error(monkeypatch):
    import trl

    from divtrace.errors import DivtraceError

    monkeypatch.setattr(trl, "__version__", "0.9.6")
    with pytest.raises(DivtraceError, match="supports TRL 1.16.x; this is TRL 0.9.6"):
        attach(object(), "unused")
