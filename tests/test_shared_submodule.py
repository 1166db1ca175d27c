"""Issue 30, "pin only the symbol at fault": a submodule shared by all blocks (torchtune's Llama
builds one ``Llama3ScaledRoPE`` and hands the same instance to every block's attention,
tests/data/torchtune_llama.py; a gate ``nn.Linear`` shared the same way, whose gradient autograd
sums over the blocks) folds over L exactly. ``named_modules`` names a shared instance once, under
block 0, so every block's call of it was recorded as block 0's work, its buffer as block 0's (and
counted L times), its parameter's gradient accumulation as block 0's: the blocks differed and every
symbol was pinned ("no polynomial in it fits"). Checked at depths and widths never probed against
PyTorch: FlopCounterMode, saved_tensors_hooks, a meta-device parameter count (the shared gate
once), and the buffer bytes of the real model (the shared cache once)."""
from __future__ import annotations

import random
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import symcost
from memory_oracle import exact_at
from symcost.frontends.spec import Constraint
from symcost.passes import memory

MAX_SEQ = 32  # rows of the rotary cache
VOCAB = 32


class Rope(nn.Module):
    """A rotary embedding over a ``[MAX_SEQ, D/2, 2]`` cos/sin cache (torchtune's RotaryPositionalEmbeddings)."""

    def __init__(self, dim):
        super().__init__()
        theta = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
        ang = torch.outer(torch.arange(MAX_SEQ).float(), theta)
        self.register_buffer("cache", torch.stack([ang.cos(), ang.sin()], -1), persistent=False)

    def forward(self, x):
        c = self.cache[: x.size(1)]
        xs = x.float().reshape(*x.shape[:-1], -1, 2)
        out = torch.stack([xs[..., 0] * c[..., 0] - xs[..., 1] * c[..., 1],
                           xs[..., 1] * c[..., 0] + xs[..., 0] * c[..., 1]], -1)
        return out.flatten(-2).type_as(x)


class Block(nn.Module):
    def __init__(self, d, rope, gate):
        super().__init__()
        self.proj = nn.Linear(d, d, bias=False)
        self.rope = rope  # the same instance in every block (a buffer)
        self.gate = gate  # the same instance in every block (a parameter: its gradient summed over them)

    def forward(self, x):
        return x + self.rope(torch.tanh(self.proj(x))) * torch.sigmoid(self.gate(x))


class SharedRopeLM(nn.Module):
    def __init__(self, v, d, n):
        super().__init__()
        rope, gate = Rope(d), nn.Linear(d, d, bias=False)
        self.emb = nn.Embedding(v, d)
        self.layers = nn.ModuleList(Block(d, rope, gate) for _ in range(n))
        self.out = nn.Linear(d, v, bias=False)

    def forward(self, t):
        h = self.emb(t)
        for block in self.layers:
            h = block(h)
        return self.out(h)


def spec():
    return symcost.ModelSpec(
        name="shared-rope-lm", symbols=("D", "L"), defaults={"B": 2, "S": 8, "D": 8, "L": 2},
        build=lambda v: SharedRopeLM(VOCAB, v["D"], v["L"]),
        make_inputs=lambda v, device: ((torch.randint(0, VOCAB, (v["B"], v["S"]), device=device),), {}),
        loss=lambda out, inputs: F.cross_entropy(out.flatten(0, 1), inputs[0][0].flatten()),
        constraints=(Constraint("multiple", "D", 2, "the rotary embedding pairs the width: D must be even"),
                     Constraint("max", "S", MAX_SEQ, f"the rotary cache holds {MAX_SEQ} positions")))


def test_a_module_shared_by_all_blocks_folds_over_L_exactly(cache_dir):
    """No symbol pinned; parameters, FLOPs and saved bytes equal PyTorch's at random sizes with
    L never probed; the shared cache's bytes are counted once (not once per block)."""
    s = spec()
    an = symcost.trace(s, precision="fp32")
    assert an.pinned == {}, an.pin_reasons
    probed = {p["L"] for p in an.plan.points}
    rng = random.Random(30)
    for _ in range(2):
        v = {"B": rng.randint(1, 3), "S": rng.randint(3, MAX_SEQ), "D": rng.choice((4, 6, 10)),
             "L": rng.choice([n for n in range(3, 7) if n not in probed])}
        exact_at(an, s, v)
        model = s.build({**s.defaults, **v})
        storages = {b.untyped_storage().data_ptr(): b.untyped_storage().nbytes() for b in model.buffers()}
        assert len(storages) == 1 and memory.memory_model(an).components(**v)["buffers"] == sum(storages.values()), v


def test_a_shared_embedding_indexed_per_block_folds_over_L_exactly(cache_dir):
    """tests/data/relenc.py (a newcomer's encoder, issue 30): every block adds the bias of ONE
    relative-position ``nn.Embedding(2·S_max − 1, H)`` registered first outside the blocks
    (``pos.table.weight``, then ``blocks.i.pos.table.weight``). Its gradient's accumulation
    (autograd's add of each block's ``embedding_dense_backward``, then AccumulateGrad's detach)
    was block 0's, so blocks 1, 2 of 3 differed from block 0 and L was pinned; now the last block
    (the first in the backward: nothing to add to yet) stands apart and L folds. Parameters (the
    table once: meta count), FLOPs (FlopCounterMode) and saved bytes (saved_tensors_hooks) at
    random sizes with L never probed."""
    rel = symcost.resolve(str(Path(__file__).resolve().parent / "data" / "relenc.py") + ":spec")
    an = symcost.trace(rel, sizes={"B": 2, "S": 8, "H": 2, "D": 4, "F": 12, "L": 2, "V": 40, "S_max": 16},
                       precision="fp32")
    assert an.pinned == {}, an.pin_reasons
    probed = {p["L"] for p in an.plan.points}
    rng = random.Random(31)
    for _ in range(2):
        s_max = rng.randint(4, 24)
        v = {"B": rng.randint(2, 3), "S": rng.randint(2, s_max), "H": rng.choice((2, 3)), "D": rng.choice((2, 4, 6)),
             "F": rng.randint(3, 20), "L": rng.choice([n for n in range(3, 7) if n not in probed]),
             "V": rng.randint(8, 50), "S_max": s_max}
        exact_at(an, rel, v)
