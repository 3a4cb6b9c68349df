"""scripts/simulate_machines.py --check (a stage of .ci/run): what fails the run of the other machines."""
import importlib.util
from pathlib import Path

_path = Path(__file__).resolve().parent.parent / "scripts" / "simulate_machines.py"
_spec = importlib.util.spec_from_file_location("simulate_machines", _path)
sim = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sim)

PLANTED = {"llama_pair sdpa": ["diverged", "model.layers.0.self_attn", "aten.bmm.default", "aten.mm.default"],
           "rollout rmsnorm_cast": ["diverged", "model.layers.0.input_layernorm", "aten.mul.Tensor", True]}


def _config(name, planted=PLANTED, drift=True, rollout_module="model.layers.0.self_attn.q_proj"):
    return {"config": name, "drift_tests_pass": drift, "planted": dict(planted),
            "rollout": {"verdict": "diverged", "module": rollout_module}}


def test_the_same_verdicts_everywhere_pass_and_the_unplanted_rollout_may_part_elsewhere():
    report = [_config("this machine"), _config("1 thread", rollout_module="model.layers.0.self_attn")]
    assert sim.failures(report, check=True) == []


def test_a_planted_variant_found_at_another_module_fails_the_check_only():
    other = dict(PLANTED, **{"llama_pair sdpa": ["diverged", "model.layers.0.mlp", "aten.mm.default", None]})
    report = [_config("this machine"), _config("no C extensions", planted=other)]
    failed = sim.failures(report, check=True)
    assert len(failed) == 1 and failed[0].startswith("no C extensions: planted llama_pair sdpa: ")
    assert "model.layers.0.mlp" in failed[0] and "model.layers.0.self_attn" in failed[0]
    assert sim.failures(report, check=False) == []


def test_a_missing_variant_a_failed_planted_run_and_failing_drift_tests_fail():
    fewer = {k: v for k, v in PLANTED.items() if k != "rollout rmsnorm_cast"}
    report = [_config("this machine"), _config("1 thread", planted=fewer),
              _config("ATEN_CPU_CAPABILITY=default", planted={"error": "Traceback ...\nRuntimeError: boom"}),
              _config("2 threads", drift=False)]
    failed = sim.failures(report, check=True)
    assert failed[0] == "2 threads: drift tests fail"
    assert any(f.startswith("1 thread: planted rollout rmsnorm_cast: None") for f in failed)
    assert any(f.startswith("ATEN_CPU_CAPABILITY=default: planted variants did not run:") and "boom" in f
               for f in failed)
    assert len(failed) == 3
