"""Torch-free facts about ops that the passes read from a (possibly cached) Analysis.

:mod:`symcost.graph.rules` (which imports torch) re-exports them; passes that walk the graph of a cached
analysis import them from here so that evaluating a cached analysis never imports torch.
"""
from __future__ import annotations

import math

#: Ops through which a parameter stays "the same weight" (dtype casts by autocast, copies).
PASS_THROUGH = {"aten._to_copy", "aten.clone", "aten.contiguous", "aten.expand", "aten._unsafe_view"}

#: Row-normalising ops: each output row needs a reduction over its input row first (max and sum
#: of exps; mean and variance), so a kernel runs them in dependent passes over a row — read and
#: reduce, then evaluate and write. Where a device works through rows one at a time (a CPU core:
#: ``devices.Device.serial_passes``) those passes do not overlap, and the op's memory time and its
#: compute (or transcendental) time add up instead of hiding one another (symcost.passes.roofline).
ROW_NORMALISING = {
    "aten._softmax", "aten._safe_softmax", "aten._log_softmax", "aten._softmax_backward_data",
    "aten._log_softmax_backward_data", "aten.native_layer_norm", "aten.native_layer_norm_backward",
    "aten._fused_rms_norm", "aten._fused_rms_norm_backward", "aten.native_group_norm",
    "aten.native_group_norm_backward",
}


def numel(shape) -> int:
    """Number of elements of a shape (a tuple of ints or sympy expressions; 1 for a 0-d tensor)."""
    return math.prod(shape) if shape else 1


def same_tensor(node: dict) -> bool:
    """Whether an op node of the Analysis graph passes its input through as "the same tensor"
    (a view, or a cast/copy in :data:`PASS_THROUGH`): walks from a parameter to the ops that
    really use it look through such nodes."""
    return node.get("family") == "view" or node.get("op", "").rsplit(".", 1)[0] in PASS_THROUGH
