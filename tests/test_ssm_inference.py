"""Inference of state-space and hybrid models (issue 30 item 6): hf:mamba2, hf:jamba, hf:zamba,
hf:zamba2 served as ``generate`` runs them, through the cache it builds,
``DynamicCache(config=model.config)`` (transformers/generation/utils.py; each model's own forward
builds the same when given none): per Mamba block a ``LinearAttentionLayer`` (a conv state and an SSM
state, fixed in size), per attention block a ``DynamicLayer`` (Jamba), per hybrid block a
``LinearAttentionAndFullAttentionLayer`` holding both (Zamba, Zamba2).

The oracles do not use symcost's step (:func:`symcost.frontends.hf.infer`): each model is built at
random tiny sizes never probed, with real CPU tensors, and run as ``generate`` runs it:

* prefill FLOPs == ``FlopCounterMode`` over ``model(input_ids [B, S], cache=DynamicCache(config),
  use_cache=True, logits_to_keep=1)``;
* decode FLOPs == ``FlopCounterMode`` over one step of one token after a forward of T tokens;
* cache bytes == the bytes of the storages of every floating-point tensor the cache's layers hold
  after the step (each storage once), and their growth per token (the real cache after T + 1
  tokens minus after T) == d(bytes)/dT: 0 for the Mamba layers;
* ``serve``'s recurrent-state bytes per sequence (``kv.state_per_sequence``) == the real cache's
  conv and SSM states of one sequence;
* parameters == the meta-device count.
"""
from __future__ import annotations

import functools
import random

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import symcost

pytest.importorskip("transformers")

#: name -> (spec factory arguments, traced sizes). Tiny configs as tests/test_hf_ssm.py's: Jamba's
#: two blocks are a Mamba block with a mixture of experts and an attention block with a dense MLP;
#: Zamba2's pattern Mamba-2 then hybrid; Zamba's blocks Mamba, Mamba, hybrid, hybrid.
MODELS = {
    "mamba2": (("mamba2", {"chunk_size": "4"}, None, None),
               {"B": 2, "H": 4, "D": 2, "K": 2, "N_state": 3, "K_conv": 4, "L": 2, "V": 37}),
    "jamba": (("jamba", {"attn_layer_period": "2", "attn_layer_offset": "1", "expert_layer_period": "2",
                         "expert_layer_offset": "0"}, "eager", None),
              {"B": 2, "H": 4, "D": 8, "K": 2, "L": 2, "V": 37, "F": 8, "E": 4, "R": 2, "N_state": 3, "K_conv": 3,
               "EXPAND": 2, "R_dt": 2}),
    "zamba2": (("zamba2", {"n_mamba_heads": "2", "mamba_ngroups": "1", "adapter_rank": "3",
                           "use_shared_attention_adapter": "true", "chunk_size": "4"}, "eager",
                {"layers_block_type": ["mamba", "hybrid"], "num_hidden_layers": 2}),
               {"B": 2, "H": 4, "D": 4, "F": 6, "N_state": 3, "K_conv": 4, "L": 3, "V": 37}),
    "zamba": (("zamba", {"n_mamba_heads": "2", "attn_layer_period": "1", "attn_layer_offset": "0"}, "eager", None),
              {"B": 2, "H": 2, "D": 4, "K": 2, "M": 6, "F": 6, "N_state": 3, "K_conv": 3, "R_dt": 2, "L": 4, "V": 37}),
}


def spec_of(name: str):
    from symcost.frontends import hf_ssm

    model_type, config, attention, base = MODELS[name][0]
    return hf_ssm.spec(model_type, config, attention, base_kwargs=base)


@functools.cache
def traced(name: str, step: str, n: int):
    """The Analysis of ``name``'s ``step`` (decode: T = 5 tokens cached; prefill: S = n), fp32,
    traced once per session."""
    sizes = {**MODELS[name][1], **({"T": 5} if step == "decode" else {"S": n})}
    return symcost.trace(spec_of(name), sizes=sizes, precision="fp32", step=step, torch_device="cpu")


def full_values(an, v: dict[str, int]) -> dict[str, int]:
    """Every size the model is built at: ``v``, the pinned ones, the defaults, a follower of
    another size (Zamba's K = H) at its leader's value."""
    full = {**an.spec.defaults, **an.pinned, **v}
    full.update({f: full[lead] for f, lead in (getattr(an.spec, "follows", None) or {}).items() if f not in v})
    return full


