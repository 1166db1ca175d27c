"""A torchtitan-style Llama 3, the model of issue 30's defects: its blocks in an ``nn.ModuleDict``
keyed "0".."L-1" (``self.layers[str(layer_id)] = TransformerBlock(...)``, iterated with
``self.layers.values()``) and its SwiGLU width rounded up to ``multiple_of`` after the 2/3 scaling
and the ``ffn_dim_multiplier``: 1024·⌈⌊1.3·⌊2·4·dim/3⌋⌋/1024⌉, a step function of dim = H·D
(14336 at Llama-3-8B's dim 4096, 1024 at every dim up to 590).

Transcribed from pytorch/torchtitan, torchtitan/models/llama3/model/model.py (``FeedForward``,
``Attention``, ``TransformerBlock``, ``Transformer``; commit 1c5be289, 2025-06-15; BSD-3-Clause,
Copyright (c) Meta Platforms, Inc. and affiliates) with ``F.scaled_dot_product_attention`` for its
``build_attention``. The rotary embedding (it moves no parameter and no width) is left out unless
``rope=True``: then it is torchtitan's at 9dec370 (2024-12-26, the commit of its published Llama 3.1
8B runs; torchtitan/models/llama/model.py ``precompute_freqs_cis``, ``reshape_for_broadcast``,
``apply_rotary_emb``): a complex64 buffer ``freqs_cis`` of ``[max_seq_len, head_dim / 2]``
(``max_seq_len`` = the job's ``seq_len``, train.py: 8192 in the published runs' tomls, S at most
that), passed to every block, multiplying q and k viewed as complex in fp32 (``rope_theta`` 500000,
llama3_configs["8B"]);
torchtitan is not a dependency of symcost or of its tests. The 8B sizes are torchtitan's
``llama3_configs["8B"]``: dim 4096, 32 layers, 32 heads, 8 key/value heads, vocabulary 128256,
``multiple_of=1024``, ``ffn_dim_multiplier=1.3``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from symcost import ModelSpec
from symcost.frontends.spec import Constraint


def ffn_width(dim: int, multiple_of: int = 1024, ffn_dim_multiplier: float | None = 1.3) -> int:
    """torchtitan's ``FeedForward.__init__`` width for ``hidden_dim = 4 * dim``."""
    hidden_dim = int(2 * (4 * dim) / 3)
    if ffn_dim_multiplier is not None:
        hidden_dim = int(ffn_dim_multiplier * hidden_dim)
    return multiple_of * ((hidden_dim + multiple_of - 1) // multiple_of)


def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0) -> torch.Tensor:
    """torchtitan's ``precompute_freqs_cis``: ``[end, dim / 2]`` complex64."""
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end, device=freqs.device)
    freqs = torch.outer(t, freqs).float()
    return torch.polar(torch.ones_like(freqs), freqs)  # complex64


def reshape_for_broadcast(freqs_cis: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """torchtitan's ``reshape_for_broadcast``: the first ``seqlen`` rows, viewed ``[1, S, 1, D/2]``."""
    ndim = x.ndim
    seqlen = x.shape[1]
    freqs_cis = freqs_cis[0:seqlen]
    assert freqs_cis.shape == (seqlen, x.shape[-1])
    shape = [d if i == 1 or i == ndim - 1 else 1 for i, d in enumerate(x.shape)]
    return freqs_cis.view(*shape)


def apply_rotary_emb(xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor):
    """torchtitan's ``apply_rotary_emb``: q and k as complex fp32 pairs times ``freqs_cis``."""
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = reshape_for_broadcast(freqs_cis, xq_)
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


class Attention(nn.Module):
    def __init__(self, dim, n_heads, n_kv_heads):
        super().__init__()
        self.n_rep = n_heads // n_kv_heads
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x, freqs_cis=None):
        bs, seqlen, _ = x.shape
        xq = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        xk = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        if freqs_cis is not None:
            xq, xk = apply_rotary_emb(xq, xk, freqs_cis=freqs_cis)
        if self.n_rep > 1:  # torchtitan's repeat_kv
            xk = xk.unsqueeze(3).expand(*xk.shape[:3], self.n_rep, self.head_dim).flatten(2, 3)
            xv = xv.unsqueeze(3).expand(*xv.shape[:3], self.n_rep, self.head_dim).flatten(2, 3)
        out = F.scaled_dot_product_attention(xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2),
                                             is_causal=True)
        return self.wo(out.transpose(1, 2).contiguous().view(bs, seqlen, -1))


