"""Memoising a function of the model built at given sizes, one memo per model (torch-free).

Used by the layouts' probe checks (:mod:`symcost.frontends.tensor_parallel`,
:mod:`symcost.frontends.expert_parallel`, :mod:`symcost.frontends.parallel`), which ask the same
question of the same model at many probe sizes; its own module so that those frontends need not
import each other for it.
"""
from __future__ import annotations

from typing import Mapping


def memo_per_model(memo: dict, values: Mapping[str, int], compute):
    """``compute(values)`` (a function of the model built at ``values``) memoised in ``memo``,
    one memo per model. The sizes of the micro-batch (B, S) are left out of the memo's key when
    two builds that differ only in them give the same answer (a model sizing a parameter by S,
    learned positions of S rows say, keeps them in)."""
    def key(v):
        skip = () if memo["inputs"] else ("B", "S")
        return tuple(sorted((k, x) for k, x in v.items() if k not in skip))

    if "inputs" not in memo:
        got = compute(values)
        memo["inputs"] = compute({k: x + 1 if k in ("B", "S") else x for k, x in values.items()}) != got
        memo[key(values)] = got
    if key(values) not in memo:
        memo[key(values)] = compute(values)
    return memo[key(values)]
