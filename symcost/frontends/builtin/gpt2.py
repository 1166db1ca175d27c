"""GPT-2 (Radford et al. 2019) in plain PyTorch, laid out like Hugging Face's ``GPT2LMHeadModel``.

Token embedding ``wte [V, H*D]`` plus learned positions ``wpe [1024, H*D]``; L pre-LayerNorm
blocks, each with a fused ``c_attn`` (H*D -> 3*H*D, bias), explicit matmul attention (causal mask,
softmax; no fused kernel, so ``FlopCounterMode`` sees both matmuls), ``c_proj``, and an MLP of
width 4*H*D with tanh-approximated GELU; a final LayerNorm and an ``lm_head`` tied to ``wte``.
Dropout is left out (GPT-2 trains with p=0.1; at p=0 it is the identity).

Symbols: H, D, L, V (the MLP width is 4*H*D, so there is no F). Defaults: GPT-2 small (H=12,
D=64, L=12, V=50257) with B=8, S=1024. ``n_positions`` (1024) is a constant, not a symbol.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from symcost.frontends.models import ModelSpec
from symcost.frontends.spec import Constraint

N_POSITIONS = 1024


class CausalSelfAttention(nn.Module):
    """``x [B, S, H*D]`` -> ``[B, S, H*D]``: fused QKV projection, causal attention, ``c_proj``."""

    def __init__(self, n_head: int, n_embd: int):
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.unflatten(-1, (self.n_head, -1)).transpose(1, 2)
                   for t in self.c_attn(x).chunk(3, dim=-1))  # each [B, H, S, D] (chunk: also on 1/TP of c_attn)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        return self.c_proj((att @ v).transpose(1, 2).flatten(-2))


class MLP(nn.Module):
    """``c_proj(gelu_tanh(c_fc(x)))``: ``[B, S, H*D]`` -> ``[B, S, H*D]`` through width 4*H*D."""

    def __init__(self, n_embd: int):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.act = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class Block(nn.Module):
    """Pre-LayerNorm block: ``x + attn(ln_1(x))``, then ``+ mlp(ln_2(x))``."""

    def __init__(self, n_head: int, n_embd: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_head, n_embd)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), mask)
        return x + self.mlp(self.ln_2(x))


class GPT2(nn.Module):
    """GPT-2 LM: token ids ``[B, S]`` (int64, S <= 1024) -> logits ``[B, S, V]``."""

    def __init__(self, vocab_size: int, n_layer: int, n_head: int, n_embd: int,
                 n_positions: int = N_POSITIONS):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(n_positions, n_embd)
        self.h = nn.ModuleList(Block(n_head, n_embd) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.apply(self._init_weights)
        self.lm_head.weight = self.wte.weight  # tied: one Parameter

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        seq = input_ids.shape[-1]
        pos = torch.arange(seq, device=input_ids.device)
        mask = torch.ones(seq, seq, dtype=torch.bool, device=input_ids.device).tril()
        x = self.wte(input_ids) + self.wpe(pos)
        for block in self.h:
            x = block(x, mask)
        return self.lm_head(self.ln_f(x))


def lm_loss(logits: torch.Tensor, inputs) -> torch.Tensor:
    """Cross-entropy of ``logits [B, S, V]`` against the input tokens shifted left by one."""
    tokens = inputs[0][0]
    return F.cross_entropy(logits.flatten(0, -2), tokens.roll(-1, dims=1).flatten())


#: Sizes the model cannot take (data, so a cached trace checks them without building the model).
CONSTRAINTS = (Constraint("max", "S", N_POSITIONS, f"S exceeds GPT-2's {N_POSITIONS} learned positions"),)


def spec() -> ModelSpec:
    """The ``gpt2`` model specification."""
    return ModelSpec(
        name="gpt2",
        symbols=("H", "D", "L", "V"),
        defaults={"B": 8, "S": 1024, "H": 12, "D": 64, "L": 12, "V": 50257},
        build=lambda v: GPT2(v["V"], v["L"], v["H"], v["H"] * v["D"]),
        make_inputs=lambda v, device: (
            (torch.randint(0, v["V"], (v["B"], v["S"]), device=device),), {}),
        loss=lm_loss,
        constraints=CONSTRAINTS,
        layers="h",
        extra={"tied_embeddings": True, "n_positions": N_POSITIONS},
    )
