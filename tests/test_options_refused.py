"""No option silently ignored, never a silent zero (issue 7 item 4, issue 6 item 7).

An option that does not apply to the chosen model or command is an error saying why (one line,
exit 2, before any trace); ``--set`` and ``--config`` naming one quantity with two values is an
error; ``eval`` takes ``--memory``; ``formulas`` prints formulas only. ``eval``'s text lists the
ops without a cost rule as the report and JSON do, and a model whose model FLOPs are 0 gets a
warning in the report instead of a crash. Each refusal comes before any trace runs.
"""
from __future__ import annotations

import json
import textwrap

import pytest
import sympy

from conftest import run_cli as run




def refused(capsys, *args: str, needles=()) -> str:
    """Run the CLI; it must refuse with one line and exit 2 before any trace starts."""
    import symcost.graph.build

    def no_trace(*a, **k):
        raise AssertionError("refused only after tracing")

    real, symcost.graph.build.trace = symcost.graph.build.trace, no_trace
    try:
        code, out, err = run(capsys, *args)
    finally:
        symcost.graph.build.trace = real
    lines = err.strip().splitlines()
    assert code == 2, (code, out, err)
    assert len(lines) == 1 and lines[0].startswith("symcost: error: "), err
    assert "Traceback" not in err + out
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


@pytest.mark.parametrize("model", ["gpt2", "cs336-lm", "mlp"])
def test_attention_on_a_builtin_model(capsys, model):
    refused(capsys, "report", model, "--attention", "sdpa", needles=("--attention", "hf:"))


def test_attention_on_a_factory(capsys, tmp_path):
    f = tmp_path / "m.py"
    f.write_text("from torch import nn\ndef build(D: int = 8):\n    return nn.Linear(D, D)\n")
    refused(capsys, "eval", f"{f}:build", "--attention", "eager", needles=("--attention",))


@pytest.mark.parametrize("args,needles", [
    (("--set", "L=4", "--config", "num_hidden_layers=8"), ("L=4", "num_hidden_layers=8")),
    (("--config", "vocab_size=1000", "--set", "V=999"), ("V=999", "vocab_size=1000")),
    (("--config", "hidden_size=1024", "--set", "H=8", "D=64"), ("hidden_size=1024", "H·D")),
])
def test_set_and_config_disagree(capsys, args, needles):
    refused(capsys, "eval", "hf:llama", *args, needles=needles)


def test_set_and_config_agreeing_is_fine(capsys):
    """The same value twice is no conflict (and the config's alias names count: gpt2's n_layer)."""
    refused(capsys, "eval", "hf:gpt2", "--config", "n_layer=3", "--set", "L=4", needles=("n_layer=3",))
    # agreeing values pass that check and reach the next one (S beyond the position table),
    # still before any trace
    refused(capsys, "eval", "hf:gpt2", "--config", "n_layer=2", "--set", "L=2", "S=5000",
            needles=("S=5000", "max_position_embeddings"))


def test_formulas_prints_formulas_only(capsys):
    """``formulas`` has no --memory and no number at default sizes (no max_batch)."""
    refused(capsys, "formulas", "mlp", "--memory", "24GiB", needles=("--memory",))
    code, out, err = run(capsys, "formulas", "mlp", "--precision", "fp32", "--json")
    assert code == 0, err
    mem = json.loads(out)["memory"]
    assert "max_batch" not in mem and "memory_at_max" not in mem and "memory_cap" not in mem
    for k in ("params", "grads", "optimizer", "activations", "peak"):
        assert isinstance(mem[k], str)
        sympy.sympify(mem[k], locals={s: sympy.Symbol(s) for s in "BSHDLVFK"})
    code, out, err = run(capsys, "formulas", "mlp", "--precision", "fp32")
    assert code == 0 and "largest batch" not in out


def test_eval_takes_memory_and_optimizer(capsys):
    """``eval --memory`` is the cap of memory.max_batch (checked at the boundary it reports)."""
    args = ("eval", "mlp", "--precision", "fp32", "--set", "B=2", "S=64", "D=256", "L=3", "--json")
    code, out, err = run(capsys, *args, "--memory", "256MiB", "--optimizer", "sgd")
    assert code == 0, err
    mem = json.loads(out)["memory"]
    assert mem["memory_cap"] == 256 * 2**20 and mem["optimizer_name"] == "sgd"
    assert mem["memory_at_max"] <= mem["memory_cap"]
    refused(capsys, "eval", "mlp", "--memory", "80XB", needles=("80XB",))


def test_hints(capsys):
    refused(capsys, "eval", "gpt2", "--set", "B", "8", needles=("--set B=8",))
    refused(capsys, "report", "--precision", "bf16", needles=("bf16-true", "bf16-mixed"))
    refused(capsys, "report", "--precision", "bf16-mixed-master", needles=("bf16-true-fp32-master",))


# ---------------------------------------------------------------------------------------------
# never a silent zero

FFT = """
import torch
from torch import nn

class Block(nn.Module):
    def __init__(self, D):
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x):
        return x + torch.fft.irfft(torch.fft.rfft(self.fc(x), dim=-1), n=x.shape[-1], dim=-1)

def build(D: int = 16, L: int = 2):
    return nn.Sequential(*[Block(D) for _ in range(L)])
"""

ELEMENTWISE = """
from torch import nn

def build(D: int = 16):
    return nn.Sequential(nn.LayerNorm(D), nn.GELU(), nn.Tanh())
"""


def _write(tmp_path, name, text):
    p = tmp_path / f"{name}.py"
    p.write_text(textwrap.dedent(text))
    return f"{p}:build"


def test_eval_text_lists_unsupported_ops(capsys, tmp_path):
    """Per block, forward rfft (one _fft_r2c) and irfft (one _fft_c2r); backward, the gradient of
    irfft is an r2c FFT and that of rfft an inverse complex FFT (torch's derivatives.yaml): with
    L = 3, r2c runs 6 times, c2r 3, c2c 3."""
    model = _write(tmp_path, "fft", FFT)
    code, out, err = run(capsys, "eval", model, "--precision", "fp32", "--set", "B=2", "S=8", "D=32", "L=3")
    assert code == 0, err
    warn = {ln.split("no cost rule for ")[1].split(",")[0] for ln in out.splitlines() if "warning" in ln}
    assert warn == {"aten._fft_r2c.default ×6", "aten._fft_c2r.default ×3", "aten._fft_c2c.default ×3"}, out


def test_report_with_zero_model_flops_warns(capsys, tmp_path):
    """No matmul-class op: model FLOPs are 0; the report with --set says so instead of dividing
    by zero (the norm's, GELU's and tanh's all-FLOPs are still counted)."""
    model = _write(tmp_path, "ew", ELEMENTWISE)
    code, out, err = run(capsys, "report", model, "--precision", "fp32", "--set", "B=2", "S=8")
    assert code == 0, err
    assert "model FLOPs are 0" in out and "ZeroDivision" not in out + err


def test_a_symbol_set_twice_is_refused():
    """``--set B=8 B=4`` used to keep the last value silently: now one line names both."""
    from symcost.commands._options import parse_sizes
    from symcost.errors import SymcostError

    with pytest.raises(SymcostError, match=r"B is set twice in --set \(B=8, B=4\)"):
        parse_sizes(("B=8", "S=16", "B=4"))
    assert parse_sizes(("B=8", "B=8")) == {"B": 8}
