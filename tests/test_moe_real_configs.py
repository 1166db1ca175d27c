"""Real mixture-of-experts configs (issue 14, item 5): DeepSeek-V2-Lite, DeepSeek-V3,
Qwen3-30B-A3B, OLMoE-1B-7B, Mixtral-8x7B, gpt-oss-20b and gpt-oss-120b, as published
(tests/data/configs/, docs/moe.md "Published sizes"). Shared experts, dense leading blocks
(``first_k_dense_replace``), MLA attention, grouped routing, attention sinks and expert biases.

Oracles (no symcost formula involved):

* parameters: ``sum(p.numel())`` of the model built from the file on the meta device;
* active parameters: counted by hand from the config fields (:func:`hand_count`, every formula
  written out), which reproduces each publication's figures under its own convention (embeddings
  in, or the input embedding out) within the publication's rounding;
* training FLOPs: ``FlopCounterMode`` of one step on fake tensors at the file's full width with
  transformers' own ``batched_mm`` experts implementation, which runs every routed slot through
  its expert's weights (``[N·R, 1, in] × [N·R, in, out]``): its FLOPs are those of any dropless
  routing, the balanced one symcost states included;
* memory of DeepSeek-V3's dense leading blocks: ``saved_tensors_hooks`` and ``torch.profiler`` of
  a real CPU step at small sizes (tests/memory_oracle.py).

Each config is traced once (at B = 4, S = 64, fp32, eager attention) and every check reads that
trace.
"""
from __future__ import annotations

import functools
import json
import os
import time
from dataclasses import dataclass

import pytest
import sympy
import test_real_configs
import torch

import symcost
from symcost.errors import SymcostError
from symcost.passes.moe import slots_per_expert
from symcost.tracing.fit import SYMS

HERE = os.path.dirname(__file__)
REQUEST = {"B": 4, "S": 64}


@dataclass(frozen=True)
class Published:
    """A publication's figures: total and active parameters, the unit of its last digit, and
    which count it publishes as active: ``"all"`` (every parameter a token uses, symcost's
    ``params_active``) or ``"no lookup"`` (the same without the input embedding table, a lookup
    with no FLOPs; the output projection stays in)."""

    total: float
    active: float
    unit: float
    convention: str
    source: str


CONFIGS = {
    "deepseek-v2-lite": Published(15.7e9, 2.4e9, 0.1e9, "no lookup",
                                  "DeepSeek-V2 paper (arXiv 2405.04434) and model card: 15.7B total, 2.4B activated"),
    "deepseek-v3": Published(671e9, 37e9, 1e9, "no lookup",
                             "DeepSeek-V3 technical report (arXiv 2412.19437): 671B total, 37B activated "
                             "(the 14B multi-token-prediction module is not counted, nor built by transformers)"),
    "qwen3-30b-a3b": Published(30.5e9, 3.3e9, 0.1e9, "all",
                               "Qwen3-30B-A3B model card: 30.5B in total, 3.3B activated, 29.9B non-embedding"),
    "olmoe-1b-7b": Published(6.9e9, 1.3e9, 0.1e9, "all", "OLMoE paper (arXiv 2409.02060): 6.9B total, 1.3B active"),
    "mixtral-8x7b": Published(46.7e9, 12.9e9, 0.1e9, "all",
                              "Mistral AI, Mixtral of experts (2023-12-11): 46.7B total, 12.9B per token"),
    "gpt-oss-20b": Published(20.91e9, 3.61e9, 0.01e9, "no lookup",
                             "gpt-oss model card (arXiv 2508.10925), Table 1: 20.91B total, 3.61B active"),
    "gpt-oss-120b": Published(116.83e9, 5.13e9, 0.01e9, "no lookup",
                              "gpt-oss model card (arXiv 2508.10925), Table 1: 116.83B total, 5.13B active"),
}


def _path(name: str) -> str:
    return os.path.join(HERE, "data", "configs", f"{name}.json")


def _config(name: str) -> dict:
    with open(_path(name)) as f:
        return json.load(f)


