"""Inference of encoder-decoders (issue 30 item 6): hf:t5, hf:bart, hf:whisper served as
``generate`` runs them, the encoder once per request, then decoder steps through an
``EncoderDecoderCache`` (cross-attention K/V computed once, self-attention KV cache).

The oracles do not use symcost's step (:mod:`symcost.frontends.hf_encdec`): each model is built at
concrete tiny sizes with real CPU tensors and run the way ``generate`` runs it
(transformers/generation/utils.py): the encoder called alone (``model.get_encoder()``), then the
decoder steps ``model(encoder_outputs=..., decoder_input_ids=..., use_cache=True)`` with the cache
the model builds itself on its first step (or, for the static cache, the two ``StaticCache``s
``generate``'s ``_prepare_static_cache`` builds), ``logits_to_keep=1`` where the forward takes it.

* prefill FLOPs == ``FlopCounterMode`` over the encoder call + the first decoder step;
* decode FLOPs == ``FlopCounterMode`` over one decoder step onto T cached tokens;
* KV bytes == the bytes of the storages both caches' tensors hold after the step.
"""
from __future__ import annotations

import functools
import inspect
import random

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import symcost
from symcost.errors import SymcostError

# model -> tiny config overrides (L = 2 blocks per stack: the real runs stay small)
CONFIGS = {
    "hf:t5": (("num_layers", "2"),),
    "hf:bart": (("encoder_layers", "2"), ("decoder_layers", "2")),
    "hf:whisper": (("encoder_layers", "2"), ("decoder_layers", "2"), ("max_target_positions", "48")),
}


@functools.cache
def traced(model: str, step: str, kv_cache: str = "dynamic", sizes: tuple = ()):
    """The Analysis of an encoder-decoder's inference step (eager attention: FlopCounterMode cannot
    see CPU sdpa's FLOPs), traced once per session."""
    return symcost.trace(model, dict(CONFIGS[model]), "eager", sizes=dict(sizes), precision="fp32", step=step,
                         kv_cache=kv_cache, torch_device="cpu")


def random_sizes(an, rng: random.Random) -> dict[str, int]:
    """Small random sizes of ``an``'s symbols, never a probe of its fit, valid for the model."""
    probes = {tuple(sorted((s, p[s]) for s in an.symbols)) for p in an.plan.points}
    while True:
        v = {"B": rng.randint(1, 3), "S": rng.randint(2, 4), "T": rng.randint(2, 20), "S_enc": rng.randint(3, 17),
             "H": rng.choice((2, 4)), "D": rng.choice((4, 8)), "M": rng.choice((8, 16, 24)),
             "F": rng.randint(8, 40), "V": rng.randint(20, 80), "N_mel": rng.randint(4, 12),
             "L": rng.randint(4, 6)}  # (each stack folded over L: a depth no probe holds)
        v = {s: v[s] for s in an.symbols}
        if tuple(sorted(v.items())) not in probes and not an.spec.check({**an.spec.defaults, **an.pinned, **v}):
            return v


def cache_bytes(cache) -> int:
    """Bytes of the storages of the floating-point tensors both caches' layers hold, each once."""
    seen, total = set(), 0
    for c in (cache.self_attention_cache, cache.cross_attention_cache):
        for layer in c.layers:
            for t in vars(layer).values():
                if isinstance(t, torch.Tensor) and t.is_floating_point() and t.untyped_storage().data_ptr() not in seen:
                    seen.add(t.untyped_storage().data_ptr())
                    total += t.untyped_storage().nbytes()
    return total


def cache_bytes_of(an, values) -> int:
    """Bytes of the real cross-attention cache of the first decoder step at ``values``."""
    from transformers.modeling_outputs import BaseModelOutput

    model = an.spec.build(values).float().eval()
    with torch.no_grad():
        enc = BaseModelOutput(last_hidden_state=model.get_encoder()(
            input_ids=torch.randint(0, 9, (values["B"], values["S_enc"]))).last_hidden_state)
        out = model(encoder_outputs=enc, decoder_input_ids=torch.zeros(values["B"], 1, dtype=torch.long),
                    use_cache=True)
    return sum(t.untyped_storage().nbytes() for layer in out.cache.cross_attention_cache.layers
               for t in (layer.keys, layer.values))


