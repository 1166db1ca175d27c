"""A stack of L identical ``Linear(D, D) + GELU`` blocks on a float input ``[B, S, D]``.

The smallest built-in: no attention, no embedding. The training step's loss is the mean square
of the output. Symbols: D (width), L (blocks). Defaults D=1024, L=8, B=8, S=128.
"""
from __future__ import annotations

import torch
from torch import nn

from symcost.frontends.models import ModelSpec


class Block(nn.Module):
    """``gelu(fc(x))``: ``[..., D]`` -> ``[..., D]``."""

    def __init__(self, dim: int):
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.act = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.fc(x))


class MLP(nn.Module):
    """L blocks in sequence: ``[B, S, D]`` -> ``[B, S, D]``."""

    def __init__(self, dim: int, num_layers: int):
        super().__init__()
        self.layers = nn.ModuleList(Block(dim) for _ in range(num_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def spec() -> ModelSpec:
    """The ``mlp`` model specification."""
    return ModelSpec(
        name="mlp",
        symbols=("D", "L"),
        defaults={"B": 8, "S": 128, "D": 1024, "L": 8},
        build=lambda v: MLP(v["D"], v["L"]),
        make_inputs=lambda v, device: ((torch.randn(v["B"], v["S"], v["D"], device=device),), {}),
        loss=lambda out, inputs: out.pow(2).mean(),
        layers="layers",
    )