class FeedForward(nn.Module):
    def __init__(self, dim, multiple_of, ffn_dim_multiplier):
        super().__init__()
        hidden_dim = ffn_width(dim, multiple_of, ffn_dim_multiplier)
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, dim, n_heads, n_kv_heads, multiple_of, ffn_dim_multiplier):
        super().__init__()
        self.attention = Attention(dim, n_heads, n_kv_heads)
        self.feed_forward = FeedForward(dim, multiple_of, ffn_dim_multiplier)
        self.attention_norm = nn.RMSNorm(dim, eps=1e-5)
        self.ffn_norm = nn.RMSNorm(dim, eps=1e-5)

    def forward(self, x, freqs_cis=None):
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, dim, n_layers, n_heads, n_kv_heads, vocab_size, multiple_of=1024, ffn_dim_multiplier=1.3,
                 max_seq_len=None, rope_theta=500000.0):
        super().__init__()
        if max_seq_len is not None:  # (torchtitan: persistent=True; a buffer, no parameter)
            self.register_buffer("freqs_cis", precompute_freqs_cis(dim // n_heads, max_seq_len, rope_theta),
                                 persistent=True)
        else:
            self.freqs_cis = None
        self.tok_embeddings = nn.Embedding(vocab_size, dim)
        self.layers = nn.ModuleDict()
        for layer_id in range(n_layers):
            self.layers[str(layer_id)] = TransformerBlock(dim, n_heads, n_kv_heads, multiple_of, ffn_dim_multiplier)
        self.norm = nn.RMSNorm(dim, eps=1e-5)
        self.output = nn.Linear(dim, vocab_size, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h) if self.freqs_cis is None else layer(h, self.freqs_cis)
        return self.output(self.norm(h))


#: torchtitan's llama3_configs["8B"] in the conventions' symbols (dim = H·D)
LLAMA3_8B = {"H": 32, "D": 128, "L": 32, "K": 8, "V": 128256}


#: torchtitan's ``max_seq_len`` in the published Llama 3.1 8B runs (the tomls' ``seq_len``)
MAX_SEQ_LEN = 8192


def build(v, multiple_of=1024, ffn_dim_multiplier=1.3, rope=False):
    """The model at sizes ``v``; ``rope``: with torchtitan's rotary embedding (``max_seq_len``
    :data:`MAX_SEQ_LEN`; a model's build never depends on B or S)."""
    return Transformer(v["H"] * v["D"], v["L"], v["H"], v["K"], v["V"], multiple_of, ffn_dim_multiplier,
                       max_seq_len=MAX_SEQ_LEN if rope else None)


def llama3(multiple_of=1024, ffn_dim_multiplier=1.3, defaults=None, rope=False):
    """The spec (defaults: a small model; ``defaults`` replaces them; ``rope``: :func:`build`'s, S at
    most :data:`MAX_SEQ_LEN`)."""
    return ModelSpec(
        name="torchtitan-llama3", symbols=("H", "D", "L", "V", "K"),
        defaults=dict(defaults or {"B": 2, "S": 16, "H": 4, "D": 8, "L": 2, "K": 2, "V": 64}),
        build=lambda v: build(v, multiple_of, ffn_dim_multiplier, rope),
        make_inputs=lambda v, device: ((torch.randint(0, v["V"], (v["B"], v["S"]), device=device),), {}),
        loss=lambda out, inputs: F.cross_entropy(out.flatten(0, 1).float(), inputs[0][0].flatten()),
        constraints=(Constraint("divides", "K", "H", "K must divide H"),) + (
            (Constraint("max", "S", MAX_SEQ_LEN, f"the rotary table holds max_seq_len = {MAX_SEQ_LEN} positions"),)
            if rope else ()),
    )


def spec():
    """``tests/data/torchtitan_llama.py:spec``: the small defaults."""
    return llama3()


def rope_spec():
    """``tests/data/torchtitan_llama.py:rope_spec``: with torchtitan's rotary embedding (the model of
    its published Llama 3.1 8B runs, docs/validation.md "Predicted step time")."""
    return llama3(rope=True)
