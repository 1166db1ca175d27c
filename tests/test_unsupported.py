"""An op with no cost rule is never silently zero (issue 2): it is listed, with how many times a
training step runs it, in ``unsupported_ops`` of the JSON and in a warning line of the report."""
from __future__ import annotations

import json
import random
import textwrap

import pytest
import sympy
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import symcost
from symcost.graph import rules
from symcost.cli import main as cli_main
from conftest import random_sizes

L = sympy.Symbol("L", positive=True, integer=True)

# L blocks, each: Linear, then a real FFT along the width and its inverse, plus a residual.
FFT_MODEL = """
import torch
from torch import nn
from symcost import ModelSpec

class FFTBlock(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        y = torch.fft.rfft(self.fc(x), dim=-1)
        return x + torch.fft.irfft(y, n=x.shape[-1], dim=-1)

class FFTNet(nn.Module):
    def __init__(self, d, n_layers):
        super().__init__()
        self.layers = nn.ModuleList(FFTBlock(d) for _ in range(n_layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x

def spec():
    return ModelSpec(
        name="fftnet",
        symbols=("D", "L"),
        defaults={"B": 2, "S": 8, "D": 16, "L": 3},
        build=lambda v: FFTNet(v["D"], v["L"]),
        make_inputs=lambda v, device: ((torch.randn(v["B"], v["S"], v["D"], device=device),), {}),
        loss=lambda out, inputs: out.pow(2).mean(),
        layers="layers",
    )
"""

# Worked out by hand, per block. Forward: rfft is one aten._fft_r2c, irfft one aten._fft_c2r.
# Backward (torch's derivatives.yaml): the gradient of irfft (c2r) is a real-to-complex FFT of
# the incoming gradient (one _fft_r2c); the gradient of rfft (r2c) zero-pads the complex gradient
# to full length and runs an inverse complex FFT (one _fft_c2c). Every block runs both backward
# ops (each block's fc weight needs the gradient through its FFTs), so over L blocks:
EXPECTED = {
    "aten._fft_r2c.default": 2 * L,
    "aten._fft_c2r.default": L,
    "aten._fft_c2c.default": L,
}


@pytest.fixture(scope="module")
def fft_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("unsupported") / "fftnet.py"
    path.write_text(textwrap.dedent(FFT_MODEL))
    return f"{path}:spec"


@pytest.fixture(scope="module")
def fft_analysis(fft_model):
    return symcost.trace(fft_model, precision="fp32")


class _OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func)] = self.counts.get(str(func), 0) + 1
        return func(*args, **(kwargs or {}))


def test_the_fft_ops_have_no_rule():
    # the premise of this file: should a rule be added for them, pick another op
    aten = torch.ops.aten
    for op in (aten._fft_r2c.default, aten._fft_c2r.default, aten._fft_c2c.default):
        assert str(op) in EXPECTED
        assert rules.classify(op) == "unsupported", op


def test_unsupported_counts_symbolic(fft_analysis):
    got = {k: sympy.sympify(v) for k, v in fft_analysis.unsupported.items()}
    assert set(got) == set(EXPECTED), got
    for k, v in EXPECTED.items():
        assert sympy.expand(got[k] - v) == 0, (k, got[k])


def test_unsupported_counts_match_a_real_run(fft_analysis):
    """The counts at random sizes equal the ops a real CPU training step dispatches."""
    for v in random_sizes(fft_analysis, random.Random("fft"), n=3):
        torch.manual_seed(0)
        model = fft_analysis.spec.build(v).train()
        args, kwargs = fft_analysis.spec.make_inputs(v, torch.device("cpu"))
        with _OpCounter() as c:
            fft_analysis.spec.loss(model(*args, **kwargs), (args, kwargs)).backward()
        for k, expr in EXPECTED.items():
            assert c.counts.get(k, 0) == int(expr.subs(L, v["L"])), (k, v, c.counts)
            assert int(sympy.sympify(fft_analysis.unsupported[k]).subs(L, v["L"])) == c.counts[k]


def run_cli(capsys, *args):
    code = 0
    try:
        cli_main(list(args))
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def test_unsupported_in_json(capsys, fft_model):
    code, out, err = run_cli(capsys, "eval", fft_model, "--set", "B=3", "S=10", "D=12", "L=4", "--json",
                             "--precision", "fp32")
    assert code == 0, err
    ops = json.loads(out)["unsupported_ops"]
    assert ops == {k: int(v.subs(L, 4)) for k, v in EXPECTED.items()}

    code, out, err = run_cli(capsys, "formulas", fft_model, "--json", "--precision", "fp32")
    assert code == 0, err
    ops = json.loads(out)["unsupported_ops"]
    assert set(ops) == set(EXPECTED)
    for k, v in ops.items():
        assert isinstance(v, str)
        assert sympy.expand(sympy.sympify(v, locals={"L": L}) - EXPECTED[k]) == 0


def test_unsupported_in_report_warning(capsys, fft_model):
    code, out, err = run_cli(capsys, "report", fft_model, "--precision", "fp32")
    assert code == 0, err
    warnings = [line for line in (out + err).splitlines() if "warning" in line.lower()]
    assert warnings, out
    text = " ".join(warnings)
    for k, v in EXPECTED.items():
        assert k in text, (k, text)
        # the count follows the op's name: "aten._fft_r2c.default ×2*L"
        after = text.split(k, 1)[1].split(",", 1)[0].strip().lstrip("×x").strip()
        assert sympy.expand(sympy.sympify(after, locals={"L": L}) - v) == 0, (k, after)


def test_supported_model_has_no_warning(traced):
    """The other side: a model whose every op has a rule lists none (so the warning means it)."""
    assert traced("mlp", "fp32", "eager").unsupported == {}