def generate_steps(an, values, kv_cache: str = "dynamic"):
    """The real model at ``values`` run as ``generate`` runs it: ``(prefill FLOPs, decode FLOPs, KV
    bytes after the measured step)``: prefill = the encoder + the first decoder step of S tokens;
    decode (T in ``values``) = one step of S tokens after T tokens were decoded."""
    from transformers import EncoderDecoderCache, StaticCache
    from transformers.modeling_outputs import BaseModelOutput

    torch.manual_seed(0)
    model = an.spec.build(values).float().eval()
    B, S, Se, T = values["B"], values["S"], values["S_enc"], values.get("T", 0)
    V = model.config.vocab_size
    if "N_mel" in values:
        enc_in = {"input_features": torch.randn(B, values["N_mel"], 2 * Se)}
    else:
        enc_in = {"input_ids": torch.randint(0, V, (B, Se))}
    params = inspect.signature(model.forward).parameters
    key = "cache" if "cache" in params else "past_key_values"
    extra = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
    cache = None
    if kv_cache == "static":  # generate's _prepare_static_cache: self of max length, cross of the encoder's
        import copy

        cfg = copy.deepcopy(model.config.get_text_config(decoder=True))
        cfg.num_hidden_layers = len(model.get_decoder().layers)
        cache = EncoderDecoderCache(StaticCache(config=cfg, max_cache_len=T + S),
                                    StaticCache(config=cfg, max_cache_len=Se))
    with torch.no_grad():
        with FlopCounterMode(display=False) as fc:
            enc = BaseModelOutput(last_hidden_state=model.get_encoder()(**enc_in).last_hidden_state)
            first = T or S
            out = model(encoder_outputs=enc, decoder_input_ids=torch.randint(0, V, (B, first)), use_cache=True,
                        **{key: cache}, **extra)
        prefill = fc.get_total_flops()
        cache = getattr(out, key)
        assert isinstance(cache, EncoderDecoderCache)
        if not T:
            return prefill, None, cache_bytes(cache)
        with FlopCounterMode(display=False) as fc:
            model(encoder_outputs=enc, decoder_input_ids=torch.randint(0, V, (B, S)), use_cache=True,
                  **{key: cache}, **extra)
        return prefill, fc.get_total_flops(), cache_bytes(cache)


def check(model: str, step: str, seed: str, kv_cache: str = "dynamic", sizes: tuple = ()):
    an = traced(model, step, kv_cache, sizes)
    assert an.step == step and ("T" in an.symbols) == (step == "decode") and "S_enc" in an.symbols
    v = random_sizes(an, random.Random(seed))
    full = {**an.spec.defaults, **an.pinned, **v}
    pre, dec, kv = generate_steps(an, full, kv_cache)
    got = an.subs(**v)["flops.forward"]
    got_kv = int(an.kv_bytes.xreplace(an.bind(**v)))
    assert (got, got_kv) == ((dec if step == "decode" else pre), kv), (model, step, v)
    # each stack folded over L (no pin): the parameters at a depth no probe held == a meta count
    assert "L" in an.symbols and set(an.stacks.values()) == {"L"}, (an.pinned, an.stacks)
    with torch.device("meta"):
        meta = sum(p.numel() for p in an.spec.build(full).parameters())
    assert int(an.params.xreplace(an.bind(**v))) == meta, (model, step, v)
    return an, v


@pytest.mark.heavy
def test_t5_prefill_and_decode_equal_generate():
    """hf:t5 (relative position bias, D = d_kv apart from M): prefill (encoder + the decoder's start
    token) and one decode step onto T tokens equal FlopCounterMode over generate's calls; the cache
    holds 2·B·(T + 1)·H·D self- and 2·B·S_enc·H·D cross-attention elements per decoder layer; serve's
    prefill (B = 1, the start token), cross-attention bytes and serving peak equal the real run's."""
    pre, _ = check("hf:t5", "prefill", "t5:prefill", sizes=(("S", 1),))
    an, v = check("hf:t5", "decode", "t5:decode")
    B, T, S_enc, H, D, L = (symcost.SYMS[s] for s in ("B", "T", "S_enc", "H", "D", "L"))
    # (two stacks, each folded over L: the cache's layers are the decoder's blocks)
    assert an.stacks == {"encoder.block": "L", "decoder.block": "L"} and "L" not in an.pinned, an.pinned
    assert (an.kv_bytes - 4 * 2 * B * H * D * L * (T + 1 + S_enc)).expand() == 0
    # serve's request: its prefill is the encoder + the first step of the start token (B = 1), its
    # cross-attention bytes those of the real cross cache of one sequence
    from symcost.hardware.devices import get_device
    from symcost.passes import inference

    sizes = {k: x for k, x in v.items() if k not in ("B", "T")}
    r = inference.serve(an, pre, get_device("h100"), "1GiB", 9, sizes)
    full = {**an.spec.defaults, **an.pinned, **sizes, "B": 1, "S": 1}
    flops, _, _ = generate_steps(pre, {**full, "T": 0})
    _, _, kv = generate_steps(an, {**full, "T": 8})
    cross = cache_bytes_of(an, full)
    assert r["encoder"] == {"S_enc": v["S_enc"], "prompt": 1} and r["prefill"]["flops"] == flops
    assert (r["kv"]["per_sequence"], r["kv"]["cross_per_sequence"]) == (kv, cross)
    # serving memory: the decode step's peak (weights, the encoder's output, both caches, the step's
    # transients) within 0.2% of torch.profiler's on the real step, at op boundaries (equal today:
    # 17,272 B at the drawn sizes, the encoder's output 448 B of it)
    # the aggregate bound's weights: those the real decode step's aten ops read (not the encoder's)
    full = {**an.spec.defaults, **an.pinned, **v}
    assert int(inference.weight_bytes(an).xreplace(an.bind(**v))) == decode_weight_bytes(an, full), v
    full = {**an.spec.defaults, **an.pinned, **v, "B": max(v["B"], 2)}
    m = decode_peak(an, full)
    pred = inference.serving_memory(an).peak(**{**v, "B": full["B"]})
    assert abs(pred - m) <= 0.002 * m, (full, pred, m)


