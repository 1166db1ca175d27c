"""A Megatron-LM style GPT, built to reproduce the activation memory of Korthikanti et al. 2022.

V. Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models"
(arXiv:2205.05198), Sec. 4.1 "Activations Memory Per Transformer Layer": with 16-bit activations
and 1-byte dropout masks, one layer stores ``s*b*h*(34 + 5*a*s/h)`` bytes (no parallelism), with
s = S, b = B, h = H*D and a = H. Each layer here stores exactly the tensors that count assumes:

* attention (11*s*b*h + 5*a*s^2*b): the LayerNorm output that feeds the QKV Linear (2sbh); Q and
  K for Q K^T (4sbh); the softmax output (2as^2b); the attention-dropout mask (as^2b); its output
  and V for the product with V (2as^2b + 2sbh); the out-projection's input (2sbh); the dropout
  mask after it (sbh);
* MLP (19*s*b*h): the Linear(h, 4h) input (2sbh), the GELU input (8sbh), the Linear(4h, h) input
  (8sbh), the dropout mask (sbh);
* the two LayerNorm inputs (4sbh).

Autograd also saves each LayerNorm's per-token mean and rstd (``[B, S, 1]``), which the paper
neglects. There is no causal mask (the paper counts none). Dropout (p=0.1) is active in training
mode. Around the layers: token plus learned position embeddings (2048 positions, a constant), a
final LayerNorm and an untied output head (h -> V), cross-entropy loss.

Symbols: H, D, L, V. Defaults: H=32, D=80 (h=2560, GPT-3 2.7B width), L=4, V=51200, B=4, S=2048.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from symcost.frontends.models import ModelSpec
from symcost.frontends.spec import Constraint

N_POSITIONS = 2048
DROPOUT = 0.1


class Dropout(nn.Dropout):
    """``nn.Dropout`` that saves a 1-byte (bool) mask on every device, as Megatron's CUDA kernel.

    ``nn.Dropout`` on CPU (and so on meta and fake CPU tensors) saves a mask of the input's
    dtype; ``torch.native_dropout`` saves a bool mask everywhere. ``[...]`` -> ``[...]``.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        return torch.native_dropout(x, self.p, True)[0]


class ParallelAttention(nn.Module):
    """Unmasked self-attention: ``x [B, S, h]`` -> ``[B, S, h]`` (before the output dropout)."""

    def __init__(self, hidden: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.query_key_value = nn.Linear(hidden, 3 * hidden)
        self.attention_dropout = Dropout(DROPOUT)
        self.dense = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.unflatten(-1, (self.num_heads, -1)).transpose(1, 2)
                   for t in self.query_key_value(x).chunk(3, dim=-1))  # each [B, a, S, D]
        scores = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
        probs = self.attention_dropout(scores.softmax(dim=-1))  # [B, a, S, S]
        return self.dense(torch.matmul(probs, v).transpose(1, 2).flatten(-2))


class ParallelMLP(nn.Module):
    """``Linear(4h, h)(gelu(Linear(h, 4h)(x)))``: ``[B, S, h]`` -> ``[B, S, h]``."""

    def __init__(self, hidden: int):
        super().__init__()
        self.dense_h_to_4h = nn.Linear(hidden, 4 * hidden)
        self.dense_4h_to_h = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense_4h_to_h(F.gelu(self.dense_h_to_4h(x), approximate="tanh"))


class TransformerLayer(nn.Module):
    """``x + drop(attn(ln(x)))``, then ``+ drop(mlp(ln(.)))``; ``[B, S, h]`` in and out."""

    def __init__(self, hidden: int, num_heads: int):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(hidden)
        self.self_attention = ParallelAttention(hidden, num_heads)
        self.post_attention_layernorm = nn.LayerNorm(hidden)
        self.mlp = ParallelMLP(hidden)
        self.dropout = Dropout(DROPOUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.dropout(self.self_attention(self.input_layernorm(x)))
        return x + self.dropout(self.mlp(self.post_attention_layernorm(x)))


class MegatronGPT(nn.Module):
    """Token ids ``[B, S]`` (int64, S <= 2048) -> logits ``[B, S, V]``."""

    def __init__(self, vocab_size: int, num_layers: int, num_heads: int, hidden: int,
                 n_positions: int = N_POSITIONS):
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab_size, hidden)
        self.position_embeddings = nn.Embedding(n_positions, hidden)
        self.layers = nn.ModuleList(TransformerLayer(hidden, num_heads) for _ in range(num_layers))
        self.final_layernorm = nn.LayerNorm(hidden)
        self.output_layer = nn.Linear(hidden, vocab_size, bias=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(input_ids.shape[-1], device=input_ids.device)
        x = self.word_embeddings(input_ids) + self.position_embeddings(pos)
        for layer in self.layers:
            x = layer(x)
        return self.output_layer(self.final_layernorm(x))


def lm_loss(logits: torch.Tensor, inputs) -> torch.Tensor:
    """Cross-entropy of ``logits [B, S, V]`` against the input tokens shifted left by one."""
    tokens = inputs[0][0]
    return F.cross_entropy(logits.flatten(0, -2), tokens.roll(-1, dims=1).flatten())


#: Sizes the model cannot take (data, so a cached trace checks them without building the model).
CONSTRAINTS = (Constraint("max", "S", N_POSITIONS, f"S exceeds the {N_POSITIONS} learned positions"),)


def spec() -> ModelSpec:
    """The ``megatron-gpt`` model specification."""
    return ModelSpec(
        name="megatron-gpt",
        symbols=("H", "D", "L", "V"),
        defaults={"B": 4, "S": 2048, "H": 32, "D": 80, "L": 4, "V": 51200},
        build=lambda v: MegatronGPT(v["V"], v["L"], v["H"], v["H"] * v["D"]),
        make_inputs=lambda v, device: (
            (torch.randint(0, v["V"], (v["B"], v["S"]), device=device),), {}),
        loss=lm_loss,
        constraints=CONSTRAINTS,
        layers="layers",
        extra={"reference": "Korthikanti et al. 2022, Sec. 4.1: activations per layer "
                            "s*b*h*(34 + 5*a*s/h) bytes with 16-bit activations"},
    )
