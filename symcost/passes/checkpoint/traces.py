"""Checkpointed steps traced by symcost itself: a spec with every k blocks in one checkpointed
segment (:func:`uniform_spec`), the every-layer trace of an analysis (:func:`every_layer`) and
the recompute it shows (:func:`recompute_last`), memoised per analysis."""

from __future__ import annotations

import dataclasses
from typing import Mapping

import sympy

from symcost._memo import BoundedMemo, object_entries, per_object
from symcost.frontends.checkpointing import traced_checkpoint
from symcost.frontends.checkpointing import without_cache as _without_cache
from symcost.tracing.fit import SYMS


def _cached(an, what: str, make):
    """``make()`` memoised per analysis (kept in it): block costs, law, every-layer trace, recompute."""
    return per_object(an, ("checkpoint", what), make)


def uniform_spec(spec, container: str, k: int):
    """A :class:`~symcost.frontends.spec.ModelSpec` of ``spec`` with every k consecutive blocks grouped into
    one checkpointed segment (non-reentrant), its ``L`` counting segments: traced by symcost it
    folds over the segments, so the memory pass gives the step's peak for any number of segments
    as a formula (L blocks = k·L' when k divides L)."""
    from torch import nn

    class Segment(nn.Module):
        def __init__(self, blocks):
            super().__init__()
            self.blocks = nn.ModuleList(blocks)

        def _run(self, *args, **kwargs):
            out = None
            for b in self.blocks:
                out = b(*args, **kwargs)
                args = (out if not isinstance(out, (tuple, list)) else out[0],) + tuple(args[1:])
            return out

        def forward(self, *args, **kwargs):
            return traced_checkpoint(self._run, *args, use_reentrant=False, **_without_cache(kwargs))

    def build(values):
        model = spec.build(dict(values, L=values["L"] * k))
        held = model.get_submodule(container) if container else model
        blocks = list(held.children())
        segs = nn.ModuleList(Segment(blocks[i:i + k]) for i in range(0, len(blocks), k))
        if isinstance(held, nn.ModuleDict):  # (torchtitan's blocks: keyed "0".."L-1", run by .values())
            segs = nn.ModuleDict({str(i): seg for i, seg in enumerate(segs)})
        parent, _, attr = container.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, segs)
        return model

    check = spec.check if k == 1 or not spec.check else (lambda v: spec.check(dict(v, L=v.get("L", 1) * k)))
    return dataclasses.replace(
        spec, name=f"{spec.name} [checkpoint every {k}]", build=build,
        defaults=dict(spec.defaults), layers=container, check=check)


def recompute_last(an, sub=None) -> tuple[sympy.Expr | None, sympy.Expr | None]:
    """Recompute FLOPs of a block checkpointed on its own (generic, special end block), from the
    step traced with every block checkpointed (:func:`every_layer`): its train FLOPs less the
    plain step's, per block. Less than the block's forward where ops after its last saved tensor
    are skipped by the checkpoint's early stop. ``sub``: the every-layer trace to use (default:
    :func:`every_layer`'s first)."""
    L = SYMS["L"]
    sub = sub if sub is not None else every_layer(an)
    diff = sympy.expand(sub.flops("train") - an.flops("train"))
    g = diff.coeff(L, 1)
    if g.has(L):
        return None, None
    return sympy.expand(g), sympy.expand(diff.subs(L, 1))


def use_every_layer(an, sub) -> None:
    """Use ``sub`` as ``an``'s every-layer trace (:func:`every_layer`) in ``sub``'s regime, e.g. one
    read from the trace cache (``symcost checkpoint`` keeps it there), so that ``an`` itself may be
    a cached analysis that cannot build the model."""
    _every_layer_traces(an).append(sub)


def use_model(an, resolve) -> None:
    """Give ``an``, read from the trace cache (data only: it cannot build its model), a way to
    build it: ``resolve()`` -> the model's live :class:`~symcost.frontends.models.ModelSpec`, used
    where a checkpointed step must be traced in a regime no given trace holds (a solver asking
    for B = 1, say)."""
    object_entries(an)[("checkpoint", "resolve_model")] = resolve


