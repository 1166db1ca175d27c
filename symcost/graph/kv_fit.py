"""The KV cache of a traced inference step fitted per cache layer (:func:`_fit_kv`), each layer's
storages one by one where their sum is no sparse polynomial (:func:`_fit_kv_layer`: a hybrid layer's
keys and values beside Mamba states), folded over L as the blocks are. Used by
:func:`symcost.graph.build.trace`; docs/inference.md, "KV-cache bytes".
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Mapping

import sympy

from symcost.errors import SymcostError
from symcost.frontends.spec import ModelSpec
from symcost.tracing.fit import FitError, Unvariable
from symcost.tracing.stacks import kv_stack

if TYPE_CHECKING:  # pragma: no cover
    from symcost.tracing.record import Recording


def _fit_kv(spec: ModelSpec, recs: list[Recording], fitter, role, container: str | None,
            pinned: Mapping[str, int], whole: Recording | None = None,
            stacks: Mapping[str, str] | None = None) -> list[tuple]:
    """The KV cache's bytes per layer after the step, fitted over the probes and folded over L:
    ``[(folded layer name, bytes formula, repeat)]``.

    Cache layer i belongs to block i of the layer container. The layers fold like the blocks
    (layer 0 stands for all L) when every layer holds the same bytes at every probe; a cache whose
    layers differ (sliding-window and full-attention layers, or a count of layers other than L)
    cannot be folded, so L is pinned (:class:`Unvariable`) and each layer is fitted on its own.
    ``whole``, a recording at the request's own L (taken where a sliding window has dropped
    tokens), counts too: a config whose layer pattern follows L (Gemma 3: every sixth layer full)
    may hold only sliding layers at the probes' small L and full ones at the request's.

    Where several stacks fold (``stacks``: container -> length symbol; ``container`` is then
    None), cache layer i belongs to block i of the stack whose blocks read or write the cache
    (:func:`symcost.tracing.stacks.kv_stack`: an encoder-decoder's decoder, each of its layers holding its
    self-attention keys and values, 2·B·(T + S)·H·D elements, and its cross-attention ones,
    2·B·S_enc·H·D; the encoder holds none), and its layers fold as that stack's blocks do
    (``role``: :func:`symcost.graph.stacks.stack_roles`), under that stack's symbol.

    Raises:
        Unvariable: L (or the cache's stack's symbol) must be pinned (see above; several stacks:
            also where no one stack, or a count of layers other than its length, holds the cache).
        FitError: a layer's bytes are no polynomial in the symbols.
    """
    ref = recs[0]
    n = len(ref.kv_layers)
    if any(len(r.kv_layers) != n for r in recs):
        raise SymcostError(f"{spec.name}: the number of KV-cache layers changes with the sizes")
    sigs = [tuple(r.kv_layers[i] for r in recs) for i in range(n)]
    if stacks:
        return _fit_kv_stacks(spec, recs, fitter, role, stacks, sigs)
    fold = "L" not in pinned and container is not None
    if fold and whole is not None and len(set(whole.kv_layers)) > 1:
        raise Unvariable("L", (
            f"the KV cache of {spec.name} holds layers of different sizes at the requested L = "
            f"{whole.values.get('L')} (sliding-window and full-attention layers), so L is not folded"))
    if fold and (n != ref.values.get("L") or len(set(sigs)) > 1):
        raise Unvariable("L", (
            f"the KV cache of {spec.name} holds {n} layers of different sizes (sliding-window and full-attention "
            "layers), so L is not folded" if n == ref.values.get("L") else
            f"the KV cache of {spec.name} has {n} layers for L = {ref.values.get('L')} blocks, so L is not folded"))
    out = []
    for i, sig in enumerate(sigs):
        module = f"{container}.{i}" if container else f"kv.{i}"
        keep, repeat, name = role(module) if container else (True, sympy.Integer(1), module)
        if keep:
            out.append((name, _fit_kv_layer(recs, i, sig, fitter), repeat))
    return out


def _fit_kv_stacks(spec: ModelSpec, recs: list[Recording], fitter, role, stacks: Mapping[str, str],
                   sigs: list[tuple]) -> list[tuple]:
    """:func:`_fit_kv` where several stacks fold: the cache's layers are the blocks of
    :func:`symcost.tracing.stacks.kv_stack`'s stack, folded as they are; an empty cache (no layer) is ``[]``."""
    from symcost.graph.stacks import _unvariable

    n, ref = len(sigs), recs[0]
    if not n:
        return []
    c = kv_stack(ref, stacks)
    if c is None:
        sym = next(iter(stacks.values()))
        raise _unvariable(sym, f"the KV cache of {spec.name} is read by the blocks of no one of its stacks "
                               f"({', '.join(stacks)}), so {sym} is not folded")
    sym = stacks[c]
    if n != ref.values.get(sym) or len(set(sigs)) > 1:
        raise _unvariable(sym, (
            f"the KV cache of {spec.name} holds {n} layers of different sizes, so {sym} is not folded"
            if n == ref.values.get(sym) else
            f"the KV cache of {spec.name} has {n} layers for {sym} = {ref.values.get(sym)} blocks of {c}, "
            f"so {sym} is not folded"))
    out = []
    for i, sig in enumerate(sigs):
        keep, repeat, name = role(f"{c}.{i}")
        if keep:
            out.append((name, _fit_kv_layer(recs, i, sig, fitter), repeat))
    return out


def _fit_kv_layer(recs: list[Recording], i: int, sig: tuple[int, ...], fitter) -> sympy.Expr:
    """Bytes of cache layer ``i`` (``sig``: at each probe), fitted storage by storage
    (``Recording.kv_parts``) and summed, else as a whole. A hybrid layer (Zamba's
    ``LinearAttentionAndFullAttentionLayer``) holds keys and values that grow with T beside a conv
    and an SSM state that do not: four monomials or more together, which the fit's sparse search
    does not find (or takes minutes to give up on, over a model's dozen sizes), each storage one or
    two. The whole is fitted where the layer holds one storage, or where the probes' layers do not
    hold alike storages or one of them does not fit.

    Raises:
        FitError: neither the storages one by one nor the whole fit (the whole's error).
    """
    what = f"KV-cache size of layer {i}"
    parts = [r.kv_parts[i] if i < len(getattr(r, "kv_parts", [])) else None for r in recs]
    if all(p is not None and len(p) == len(parts[0]) for p in parts) and len(parts[0]) > 1:
        try:
            return sympy.expand(sympy.Add(*[fitter(tuple(p[j] for p in parts), f"{what}, storage {j}")
                                            for j in range(len(parts[0]))]))
        except FitError:
            pass
    return fitter(sig, what)
