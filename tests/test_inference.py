"""Inference steps (issue 17): prefill and decode traced through the model's own KV cache.

The oracles are independent of symcost's formulas: each model is built at the concrete sizes with
real CPU tensors (no meta device, no fake tensors), its own cache class is created from its config
with ``transformers``' API (``DynamicCache(config=...)``, ``StaticCache(config=...,
max_cache_len=...)``), a decode step's cache is filled with T tokens by one forward, and then

* FLOPs: ``FlopCounterMode`` around the step's forward (``logits_to_keep=1``, as ``generate``);
* KV bytes: the bytes of the storages the cache's tensors hold after the step (each storage once,
  ``untyped_storage().nbytes()``), measured on the real model (or on the meta device for a full
  size configuration);
* causal pairs: the score pairs the model's own attention leaves unmasked (``output_attentions``:
  the probabilities it really computes, counted where they are non-zero).
"""
from __future__ import annotations

import contextlib
import functools
import random

import pytest
import sympy
import torch
from test_moe import balanced_router  # the stated routing model on the real run
from torch.utils.flop_counter import FlopCounterMode

import symcost
from symcost.tracing.fit import SYMS


def traced_step(model: str, step: str, kv_cache: str = "dynamic", config: tuple = (), sizes: tuple = (),
                precision: str = "fp32", attention: str = "eager"):
    """The Analysis of an inference step (eager attention: FlopCounterMode cannot see CPU sdpa),
    traced once per session."""
    return _traced(model, step, kv_cache, tuple(config), tuple(sizes), precision, attention)


@functools.cache
def _traced(model, step, kv_cache, config, sizes, precision, attention):
    return symcost.trace(model, dict(config), attention, sizes=dict(sizes), precision=precision, step=step,
                         kv_cache=kv_cache)


def full_values(an, sizes):
    """The model's defaults with the pinned sizes and ``sizes`` on top, tied symbols following."""
    v = {**an.spec.defaults, **an.pinned, **sizes}
    v.update({a: v[b] for a, b in an.spec.tied.items()})
    return v


def cache_bytes(cache) -> int:
    """Bytes of the storages of the floating-point tensors the cache's layers hold, each once."""
    seen, total = set(), 0
    for layer in cache.layers:
        for t in vars(layer).values():
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                st = t.untyped_storage()
                if st.data_ptr() not in seen or t.device.type == "meta":
                    seen.add(st.data_ptr())
                    total += st.nbytes()
    return total


def run_step(spec, values, step: str, kv_cache: str = "dynamic", device: str = "cpu", dtype=torch.float32,
             counter: bool = True, attentions: bool = False):
    """One inference step of the real model with its own cache: ``(FLOPs, KV bytes, outputs)``."""
    from transformers import DynamicCache, StaticCache

    torch.manual_seed(0)
    with torch.device(device):
        model = spec.build(values)
    model = model.to(dtype).eval()
    if spec.extra.get("routing"):
        model.set_experts_implementation("eager")  # transformers' own loop over the experts
    B, S, V = values["B"], values["S"], values["V"]
    T = values.get("T", 0) if step == "decode" else 0
    cache = (StaticCache(config=model.config, max_cache_len=T + S) if kv_cache == "static"
             else DynamicCache(config=model.config))
    import inspect

    key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with torch.no_grad(), balanced_router():
        if T:
            model(input_ids=torch.randint(0, V, (B, T), device=device), use_cache=True, **{key: cache})
        ids = torch.randint(0, V, (B, S), device=device)
        with FlopCounterMode(display=False) if counter else contextlib.nullcontext() as fc:
            out = model(input_ids=ids, use_cache=True, logits_to_keep=1, output_attentions=attentions,
                        **{key: cache})
    return (fc.get_total_flops() if counter else None), cache_bytes(cache), out


