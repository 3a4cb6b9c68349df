"""The ledger and `divtrace cert` (docs/cert.md): a custom RL loop on a tiny HF Llama writes a ledger; cert's
verdict, first step / sequence / token and weight findings are checked against ground truth computed here from
the tensors themselves; damage, runs in progress and missing sides; the HF generate and vLLM adapters; the
vllm-hf weight map."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from divtrace.cert import certify, fingerprint_weights, from_generate, from_vllm, ledger
from divtrace.cert import format as fmt
from divtrace.errors import DivtraceError

transformers = pytest.importorskip("transformers")


def tiny_llama(seed=0, dtype=torch.float32):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=64, pad_token_id=0, eos_token_id=1)
    return LlamaForCausalLM(cfg).to(dtype).eval()


PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13], [20, 21]]
COMPLETIONS = [[30, 31, 32, 33], [40, 41], [50, 51, 52]]


def full_logprobs(model, prompt, completion, dtype=None):
    """Logprobs of `completion` after `prompt`, one forward of the whole sequence (the trainer's way)."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0]
        if dtype is not None:
            logits = logits.to(dtype)
    lp = torch.log_softmax(logits.float(), -1)
    p = len(prompt)
    return lp[p - 1:p - 1 + len(completion)].gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)


def run_loop(path, steps=3, part_at=None, stale_weight_at=None, version_skew_at=None, finish=True, trainer_at=None):
    """A custom RL loop writing a ledger. part_at=(step, seq): that sequence's trainer logprobs come from bf16
    logits (a planted numerics difference); stale_weight_at=step: the rollout copy misses one tensor's update."""
    trainer = tiny_llama()
    rollout = tiny_llama()
    rollout.load_state_dict(trainer.state_dict())
    led = ledger(path)
    truth = {}
    for step in range(steps):
        with torch.no_grad():
            for name, p in trainer.named_parameters():  # an "optimizer step" that changes every weight
                p.add_(1e-3 * (step + 1))
            for (name, p), q in zip(trainer.named_parameters(), rollout.parameters()):  # the weight sync
                if stale_weight_at == step and name == "model.layers.0.mlp.down_proj.weight":
                    continue
                q.copy_(p)
        r = [full_logprobs(rollout, p, c) for p, c in zip(PROMPTS, COMPLETIONS)]
        t = [full_logprobs(trainer, p, c, torch.bfloat16 if part_at and part_at == (step, i) else None)
             for i, (p, c) in enumerate(zip(PROMPTS, COMPLETIONS))]
        truth[step] = (r, t)
        v = step if version_skew_at != step else step - 1
        led.rollout(step, PROMPTS, COMPLETIONS, r, weights=rollout, version=v)
        if trainer_at is None or step in trainer_at:
            led.trainer(step, PROMPTS, COMPLETIONS, t, weights=trainer, version=step)
    if finish:
        led.__exit__(None, None, None)
    else:
        led._lines.flush()
    return truth


def first_parting(truth):
    """Ground truth: the first (step, sequence, token) whose logprobs differ bitwise, from the tensors."""
    for step in sorted(truth):
        r, t = truth[step]
        for i, (a, b) in enumerate(zip(r, t)):
            ne = (a.view(torch.int32) != b.view(torch.int32)).nonzero()
            if len(ne):
                return step, i, int(ne[0])
    return None


def cli(*args):
    env = dict(os.environ, COLUMNS="200")
    return subprocess.run([sys.executable, "-m", "divtrace", *map(str, args)], capture_output=True, text=True, env=env)


def test_control_every_step_bitwise_equal_exits_0(tmp_path):
    truth = run_loop(tmp_path / "led")
    assert first_parting(truth) is None
    r = certify(tmp_path / "led")
    assert r.verdict == "certified" and r.exit_code == 0
    assert [s.step for s in r.steps] == [0, 1, 2] and all(s.status == "equal" for s in r.steps)
    assert r.to_dict()["tokens_compared"] == 3 * sum(map(len, COMPLETIONS))
    p = cli("cert", tmp_path / "led")
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.startswith("PASSED: certified")


