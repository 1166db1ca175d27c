"""Issue 6, item 9: the quantities scaling-law papers use.

- Kaplan et al. 2020 ("Scaling Laws for Neural Language Models", section 2.1 and Table 1): N, the
  non-embedding parameters, leaves out the token and position embeddings (and an untied output
  projection); C_forward ≈ 2N + 2·n_layer·n_ctx·d_attn, whose attention term counts the causal
  score pairs.
- ``--attention-flops causal``: S·(S+1)/2 score pairs per attention matmul instead of S², only
  for the attention matmuls; the JSON says which count it used.

Oracles: hand counts in the symbols, and parameter counts of the real modules (by type) built on
the meta device.
"""
from __future__ import annotations

import json
import random
import textwrap

import pytest
import sympy
import torch
from click.testing import CliRunner
from torch import nn

from symcost.cli import main

B, S, H, D, L, V, Fs = sympy.symbols("B S H D L V F", positive=True, integer=True)
SYM = {"B": B, "S": S, "H": H, "D": D, "L": L, "V": V, "F": Fs}


def at(expr, values):
    return int(sympy.sympify(expr).subs({SYM[k]: v for k, v in values.items() if k in SYM}))


def embedding_oracle(model: nn.Module) -> int:
    """Parameters of the nn.Embedding modules, plus the final nn.Linear to the vocabulary when it
    is not tied to one of them (identity of the Parameter), counted once each."""
    seen = {id(p): p for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    head = getattr(model, "lm_head", None)
    if head is not None:
        for p in head.parameters():
            seen.setdefault(id(p), p)
    return sum(p.numel() for p in seen.values())


def test_gpt2_params_embedding_and_kaplan_n(traced):
    an = traced("gpt2", "fp32", "eager")
    d = H * D
    # wte [V, d] (tied to lm_head: once) and wpe [1024, d]
    assert sympy.expand(an.params_embedding - (V * d + 1024 * d)) == 0
    # per block: ln_1, ln_2 (2d each), c_attn 3d² + 3d, c_proj d² + d, c_fc 4d² + 4d,
    # c_proj 4d² + d = 12d² + 13d; then ln_f 2d. Kaplan's N = 12·n_layer·d² leaves biases and
    # norms out as small; this count keeps them.
    assert sympy.expand(an.params_nonembedding - (L * (12 * d**2 + 13 * d) + 2 * d)) == 0
    assert set(an.embedding_params) == {"wte.weight", "wpe.weight"}
    rng = random.Random("gpt2-embedding")
    for _ in range(3):
        v = {"B": 1, "S": 8, "H": rng.randint(1, 4), "D": rng.randint(2, 9), "L": rng.randint(1, 3),
             "V": rng.randint(10, 90)}
        with torch.device("meta"):
            model = an.spec.build(v)
        total = sum(p.numel() for p in model.parameters())
        assert at(an.params_embedding, v) == embedding_oracle(model)
        assert at(an.params_nonembedding, v) == total - embedding_oracle(model)


def test_untied_output_projection_is_embedding(traced):
    """cs336-lm: token table [V, d] and an untied lm_head [V, d], both out of N; nothing else
    (RoPE has no parameters)."""
    an = traced("cs336-lm")
    assert sympy.expand(an.params_embedding - 2 * V * H * D) == 0
    assert set(an.embedding_params.values()) == {"lookup", "output projection"}
    v = {"B": 1, "S": 8, "H": 2, "D": 6, "L": 2, "V": 37, "F": 20}
    with torch.device("meta"):
        model = an.spec.build(v)
    named = dict(model.named_parameters())
    emb = named["token_embeddings.weight"].numel() + named["lm_head.weight"].numel()
    assert at(an.params_embedding, v) == emb
    assert at(an.params_nonembedding, v) == sum(p.numel() for p in named.values()) - emb


SLICED_POSITIONS = """
import torch
from torch import nn
from symcost import ModelSpec

class LM(nn.Module):
    # token table [V, D] looked up, position table [64, D] sliced to S and added, a D x D block,
    # an untied head with a bias [D -> V]
    def __init__(self, v, d):
        super().__init__()
        self.tok = nn.Embedding(v, d)
        self.pos = nn.Parameter(torch.zeros(64, d))
        self.block = nn.Linear(d, d)
        self.head = nn.Linear(d, v)

    def forward(self, ids):
        return self.head(torch.relu(self.block(self.tok(ids) + self.pos[: ids.shape[1]])))

def spec():
    return ModelSpec(
        name="sliced", symbols=("D", "V"), defaults={"B": 2, "S": 8, "D": 6, "V": 23},
        build=lambda v: LM(v["V"], v["D"]),
        make_inputs=lambda v, device: ((torch.randint(0, v["V"], (v["B"], v["S"]), device=device),), {}),
        loss=lambda out, inputs: out.pow(2).mean(),
    )
"""


def test_sliced_position_table_and_head_bias(tmp_path):
    """A position table read by slicing (not a lookup) and an output projection with a bias: both
    out of N; N is the block's D² + D."""
    import symcost

    path = tmp_path / "sliced.py"
    path.write_text(textwrap.dedent(SLICED_POSITIONS))
    an = symcost.trace(f"{path}:spec", precision="fp32", use_cache=False)
    assert an.embedding_params == {"tok.weight": "lookup", "pos": "position slice",
                                   "head.weight": "output projection", "head.bias": "output projection"}
    assert sympy.expand(an.params_embedding - (V * D + 64 * D + D * V + V)) == 0
    assert sympy.expand(an.params_nonembedding - (D**2 + D)) == 0


def test_no_vocabulary_no_embedding(traced):
    an = traced("mlp", "fp32", "eager")
    assert an.params_embedding == 0 and sympy.expand(an.params_nonembedding - an.params) == 0


def test_causal_attention_gpt2_hand_count_at_random_sizes(traced):
    """GPT-2's attention matmuls per layer: forward Q·Kᵀ and P·V, backward dP, dV, dQ, dK (six
    bmm of B·H products over the S×S score matrix, 2·D FLOPs per score pair each). Full count:
    S² pairs, 2·B·H·D·S² per bmm. Causal: query i meets keys 0..i, S·(S+1)/2 pairs,
    B·H·D·S·(S+1) per bmm. Nothing else changes."""
    full = traced("gpt2", "fp32", "eager")
    causal = full.with_attention_flops("causal")
    assert (full.attention_count, causal.attention_count) == ("full", "causal")
    assert causal.with_attention_flops("full") is full
    per_bmm_full, per_bmm_causal = 2 * B * H * D * S**2, B * H * D * S * (S + 1)
    n_bmm = {"forward": 2, "backward": 4}
    rng = random.Random("causal-gpt2")
    for _ in range(4):
        v = {"B": rng.randint(1, 9), "S": rng.randint(2, 1024), "H": rng.randint(1, 16), "D": rng.randint(1, 128),
             "L": rng.randint(1, 48), "V": rng.randint(2, 60000)}
        for ph, n in n_bmm.items():
            hand = at(full.flops(ph) - n * L * per_bmm_full + n * L * per_bmm_causal, v)
            assert at(causal.flops(ph), v) == hand, (ph, v)
            delta = at(full.flops(ph, "all") - causal.flops(ph, "all"), v)
            assert delta == at(n * L * (per_bmm_full - per_bmm_causal), v), (ph, v)
            assert at(causal.bytes(ph), v) == at(full.bytes(ph), v)
        assert at(causal.attention_flops, v) == at(6 * L * per_bmm_causal, v)
    # only the attention matmuls change
    changed = [(a.name, a.module) for a, b in zip(full.ops, causal.ops) if a.cost != b.cost]
    assert changed and all(m == "h.{i}.attn" and n == "aten.bmm.default" for n, m in changed), changed
    assert len(changed) == 6


def test_kaplan_attention_term_gpt2_small(traced):
    """Kaplan et al. 2020, Table 1: the attention ("mask") term of the forward pass is
    2·n_layer·n_ctx·d_attn FLOPs per token. symcost's causal count per token per layer is
    2·d_attn·(S+1): Kaplan's 2·n_ctx·d_attn plus the diagonal 2·d_attn; the full count is twice
    Kaplan's. At GPT-2 small (d_attn = 768, n_ctx = 1024): 1,572,864 + 1,536."""
    full = traced("gpt2", "fp32", "eager")
    causal = full.with_attention_flops("causal")

    def fwd_attention(an):
        return sympy.expand(sum(op.repeat * op.cost.flops for op in an.ops if op.attention and op.phase == "forward"))

    d_attn = H * D
    per_token_layer = sympy.expand(fwd_attention(causal) / (B * S * L))
    assert sympy.expand(per_token_layer - (2 * S * d_attn + 2 * d_attn)) == 0
    assert sympy.expand(fwd_attention(full) / (B * S * L) - 2 * (2 * S * d_attn)) == 0
    small = {"B": 8, "S": 1024, "H": 12, "D": 64, "L": 12, "V": 50257}
    assert at(per_token_layer, small) == 2 * 1024 * 768 + 2 * 768 == 1_572_864 + 1_536


CAUSAL_LM = """
import torch
import torch.nn.functional as F
from torch import nn
from symcost import ModelSpec

class LM(nn.Module):
    # tokens [B, S] -> embedding [V, H*D] -> causal SDPA (q = k = v = x) -> untied head [H*D, V]
    def __init__(self, v, h, d):
        super().__init__()
        self.h = h
        self.emb = nn.Embedding(v, h * d)
        self.head = nn.Linear(h * d, v, bias=False)

    def forward(self, ids):
        x = self.emb(ids).unflatten(-1, (self.h, -1)).transpose(1, 2)
        y = F.scaled_dot_product_attention(x, x, x, is_causal=True)
        return self.head(y.transpose(1, 2).flatten(-2))

def spec():
    return ModelSpec(
        name="causal-lm", symbols=("H", "D", "V"), defaults={"B": 2, "S": 8, "H": 2, "D": 4, "V": 31},
        build=lambda v: LM(v["V"], v["H"], v["D"]),
        make_inputs=lambda v, device: ((torch.randint(0, v["V"], (v["B"], v["S"]), device=device),), {}),
        loss=lambda out, inputs: out.float().pow(2).mean(),
    )
"""


def test_cli_json_params_embedding_and_attention_count(tmp_path):
    """formulas --json and eval --json carry params_embedding / params_nonembedding and say which
    attention count they used; --attention-flops causal changes only the fused attention kernel
    (CPU flash: forward 4·B·H·S²·D -> 2·B·H·D·S·(S+1); backward, model FLOPs 8·B·H·S²·D ->
    4·B·H·D·S·(S+1), hardware FLOPs 10·B·H·S²·D -> 5·B·H·D·S·(S+1))."""
    path = tmp_path / "causal_lm.py"
    path.write_text(textwrap.dedent(CAUSAL_LM))
    model = f"{path}:spec"
    runner = CliRunner()

    def run(*args):
        res = runner.invoke(main, list(args), catch_exceptions=False)
        assert res.exit_code == 0, res.output
        return json.loads(res.stdout)

    v = {"B": 3, "S": 11, "H": 2, "D": 5, "V": 29}
    sets = ["--set", *[f"{k}={x}" for k, x in v.items()]]
    formulas = run("formulas", model, "--json", "--precision", "fp32", "--attention-flops", "causal")
    assert formulas["attention_flops_count"] == "causal"
    assert sympy.expand(sympy.sympify(formulas["params_embedding"], locals=SYM) - 2 * V * H * D) == 0
    assert sympy.sympify(formulas["params_nonembedding"], locals=SYM) == 0
    full = run("eval", model, "--json", "--precision", "fp32", *sets)
    causal = run("eval", model, "--json", "--precision", "fp32", "--attention-flops", "causal", *sets)
    assert (full["attention_flops_count"], causal["attention_flops_count"]) == ("full", "causal")
    assert full["params_embedding"] == causal["params_embedding"] == 2 * 29 * 10
    assert full["params_nonembedding"] == 0
    b, s, h, d = v["B"], v["S"], v["H"], v["D"]
    assert full["flops"]["forward"] - causal["flops"]["forward"] == 4 * b * h * s * s * d - 2 * b * h * d * s * (s + 1)
    # model FLOPs of the fused backward: the four gradient products (dP, dV, dQ, dK), 8·B·H·S²·D;
    # hardware FLOPs add the scores it recomputes, 10·B·H·S²·D (FlopCounterMode's count)
    assert full["flops"]["backward"] - causal["flops"]["backward"] == 8 * b * h * s * s * d - 4 * b * h * d * s * (s + 1)
    assert (full["flops_hw"]["backward"] - causal["flops_hw"]["backward"]
            == 10 * b * h * s * s * d - 5 * b * h * d * s * (s + 1))
    assert full["bytes"] == causal["bytes"] and full["params"] == causal["params"]
    assert causal["attention_flops"] == 6 * b * h * d * s * (s + 1)
    bad = runner.invoke(main, ["eval", model, "--attention-flops", "half"])
    assert bad.exit_code == 2 and "half" in bad.output
