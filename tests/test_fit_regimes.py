"""Issue 30 item 3: sizes that are not polynomials in the symbols as the plain ring holds them are
fitted exactly, or their regime traced and said, pinning only the symbol at fault.

- A model's own divisor (``Constraint("divides", "G", "W")``) has an inverse generator in the
  memory schedule's ring (tracing/poly.py ``Algebra(inverses=...)``), as the mesh sizes have: a
  [G, W/G, W/G] block-diagonal weight's W²/G elements and a grouped convolution's W·(W/G)·k
  weight are polynomials there (they pinned W and G: the ring held 1/DP, 1/TP, 1/EP only).
- A padded chunked scan (Mamba-2's c·⌈S/c⌉, ``ModelSpec.pads``): a request below one chunk is
  the regime 2 <= S < c (one padded chunk of constant length c), S a formula there (it pinned S:
  the probes kept S's class mod c, whose only value below c is the request); a request of two
  chunks or more is S's class mod c from its first value of two chunks on.

Oracles, at random sizes of the regime never probed: a meta-device parameter count,
FlopCounterMode on the real step (grouped convolutions split into their groups, which it counts
right), the bytes saved_tensors_hooks sees (tests/memory_oracle.py) and torch.profiler's peak at
the ends of top-level ops.
"""
from __future__ import annotations

import random

import pytest

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


@pytest.mark.heavy
def test_mamba2_below_one_chunk_is_a_regime_in_s(monkeypatch):
    """hf:mamba2 at S below the scan's chunk_size (8): transformers' torch scan pads S to one chunk
    of 8 (c·⌈S/c⌉ = c), so every padded size is a constant and the rest polynomials in S: S is a
    formula for 2 <= S <= 7 (``Analysis.bounds``, the report's regime line), not pinned (before: 'S
    = 5 pinned (no other value of it runs the same ops as the requested one)': the probes kept S's
    class mod 8, whose only value below 8 is 5); exact at random other S of the range and other
    sizes (FLOPs against FlopCounterMode with the depthwise conv split, saved bytes, a meta count);
    a size outside the range (S = 8: one whole chunk, no padding; S = 9: two chunks) is refused
    by ``subs``. (A request of S = 8 is a regime of one value, pinned before any probe with the
    reason; S = 9 the class of 9 mod 8 from 9 on: ``pad_bounds``.)"""
    from symcost.tracing.probes import pad_bounds

    spec = symcost.resolve("hf:mamba2", config={"chunk_size": "8"})
    an = symcost.trace(spec, sizes={"B": 2, "S": 5, "H": 4, "D": 2, "K": 2, "N_state": 3, "K_conv": 4, "L": 2,
                                    "V": 37}, precision="fp32", torch_device="cpu")
    assert an.pinned == {} and an.bounds == {"S": [2, 7]} and "S" not in an.residues, (an.pinned, an.bounds)
    assert len({p["S"] for p in an.fitter.plan.points}) >= 2
    rng = random.Random("mamba2 below one chunk")
    _split_conv1d(monkeypatch)
    for s in rng.sample([2, 3, 4, 6, 7], 2):
        # (1 < K < H, H and D even: the trace's regime and classes mod expand = 2)
        v = {"B": rng.randint(2, 3), "S": s, "H": rng.choice((4, 6, 8)), "D": 2 * rng.randint(1, 3), "K": 2,
             "N_state": rng.randint(2, 5), "K_conv": rng.randint(2, 5), "L": rng.randint(1, 3), "V": rng.randint(20, 60)}
        exact_at(an, spec, v)
    for s in (8, 9):
        with pytest.raises(symcost.SymcostError, match="outside the regime 2 ≤ S ≤ 7"):
            an.subs(B=2, S=s)
    assert pad_bounds(8, 8) == (8, 8) and pad_bounds(9, 8) == (9, None) and pad_bounds(16, 8) == (16, None)