def hand_count(c: dict) -> dict[str, int]:
    """Total and active parameters of a config file, by hand (M = hidden_size, V = vocab_size,
    L = num_hidden_layers, H heads, K key/value heads, E routed experts, R = num_experts_per_tok).

    Outside the blocks: V·M token embedding, V·M untied output projection, M final RMSNorm. Per
    block: attention + 2·M RMSNorm gains + the feed-forward part. A SwiGLU MLP of width f has
    3·M·f weights. Active: R of the E routed experts.

    * MLA (DeepSeek): queries M·H·(d_nope + d_rope) (``q_lora_rank`` null) or M·r_q + r_q +
      r_q·H·(d_nope + d_rope); ``kv_a`` M·(r_kv + d_rope), its norm r_kv, ``kv_b``
      r_kv·H·(d_nope + d_v), output H·d_v·M. ``first_k_dense_replace`` dense blocks of width
      ``intermediate_size``; the others: router E·M, ``n_shared_experts`` shared experts of width
      F (one SwiGLU of width n_shared·F), E routed experts of width F = ``moe_intermediate_size``.
    * GQA (the others): q, o M·H·d; k, v M·K·d (d = ``head_dim`` or M/H), with biases H·d, 2·K·d
      and M where ``attention_bias``; OLMoE's q/k norms over H·d and K·d; Qwen3's per-head q/k
      norms 2·d; gpt-oss's attention sinks H, router bias E and expert biases 2F + M. Every block
      sparse, F = ``moe_intermediate_size`` or ``intermediate_size``, router E·M.
    """
    t, M, V, L = c["model_type"], c["hidden_size"], c["vocab_size"], c["num_hidden_layers"]
    H = c["num_attention_heads"]
    K = c.get("num_key_value_heads") or H
    outer = V * M + (0 if c.get("tie_word_embeddings") else V * M) + M
    if t.startswith("deepseek"):
        qk, rkv, rq = c["qk_nope_head_dim"] + c["qk_rope_head_dim"], c["kv_lora_rank"], c["q_lora_rank"]
        q = M * H * qk if rq is None else M * rq + rq + rq * H * qk
        attn = (q + M * (rkv + c["qk_rope_head_dim"]) + rkv + rkv * H * (c["qk_nope_head_dim"] + c["v_head_dim"])
                + H * c["v_head_dim"] * M)
        E, R, F = c["n_routed_experts"], c["num_experts_per_tok"], c["moe_intermediate_size"]
        k = c["first_k_dense_replace"]
        common = (L * (attn + 2 * M) + k * 3 * M * c["intermediate_size"]
                  + (L - k) * (E * M + 3 * M * F * c["n_shared_experts"]))
        total, active = outer + common + (L - k) * E * 3 * M * F, outer + common + (L - k) * R * 3 * M * F
    else:
        d = c.get("head_dim") or M // H
        attn = 2 * M * H * d + 2 * M * K * d + ((H * d + 2 * K * d + M) if c.get("attention_bias") else 0)
        attn += {"olmoe": H * d + K * d, "qwen3_moe": 2 * d, "gpt_oss": H}.get(t, 0)
        E = c.get("num_local_experts") or c.get("num_experts")
        R = c["num_experts_per_tok"]
        F = c.get("moe_intermediate_size") or c["intermediate_size"]
        expert = 3 * M * F + ((2 * F + M) if t == "gpt_oss" else 0)
        router = E * M + (E if t == "gpt_oss" else 0)
        total = outer + L * (attn + 2 * M + router + E * expert)
        active = outer + L * (attn + 2 * M + router + R * expert)
    return {"total": total, "active": active, "lookup": V * M, "embeddings": outer - M}


def _published_form(count: int, pub: Published) -> bool:
    """``count`` written with the publication's digits: rounded (half a unit either way) or cut
    off (DeepSeek-V2-Lite's 2.45 B and Qwen3's 3.35 B are published as 2.4 B and 3.3 B)."""
    return pub.active - pub.unit / 2 <= count < pub.active + pub.unit


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_hand_count_is_the_publication(name):
    """The hand count reproduces the published total and active figures under the publication's
    own convention (and not under the other one, where they differ in the published digits)."""
    pub, h = CONFIGS[name], hand_count(_config(name))
    assert abs(h["total"] - pub.total) <= pub.unit / 2, (name, h["total"])
    published_active = h["active"] - (h["lookup"] if pub.convention == "no lookup" else 0)
    assert _published_form(published_active, pub), (name, published_active)
    other = h["active"] - (h["lookup"] if pub.convention == "all" else 0)
    if name != "deepseek-v3":  # 37.55 B cut off and 36.63 B rounded both read 37 B
        assert not _published_form(other, pub), (name, other)
    if name == "qwen3-30b-a3b":  # the card's 29.9 B "non-embedding": both V·M tables out
        assert abs(h["total"] - h["embeddings"] - 29.9e9) <= 0.05e9


