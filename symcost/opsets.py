"""Torch-free facts about ops that the passes read from a (possibly cached) Analysis.

:mod:`symcost.rules` (which imports torch) re-exports them; passes that walk the graph of a cached
analysis import them from here so that evaluating a cached analysis never imports torch.
"""
from __future__ import annotations

import math

#: Ops through which a parameter stays "the same weight" (dtype casts by autocast, copies).
PASS_THROUGH = {"aten._to_copy", "aten.clone", "aten.contiguous", "aten.expand", "aten._unsafe_view"}


def numel(shape) -> int:
    """Number of elements of a shape (a tuple of ints or sympy expressions; 1 for a 0-d tensor)."""
    return math.prod(shape) if shape else 1


def same_tensor(node: dict) -> bool:
    """Whether an op node of the Analysis graph passes its input through as "the same tensor"
    (a view, or a cast/copy in :data:`PASS_THROUGH`): walks from a parameter to the ops that
    really use it look through such nodes."""
    return node.get("family") == "view" or node.get("op", "").rsplit(".", 1)[0] in PASS_THROUGH
