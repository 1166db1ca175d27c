"""The stage traces of a pipeline over a model with several stacks of blocks (an encoder-decoder:
:mod:`symcost.frontends.pipeline_stacks`; docs/parallel.md, "Several stacks under --pp").

The stacks' blocks are cut as one list (encoder blocks, then decoder blocks) into ``PP`` stages by
the split rule of one block list, and every stage is traced on its own (its blocks per stack are a
range of the concatenated list that moves with each stack's length, so the stacks' lengths are
pinned at the request, with that reason; every other symbol stays free). What crosses a boundary,
the cut stack's hidden state and every ended stack's output (the encoder's output, carried through
the decoder's stages), is recorded as the stage's ``c10d.recv_``/``c10d.send`` ops, forward and
their gradients backward, as for one block list. :func:`symcost.passes.pipeline.summary` composes
the stages' traces per rank as it does for one block list.
"""
from __future__ import annotations

from typing import Mapping

from symcost._memo import BoundedMemo
from symcost.errors import SymcostError

#: stage traces by (model, defaults, stage, precision, request, cache key)
_TRACES = BoundedMemo(16)  # (the 16 last used)


class StackStages(dict):
    """``{"stage<s>": Analysis}`` with ``plan``: the :class:`~symcost.frontends.pipeline_stacks.StackStage` list."""

    plan: list


def trace_stack_stages(spec, pp: int, virtual: int = 1, precision: str = "fp32", sizes: Mapping[str, int] | None = None,
                       cache: tuple | None = None, inner=None, split=None):
    """``(spec, StackStages)``: each of the ``pp`` stages of ``spec``'s stacks cut as one list,
    traced for one micro-batch (:func:`symcost.frontends.pipeline_stacks.stage_spec`) at the
    request's sizes (``sizes``; the stacks' lengths pinned there, the other symbols fitted).
    ``cache``: as :func:`symcost.passes.pipeline.trace_stages` (option ``pp_stacks_stage``).

    Raises:
        SymcostError: what :func:`~symcost.frontends.pipeline_stacks.refusal` says is not staged
            (keyword inputs, another mesh dimension, interleaved stages), fewer blocks than stages,
            a split that does not fit."""
    import symcost
    from symcost.frontends import pipeline_stacks as ps

    from symcost.tracing.stacks import pipeline_stacks, stack_length_symbols

    values = spec.values(dict(sizes or {}))
    containers = pipeline_stacks(spec, values)
    why = ps.refusal(spec, values, containers, inner, virtual)
    if why:
        raise SymcostError(why)
    syms = stack_length_symbols(spec, containers, values)
    pr = ps.probe(spec, values, containers, precision)
    plan = ps.plan(pr.lengths, pr.order, pp * virtual, split)
    req = tuple(sorted((k, int(v)) for k, v in (sizes or {}).items() if k in spec.all_symbols))
    req_full = {**dict(req), **{s: int(values[s]) for s in syms}}
    out = StackStages()
    out.plan = plan
    probes: dict = {}
    for st in plan:
        key = (spec.name, tuple(sorted(spec.defaults.items())), st, precision, tuple(sorted(req_full.items())),
               (cache[0], tuple(sorted((cache[1] or {}).items())), cache[2]) if cache else None)
        if key not in _TRACES:
            def fresh(st=st):
                stage = ps.stage_spec(spec, st, len(plan), values, containers, syms, precision=precision, probes=probes)
                return symcost.trace(stage, sizes=req_full, precision=precision)

            if cache is not None:
                from symcost.graph.cache import cached_trace

                name, config, attention = cache
                held = ";".join(f"{c}:{a}:{b}" for c, (a, b) in st.held)
                _TRACES[key] = cached_trace(name, config, attention, precision, req_full, fresh,
                                            options={"pp_stacks_stage": f"{st.index}/{len(plan)}|{held}"})
            else:
                _TRACES[key] = fresh()
        out[f"stage{st.index}"] = _TRACES[key]
    return spec, out
