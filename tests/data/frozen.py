"""A language model fine-tuned LoRA-style: a frozen backbone (token table, a frozen position table
of S rows as Whisper's encoder keeps one, each block's base projections) and trainable low-rank
adapters, norms and head (tests/test_frozen_params.py)."""
import torch
from torch import nn
from torch.nn import functional as F
from symcost import ModelSpec


class Block(nn.Module):
    def __init__(self, W, F_, R):
        super().__init__()
        self.norm = nn.LayerNorm(W)
        self.up, self.down = nn.Linear(W, F_), nn.Linear(F_, W, bias=False)  # the frozen base
        self.up.requires_grad_(False)
        self.down.requires_grad_(False)
        self.lora_a, self.lora_b = nn.Linear(W, R, bias=False), nn.Linear(R, F_, bias=False)  # trained

    def forward(self, x):
        h = self.norm(x)
        return x + self.down(F.gelu(self.up(h) + self.lora_b(self.lora_a(h))))


class LoraLM(nn.Module):
    def __init__(self, V, W, F_, L, R, S):
        super().__init__()
        self.embed = nn.Embedding(V, W).requires_grad_(False)
        self.pos = nn.Parameter(torch.zeros(S, W), requires_grad=False)
        self.blocks = nn.ModuleList(Block(W, F_, R) for _ in range(L))
        self.norm, self.head = nn.LayerNorm(W), nn.Linear(W, V, bias=False)

    def forward(self, ids):
        x = self.embed(ids) + self.pos
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x))


def spec():
    return ModelSpec(
        name="lora-lm",
        symbols=("H", "D", "F", "L", "V", "R_lora"),
        defaults={"B": 2, "S": 8, "H": 2, "D": 4, "F": 16, "L": 3, "V": 32, "R_lora": 2},
        meanings={"R_lora": "rank of each block's low-rank adapter"},
        build=lambda v: LoraLM(v["V"], v["H"] * v["D"], v["F"], v["L"], v["R_lora"], v["S"]),
        make_inputs=lambda v, device: ((torch.randint(0, v["V"], (v["B"], v["S"]), device=device),), {}),
        loss=lambda logits, inputs: F.cross_entropy(logits.flatten(0, 1), inputs[0][0].flatten()),
    )