def draw(name: str, an, rng: random.Random) -> dict[str, int]:
    """Random tiny sizes of ``an``'s free symbols in its regime (its moduli, 1 < K < H where the
    trace has it), never a probe of its fit, that the model builds at."""
    probes = {tuple(sorted((s, p[s]) for s in an.symbols)) for p in an.plan.points}
    spec = an.spec
    while True:
        v = {"B": rng.randint(2, 4), "T": rng.randint(2, 9), "S": rng.choice((6, 10)), "V": rng.randint(20, 60),
             "N_state": rng.randint(2, 5), "K_conv": rng.randint(2, 5), "F": rng.randint(4, 20),
             "R_dt": rng.randint(1, 4), "EXPAND": rng.randint(1, 2), "L": rng.randint(1, 3)}
        if name == "mamba2":  # (H, D even: their classes mod expand = 2; 1 < K < H)
            v.update(K=2, H=2 * rng.randint(2, 3), D=2 * rng.randint(1, 3))
        elif name == "jamba":  # (E dividing B*R: the balanced routing's slots are whole)
            v.update(H=rng.choice((4, 6)), D=8, E=rng.choice((2, 4)), R=2, F=8 * rng.randint(1, 3))
            v["K"] = rng.choice([k for k in (2, 3) if v["H"] % k == 0])
        elif name == "zamba2":  # (H, D in the trace's classes mod 2*n_mamba_heads = 4)
            v.update(H=4 * rng.randint(1, 2), D=4 * rng.randint(1, 2))
        else:  # (K = H follows; M even: its class mod n_mamba_heads = 2)
            v.update(H=rng.randint(2, 3), D=rng.randint(2, 6), M=2 * rng.randint(2, 5))
            v["K"] = v["H"]
        v = {s: v[s] for s in an.symbols}
        full = full_values(an, v)
        if name == "jamba" and (full["B"] * full["S"] * full["R"]) % full["E"]:
            continue  # (balanced routing: E divides the B*S*R token slots)
        if tuple(sorted(v.items())) not in probes and not (spec.check and spec.check(full)):
            return v


def cache_bytes(cache, states_only: bool = False) -> int:
    """Bytes of the storages of the floating-point tensors the cache's layers hold, each once
    (``states_only``: only the conv and recurrent states of the Mamba layers)."""
    from torch.utils._pytree import tree_leaves

    seen, total = set(), 0
    for layer in cache.layers:
        held = ([getattr(layer, k, None) for k in ("conv_states", "recurrent_states")] if states_only
                else list(vars(layer).values()))
        for t in tree_leaves(held):
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                total += t.untyped_storage().nbytes()
    return total


def generate_step(spec, values, step: str):
    """The real model at ``values`` run as ``generate`` runs it: ``(FLOPs of the step, the cache
    after it)``; decode = one token after a forward of T tokens, prefill = S tokens on an empty
    cache. Jamba's router forced to the balanced assignment (symcost's routing model), its experts
    run by transformers' eager loop (FlopCounterMode does not count the default ``grouped_mm``'s
    ``aten._grouped_mm``; docs/conventions.md)."""
    from test_moe import balanced_router
    from transformers import DynamicCache

    torch.manual_seed(0)
    model = spec.build(values).float().eval().requires_grad_(False)  # (FlopCounterMode's module hooks)
    if any(n.endswith(".experts") for n, _ in model.named_modules()):
        model.set_experts_implementation("eager")
    cache = DynamicCache(config=model.config)
    B, V = values["B"], model.config.vocab_size
    with torch.no_grad(), balanced_router():
        if step == "decode":
            model(input_ids=torch.randint(0, V, (B, values["T"])), cache=cache, use_cache=True)
        with FlopCounterMode(display=False) as fc:
            model(input_ids=torch.randint(0, V, (B, values["S"] if step == "prefill" else 1)), cache=cache,
                  use_cache=True, logits_to_keep=1)
    return fc.get_total_flops(), cache


def check(name: str, step: str, seed: str, n: int = 6):
    """``name``'s ``step`` traced, then FLOPs, cache bytes, their growth per token and the
    parameters at random sizes against the real model's. Returns (analysis, sizes, real cache)."""
    an = traced(name, step, n)
    assert an.step == step and ("T" in an.symbols) == (step == "decode"), (an.step, an.symbols)
    v = draw(name, an, random.Random(seed))
    full = full_values(an, v)
    flops, cache = generate_step(an.spec, full, step)
    got = an.subs(**v)
    kv = an.kv_bytes.xreplace(an.bind(**v))
    assert (got["flops.forward"], int(kv), got["params"]) == (
        flops, cache_bytes(cache), sum(p.numel() for p in an.spec.build_meta(full).parameters())), (name, step, v)
    if step == "decode":  # the cache one token further: grows by d(bytes)/dT, 0 for a Mamba layer
        _, after = generate_step(an.spec, {**full, "T": full["T"] + 1}, step)
        T = symcost.SYMS["T"]
        assert cache_bytes(after) - cache_bytes(cache) == int(an.kv_bytes.diff(T).xreplace(an.bind(**v))), v
    return an, v, cache


