"""The inference step of an ``hf:`` model through transformers' own KV cache (``ModelSpec.infer``
of the specs :mod:`symcost.frontends.hf` and :mod:`symcost.frontends.hf_tasks` build): moved out
of ``hf.py`` (past ~800 lines), re-exported there as ``hf.infer``.

Torch is imported at module level; transformers inside the function.
"""
from __future__ import annotations

import operator
from typing import Mapping

import torch

from symcost.errors import SymcostError


def infer(model, values: Mapping[str, int], device, step: str, kv_cache: str = "dynamic"):
    """One inference step of a ``transformers`` causal LM through its own KV cache
    (:attr:`symcost.frontends.spec.ModelSpec.infer`).

    The cache is the model's own class built from its config, as ``generate`` builds it:
    ``DynamicCache(config=...)`` (per-layer ``DynamicLayer`` or, for sliding-window layers,
    ``DynamicSlidingWindowLayer``: transformers/cache_utils.py) or ``StaticCache(config=...,
    max_cache_len=T + S)``. For a ``decode`` step the cache is first filled with ``values["T"]``
    tokens per sequence by one forward (the caller does not record it). The step is
    ``model(input_ids [B, S], cache, use_cache=True, logits_to_keep=1)``: like ``generate``, only
    the last position's logits are computed (transformers/generation/utils.py sets
    ``logits_to_keep = 1`` where the model's forward takes it).

    Returns:
        ``((), kwargs, kv_layers)``: the step's call, and ``kv_layers()`` -> one list of tensors
        per cache layer (every tensor attribute of ``cache.layers[i]``, inside lists and dicts too:
        a state-space layer's conv and recurrent states, Mamba's ``LinearAttentionLayer``).

    Raises:
        SymcostError: an unknown cache class.
    """
    import inspect

    from transformers import DynamicCache, StaticCache

    B, S, V = (operator.index(values[k]) for k in ("B", "S", "V"))
    T = operator.index(values.get("T", 0)) if step == "decode" else 0
    if kv_cache == "static":
        cache = StaticCache(config=model.config, max_cache_len=T + S)
    elif kv_cache == "dynamic":
        cache = DynamicCache(config=model.config)
    else:
        raise SymcostError(f"unknown KV cache {kv_cache!r}; accepted: dynamic, static")
    params = inspect.signature(model.forward).parameters
    key = "cache" if "cache" in params else "past_key_values"  # renamed in transformers 5.x
    extra = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
    if T:
        ids = torch.randint(0, V, (B, T), dtype=torch.long, device=device)
        model(input_ids=ids, use_cache=True, **{key: cache}, **extra)
    ids = torch.randint(0, V, (B, S), dtype=torch.long, device=device)

    def kv_layers():
        # (a state-space layer, transformers' LinearAttentionLayer, keeps its conv and recurrent
        # states in dicts by state index: their tensors are found inside the containers)
        from torch.utils._pytree import tree_leaves

        return [[t for t in tree_leaves(list(vars(layer).values())) if isinstance(t, torch.Tensor)]
                for layer in getattr(cache, "layers", [])]

    return (), {"input_ids": ids, key: cache, "use_cache": True, **extra}, kv_layers