# -- the traces ----------------------------------------------------------------------------------


@functools.cache
def _trace(name: str, sizes: tuple = tuple(REQUEST.items())):
    t = time.perf_counter()
    an = symcost.trace(_path(name), sizes=dict(sizes), precision="fp32", attention="eager")
    an.__dict__["test_seconds"] = time.perf_counter() - t
    return an


def _full(spec, **sizes) -> dict[str, int]:
    v = {**spec.defaults, **sizes}
    v.update({a: v[b] for a, b in spec.tied.items()})
    return v


def fake_flops(spec, values: dict[str, int]) -> dict[str, int]:
    """FlopCounterMode's forward (with the loss) and backward of one step of the model ``spec``
    builds at ``values``, on fake tensors, with transformers' ``batched_mm`` experts (every routed
    slot through its expert: routing-independent FLOPs)."""
    return test_real_configs.fake_flops(spec, values, experts="batched_mm")


def _lookup(an) -> sympy.Expr:
    """The input embedding table(s): parameters the traced forward reads by a lookup."""
    names = {n for n, why in an.embedding_params.items() if why == "lookup"}
    return sympy.expand(sympy.Add(*[rep * sympy.Mul(*shape) for n, (shape, _, rep) in an.param_shapes.items()
                                    if n in names]))


@pytest.mark.heavy
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_params_and_active_params(name):
    """params == sum(numel) on meta; params_active == the hand count, and the publication's
    figure under its convention; no symbol pinned; the expert buffers hold B·S·R/E slots."""
    an = _trace(name)
    assert not an.pinned, an.pin_reasons
    spec = an.spec
    with torch.device("meta"):
        model = spec.build(_full(spec))
    got = an.subs(**REQUEST)
    h = hand_count(_config(name))
    assert got["params"] == sum(p.numel() for p in model.parameters()) == h["total"]
    assert got["params_active"] == h["active"] < got["params"]
    pub = CONFIGS[name]
    env = an.bind(**REQUEST)
    lookup = int(_lookup(an).xreplace(env))
    assert lookup == h["lookup"]
    assert _published_form(got["params_active"] - (lookup if pub.convention == "no lookup" else 0), pub)
    B, S, R, E = (SYMS[s] for s in "BSRE")
    assert sympy.simplify(slots_per_expert(an) - B * S * R / E) == 0


