"""``moe``: a small mixture-of-experts LM in plain PyTorch, the readable reference for MoE costs.

The CS336 pre-norm decoder (``graphs/cs336_lm.py``: RMSNorm, RoPE, causal attention written out
with einsum, untied ``lm_head``) with every feed-forward replaced by a sparse MoE layer in the
style of Mixtral (Jiang et al. 2024, "Mixtral of Experts", Sec. 2.1):

* a top-k router: ``logits = x W_r^T`` (``W_r [E, M]``), ``softmax``, the R largest
  probabilities, renormalised to sum to 1 per token;
* E SwiGLU experts stored as stacked weights ``w1, w3 [E, F, M]`` and ``w2 [E, M, F]``;
* each token's output is the router-weighted sum of its R experts' outputs.

Two ways to run the experts, with the same weights and the same result when no slot is dropped:

* the traced one (default): symcost's static-shaped dispatch (:func:`symcost.frontends.moe.dispatch`)
  under the experts' routing model (balanced unless ``--routing`` says otherwise): every expert
  processes a buffer of C = c·N·R/E token slots with one batched matmul per weight;
* ``Experts.reference = True``: the textbook loop over experts with ``torch.where`` (the shapes
  depend on the router's choices, so it cannot be traced without data); the tests run it on real
  tensors, with the router forced to the balanced assignment, as the FLOP oracle.

Symbols: H heads, D head dimension (d_model M = H*D), L layers, V vocabulary, F expert FFN width,
E experts, R experts per token. Defaults: H=8, D=64, L=4, V=10000, F=1024, E=8, R=2, B=8, S=256.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from symcost.errors import SymcostError
from symcost.frontends import moe
from symcost.frontends.builtin.cs336_lm import (
    MAX_SEQ_LEN,
    CausalMultiHeadSelfAttention,
    Embedding,
    Linear,
    RMSNorm,
    lm_loss,
)
from symcost.frontends.models import ModelSpec


class TopKRouter(nn.Module):
    """``x [N, M] -> (weights [N, R], experts [N, R])``: softmax over E logits, top R, renormalised."""

    def __init__(self, d_model: int, n_experts: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.weight = nn.Parameter(torch.randn(n_experts, d_model) / math.sqrt(d_model))

    def forward(self, x: torch.Tensor):
        probs = F.linear(x, self.weight).float().softmax(dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts


class Experts(nn.Module):
    """E SwiGLU experts ``w2(silu(w1 x) * w3 x)``: token states ``[N, M]`` and the router's
    ``(weights, experts) [N, R]`` -> ``[N, M]``."""

    def __init__(self, d_model: int, d_ff: int, n_experts: int):
        super().__init__()
        self.num_experts = n_experts
        self.w1 = nn.Parameter(torch.randn(n_experts, d_ff, d_model) / math.sqrt(d_model))
        self.w3 = nn.Parameter(torch.randn(n_experts, d_ff, d_model) / math.sqrt(d_model))
        self.w2 = nn.Parameter(torch.randn(n_experts, d_model, d_ff) / math.sqrt(d_ff))
        self.reference = False  # True: the data-dependent loop over experts (real tensors only)
        setattr(self, moe.ROUTING_ATTR, moe.BALANCED)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        if self.reference:
            return self._loop(x, weights, experts)
        n, e = x.shape[0], self.num_experts
        if moe.routing_of(self).kind == "skew":
            raise SymcostError(f"--routing {moe.routing_of(self).name} is the load of the most loaded expert-parallel "
                               "rank; it needs --ep N (on one device every expert is there: balanced or capacity=C)")
        capacity = moe.routing_of(self).capacity(n, experts.shape[-1], e)
        buf, dest, token = moe.dispatch(x, experts, e, capacity)  # [E, C, M]
        h = F.silu(moe.expert_linear(buf, self.w1)) * moe.expert_linear(buf, self.w3)  # [E, C, F]
        out = moe.expert_linear(h, self.w2)  # [E, C, M]
        return moe.combine(out, dest, token, weights, n)

    def _loop(self, x, weights, experts):
        out = torch.zeros_like(x)
        for i in range(self.num_experts):
            token, k = torch.where(experts == i)
            if token.numel() == 0:
                continue
            xe = x[token]
            ye = (F.silu(xe @ self.w1[i].T) * (xe @ self.w3[i].T)) @ self.w2[i].T
            out.index_add_(0, token, ye * weights[token, k, None])
        return out


class MoEFeedForward(nn.Module):
    """Sparse feed-forward: ``[B, S, M] -> [B, S, M]``, each token through R of E experts."""

    def __init__(self, d_model: int, d_ff: int, n_experts: int, top_k: int):
        super().__init__()
        self.router = TopKRouter(d_model, n_experts, top_k)
        self.experts = Experts(d_model, d_ff, n_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weights, experts = self.router(flat)
        return self.experts(flat, weights, experts).view_as(x)


class MoEBlock(nn.Module):
    """Pre-norm block: ``x + attn(ln1(x))``, then ``+ moe(ln2(x))``; ``[B, S, H*D]`` in and out."""

    def __init__(self, d_model, num_heads, d_ff, n_experts, top_k, max_seq_len, theta):
        super().__init__()
        self.ln1 = RMSNorm(d_model)
        self.attn = CausalMultiHeadSelfAttention(d_model, num_heads, max_seq_len, theta)
        self.ln2 = RMSNorm(d_model)
        self.moe = MoEFeedForward(d_model, d_ff, n_experts, top_k)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), mask)
        return x + self.moe(self.ln2(x))


class MoELM(nn.Module):
    """Token ids ``[B, S]`` (int64) -> logits ``[B, S, V]``."""

    def __init__(self, vocab_size, d_model, num_layers, num_heads, d_ff, n_experts, top_k,
                 max_seq_len: int = MAX_SEQ_LEN, rope_theta: float = 10000.0):
        super().__init__()
        self.token_embeddings = Embedding(vocab_size, d_model)
        self.layers = nn.ModuleList(
            MoEBlock(d_model, num_heads, d_ff, n_experts, top_k, max_seq_len, rope_theta)
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


def _check(values) -> str | None:
    if values.get("D", 0) % 2:
        return f"RoPE needs an even head dimension D (got D={values['D']})"
    if values.get("S", 0) > MAX_SEQ_LEN:
        return f"S={values['S']} exceeds the RoPE table of {MAX_SEQ_LEN} positions"
    return moe.check(values)


def spec() -> ModelSpec:
    """The ``moe`` model specification (balanced routing; see :func:`symcost.frontends.moe.with_routing`)."""
    return ModelSpec(
        name="moe",
        symbols=("H", "D", "L", "V", "F", "E", "R"),
        defaults={"B": 8, "S": 256, "H": 8, "D": 64, "L": 4, "V": 10000, "F": 1024, "E": 8, "R": 2},
        build=lambda v: MoELM(v["V"], v["H"] * v["D"], v["L"], v["H"], v["F"], v["E"], v["R"]),
        make_inputs=lambda v, device: ((torch.randint(0, v["V"], (v["B"], v["S"]), device=device),), {}),
        loss=lm_loss,
        check=_check,
        layers="layers",
        probe_check=moe.probe_check,
        extra={"routing": moe.BALANCED.name, "routing_description": moe.BALANCED.describe()},
    )
