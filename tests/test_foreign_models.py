"""Issue 30, the defects under "Why": symcost is never silently wrong on models nobody here wrote.
Each defect on its smallest input, against an independent oracle (PyTorch measuring the same
quantity: a meta-device parameter count, FlopCounterMode, saved_tensors_hooks on real tensors, a
hand count of the bytes an op reads and writes)."""
from __future__ import annotations

import json
import random
import textwrap

import pytest
import torch
from torch import nn

import symcost
from conftest import run_cli

# ------------------------------------------------------------------------------------------------
# a model that prints while it is built and run (nanoGPT prints its parameter count in __init__)
PRINTING_MODEL = """
import torch
from torch import nn
from symcost import ModelSpec

class Chatty(nn.Module):
    def __init__(self, d, n_layers):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(n_layers))
        print("number of parameters: %.2fM" % (sum(p.numel() for p in self.parameters()) / 1e6,))

    def forward(self, x):
        print("forward", tuple(x.shape))
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x

print("loading the model file")

def chatty(D=16, L=2):
    return Chatty(D, L)

def chatty_spec():
    print("making the spec")
    return ModelSpec(name="chatty", symbols=("D", "L"), defaults={"B": 2, "S": 4, "D": 16, "L": 2},
                     build=lambda v: Chatty(v["D"], v["L"]),
                     make_inputs=lambda v, device: ((torch.randn(v["B"], v["S"], v["D"], device=device),), {}),
                     loss=lambda out, inputs: out.pow(2).mean(), layers="layers")
"""


@pytest.fixture(scope="module")
def chatty_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("chatty") / "chatty.py"
    path.write_text(textwrap.dedent(PRINTING_MODEL))
    return str(path)


@pytest.mark.parametrize("factory", ["chatty", "chatty_spec"])
def test_printing_model_keeps_json_clean(chatty_file, factory, capsys, tmp_path, monkeypatch):
    """The model's prints (at import, in the factory, in __init__, in forward) go to stderr; stdout
    is the JSON object alone, and its parameter count is the meta-device count."""
    monkeypatch.setenv("SYMCOST_CACHE_DIR", str(tmp_path))
    d, n_layers = random.Random(factory).choice((8, 12, 24)), 3
    code, out, err = run_cli(capsys, "eval", f"{chatty_file}:{factory}", "--set", f"D={d}", f"L={n_layers}",
                             "B=2", "S=5", "--json")
    assert code == 0, err
    js = json.loads(out)  # the whole of stdout is one JSON object
    with torch.device("meta"):
        meta = nn.ModuleList(nn.Linear(d, d) for _ in range(n_layers))
    assert js["params"] == sum(p.numel() for p in meta.parameters())
    assert "number of parameters" in err and "number of parameters" not in out