def test_planted_numerics_difference_is_found_at_its_step_sequence_and_token(tmp_path):
    truth = run_loop(tmp_path / "led", part_at=(1, 1))
    step, seq, tok = first_parting(truth)
    assert step == 1 and seq == 1  # the plant reached the logprobs
    p = cli("cert", tmp_path / "led", "--json")
    assert p.returncode == 1, p.stderr
    d = json.loads(p.stdout)
    assert d["verdict"] == "parts" and d["first"]["step"] == step and d["first"]["cause"] == "numerics"
    t = d["first"]["token"]
    assert (t["sequence_index"], t["token"]) == (seq, tok)
    assert t["position"] == len(PROMPTS[seq]) + tok and t["id"] == COMPLETIONS[seq][tok]
    a, b = truth[step][0][seq][tok].item(), truth[step][1][seq][tok].item()
    assert (t["rollout"], t["trainer"]) == (a, b)
    s1 = d["steps"][1]
    assert s1["tokens_compared"] == sum(map(len, COMPLETIONS)) and s1["tokens_equal"] < s1["tokens_compared"]
    assert s1["max_abs_diff"] == pytest.approx(max(abs(x - y) for x, y in zip(truth[1][0][seq].tolist(),
                                                                                truth[1][1][seq].tolist())))
    assert d["steps"][0]["status"] == "equal" and d["steps"][2]["status"] == "equal"
    text = cli("cert", tmp_path / "led").stdout
    assert text.startswith("FAILED: step 1 parts with equal weights")


def test_weight_sync_bug_is_a_weight_mismatch_at_its_step(tmp_path):
    run_loop(tmp_path / "led", stale_weight_at=2)
    r = certify(tmp_path / "led")
    assert r.exit_code == 1 and r.first["step"] == 2 and r.first["cause"] == "weights"
    assert r.first["weights_differ"] == ["model.layers.0.mlp.down_proj.weight"]
    assert [s.status for s in r.steps] == ["equal", "equal", "parts"]
    out = cli("cert", tmp_path / "led").stdout
    assert "FAILED: step 2: the weights differ" in out and "model.layers.0.mlp.down_proj.weight" in out


def test_equal_logprobs_with_unequal_weights_is_a_failure_naming_the_parameter(tmp_path):
    model = tiny_llama()
    other = {n: p.detach().clone() for n, p in model.named_parameters()}
    other["lm_head.weight"][0, 0] += 1.0
    lp = [torch.zeros(len(c)) for c in COMPLETIONS]
    with ledger(tmp_path / "led") as led:
        led.rollout(0, PROMPTS, COMPLETIONS, lp, weights=model, version=0)
        led.trainer(0, PROMPTS, COMPLETIONS, lp, weights=other, version=0)
    r = certify(tmp_path / "led")
    assert r.exit_code == 1 and r.first["cause"] == "weights" and r.first["token"] is None
    assert r.first["weights_differ"] == ["lm_head.weight"]


def test_stale_weight_version_is_inconclusive_not_a_failure(tmp_path):
    run_loop(tmp_path / "led", stale_weight_at=1, version_skew_at=1)
    r = certify(tmp_path / "led")
    assert r.verdict == "inconclusive" and r.reason.startswith("stale: step 1")


def test_run_in_progress_is_running_and_a_torn_last_line_is_cut_back(tmp_path):
    run_loop(tmp_path / "led", finish=False)
    seg = next((tmp_path / "led").glob("seg-*.jsonl"))
    with open(seg, "a") as f:
        f.write('{"k":"lp","step":3,"si')  # a write in progress
    r = certify(tmp_path / "led")
    assert r.verdict == "inconclusive" and r.reason == "running" and r.exit_code == 3
    assert r.segments[0].torn and [s.step for s in r.steps] == [0, 1, 2]
    p = cli("cert", tmp_path / "led", "--json")
    assert p.returncode == 3 and json.loads(p.stdout)["reason"] == "running"


def test_a_parting_step_fails_even_while_the_run_is_in_progress(tmp_path):
    run_loop(tmp_path / "led", part_at=(0, 2), finish=False)
    r = certify(tmp_path / "led")
    assert r.exit_code == 1 and r.running and r.first["step"] == 0


def test_torn_line_in_a_finished_ledger_is_damage_naming_file_and_line(tmp_path):
    run_loop(tmp_path / "led")
    seg = next((tmp_path / "led").glob("seg-*.jsonl"))
    n = len(seg.read_text().splitlines())
    seg.write_bytes(seg.read_bytes()[:-5])
    p = cli("cert", tmp_path / "led")
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.startswith(f"divtrace: error: {seg} line {n}: cut off") and "Traceback" not in p.stderr