def random_sizes(an, rng: random.Random, n: int) -> list[dict[str, int]]:
    """``n`` small random sizes of ``an``'s symbols (real models are built at them), valid for
    the model, in the regime traced (1 < K < H where K is free), never a probe of the fit; MoE sizes
    give every expert a whole number of token slots (E divides B·S·R)."""
    probes = {tuple(sorted((s, p[s]) for s in an.symbols)) for p in an.plan.points}
    out = []
    while len(out) < n:
        v = {"B": rng.randint(1, 4), "S": rng.randint(2, 12), "T": rng.randint(2, 30),
             "H": rng.choice((2, 4, 6, 8)), "D": rng.choice((4, 6, 8, 12, 16)), "L": rng.randint(1, 3),
             "V": rng.randint(17, 90), "F": rng.randint(8, 48), "M": rng.choice((8, 16, 24, 32)),
             "E": rng.randint(2, 6), "R": rng.randint(2, 3)}
        ks = [k for k in (2, 3, 4) if v["H"] % k == 0 and k < v["H"]]  # 1 < K < H: the regime traced
        if "K" in an.symbols and not ks:
            continue
        v["K"] = rng.choice(ks or [1])
        v = {s: v[s] for s in an.symbols}
        full = full_values(an, v)
        if "E" in v and ((full["B"] * full["S"] * v["R"]) % v["E"] or v["R"] > v["E"]):
            continue
        if tuple(sorted(v.items())) in probes or an.spec.check(full):
            continue
        if any(s in v and v[s] % m != r for s, (m, r) in an.residues.items()):
            continue
        out.append(v)
    return out


# model -> (config overrides, trace sizes choosing the regime, heavy)
ARCHS = {
    "hf:llama": ((), (("K", 4),), False),  # grouped-query attention (1 < K < H)
    "hf:falcon": ((), (), True),  # multi-query attention (one key/value head), parallel blocks
    "hf:mistral": ((), (), True),  # sliding-window attention: DynamicSlidingWindowLayer caches
    "hf:qwen3": ((), (), True),  # head_dim set apart from hidden_size (the symbol M), q/k norms
    "hf:mixtral": ((), (), True),  # mixture of experts (balanced routing), sliding-window config
    "hf:gpt2": ((), (), True),  # multi-head attention, learned positions, Conv1D
    "hf:gpt_neox": ((), (), True),  # partial rotary, fused QKV
    "hf:phi3": ((), (), True),  # fused qkv and gate_up projections
}


def _params():
    return [pytest.param(m, step, marks=pytest.mark.heavy) if (h or step == "prefill") else pytest.param(m, step)
            for m, (_, _, h) in ARCHS.items() for step in ("prefill", "decode")]


@pytest.mark.parametrize("model,step", _params())
def test_flops_and_kv_bytes_equal_pytorch(model, step):
    """FLOPs of prefill and decode == FlopCounterMode, KV bytes == the cache's storages, at random
    sizes never used in the fit (8 architectures)."""
    config, sizes, _ = ARCHS[model]
    an = traced_step(model, step, config=config, sizes=sizes)
    assert an.step == step and ("T" in an.symbols) == (step == "decode")
    bad = []
    for v in random_sizes(an, random.Random(f"infer:{model}:{step}"), 3):
        full = full_values(an, v)
        flops, kv, _ = run_step(an.spec, full, step)
        got = an.subs(**v)
        got_kv = int(an.kv_bytes.xreplace(an.bind(**v)))
        assert flops > 0 and kv > 0
        if (got["flops.forward"], got_kv) != (flops, kv):
            bad.append(f"{model} {step} at {v}: symcost flops {got['flops.forward']} kv {got_kv}, "
                       f"measured {flops} and {kv}")
    assert not bad, "\n".join(bad)


