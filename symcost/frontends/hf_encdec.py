"""Inference steps of ``hf:`` encoder-decoders (T5, BART: ``seq2seq``; Whisper: ``speech-seq2seq``)
as ``transformers``' ``generate`` runs them: the encoder once per request, then decoder steps that
read the cross-attention keys and values from the cache (computed once, by the first decoder
step) and their own self-attention KV cache.

``generate`` (transformers/generation/utils.py) runs the encoder in
``_prepare_text_encoder_decoder_kwargs_for_generation`` and keeps ``encoder_outputs`` for every
step; its cache is an ``EncoderDecoderCache(self-attention cache, cross-attention cache)``, both
``DynamicCache(config=...)`` (or ``StaticCache``, the cross one of ``max_cache_len`` = the
encoder's output length). The first decoder step computes each layer's cross-attention K/V from
the encoder's output and stores them (``EncoderDecoderCache.is_updated``); later steps read them
back. So symcost's two steps (:attr:`symcost.frontends.spec.ModelSpec.infer`, :func:`infer`):

- ``prefill``: the encoder over ``S_enc`` source positions and the first decoder step over
  ``S`` decoder tokens (the decoder's start token(s): 1 for T5 and BART, Whisper's forced prompt
  a few), through an empty cache: ``model(encoder input, decoder_input_ids [B, S], cache)``, whose
  forward runs the encoder and then the decoder, the ops ``generate``'s two calls run;
- ``decode``: one decoder step of ``S`` new tokens (1) onto a self-attention cache holding ``T``
  tokens and the full cross-attention cache: ``model(encoder_outputs, decoder_input_ids [B, S],
  cache)``; the cache is filled first by one forward (encoder + ``T`` decoder tokens, not the
  step). The encoder's output is an input of the step (``generate`` holds it in memory).

The KV cache's bytes per decoder layer are those of both caches' tensors: self-attention
2·B·(T + S)·H·D and cross-attention 2·B·S_enc·H·D elements (traced, never typed). No attention
mask is passed (as :func:`symcost.frontends.hf.infer`: a batch without padding).
"""
from __future__ import annotations

import copy
import inspect
import operator
from typing import Mapping

import torch

from symcost.errors import SymcostError

#: The tasks whose models have an encoder-decoder cache (:mod:`symcost.frontends.hf_tasks`).
TASKS = ("seq2seq", "speech-seq2seq")


def decoder_layers(model) -> int:
    """The number of decoder blocks of a ``transformers`` encoder-decoder (``decoder.layers``, or
    T5's ``decoder.block``).

    Raises:
        SymcostError: a decoder with neither list."""
    dec = model.get_decoder()
    blocks = getattr(dec, "layers", None)
    if blocks is None:
        blocks = getattr(dec, "block", None)
    if blocks is None:
        raise SymcostError(f"{type(model).__name__}'s decoder has no layers nor block list; symcost's "
                           "encoder-decoder inference knows T5, BART and Whisper")
    return len(blocks)


def cache_config(model):
    """The decoder's config for its cache classes, with ``num_hidden_layers`` the decoder's blocks.

    ``DynamicCache(config=model.config)`` makes one layer per ``num_hidden_layers``, which T5,
    BART and Whisper map to the *encoder's* layers; a model with more decoder than encoder layers
    then fails its decoder step (IndexError in ``Cache.update``), fewer leaves empty layers.
    Whisper's own forward builds its cache from such a copy (modeling_whisper.py, "Build a config
    that DynamicCache can use"); T5's decoder stack carries ``num_layers = num_decoder_layers``."""
    cfg = copy.deepcopy(model.config.get_text_config(decoder=True))
    cfg.num_hidden_layers = decoder_layers(model)
    return cfg


def make_cache(model, kv_cache: str, self_len: int, cross_len: int):
    """The ``EncoderDecoderCache`` ``generate`` builds (transformers/generation/utils.py,
    ``_prepare_cache_for_generation``): two ``DynamicCache``s, or for ``static`` a ``StaticCache``
    of ``self_len`` tokens for self-attention and one of ``cross_len`` (the encoder's output
    length) for cross-attention.

    Raises:
        SymcostError: an unknown cache class."""
    from transformers import DynamicCache, EncoderDecoderCache, StaticCache

    cfg = cache_config(model)
    if kv_cache == "static":
        return EncoderDecoderCache(StaticCache(config=cfg, max_cache_len=self_len),
                                   StaticCache(config=cfg, max_cache_len=cross_len))
    if kv_cache == "dynamic":
        return EncoderDecoderCache(DynamicCache(config=cfg), DynamicCache(config=cfg))
    raise SymcostError(f"unknown KV cache {kv_cache!r}; accepted: dynamic, static")