@pytest.mark.parametrize("damage", ["garbage", "crc", "short_bin"])
def test_damaged_segments_are_bad_input(tmp_path, damage):
    run_loop(tmp_path / "led")
    seg = next((tmp_path / "led").glob("seg-*.jsonl"))
    lines = seg.read_text().splitlines(keepends=True)
    if damage == "garbage":
        lines[2] = "not json\n"
        seg.write_text("".join(lines))
        want = f"{seg} line 3: not a ledger record"
    elif damage == "crc":
        b = seg.with_suffix(".bin")
        data = bytearray(b.read_bytes())
        data[5] ^= 1
        b.write_bytes(bytes(data))
        want = f"{seg} line 2: its payload fails its CRC"
    else:
        b = seg.with_suffix(".bin")
        b.write_bytes(b.read_bytes()[:10])
        want = f"{seg} line 2: its payload"
    p = cli("cert", tmp_path / "led")
    assert p.returncode == 2 and p.stderr.startswith(f"divtrace: error: {want}"), p.stderr


def test_missing_side_is_inconclusive(tmp_path):
    run_loop(tmp_path / "led", trainer_at={0, 2})
    r = certify(tmp_path / "led")
    assert r.verdict == "inconclusive" and r.reason.startswith("missing: step 1: no trainer logprobs")


def test_missing_segment_and_unclosed_segment_are_inconclusive(tmp_path):
    run_loop(tmp_path / "led")
    end = json.loads((tmp_path / "led" / fmt.END_FILE).read_text())
    end["segments"].append("seg-run-r1-host-1")
    (tmp_path / "led" / fmt.END_FILE).write_text(json.dumps(end))
    r = certify(tmp_path / "led")
    assert r.exit_code == 3 and "seg-run-r1-host-1" in r.reason


def test_not_a_ledger_is_bad_input(tmp_path):
    p = cli("cert", tmp_path)
    assert p.returncode == 2 and "not a ledger" in p.stderr


def test_two_ranks_write_two_segments_and_pair_across_them(tmp_path):
    model = tiny_llama()
    lps = [full_logprobs(model, p, c) for p, c in zip(PROMPTS, COMPLETIONS)]
    w = fingerprint_weights(model)
    rollout, trainer = ledger(tmp_path / "led", rank=0, world_size=2), ledger(tmp_path / "led", rank=1, world_size=2)
    rollout.rollout(0, PROMPTS, COMPLETIONS, lps, weights=w, version="v0")
    trainer.trainer(0, PROMPTS[::-1], COMPLETIONS[::-1], lps[::-1], weights=w, version="v0")  # another order
    trainer.close()
    rollout.close()
    rollout.finish()
    assert len(list((tmp_path / "led").glob("seg-*.jsonl"))) == 2
    assert certify(tmp_path / "led").exit_code == 0


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    run_loop(tmp_path / "led", part_at=(1, 0), stale_weight_at=2)
    p = cli("cert", tmp_path / "led", "--plot", tmp_path / "cert.png")
    assert p.returncode == 1 and (tmp_path / "cert.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_python_float_logprobs_must_be_exact_in_their_dtype(tmp_path):
    with ledger(tmp_path / "led") as led:
        led.rollout(0, [[1, 2]], [[3]], [[-0.5]])  # exact in float32
        with pytest.raises(DivtraceError, match="is not a float32 value"):
            led.rollout(0, [[1, 2]], [[3]], [[0.1]])


def test_from_generate_matches_a_plain_recomputation_of_the_rollout_logits(tmp_path):
    model = tiny_llama(seed=1)
    ids = torch.tensor([[0, 0, 5, 6, 7], [9, 10, 11, 12, 13]])
    mask = (ids != 0).long()
    torch.manual_seed(0)
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, top_k=5, max_new_tokens=4,
                         output_logits=True, output_scores=True, return_dict_in_generate=True, eos_token_id=1,
                         pad_token_id=0)
    b = from_generate(out, ids, mask, eos_token_id=1)
    assert b.prompts == [[5, 6, 7], [9, 10, 11, 12, 13]]
    for i, comp in enumerate(b.completions):
        for t, tok in enumerate(comp):
            want = torch.log_softmax(out.logits[t][i].float(), -1)[tok]
            assert torch.equal(b.logprobs[i][t], want)
            assert torch.equal(b.processed[i][t], torch.log_softmax(out.scores[t][i].float(), -1)[tok])
    with ledger(tmp_path / "led") as led:
        led.rollout(0, b.prompts, b.completions, b.logprobs)
        led.rollout(0, b.prompts, b.completions, b.processed, kind="processed")
    s = certify(tmp_path / "led").steps[0]
    assert s.processed_tokens == sum(map(len, b.completions))


