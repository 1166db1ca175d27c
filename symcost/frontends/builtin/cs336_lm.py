"""The default model: the pre-norm decoder-only Transformer LM of Stanford CS336 assignment 1.

Built from scratch as the assignment asks: a bias-free ``Linear`` and an ``Embedding`` of their
own, ``RMSNorm`` computed in fp32, a SwiGLU feed-forward, RoPE on queries and keys, and causal
multi-head self-attention written out with einsum (no ``F.scaled_dot_product_attention``, so
``FlopCounterMode`` sees both attention matmuls), a final ``RMSNorm`` and an untied ``lm_head``.

Symbols: H heads, D head dimension (d_model = H*D), L layers, V vocabulary, F feed-forward
width. Defaults are the assignment's TinyStories configuration: d_model 512 (H=16, D=32), L=4,
V=10000, F=1344, context 256 (S), batch 8 (B). The RoPE table size ``max_seq_len`` (4096) is a
constant, not a symbol.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from einops import einsum, rearrange
from torch import nn

from symcost.frontends.models import ModelSpec
from symcost.frontends.spec import Constraint

MAX_SEQ_LEN = 4096


class Linear(nn.Module):
    """``y = x W^T`` without bias; ``x [..., d_in] -> [..., d_out]``, weight ``[d_out, d_in]``."""

    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        std = math.sqrt(2.0 / (d_in + d_out))
        self.weight = nn.Parameter(torch.empty(d_out, d_in))
        nn.init.trunc_normal_(self.weight, std=std, a=-3 * std, b=3 * std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return einsum(x, self.weight, "... d_in, d_out d_in -> ... d_out")


class Embedding(nn.Module):
    """Token lookup: ids ``[...]`` (int64) -> ``[..., d_model]``, weight ``[V, d_model]``."""

    def __init__(self, num_embeddings: int, d_model: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, d_model))
        nn.init.trunc_normal_(self.weight, std=1.0, a=-3.0, b=3.0)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.weight[token_ids]


class RMSNorm(nn.Module):
    """``x / rms(x) * g`` over the last dim, computed in fp32 and cast back to ``x``'s dtype.

    ``x [..., d_model] -> [..., d_model]``; gain ``g [d_model]``.
    """

    def __init__(self, d_model: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        in_dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x * self.weight).to(in_dtype)


class SwiGLU(nn.Module):
    """``W2(silu(W1 x) * W3 x)``: ``[..., d_model] -> [..., d_model]`` through width ``d_ff``."""

    def __init__(self, d_model: int, d_ff: int):
        super().__init__()
        self.w1 = Linear(d_model, d_ff)
        self.w2 = Linear(d_ff, d_model)
        self.w3 = Linear(d_model, d_ff)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class RotaryPositionalEmbedding(nn.Module):
    """RoPE on interleaved pairs of the last dim; positions are ``0..S-1``.

    ``x [..., S, d_k] -> [..., S, d_k]``; buffers ``cos``, ``sin`` ``[max_seq_len, d_k/2]``
    (non-persistent, cast to ``x``'s dtype when used).
    """

    def __init__(self, theta: float, d_k: int, max_seq_len: int):
        super().__init__()
        inv_freq = theta ** (-torch.arange(0, d_k, 2, dtype=torch.float32) / d_k)
        angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv_freq)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seq = x.shape[-2]
        cos, sin = self.cos[:seq].to(x.dtype), self.sin[:seq].to(x.dtype)
        x1, x2 = x[..., 0::2], x[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
        return out.flatten(-2)


def scaled_dot_product_attention(q, k, v, mask):
    """Explicit attention: ``q, k [..., S, D]``, ``v [..., S, D]``, bool ``mask [S, S]`` (True =
    attend) -> ``[..., S, D]``."""
    scores = einsum(q, k, "... q d, ... k d -> ... q k") / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~mask, float("-inf"))
    return einsum(scores.softmax(dim=-1), v, "... q k, ... k d -> ... q d")


class CausalMultiHeadSelfAttention(nn.Module):
    """Causal MHSA with RoPE and separate q/k/v/output projections: ``[B, S, H*D]`` -> same."""

    def __init__(self, d_model: int, num_heads: int, max_seq_len: int, theta: float):
        super().__init__()
        self.num_heads = num_heads
        self.q_proj = Linear(d_model, d_model)
        self.k_proj = Linear(d_model, d_model)
        self.v_proj = Linear(d_model, d_model)
        self.output_proj = Linear(d_model, d_model)
        self.rope = RotaryPositionalEmbedding(theta, d_model // num_heads, max_seq_len)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q, k, v = (rearrange(p(x), "b s (h d) -> b h s d", h=self.num_heads)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        out = scaled_dot_product_attention(self.rope(q), self.rope(k), v, mask)
        return self.output_proj(rearrange(out, "b h s d -> b s (h d)"))


class TransformerBlock(nn.Module):
    """Pre-norm block: ``x + attn(ln1(x))``, then ``+ ffn(ln2(x))``; ``[B, S, H*D]`` in and out."""

    def __init__(self, d_model: int, num_heads: int, d_ff: int, max_seq_len: int, theta: float):
        super().__init__()
        self.ln1 = RMSNorm(d_model)
        self.attn = CausalMultiHeadSelfAttention(d_model, num_heads, max_seq_len, theta)
        self.ln2 = RMSNorm(d_model)
        self.ffn = SwiGLU(d_model, d_ff)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), mask)
        return x + self.ffn(self.ln2(x))


class TransformerLM(nn.Module):
    """CS336 Transformer LM: token ids ``[B, S]`` (int64) -> logits ``[B, S, V]``."""

    def __init__(self, vocab_size: int, d_model: int, num_layers: int, num_heads: int, d_ff: int,
                 max_seq_len: int = MAX_SEQ_LEN, rope_theta: float = 10000.0):
        super().__init__()
        self.token_embeddings = Embedding(vocab_size, d_model)
        self.layers = nn.ModuleList(
            TransformerBlock(d_model, num_heads, d_ff, max_seq_len, rope_theta)
            for _ in range(num_layers)
        )
        self.ln_final = RMSNorm(d_model)
        self.lm_head = Linear(d_model, vocab_size)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        seq = token_ids.shape[-1]
        mask = torch.ones(seq, seq, dtype=torch.bool, device=token_ids.device).tril()
        x = self.token_embeddings(token_ids)
        for layer in self.layers:
            x = layer(x, mask)
        return self.lm_head(self.ln_final(x))


def lm_loss(logits: torch.Tensor, inputs) -> torch.Tensor:
    """Cross-entropy of ``logits [B, S, V]`` against the input tokens shifted left by one."""
    tokens = inputs[0][0]
    return F.cross_entropy(logits.flatten(0, -2), tokens.roll(-1, dims=1).flatten())


#: Sizes the model cannot take (data, so a cached trace checks them without building the model).
CONSTRAINTS = (
    Constraint("multiple", "D", 2, "RoPE needs an even head dimension D"),
    Constraint("max", "S", MAX_SEQ_LEN, f"S exceeds the RoPE table of {MAX_SEQ_LEN} positions"),
)


def spec() -> ModelSpec:
    """The ``cs336-lm`` model specification."""
    return ModelSpec(
        name="cs336-lm",
        symbols=("H", "D", "L", "V", "F"),
        defaults={"B": 8, "S": 256, "H": 16, "D": 32, "L": 4, "V": 10000, "F": 1344},
        build=lambda v: TransformerLM(v["V"], v["H"] * v["D"], v["L"], v["H"], v["F"]),
        make_inputs=lambda v, device: (
            (torch.randint(0, v["V"], (v["B"], v["S"]), device=device),), {}),
        loss=lm_loss,
        constraints=CONSTRAINTS,
        layers="layers",
    )