def encoder_inputs(task: str, values: Mapping[str, int], device, dtype=torch.float32) -> dict:
    """The encoder's input of one request batch: ``input_ids [B, S_enc]`` int64 in ``[0, V)``
    (``seq2seq``), ``input_features [B, N_mel, 2·S_enc]`` in ``dtype``, the weights' (``speech-seq2seq``:
    Whisper's conv stem halves the frames to S_enc positions; a bf16 model is fed bf16 features, as
    transformers' Whisper examples cast them)."""
    i = lambda k: operator.index(values[k])  # noqa: E731
    if task == "speech-seq2seq":
        return {"input_features": torch.randn(i("B"), i("N_mel"), 2 * i("S_enc"), device=device, dtype=dtype)}
    return {"input_ids": torch.randint(0, i("V"), (i("B"), i("S_enc")), dtype=torch.long, device=device)}


def max_target(model) -> int | None:
    """The most decoder positions the model can hold: a learned position table's rows
    (Whisper's ``max_target_positions``, BART's ``max_position_embeddings``); None for relative
    positions (T5)."""
    cfg = model.config
    for key in ("max_target_positions", "max_position_embeddings"):
        v = getattr(cfg, key, None)
        if isinstance(v, int) and not isinstance(v, bool) and getattr(cfg, "model_type", "") != "t5":
            return v
    return None


def infer_for(task: str):
    """The :attr:`~symcost.frontends.spec.ModelSpec.infer` of an ``hf:`` encoder-decoder of
    ``task`` (:data:`TASKS`): :func:`infer` with the task bound."""
    if task not in TASKS:
        raise SymcostError(f"no encoder-decoder inference for task {task!r}; accepted: {', '.join(TASKS)}")

    def bound(model, values, device, step, kv_cache="dynamic"):
        return infer(task, model, values, device, step, kv_cache)

    return bound


def infer(task: str, model, values: Mapping[str, int], device, step: str, kv_cache: str = "dynamic"):
    """One inference step of an encoder-decoder through its ``EncoderDecoderCache`` (module
    docstring): ``prefill`` = the encoder over ``values["S_enc"]`` positions + the first decoder
    step of ``values["S"]`` tokens into an empty cache; ``decode`` = one decoder step of
    ``values["S"]`` tokens onto ``values["T"]`` cached ones and the cross-attention cache, with
    ``encoder_outputs`` the filling forward's. Like ``generate``, only the last position's
    logits where the forward takes ``logits_to_keep`` (BART; T5 and Whisper compute all S).

    Returns:
        ``((), kwargs, kv_layers)``: the step's call, and ``kv_layers()`` -> per decoder layer the
        tensors both caches hold (self-attention's, then cross-attention's).

    Raises:
        SymcostError: an unknown cache class; T + S past a learned position table (Whisper's
            ``max_target_positions``, BART's ``max_position_embeddings``), which PyTorch's
            embedding would refuse.
    """
    from transformers.modeling_outputs import BaseModelOutput

    B, S = operator.index(values["B"]), operator.index(values["S"])
    T = operator.index(values.get("T", 0)) if step == "decode" else 0
    top = max_target(model)
    if top is not None and T + S > top:
        raise SymcostError(f"{type(model).__name__}: T + S = {T + S} decoder positions (serve: --context) past its learned position "
                           f"table ({top}); raise it with --config (max_target_positions / max_position_embeddings)")
    V = operator.index(values["V"]) if "V" in values else model.config.vocab_size
    cache = make_cache(model, kv_cache, T + S, operator.index(values["S_enc"]))
    params = inspect.signature(model.forward).parameters
    key = "cache" if "cache" in params else "past_key_values"  # renamed in transformers 5.x
    extra = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
    enc = encoder_inputs(task, values, device, next(model.parameters()).dtype)
    if T:
        ids = torch.randint(0, V, (B, T), dtype=torch.long, device=device)
        out = model(**enc, decoder_input_ids=ids, use_cache=True, **{key: cache}, **extra)
        enc = {"encoder_outputs": BaseModelOutput(last_hidden_state=out.encoder_last_hidden_state)}
        del out
    ids = torch.randint(0, V, (B, S), dtype=torch.long, device=device)

    def kv_layers():
        def tensors(c):
            return [[t for t in vars(layer).values() if isinstance(t, torch.Tensor)] for layer in getattr(c, "layers", [])]

        own, cross = tensors(cache.self_attention_cache), tensors(cache.cross_attention_cache)
        return [a + b for a, b in zip(own, cross)]

    return (), {**enc, "decoder_input_ids": ids, key: cache, "use_cache": True, **extra}, kv_layers