def decode_weight_bytes(an, values) -> int:
    """Bytes of the parameters the real decode step onto T tokens reads (the model run as
    ``generate`` runs it): each parameter, by storage (tied ones once), whose tensor is an input of
    an aten op of the step under ``TorchDispatchMode``, but for one read only as
    ``aten.embedding``'s table (a lookup reads its B·S rows, which the step's ops count)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves
    from transformers.modeling_outputs import BaseModelOutput

    torch.manual_seed(0)
    model = an.spec.build(values).float().eval()
    B, Se, T, V = values["B"], values["S_enc"], values["T"], model.config.vocab_size
    params = {p.untyped_storage().data_ptr(): p for p in model.parameters()}
    read, looked_up = set(), set()

    class Reads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            for k, t in enumerate(tree_leaves((args, kwargs or {}))):
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in params:
                    lookup = func.overloadpacket is torch.ops.aten.embedding and k == 0
                    (looked_up if lookup else read).add(t.untyped_storage().data_ptr())
            return func(*args, **(kwargs or {}))

    with torch.no_grad():
        enc = BaseModelOutput(last_hidden_state=model.get_encoder()(
            input_ids=torch.randint(0, V, (B, Se))).last_hidden_state)
        key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        out = model(encoder_outputs=enc, decoder_input_ids=torch.randint(0, V, (B, T)), use_cache=True)
        with Reads():
            model(encoder_outputs=enc, decoder_input_ids=torch.randint(0, V, (B, 1)), use_cache=True,
                  **{key: getattr(out, key)})
    return sum(params[d].numel() * params[d].element_size() for d in read)


def decode_peak(an, values) -> int:
    """Peak bytes of one real decode step (DynamicCache, fp32) from torch.profiler's allocator events
    (tests/memory_oracle.py, as tests/test_serve.py measures decoder-only steps): baseline =
    parameters, buffers, the encoder's output, both caches' tensors before the step and the step's
    token ids; the step's concatenations allocate the new self-attention tensors and free the old."""
    from memory_oracle import _levels, _storages, profiled
    from transformers.modeling_outputs import BaseModelOutput

    torch.manual_seed(0)
    model = an.spec.build(values).float().eval()
    B, T, V = values["B"], values["T"], model.config.vocab_size
    with torch.no_grad(), profiled():
        h = model.get_encoder()(input_ids=torch.randint(0, V, (B, values["S_enc"]))).last_hidden_state
        enc = BaseModelOutput(last_hidden_state=h)
        cache = model(encoder_outputs=enc, decoder_input_ids=torch.randint(0, V, (B, T)), use_cache=True).cache
    ids = torch.randint(0, V, (B, 1))
    kv = [t for c in (cache.self_attention_cache, cache.cross_attention_cache) for layer in c.layers
          for t in (layer.keys, layer.values)]
    baseline = sum(_storages(list(model.parameters()) + list(model.buffers()) + kv + [ids, h]).values())
    del kv
    with torch.no_grad(), profiled() as prof:
        out = model(encoder_outputs=enc, decoder_input_ids=ids, cache=cache, use_cache=True)
        del out
    return baseline + _levels(prof)[1]


@pytest.mark.heavy
def test_bart_static_cache_decode_equals_generate():
    """hf:bart with generate's static cache (self-attention StaticCache of T + S tokens, cross of
    S_enc), logits_to_keep=1: the decode step equals FlopCounterMode, the cache's bytes the real ones."""
    check("hf:bart", "decode", "bart:static", "static")


@pytest.mark.heavy
def test_whisper_prefill_and_decode_equal_generate():
    """hf:whisper (the conv stem over 2·S_enc mel frames runs in the prefill only): prefill with a
    decoder prompt of S tokens and one decode step equal FlopCounterMode over generate's calls."""
    check("hf:whisper", "prefill", "whisper:prefill")
    check("hf:whisper", "decode", "whisper:decode")


