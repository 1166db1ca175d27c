"""An encoder whose blocks all use ONE shared relative-position-bias module."""
import torch
from torch import nn
from torch.nn import functional as F
from symcost import ModelSpec
from symcost.frontends.spec import Constraint


class RelPosBias(nn.Module):
    """Learned bias per (head, offset), offsets in [-(S_max-1), S_max-1]; shared by every block."""

    def __init__(self, H, S_max):
        super().__init__()
        self.S_max = S_max
        self.table = nn.Embedding(2 * S_max - 1, H)

    def forward(self, S, device):
        pos = torch.arange(S, device=device)
        rel = pos[None, :] - pos[:, None] + (self.S_max - 1)      # [S, S]
        return self.table(rel).permute(2, 0, 1)                  # [H, S, S]


class Block(nn.Module):
    def __init__(self, H, D, F_, pos):
        super().__init__()
        w = H * D
        self.H, self.pos = H, pos                                 # the same module object in every block
        self.norm1, self.qkv, self.out = nn.LayerNorm(w), nn.Linear(w, 3 * w), nn.Linear(w, w)
        self.norm2, self.up, self.down = nn.LayerNorm(w), nn.Linear(w, F_), nn.Linear(F_, w)

    def forward(self, x):
        b, s, w = x.shape
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        split = lambda t: t.view(b, s, self.H, w // self.H).transpose(1, 2)
        scores = split(q) @ split(k).transpose(-1, -2) / (w // self.H) ** 0.5
        scores = scores + self.pos(s, x.device)
        att = (scores.softmax(-1) @ split(v)).transpose(1, 2).reshape(b, s, w)
        x = x + self.out(att)
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class RelEncoder(nn.Module):
    def __init__(self, V, H, D, F_, L, S_max):
        super().__init__()
        self.embed = nn.Embedding(V, H * D)
        self.pos = RelPosBias(H, S_max)
        self.blocks = nn.ModuleList(Block(H, D, F_, self.pos) for _ in range(L))
        self.norm, self.head = nn.LayerNorm(H * D), nn.Linear(H * D, V, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x))


def spec():
    return ModelSpec(
        name="rel-encoder",
        symbols=("H", "D", "F", "L", "V", "S_max"),
        defaults={"B": 4, "S": 64, "H": 4, "D": 16, "F": 256, "L": 4, "V": 1000, "S_max": 128},
        meanings={"S_max": "longest sequence the relative-position table covers"},
        constraints=(Constraint("max", "S", "S_max", "S must be at most S_max (the position table's reach)"),),
        build=lambda v: RelEncoder(v["V"], v["H"], v["D"], v["F"], v["L"], v["S_max"]),
        make_inputs=lambda v, device: ((torch.randint(0, v["V"], (v["B"], v["S"]), device=device),), {}),
        loss=lambda logits, inputs: F.cross_entropy(logits.flatten(0, 1), inputs[0][0].flatten()),
    )