def _second_size(an) -> dict[str, int]:
    """B = 3, S = 32, one more block, and other E and R of the config's kind (E a multiple of
    DeepSeek-V3's n_group, R below E): the router's E·M and the expert slots N·R change."""
    spec = an.spec
    v = {"B": 3, "S": 32, "L": spec.lead_blocks + 3}
    e, r = spec.defaults["E"], spec.defaults["R"]
    for cand in (e // 2, e * 2, e + 8):
        if spec.check(_full(spec, **v, E=cand, R=max(2, r // 2))) is None:
            return {**v, "E": cand, "R": max(2, r // 2)}
    raise AssertionError(f"no other E for {spec.name}")  # pragma: no cover


@pytest.mark.heavy
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_train_flops_equal_flopcounter(name):
    """Forward, backward and train model FLOPs at two sizes == FlopCounterMode of transformers'
    batched_mm experts (N·R slot matmuls: the balanced routing's count)."""
    an = _trace(name)
    lead = an.spec.lead_blocks
    for sizes in ({"B": 2, "S": 16, "L": lead + 2}, _second_size(an)):
        want = fake_flops(an.spec, _full(an.spec, **sizes))
        got = an.subs(**sizes)
        assert {k: got[k] for k in want} == want, (name, sizes)


# -- DeepSeek-V3's dense leading blocks ---------------------------------------------------------------


@pytest.mark.heavy
def test_v3_leading_blocks_fold_and_memory():
    """The three dense blocks fold apart from the MoE ones (``lead_blocks``): the parameters of
    block 0 stand for blocks 0..2, those of block 3 for L - 3 blocks. Memory from the one trace,
    evaluated at small sizes (the file's fixed MLA and dense widths, the symbols small) against a
    real CPU step: activations == saved_tensors_hooks, the peak == torch.profiler's (AdamW
    foreach), at L = 4 (one MoE block) and L = 6."""
    import memory_oracle as oracle

    from symcost.passes.memory import memory_model

    an = _trace("deepseek-v3")
    assert an.spec.lead_blocks == 3
    reps = {n: rep for n, (_, _, rep) in an.param_shapes.items()}
    L = SYMS["L"]
    assert reps["model.layers.{0..2}.mlp.gate_proj.weight"] == 3
    assert reps["model.layers.{i}.mlp.experts.gate_up_proj"] == L - 3
    assert an.schedule.error is None
    mm = memory_model(an, "fp32", "adamw", "foreach")
    for sizes in ({"B": 2, "S": 8, "H": 4, "D": 8, "V": 64, "F": 16, "E": 16, "R": 2, "L": 4},
                  {"B": 3, "S": 8, "H": 4, "D": 8, "V": 64, "F": 16, "E": 16, "R": 4, "L": 6}):
        c = mm.components(**sizes)
        assert c["activations"] == oracle.saved_bytes(an.spec, sizes, "fp32"), sizes
        measured = oracle.step_peak(an.spec, sizes, "fp32", "adamw", foreach=True)["peak"]
        assert abs(c["peak"] - measured) <= 0.01 * measured, (sizes, c["peak"], measured, mm.peak_where(**sizes))


@pytest.mark.heavy
def test_v3_with_no_moe_block_is_its_own_regime():
    """L <= first_k_dense_replace builds a dense model (PyTorch builds it): traced as it is with L
    pinned, its parameters and FLOPs exact; the folded trace refuses such an L (another regime)."""
    folded = _trace("deepseek-v3")
    with pytest.raises(SymcostError, match="leading blocks"):
        folded.subs(L=2)
    an = _trace("deepseek-v3", (("B", 4), ("S", 64), ("L", 2)))
    assert an.pinned == {"L": 2} and "3 leading blocks" in an.pin_reasons["L"]
    spec = an.spec
    with torch.device("meta"):
        model = spec.build(_full(spec, L=2))
    assert an.subs()["params"] == sum(p.numel() for p in model.parameters())
    assert an.params_active == an.params  # no routed experts in two dense blocks
    for sizes in ({"B": 2, "S": 16}, {"B": 3, "S": 32}):
        want = fake_flops(spec, _full(spec, L=2, **sizes))
        got = an.subs(**sizes)
        assert {k: got[k] for k in want} == want, sizes


def test_cache_does_not_answer_l_below_the_leading_blocks():
    """A cached trace of the folded regime (L > n) does not match a request with L <= n."""
    from symcost.graph import cache

    meta = {"defaults": {"L": 61, "H": 4}, "tied": {}, "follows": {}, "all_symbols": ["B", "H", "L", "S"],
            "pinned": {}, "lead_blocks": 3}
    meta["facts"] = cache._facts(meta, {})
    meta["config_values"] = cache._config_values(meta, {})
    assert cache._matches(meta, {"L": 4}) and cache._matches(meta, {})
    assert not cache._matches(meta, {"L": 3}) and not cache._matches(meta, {"L": 1})


def test_layer_types_follow_l_by_their_period():
    from symcost.frontends.hf import _resize_pattern

    assert _resize_pattern(["s", "f"] * 12, 3) == ["s", "f", "s"]
    assert _resize_pattern(["f", "s", "s"] * 4, 5) == ["f", "s", "s", "f", "s"]
    assert _resize_pattern(["a"] * 4, 2) == ["a", "a"]


def test_grouped_routing_constraints():
    """DeepSeek-V3's router views the E scores as [n_group, E/n_group] and takes the top 2 of each
    group: E a multiple of n_group and E >= 2·n_group are constraints (what PyTorch rejects), not
    regimes; DeepSeek's config validates H | hidden_size, a constraint where M is a symbol."""
    spec = symcost.resolve(_path("deepseek-v3"), None, "eager")
    full = _full(spec)
    assert spec.check(dict(full, E=24)) is None
    assert "multiple of n_group=8" in spec.check(dict(full, E=20))
    assert "at least 2·n_group=16" in spec.check(dict(full, E=8))
    lite = symcost.resolve(_path("deepseek-v2-lite"), None, "eager")
    assert "M" in lite.symbols and "H must divide M" in lite.check(_full(lite, M=2050))
    assert spec.lead_blocks == 3 and lite.lead_blocks == 0  # V2-Lite's single dense block folds as a special first block


@pytest.mark.parametrize("routing", ["balanced", "capacity=2"])
def test_one_sequence_leaves_e_free(routing):
    """B = 1 (``symcost report`` by default) is pinned; E must still take three probe values
    (E a multiple of n_group = 8, at least 16). Under ``capacity=c`` (symcost's padded dispatch)
    they divide c·S·R: the base probe is chosen so (S·R = 48, 80, ...), or E would be pinned and
    S after it; under ``balanced`` (transformers' grouped_mm experts: shapes [N·R, ·] at any
    routing) the probes need no whole number of slots per expert."""
    from symcost.frontends import moe
    from symcost.tracing.fit import find_base, plan_probes

    spec = moe.with_routing(symcost.resolve(_path("deepseek-v3"), None, "eager"), routing)
    syms = tuple(s for s in spec.all_symbols if s not in ("B", "K"))  # K tied to H (K = H requested)
    kw = dict(fixed={"B": 1, "L": 5}, request=_full(spec, B=1, S=4096), ties={"K": "H"}, moduli=dict(spec.moduli))
    base = find_base(syms + ("B",), spec.probe_ok, 0, **kw)
    plan = plan_probes(syms + ("B",), spec.probe_ok, n_random=0, base=base, **kw)
    es = {p["E"] for p in plan.points}
    assert "E" in plan.axis and len(es) >= 3 and all(e % 8 == 0 and e >= 16 for e in es), es
    if routing != "balanced":
        assert all((2 * p["B"] * p["S"] * p["R"]) % p["E"] == 0 for p in plan.points)


def test_qwen3_moe_takes_head_dim_apart_from_the_width():
    """transformers' Qwen3-MoE config class has no head_dim field, but its attention reads
    ``config.head_dim`` (else hidden_size / heads): ``--config head_dim=96`` is accepted and binds D,
    and the width becomes its own symbol M (as for dense Qwen3); without a head_dim, d_model = H·D."""
    spec = symcost.resolve("hf:qwen3_moe", {"head_dim": "96"})
    assert {"D", "M"} <= set(spec.symbols) and spec.defaults["D"] == 96 and spec.defaults["M"] == 2048
    spec = symcost.resolve(_path("qwen3-30b-a3b"))
    assert spec.defaults["D"] == 128 and spec.defaults["M"] == 2048
    assert "M" not in symcost.resolve("hf:qwen3_moe").symbols


@pytest.mark.heavy
def test_qwen3_30b_a3b_head_dim_apart_from_the_width():
    """Qwen3-30B-A3B's head_dim 128 is not hidden_size 2048 / 32 heads: the trace has D and M as
    symbols (neither pinned, the head dim not folded into constants), and its parameter formula at
    other head dims and widths equals transformers' model built on the meta device from the file
    with that head_dim and hidden_size (2 layers)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    an = _trace("qwen3-30b-a3b")
    assert {"D", "M"} <= set(an.symbols) and not an.pinned, an.pin_reasons
    for d, m in ((96, 2048), (160, 1024)):
        cfg = AutoConfig.from_pretrained(_path("qwen3-30b-a3b"), head_dim=d, hidden_size=m, num_hidden_layers=2)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg)
        assert model.model.layers[0].self_attn.q_proj.weight.shape == (32 * d, m)
        assert an.subs(**REQUEST, D=d, M=m, L=2)["params"] == sum(p.numel() for p in model.parameters()), (d, m)
