"""Memoising a function of the model built at given sizes, one memo per model (torch-free).

Used by the layouts' probe checks (:mod:`symcost.frontends.tensor_parallel`,
:mod:`symcost.frontends.expert_parallel`, :mod:`symcost.frontends.parallel`), which ask the same
question of the same model at many probe sizes; its own module so that those frontends need not
import each other for it.
"""
from __future__ import annotations

import weakref
from typing import Mapping


#: the groups of sizes a probe check's answer may not depend on, each tested once per model by
#: :func:`memo_per_model`: the micro-batch (B, S) and an MoE's experts per token (R, which sizes
#: no parameter in the models seen; the probe searches vary it with E at every candidate:
#: gpt-oss-20b's --tp trace built the model 1,310 times, 774 of them distinct without R)
INPUT_GROUPS = (("B", "S"), ("R",))


def memo_per_model(memo: dict, values: Mapping[str, int], compute):
    """``compute(values)`` (a function of the model built at ``values``) memoised in ``memo``,
    one memo per model. Each group of :data:`INPUT_GROUPS` is left out of the memo's key when
    two builds that differ only in it (each of its sizes one more) give the same answer at the
    first sizes asked (a model sizing a parameter by S, learned positions of S rows say, keeps S
    in; a size whose increment the model refuses, R = E, keeps its group in)."""
    def key(v):
        return tuple(sorted((k, x) for k, x in v.items() if k not in memo["skip"]))

    if "skip" not in memo:
        got = compute(values)
        skip: list = []
        for group in INPUT_GROUPS:
            if any(k in values for k in group) and _same(compute, {k: x + 1 if k in group else x
                                                                   for k, x in values.items()}, got):
                skip += group
        memo["skip"] = tuple(skip)
        memo[key(values)] = got
    if key(values) not in memo:
        memo[key(values)] = compute(values)
    return memo[key(values)]


def _same(compute, values, got) -> bool:
    """Whether ``compute(values)`` gives ``got``; False where the model refuses ``values`` (R + 1
    beyond E: transformers' Mixtral raises)."""
    try:
        return compute(values) == got
    except Exception:  # noqa: BLE001 - any refusal: the group stays in the key
        return False


#: spec.build -> [(sizes, the model built on the meta device at them)], the last two: :func:`meta_model`
_LAST: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def meta_model(spec, values: Mapping[str, int]):
    """``spec.build_meta(values)``, the last two built kept per model and handed out again for
    the same sizes. The layouts' probe checks each build the model at a candidate's sizes (the
    data-parallel first dimensions, the tensor-parallel split, the experts' dims): on a 2-D mesh
    every candidate of a probe search was built twice in a row at the same sizes (llama-3-8b FSDP
    over TP = 8: 7,582 builds, 3,818 since: 72 -> 60 s CPU). Two, for :func:`memo_per_model`'s first
    call, which builds at B + 1, S + 1 too. For readers only: the model is shared, never to be
    changed (parallelised, moved, given values).

    Raises:
        whatever ``spec.build_meta`` raises (nothing is kept then)."""
    key = tuple(sorted(values.items()))
    last = _LAST.get(spec.build) or []
    for k, model in last:
        if k == key:
            return model
    model = spec.build_meta(values)
    _LAST[spec.build] = [(key, model)] + last[:1]
    return model
