"""Issue 26 snag 8: logprob, KL and argmax figures are computed for any root output; where the output is neither
named logits/logprobs nor normalized log-probabilities, bisect says so (JSON `final.caveat`, a `caveat:` line)."""
from __future__ import annotations

import torch

import divtrace
from divtrace.cli.app import main
from divtrace.compare.final import is_logprobs, output_caveat
from helpers import record_pair


class Encoder(torch.nn.Module):
    """A model whose output is hidden states, not logits; `tanh` plants GELU's tanh approximation on one side."""

    def __init__(self, tanh: bool):
        super().__init__()
        torch.manual_seed(0)
        self.up, self.down = torch.nn.Linear(16, 64), torch.nn.Linear(64, 16)
        self.approx = "tanh" if tanh else "none"

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(x), approximate=self.approx))


def test_hidden_state_output_gets_a_caveat(tmp_path, capsys):
    x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(1))
    for name, tanh in (("a", False), ("b", True)):
        m = Encoder(tanh)
        with torch.no_grad(), divtrace.record(m, tmp_path / name, mode="full", label=name):
            m(x)
    fin = divtrace.bisect(tmp_path / "a", tmp_path / "b").to_dict()["final"]
    assert fin["identical"] is False and fin["kl"] is not None
    assert fin["caveat"] and "neither named logits nor normalized log-probabilities" in fin["caveat"]
    capsys.readouterr()
    assert main(["bisect", str(tmp_path / "a"), str(tmp_path / "b")]) == 1
    assert "caveat: the output out is neither named logits" in " ".join(capsys.readouterr().out.split())


def test_logprobs_and_logits_get_none(tmp_path):
    a, b = record_pair(tmp_path, "rmsnorm_cast", layers=2)  # the example returns log_softmax: logprobs
    assert divtrace.bisect(a, b).to_dict()["final"]["caveat"] is None
    hidden = torch.randn(4, 32)
    assert is_logprobs(hidden.log_softmax(-1)) and not is_logprobs(hidden)
    assert is_logprobs(hidden.bfloat16().log_softmax(-1).float())  # bf16 logprobs stored in fp32
    assert output_caveat("out.logits", hidden, hidden) is None  # named logits
    assert output_caveat("out", hidden, hidden) is not None