def test_static_cache_decode():
    """StaticCache (preallocated for T + S tokens, written in place) traced and checked the same way."""
    an = traced_step("hf:llama", "decode", "static", sizes=(("K", 4),))
    assert an.kv_cache == "static"
    for v in random_sizes(an, random.Random("infer:static"), 2):
        flops, kv, _ = run_step(an.spec, full_values(an, v), "decode", "static")
        assert (an.subs(**v)["flops.forward"], int(an.kv_bytes.xreplace(an.bind(**v)))) == (flops, kv), v


def test_decode_step_shapes():
    """Decode reads the cache: attention over T + 1 keys, the cache one token longer, S pinned at 1."""
    an = traced_step("hf:llama", "decode", sizes=(("K", 4),))
    assert an.pinned == {"S": 1}
    B, T, K, D, L = (SYMS[s] for s in "BTKDL")
    # key and value caches of K heads of D elements (fp32) for T + 1 tokens, every layer
    assert sympy.expand(an.kv_bytes - 2 * 4 * B * K * D * L * (T + 1)) == 0


# ------------------------------------------------------------------------------------------------
# causal pairs with more keys than queries (decode, chunked prefill)
def _pairs_per_head(an_causal, an_full, values) -> set:
    """Score pairs per attention matmul that symcost's causal count implies: causal / full FLOPs of
    each attention op times the q·k pairs of the full count."""
    env = an_full.bind(**values)
    q = an_full.pinned.get("S", values.get("S"))
    k = values.get("T", 0) + q
    out = set()
    for full, causal in zip(an_full.ops, an_causal.ops):
        if not full.attention:
            continue
        f, c = int(full.cost.flops.xreplace(env)), int(causal.cost.flops.xreplace(env))
        out.add(sympy.Rational(c, f) * q * k)
    return out


def _measured_pairs(an, values) -> set:
    """Pairs the model's own attention computes: its probabilities (``output_attentions``) that are
    not zero, per batch row, layer and head."""
    _, _, out = run_step(an.spec, full_values(an, values), an.step, counter=False, attentions=True)
    return {int((a[b, h] != 0).sum()) for a in out.attentions for b in range(a.shape[0]) for h in range(a.shape[1])}


