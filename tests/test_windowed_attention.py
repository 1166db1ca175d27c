"""Sliding-window attention and DeepSeek's multi-head latent attention (MLA) counted as they run
(issue 28 item 3), against ``transformers`` running the same step:

* **KV cache bytes** (``serve``'s cache, ``Analysis.kv_bytes``): the bytes of the storages the
  model's own ``DynamicCache(config=...)`` holds after a decode step (``DynamicSlidingWindowLayer``
  for a config's sliding layers, ``DynamicLayer`` for its full ones), measured on the real model
  (tests/test_inference.py ``run_step``/``cache_bytes``) at random sizes beyond the window: a
  sliding layer keeps the window, a full layer every token. Gemma 2 (sliding and full layers
  alternate), Gemma 3 (five sliding layers to one full), gpt-oss (alternating, with attention
  sinks and a mixture of experts);
* **MLA**: transformers (5.x) caches DeepSeek's compressed latent, ``kv_lora_rank`` +
  ``qk_rope_head_dim`` elements per token and layer shared by every head, and expands it into
  per-head keys and values after reading the cache (``DeepseekV3Attention.forward``: "Cache read /
  write is performed while latent KV is still compressed"); the traced cache equals the real
  cache's storages and the per-token bytes the config's two widths;
* **training FLOPs** with a window shorter than S: the attention transformers runs (eager here, and
  SDPA alike) multiplies every query with every key and masks the scores outside the window, so
  the model FLOPs are those of the S x S product, as ``FlopCounterMode`` counts them on the real
  step; a window-aware kernel (flash-attention-2's ``window_size``) is not what runs on this CPU.

Decode steps pass ``logits_to_keep=1`` as ``generate`` does; fp32, eager attention
(FlopCounterMode cannot see CPU SDPA's fused kernel).
"""
from __future__ import annotations

import random

import pytest
import sympy
from test_flops_exact import measure
from test_inference import full_values, random_sizes, run_step, traced_step

from symcost.tracing.fit import SYMS

W = 6  # the window every test sets (sliding_window), below the T and S drawn


def _beyond(an, seed: str, n: int = 2) -> list[dict]:
    """``n`` random sizes of ``an``'s symbols with T at or beyond the window."""
    out = [v for v in random_sizes(an, random.Random(seed), 24) if v.get("T", W) >= W]
    assert len(out) >= n, out
    return out[:n]


def _check_decode(an, seed: str) -> None:
    for v in _beyond(an, seed):
        flops, kv, _ = run_step(an.spec, full_values(an, v), "decode")
        got = (an.subs(**v)["flops.forward"], int(an.kv_bytes.xreplace(an.bind(**v))))
        assert got == (flops, kv), (an.model, v, got, (flops, kv))


def _layer_kinds(an) -> list[str]:
    model = an.spec.build_meta(full_values(an, {}))
    return list(model.config.layer_types)


@pytest.mark.hf
@pytest.mark.parametrize("model,config", [
    # (two layers: one sliding, one full, as the published configs alternate them; at four, the
    # same ops twice over: 31 CPU-s for these two, 2026-12-06, loaded machine)
    ("hf:gemma2", (("num_hidden_layers", "2"),)),  # sliding and full layers alternate
    ("hf:gpt_oss", (("num_hidden_layers", "2"),)),  # the same, with sinks and experts
    pytest.param("hf:gemma3_text", (("num_hidden_layers", "6"),), marks=pytest.mark.heavy),  # 5 sliding : 1 full
])
def test_sliding_and_full_layers_cache_as_transformers_holds_it(model, config):
    """Beyond the window, the decode step's cache bytes and FLOPs equal the real model's own
    DynamicCache (storages after the step) and FlopCounterMode at random B, T and widths; a
    sliding layer's bytes no longer grow with T, a full layer's do: ∂kv/∂T is 2·(full layers)·B·K·
    head_dim·4 (fp32), read off the config's own layer_types."""
    an = traced_step(model, "decode", config=(("sliding_window", str(W)), *config), sizes=(("T", 3 * W),))
    kinds = _layer_kinds(an)
    full = kinds.count("full_attention")
    assert 0 < full < len(kinds), kinds
    B, T, K, D = (SYMS[s] for s in "BTKD")
    assert sympy.expand(sympy.diff(an.kv_bytes, T) - 2 * full * B * K * D * 4) == 0, (an.kv_bytes, kinds)
    _check_decode(an, f"window:{model}")


@pytest.mark.hf
def test_mla_caches_the_latent():
    """DeepSeek-V3's MLA (two blocks, the second MoE): transformers caches the compressed latent,
    ``kv_lora_rank + qk_rope_head_dim`` fp32 elements per token and layer (one "head" shared by all
    heads), not the expanded per-head keys and values; symcost's traced cache equals the real
    cache's storages and the decode FLOPs FlopCounterMode's at random sizes."""
    cfg = (("num_hidden_layers", "2"), ("first_k_dense_replace", "1"), ("kv_lora_rank", "24"),
           ("qk_rope_head_dim", "8"), ("qk_nope_head_dim", "8"), ("v_head_dim", "8"), ("q_lora_rank", "16"),
           ("hidden_size", "32"), ("num_attention_heads", "4"),
           ("num_key_value_heads", "4"), ("moe_intermediate_size", "16"), ("vocab_size", "64"))
    an = traced_step("hf:deepseek_v3", "decode", config=cfg, sizes=(("T", 9),))
    B, T, L = (SYMS[s] for s in "BTL")
    assert sympy.expand(an.kv_bytes - (24 + 8) * 4 * B * L * (T + 1)) == 0, an.kv_bytes
    rng = random.Random("mla")
    for _ in range(2):
        v = {**{s: x for s, x in full_values(an, {}).items() if s in an.symbols},
             "B": rng.randint(1, 3), "T": rng.randint(2, 20)}
        if "L" in an.symbols:
            v["L"] = rng.randint(2, 3)
        flops, kv, _ = run_step(an.spec, full_values(an, v), "decode")
        got = (an.subs(**v)["flops.forward"], int(an.kv_bytes.xreplace(an.bind(**v))))
        assert got == (flops, kv), (v, got, (flops, kv))


@pytest.mark.hf
@pytest.mark.heavy
def test_training_flops_with_a_window_shorter_than_s():
    """Gemma 2 (window 6, sliding and full layers) trained at S beyond the window: model FLOPs of
    forward and backward equal FlopCounterMode on the real step at random B, S: the S x S product
    transformers' attention computes (the window is a mask), not W·S."""
    import symcost

    cfg = {"sliding_window": str(W), "num_hidden_layers": "2", "hidden_size": "32", "num_attention_heads": "4",
           "num_key_value_heads": "2", "head_dim": "8", "intermediate_size": "48", "vocab_size": "64"}
    an = symcost.trace("hf:gemma2", cfg, "eager", sizes={"S": 4 * W}, precision="fp32")
    rng = random.Random("window:train")
    for _ in range(2):
        v = {**{s: x for s, x in full_values(an, {}).items() if s in an.symbols},
             "B": rng.randint(1, 3), "S": rng.randint(2 * W, 6 * W)}
        want, got = measure(an.spec, full_values(an, v)), an.subs(**v)
        assert (got["flops.forward"], got["flops.backward"]) == (want["flops.forward"], want["flops.backward"]), v
