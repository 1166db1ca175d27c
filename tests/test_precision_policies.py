"""Precision names as Lightning and Accelerate use them (issue 7, item 3).

``bf16-mixed`` (the default) is ``torch.autocast`` over fp32 weights: its static memory must be
what a real autocast AdamW step allocates (fp32 weights, fp32 gradients, fp32 moments and step
counters: 16 bytes per parameter), measured on real CPU tensors after ``optimizer.step()``. The
seed's 12P policy (bf16 weights and gradients, fp32 Adam moments) stays available as
``bf16-true-fp32-state``; ``bf16-true`` is every tensor in bf16.
"""
from __future__ import annotations

import json
import random

import pytest
import torch
from click.testing import CliRunner

from symcost.passes import memory
from symcost.cli import main
from conftest import random_sizes
from memory_oracle import full_values


def autocast_adamw_step(spec, sizes) -> dict[str, int]:
    """Bytes of parameters, gradients and AdamW state after one real ``torch.autocast(bf16)``
    step of the fp32 model (as Lightning's ``precision="bf16-mixed"`` runs it)."""
    torch.manual_seed(0)
    values = full_values(spec, sizes)
    model = spec.build(values)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    args, kwargs = spec.make_inputs(values, torch.device("cpu"))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = spec.loss(model(*args, **kwargs), (args, kwargs))
    loss.backward()
    opt.step()

    def nbytes(ts):
        return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in ts}.values())

    params = list(model.parameters())
    state = [t for st in opt.state.values() for t in st.values() if isinstance(t, torch.Tensor)]
    return {"params": nbytes(params), "grads": nbytes([p.grad for p in params if p.grad is not None]),
            "optimizer": nbytes(state), "master_weights": 0}


@pytest.mark.parametrize("model", ["cs336-lm", "gpt2"])
def test_bf16_mixed_static_is_a_real_autocast_step(traced, model):
    an = traced(model, "bf16-mixed")
    mm = memory.memory_model(an)  # the trace's own policy: the default precision
    assert mm.policy.name == "bf16-mixed" and mm.bytes_per_param() == 16
    for sz in random_sizes(an, random.Random(f"amp|{model}"), n=2):
        want = autocast_adamw_step(an.spec, sz)
        got = mm.components(**sz)
        for k, v in want.items():
            assert got[k] == v, f"{model} at {sz}: {k} symcost {got[k]} B, autocast AdamW step {v} B"


def test_policy_names_through_the_cli():
    """Each name's bytes per parameter with AdamW, as the JSON states them; the seed's 12P is
    ``bf16-true-fp32-state``."""
    want = {"bf16-mixed": 16, "bf16-true": 8, "bf16-true-fp32-state": 12, "bf16-true-fp32-master": 16}
    for name, bpp in want.items():
        r = CliRunner().invoke(main, ["formulas", "mlp", "--precision", name, "--json"])
        assert r.exit_code == 0, r.output
        js = json.loads(r.output)
        assert js["precision"] == name and js["memory"]["bytes_per_param"] == bpp, (name, js["memory"])