def test_causal_pairs_four_queries_ten_keys():
    """A 4-query, 10-key causal block (a chunk of 4 tokens after 6 cached ones) has 34 pairs: the
    model's own mask and symcost's causal count agree, and so at random chunk sizes."""
    an = traced_step("hf:llama", "decode", sizes=(("K", 4), ("S", 4), ("T", 6)))
    assert {"S", "T"} <= set(an.symbols)  # a chunked prefill: S new tokens onto T cached ones
    causal = an.with_attention_flops("causal")
    v = {"B": 2, "S": 4, "T": 6, "H": 4, "K": 2, "D": 8, "L": 2, "V": 40, "F": 24}
    assert _measured_pairs(an, v) == {34} == _pairs_per_head(causal, an, v)
    rng = random.Random("causal-pairs")
    for _ in range(3):
        v = dict(v, S=rng.randint(2, 9), T=rng.randint(1, 20))
        q, k = v["S"], v["S"] + v["T"]
        want = _measured_pairs(an, v)
        assert want == {q * k - q * (q - 1) // 2} == _pairs_per_head(causal, an, v), v


def test_causal_pairs_decode_and_prefill():
    """Decode (one query) computes every pair; a prefill of S tokens S·(S+1)/2."""
    dec = traced_step("hf:llama", "decode", sizes=(("K", 4),))
    v = {"B": 2, "T": 9, "H": 4, "K": 2, "D": 8, "L": 1, "V": 40, "F": 24}
    assert _measured_pairs(dec, v) == {10} == _pairs_per_head(dec.with_attention_flops("causal"), dec, v)
    pre = traced_step("hf:llama", "prefill", sizes=(("K", 4),))
    v = {"B": 2, "S": 7, "H": 4, "K": 2, "D": 8, "L": 1, "V": 40, "F": 24}
    assert _measured_pairs(pre, v) == {28} == _pairs_per_head(pre.with_attention_flops("causal"), pre, v)


# ------------------------------------------------------------------------------------------------
# KV bytes of a real configuration
QWEN3_4B = "tests/data/configs/qwen3-4b.json"


def _meta_model(path: str, dtype=torch.bfloat16):
    """The configuration's model built with transformers' own API on the meta device (no weights)."""
    import json

    from transformers import AutoConfig, AutoModelForCausalLM

    with open(path) as f:
        d = json.load(f)
    kw = {k: v for k, v in d.items() if k not in ("model_type", "architectures", "transformers_version",
                                                   "torch_dtype", "dtype")}
    cfg = AutoConfig.for_model(d["model_type"], **kw)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()


def _meta_cache_bytes(model, B: int, T: int, S: int = 1) -> int:
    """Bytes of the DynamicCache's key and value storages after T tokens and a step of S, measured on
    the meta device (every storage counted: meta storages have no address to compare)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.zeros(B, T, dtype=torch.long, device="meta"), cache=cache, use_cache=True)
        model(input_ids=torch.zeros(B, S, dtype=torch.long, device="meta"), cache=cache, use_cache=True)
    return sum(t.untyped_storage().nbytes() for layer in cache.layers for t in (layer.keys, layer.values))


@pytest.mark.heavy
def test_qwen3_4b_kv_bytes_per_token():
    """Qwen3-4B's published config (head_dim 128 apart from hidden_size 2560 / 32 heads = 80, 8 key/value
    heads, 36 layers) in bf16: 36 · 8 · 128 · 2 (keys and values) · 2 bytes = 147,456 bytes per token,
    and the cache the real model allocates on the meta device at random sizes."""
    from symcost.passes import inference

    an = traced_step(QWEN3_4B, "decode", precision="bf16-true", attention="sdpa")
    assert an.spec.defaults["D"] == 128 and an.spec.defaults["M"] == 2560 and an.spec.defaults["K"] == 8
    kv = inference.kv_cache(an, {"B": 2, "T": 8191})
    assert kv["per_token"] == 147_456 == 36 * 8 * 128 * 2 * 2
    assert kv["per_sequence"] == 147_456 * 8192 and kv["total"] == 2 * kv["per_sequence"]
    assert parse(kv["per_token_formula"]) == 4 * SYMS["D"] * SYMS["K"] * SYMS["L"]
    model = _meta_model(QWEN3_4B)
    rng = random.Random("qwen3-4b-kv")
    for _ in range(2):
        B, T = rng.randint(1, 4), rng.randint(2, 40)
        want = _meta_cache_bytes(model, B, T)
        assert want == 147_456 * B * (T + 1)
        assert int(an.kv_bytes.xreplace(an.bind(B=B, T=T))) == want, (B, T)


def parse(text):
    return symcost.parse_formula(text)


@pytest.mark.heavy
def test_sliding_window_beyond_the_window():
    """Past its window W the sliding-window cache stops growing: traced at T beyond W = 6, the decode
    step's FLOPs and the cache's bytes (the (W - 1) + 1 tokens of the last concatenation, the storage
    it keeps a view of) equal the real model's at random T beyond the window."""
    an = traced_step("hf:mistral", "decode", config=(("sliding_window", "6"),), sizes=(("T", 20),))
    B, K, D, L = (SYMS[s] for s in "BKDL")
    assert sympy.expand(an.kv_bytes - 2 * 4 * 6 * B * K * D * L) == 0  # no T: W - 1 + S = 6 tokens
    beyond = [v for v in random_sizes(an, random.Random("infer:window"), 12) if v["T"] >= 6][:3]
    assert len(beyond) >= 2  # (below the window is the other regime)
    for v in beyond:
        flops, kv, _ = run_step(an.spec, full_values(an, v), "decode")
        assert (an.subs(**v)["flops.forward"], int(an.kv_bytes.xreplace(an.bind(**v)))) == (flops, kv), v