@pytest.mark.heavy
def test_mamba2_prefill_and_decode_equal_generate():
    """hf:mamba2: one LinearAttentionLayer per block (conv state [B, H·D + 2·K·N_state, K_conv], SSM
    state [B, H, D, N_state]); prefill and decode equal FlopCounterMode and the real cache, which
    does not grow with T; serve's text says "state cache", no "KV cache", and its bytes per token 0."""
    from rich.console import Console

    from symcost.hardware.devices import get_device
    from symcost.passes import inference
    from symcost.render.inference import render_text, to_json

    dec, v, cache = check("mamba2", "decode", "mamba2:decode")
    assert {type(x).__name__ for x in cache.layers} == {"LinearAttentionLayer"}
    assert not dec.kv_bytes.has(symcost.SYMS["T"]) and not dec.flops("forward", "model").has(symcost.SYMS["T"])
    pre, _, _ = check("mamba2", "prefill", "mamba2:prefill")
    sizes = {k: x for k, x in v.items() if k not in ("B", "T")}
    r = inference.serve(dec, None, get_device("h100"), "1GiB", 9, sizes)
    one = generate_step(dec.spec, {**full_values(dec, sizes), "B": 1, "T": 8}, "decode")[1]
    kv = to_json("hf:mamba2", "fp32", get_device("h100"), r)["kv"]
    assert (kv["cache"], kv["per_token_formula"]) == ("state", "0")
    assert kv["state_per_sequence"] == kv["per_sequence"] == cache_bytes(one, states_only=True) == cache_bytes(one)
    con = Console(record=True, width=200)
    render_text(con, "hf:mamba2", "fp32", get_device("h100"), r)
    text = con.export_text()
    assert "state cache" in text and "KV" not in text, text


@pytest.mark.heavy
def test_jamba_prefill_and_decode_equal_generate():
    """hf:jamba: a Mamba block (LinearAttentionLayer) and an attention block (DynamicLayer, one
    token more per step); prefill (S = 8: the CPU scan loops over S, pinned) and decode (mixture
    of experts under balanced routing) equal FlopCounterMode, the cache the real one, its growth per
    token the attention block's keys and values only; serve's recurrent-state bytes per sequence
    are the real states'."""
    from symcost.passes import inference

    an, v, cache = check("jamba", "decode", "jamba:decode")
    assert [type(x).__name__ for x in cache.layers] == ["LinearAttentionLayer", "DynamicLayer"]
    assert inference.cache_kind(an) == "kv+state"
    one = {**full_values(an, v), "B": 1}
    kv = inference.kv_cache(an, {**v, "B": 1})
    assert kv["state_per_sequence"] == cache_bytes(generate_step(an.spec, one, "decode")[1], states_only=True)
    # (S = 8 > K_conv: a prompt shorter than the convolution pads its conv state, another regime)
    check("jamba", "prefill", "jamba:prefill", n=8)
    # a prompt no longer than the convolution (S = 3 = K_conv): no random size of its regime records
    # (K_conv drawn above S pads), so its config sizes are pinned, not refused (was: "no fresh probe
    # of this regime could be recorded")
    short = check("jamba", "prefill", "jamba:short", n=3)[0]
    assert "K_conv" in short.pinned and "no random size" in short.pin_reasons["K_conv"], short.pin_reasons


@pytest.mark.heavy
def test_zamba2_prefill_and_decode_equal_generate():
    """hf:zamba2: Mamba-2 blocks (LinearAttentionLayer) and a hybrid block
    (LinearAttentionAndFullAttentionLayer: the shared attention's keys and values beside the
    Mamba-2 states, fitted storage by storage); prefill and decode equal FlopCounterMode and the
    real cache."""
    from symcost.passes import inference

    an, v, cache = check("zamba2", "decode", "zamba2:decode")
    assert [type(x).__name__ for x in cache.layers] == ["LinearAttentionLayer", "LinearAttentionAndFullAttentionLayer",
                                                        "LinearAttentionLayer"]
    # (H, D, N_state formulas: the hybrid layer's storages fitted one by one, not its sum)
    assert {"S", "L"} <= set(an.pinned) and not {"H", "D", "N_state"} & set(an.pinned), an.pinned
    one = {**full_values(an, v), "B": 1}
    assert inference.kv_cache(an, {**v, "B": 1})["state_per_sequence"] == cache_bytes(
        generate_step(an.spec, one, "decode")[1], states_only=True)
    check("zamba2", "prefill", "zamba2:prefill")


@pytest.mark.heavy
def test_zamba_decode_equals_generate():
    """hf:zamba: multi-head Mamba blocks and hybrid blocks (the shared transformer block's keys and
    values beside the Mamba states, one LinearAttentionAndFullAttentionLayer); the decode step
    equals FlopCounterMode and the real cache."""
    _, _, cache = check("zamba", "decode", "zamba:decode")
    assert [type(x).__name__ for x in cache.layers] == ["LinearAttentionLayer", "LinearAttentionLayer",
                                                        "LinearAttentionAndFullAttentionLayer",
                                                        "LinearAttentionAndFullAttentionLayer"]
