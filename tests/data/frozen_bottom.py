"""Language models whose blocks differ in which parameters are frozen (tests/test_frozen_params.py,
the fold's guard): ``spec`` freezes the bottom blocks (a common fine-tuning recipe: the first
``min(2, L)`` blocks ``requires_grad_(False)``, the rest trained), ``spec_top`` the blocks from
index 3 on (none in a recording of 2 or 3 blocks, the probes')."""
import torch
from torch import nn
from torch.nn import functional as F
from symcost import ModelSpec


class Block(nn.Module):
    def __init__(self, W, F_):
        super().__init__()
        self.norm = nn.LayerNorm(W)
        self.up, self.down = nn.Linear(W, F_), nn.Linear(F_, W, bias=False)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class BottomFrozenLM(nn.Module):
    def __init__(self, V, W, F_, L, frozen=slice(0, 2)):
        super().__init__()
        self.embed = nn.Embedding(V, W)
        self.blocks = nn.ModuleList(Block(W, F_) for _ in range(L))
        for b in self.blocks[frozen]:
            b.requires_grad_(False)
        self.norm, self.head = nn.LayerNorm(W), nn.Linear(W, V, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x))


def spec(frozen=slice(0, 2), name="bottom-frozen-lm"):
    return ModelSpec(
        name=name,
        symbols=("H", "D", "F", "L", "V"),
        defaults={"B": 2, "S": 8, "H": 2, "D": 4, "F": 16, "L": 4, "V": 32},
        build=lambda v: BottomFrozenLM(v["V"], v["H"] * v["D"], v["F"], v["L"], frozen),
        make_inputs=lambda v, device: ((torch.randint(0, v["V"], (v["B"], v["S"]), device=device),), {}),
        loss=lambda logits, inputs: F.cross_entropy(logits.flatten(0, 1), inputs[0][0].flatten()),
    )


def spec_top():
    return spec(slice(3, None), "top-frozen-lm")
