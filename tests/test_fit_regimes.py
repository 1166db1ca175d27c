"""Issue 30 item 3: sizes that are not polynomials in the symbols as the plain ring holds them are
fitted exactly, or their regime traced and said, pinning only the symbol at fault.

- A model's own divisor (``Constraint("divides", "G", "W")``) has an inverse generator in the
  memory schedule's ring (tracing/poly.py ``Algebra(inverses=...)``), as the mesh sizes have: a
  [G, W/G, W/G] block-diagonal weight's W²/G elements and a grouped convolution's W·(W/G)·k
  weight are polynomials there (they pinned W and G: the ring held 1/DP, 1/TP, 1/EP only).

Oracles, at random sizes of the regime never probed: a meta-device parameter count,
FlopCounterMode on the real step (grouped convolutions split into their groups, which it counts
right), the bytes saved_tensors_hooks sees (tests/memory_oracle.py) and torch.profiler's peak at
the ends of top-level ops.
"""
from __future__ import annotations

import random

import pytest
import torch

import symcost
from memory_oracle import exact_at, step_peak
from test_hf_tasks import _split_conv1d

#: A user factory whose sizes need 1/G in the memory ring: a grouped conv1d (W channels in G
#: groups, kernel 3: a [W, W/G, 3] weight), GroupNorm(G, W), and a block-diagonal mixing of each
#: group's W/G channels by a [G, W/G, W/G] weight (W²/G elements), one batched matmul.
GROUPED_CONV = '''
import torch
from torch import nn
from symcost import ModelSpec
from symcost.frontends.spec import Constraint


class Block(nn.Module):
    def __init__(self, W, G):
        super().__init__()
        self.G = G
        self.conv = nn.Conv1d(W, W, 3, padding=1, groups=G)
        self.norm = nn.GroupNorm(G, W)
        self.mix = nn.Parameter(torch.randn(G, W // G, W // G) / W ** 0.5)

    def forward(self, x):                                               # x [B, W, S]
        b, w, s = x.shape
        h = torch.relu(self.norm(self.conv(x)))
        y = torch.matmul(self.mix, h.view(b, self.G, w // self.G, s))   # [B, G, W/G, S]
        return x + torch.tanh(y.reshape(b, w, s))


class Net(nn.Module):
    def __init__(self, W, G, L):
        super().__init__()
        self.blocks = nn.ModuleList(Block(W, G) for _ in range(L))

    def forward(self, x):
        for blk in self.blocks:
            x = blk(x)
        return x


def spec():
    return ModelSpec(
        name="grouped-conv", symbols=("W", "G", "L"), defaults={"B": 2, "S": 5, "W": 12, "G": 3, "L": 2},
        meanings={"W": "channels", "G": "groups of W/G channels"},
        constraints=(Constraint("divides", "G", "W", "G must divide W"),),
        build=lambda v: Net(v["W"], v["G"], v["L"]),
        make_inputs=lambda v, device: ((torch.randn(v["B"], v["W"], v["S"], device=device),), {}),
        loss=lambda out, inputs: out.pow(2).mean())
'''


def test_own_divisor_storage_w2_over_g_exact(tmp_path, monkeypatch):
    """W²/G storages (the [G, W/G, W/G] weight, the grouped conv's [W, W/G, 3]) fit exactly and
    pin nothing (before: W and G pinned, 'the size of blocks.0.mix fitted as W**2/G, which is no
    polynomial in the symbols'); the printed formulas keep W**2/G; parameters, FLOPs and saved
    bytes exact at two random (W, G), and the peak equal to torch.profiler's at the ends of
    top-level ops at a third (the CPU's convolution backward adds an im2col workspace inside the
    kernel, which symcost does not model: tests/test_any_model.py)."""
    from symcost.frontends.models import resolve
    from symcost.passes import memory

    path = tmp_path / "grouped_conv.py"
    path.write_text(GROUPED_CONV)
    spec = resolve(f"{path}:spec")
    an = symcost.trace(spec, sizes={"B": 2, "S": 5, "W": 12, "G": 3, "L": 2}, precision="fp32", torch_device="cpu")
    assert not an.pinned, an.pin_reasons
    W, G, L = (symcost.SYMS[s] for s in ("W", "G", "L"))
    assert "W**2/G" in str(an.params), an.params
    assert an.schedule.inverses == ["G"] and not an.schedule.error, an.schedule.error
    _split_conv1d(monkeypatch)
    rng = random.Random("W**2/G")
    draws = []
    for _ in range(3):
        g = rng.randint(2, 5)
        draws.append({"B": rng.randint(2, 4), "S": rng.randint(2, 9), "W": g * rng.choice((2, 4, 5)), "G": g,
                      "L": rng.randint(1, 3)})
    probed = {(p["W"], p["G"]) for p in an.fitter.plan.points}
    assert not probed & {(v["W"], v["G"]) for v in draws}, probed
    for v in draws[:2]:
        exact_at(an, spec, v)
    monkeypatch.undo()
    v = draws[2]
    mm = memory.memory_model(an, "fp32", "adamw", "default", "cpu")
    assert mm.peak(**v) == step_peak(spec, v, "fp32", "adamw", foreach=None)["peak_ops"], v