def test_decoder_positions_past_the_table_one_line():
    """T + S past Whisper's learned decoder positions is refused in one line naming the table."""
    from symcost.frontends import hf_encdec

    spec = symcost.resolve("hf:whisper", config=dict(CONFIGS["hf:whisper"]))
    v = {**spec.defaults, "H": 2, "D": 4, "F": 8, "V": 20, "S_enc": 3, "N_mel": 4, "B": 1, "S": 1, "T": 48}
    with torch.device("meta"):
        model = spec.build(v)
    with pytest.raises(SymcostError, match=r"T \+ S = 49 decoder positions \(serve: --context\) past its learned position table \(48\)"):
        hf_encdec.infer("speech-seq2seq", model.eval(), v, "meta", "decode")


def test_cache_layers_follow_the_decoder():
    """A T5 with more decoder than encoder blocks (num_decoder_layers = 3, num_layers = 1): the cache
    symcost builds has the decoder's layers and holds, after a decode step, the bytes of the cache
    the model builds itself (T5's decoder stack from its own config) on the same calls."""
    from transformers.modeling_outputs import BaseModelOutput

    from symcost.frontends import hf_encdec

    spec = symcost.resolve("hf:t5", config={"num_layers": "1", "num_decoder_layers": "3"})
    v = {**spec.defaults, "H": 2, "D": 4, "M": 8, "F": 8, "V": 20, "S_enc": 5, "B": 2, "S": 1, "T": 3}
    torch.manual_seed(0)
    model = spec.build(v).eval()
    with torch.no_grad():
        _, kwargs, kv_layers = hf_encdec.infer("seq2seq", model, v, "cpu", "decode")
        model(**kwargs)
        ours = kwargs["cache"]
        enc = BaseModelOutput(last_hidden_state=model.get_encoder()(input_ids=torch.randint(0, 20, (2, 5)))[0])
        out = model(encoder_outputs=enc, decoder_input_ids=torch.randint(0, 20, (2, 3)), use_cache=True)
        model(encoder_outputs=enc, decoder_input_ids=torch.randint(0, 20, (2, 1)), cache=out.cache, use_cache=True)
    assert len(kv_layers()) == len(ours.self_attention_cache.layers) == len(out.cache.self_attention_cache.layers) == 3
    assert cache_bytes(ours) == cache_bytes(out.cache) == 4 * 3 * 2 * 2 * 2 * 4 * (3 + 1 + 5)


@pytest.mark.heavy
def test_mamba_decode_recurrent_state_equals_real_step():
    """hf:mamba's decode step through generate's cache (DynamicCache of LinearAttentionLayers: per
    layer a conv state [B, EXPAND·M, K_conv] and an SSM state [B, EXPAND·M, N_state], written in
    place): FLOPs == FlopCounterMode over the real step after T tokens, the cache's bytes == the real
    states' storages, at random tiny sizes; neither grows with T."""
    from transformers import DynamicCache

    config = {"hidden_size": "16", "num_hidden_layers": "2", "vocab_size": "40", "state_size": "4",
              "time_step_rank": "2"}
    an = symcost.trace("hf:mamba", config, sizes={"B": 2, "T": 5}, precision="fp32", step="decode", torch_device="cpu")
    assert an.pinned == {"S": 1} and "T" in an.symbols
    T_ = symcost.SYMS["T"]
    assert not an.flops("forward", "model").has(T_) and not an.kv_bytes.has(T_) and an.kv_bytes != 0
    rng = random.Random("mamba:decode")
    v = {"B": rng.randint(1, 3), "T": rng.randint(2, 9), "M": rng.choice((8, 16)), "N_state": rng.randint(2, 6),
         "K_conv": rng.randint(2, 4), "EXPAND": rng.randint(1, 2), "R_dt": rng.randint(1, 3), "V": rng.randint(20, 50)}
    full = {**an.spec.defaults, **an.pinned, **v}
    torch.manual_seed(0)
    model = an.spec.build(full).float().eval().requires_grad_(False)  # (FlopCounterMode's module hooks)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.randint(0, v["V"], (v["B"], v["T"])), cache=cache, use_cache=True)
        with FlopCounterMode(display=False) as fc:
            model(input_ids=torch.randint(0, v["V"], (v["B"], 1)), cache=cache, use_cache=True, logits_to_keep=1)
    states = [t for layer in cache.layers for d in (layer.conv_states, layer.recurrent_states) for t in d.values()]
    assert len(states) == 2 * full["L"]
    real = sum(t.untyped_storage().nbytes() for t in states)
    assert (an.subs(**v)["flops.forward"], int(an.kv_bytes.xreplace(an.bind(**v)))) == (fc.get_total_flops(), real), v