def vllm_output(request_id, prompt, tokens, logprobs):
    """The shape of vLLM's RequestOutput / CompletionOutput / Logprob as llm.generate returns them."""
    lps = [{tok: SimpleNamespace(logprob=lp, rank=1, decoded_token=None), 7: SimpleNamespace(logprob=-9.0)}
           for tok, lp in zip(tokens, logprobs)]
    co = SimpleNamespace(index=0, token_ids=tokens, logprobs=lps)
    return SimpleNamespace(request_id=request_id, prompt_token_ids=prompt, outputs=[co])


def test_from_vllm_takes_the_sampled_tokens_logprobs_as_returned():
    lp = torch.tensor([-0.25, -1.7, -3.3], dtype=torch.float32)
    out = [vllm_output("r0", [1, 2, 3], [4, 5, 6], lp.tolist())]
    b = from_vllm(out)
    assert b.kind == "logprobs" and b.seq_ids == ["r0/0"] and b.prompts == [[1, 2, 3]]
    assert torch.equal(b.logprobs[0], lp)
    assert from_vllm(out, logprobs_mode="processed_logprobs").kind == "processed"
    with pytest.raises(DivtraceError, match="returns logits"):
        from_vllm(out, logprobs_mode="raw_logits")
    with pytest.raises(DivtraceError, match="not float32"):
        from_vllm([vllm_output("r1", [1], [4], [0.1])])


def test_vllm_hf_map_splits_fused_projections_to_hf_names():
    hf = {"model.layers.0.self_attn.q_proj.weight": torch.randn(8, 4),
          "model.layers.0.self_attn.k_proj.weight": torch.randn(4, 4),
          "model.layers.0.self_attn.v_proj.weight": torch.randn(4, 4),
          "model.layers.0.mlp.gate_proj.weight": torch.randn(6, 4),
          "model.layers.0.mlp.up_proj.weight": torch.randn(6, 4),
          "model.embed_tokens.weight": torch.randn(10, 4)}

    class Fused(torch.nn.Module):
        def __init__(self, w, sizes):
            super().__init__()
            self.weight = torch.nn.Parameter(w)
            self.output_sizes = sizes

    class Emb(torch.nn.Module):
        def __init__(self, w):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.cat([w, torch.zeros(6, 4)]))  # padded to 16 rows
            self.org_vocab_size = 10

    vllm = torch.nn.Module()
    vllm.model = torch.nn.Module()
    vllm.model.embed_tokens = Emb(hf["model.embed_tokens.weight"])
    layer = torch.nn.Module()
    vllm.model.layers = torch.nn.ModuleList([layer])
    layer.self_attn = torch.nn.Module()
    layer.self_attn.qkv_proj = Fused(torch.cat([hf[f"model.layers.0.self_attn.{x}_proj.weight"] for x in "qkv"]),
                                     [8, 4, 4])
    layer.mlp = torch.nn.Module()
    layer.mlp.gate_up_proj = Fused(torch.cat([hf["model.layers.0.mlp.gate_proj.weight"],
                                              hf["model.layers.0.mlp.up_proj.weight"]]), [6, 6])
    assert fingerprint_weights(vllm, "vllm-hf") == fingerprint_weights(hf)
    layer.mlp.gate_up_proj.output_sizes = [5, 5]
    with pytest.raises(DivtraceError, match="cannot split"):
        fingerprint_weights(vllm, "vllm-hf")


def test_every_json_key_is_documented(tmp_path):
    run_loop(tmp_path / "led", part_at=(1, 1))
    d = certify(tmp_path / "led").to_dict()
    doc = (Path(__file__).resolve().parents[1] / "docs" / "cert.md").read_text()
    keys = set(d) | set(d["steps"][0]) | set(d["first"]) | set(d["first"]["token"]) | set(d["segments"][0])
    keys |= set(d["steps"][0]["weights"]) | set(d["steps"][0]["sequences"])
    missing = sorted(k for k in keys if f"`{k}`" not in doc)
    assert not missing, missing


def test_a_killed_writer_reads_as_stopped_not_running(tmp_path):
    code = ("import sys, os; sys.path.insert(0, %r); from test_cert_ledger import run_loop; "
            "run_loop(%r, finish=False); os._exit(0)" % (str(Path(__file__).parent), str(tmp_path / "led")))
    subprocess.run([sys.executable, "-c", code], check=True)  # exits without closing its segment
    r = certify(tmp_path / "led")
    assert r.exit_code == 3 and r.reason.startswith("stopped: segment") and "is gone" in r.reason