def _every_layer_traces(an) -> list:
    return _cached(an, "every_layer", list)


def _holds(sub, sizes: Mapping[str, int]) -> bool:
    """Whether the every-layer trace ``sub`` holds at ``sizes``: the same regime facts (symbols set
    to 1, equal config symbols: shared/conventions.md, "Regimes") and its pinned sizes equal."""
    from symcost.frontends.spec import request_facts

    values = {s: int(v) for s, v in sizes.items()}
    if any(s in values and values[s] != v for s, v in sub.pinned.items() if s != "L"):
        return False
    facts, spec = getattr(sub, "request_facts", None), getattr(sub, "spec", None)
    if not facts or spec is None or not sub.recordings:  # from the trace cache: given for this request
        return True
    req = {s: v for s, v in values.items() if s in spec.all_symbols}
    return request_facts(spec.values(req, inputs=False), spec.all_symbols) == facts


def every_layer(an, sizes: Mapping[str, int] | None = None):
    """The analysis of ``an``'s step with every block checkpointed on its own (:func:`uniform_spec`
    with k = 1, non-reentrant, RNG states included) in the regime of ``sizes`` (symbol -> int; sizes
    of 1 and equal config symbols choose it, as for any trace): one given by
    :func:`use_every_layer` or traced earlier in that regime, or traced now (needs the live model).
    Without ``sizes``, the first one at hand (or one traced in ``an``'s own regime).

    Raises:
        SymcostError: ``an`` was read from the trace cache and no every-layer trace was given.
    """
    subs = _every_layer_traces(an)
    for sub in subs:
        if sizes is None or _holds(sub, sizes):
            return sub
    sub = _uniform_trace(an, 1)  # in an's own regime, where that holds at these sizes
    if sizes is not None and not _holds(sub, sizes):
        sub = _uniform_trace(an, 1, sizes)  # the regime of the sizes (B = 1 there, say)
    subs.append(sub)
    return sub


def _uniform_trace(an, k: int, sizes: Mapping[str, int] | None = None):
    """``an``'s step with every k blocks checkpointed (:func:`uniform_spec`), traced (once: kept
    per analysis, k and request) at ``sizes`` (symbol -> int; L left out for k > 1, there it
    counts segments), by default in ``an``'s own regime: at the sizes ``an`` was requested at
    (``an.request_sizes``), so the two traces tie and pin the same symbols (K = H or not, a pinned
    ALiBi head count) and their difference is the recomputation alone. ``an``'s pinned values are
    kept in any case."""
    from symcost.graph.build import trace

    if sizes is None:
        req = {s: int(v) for s, v in (getattr(an, "request_sizes", None) or {}).items()
               if s != "L" or s in an.pinned}
    else:
        req = {s: int(v) for s, v in sizes.items() if s != "L"}
    req.update({s: int(v) for s, v in an.pinned.items()})
    if k > 1 and "L" in req and "L" not in an.pinned:
        req.pop("L")
    key = (id(an.spec), an.precision, "uniform", k, tuple(sorted(req.items())))
    hit = _TRACES.get(key)
    if hit is None or hit[0] is not an.spec:
        base = an.spec
        given = object_entries(an).get(("checkpoint", "resolve_model"))
        if not an.recordings and given is not None:  # a cached analysis: built again (use_model)
            base = _cached(an, "live_spec", given)
        spec = uniform_spec(base, an.layer_container or "", k)
        req = {s: v for s, v in req.items() if s in spec.all_symbols}
        hit = _TRACES[key] = (an.spec, trace(spec, sizes=req, precision=an.precision))
    return hit[1]


#: traces of checkpointed steps, by (model spec, precision, "uniform", k, request): the 8 last used
_TRACES = BoundedMemo(8)
