"""Cost rules of the ``special`` ops whose count is worked out per op: pooling windows, nearest
resampling and the mean-squared-error loss (vision models, diffusion UNets, regression heads).

Each rule takes an op view (``symcost.graph.rules.OpView``: shapes as sympy expressions or ints,
the op's arguments with tensors replaced by their shapes) and returns ``(flops_all, bytes)``;
model FLOPs are 0 (none of these is a matmul-class op: ``torch.utils.flop_counter`` has no entry
for them and ``FlopCounterMode`` counts 0). :mod:`symcost.graph.rules` classifies every packet of
:data:`SPECIAL_RULES` as ``special``. Counts (one FLOP = one add, multiply or compare, as
docs/conventions.md; bytes the unfused lower bound, each tensor read or written once):

==========================================  =============================  ============================
op                                          all-FLOPs                      bytes
==========================================  =============================  ============================
``max_pool{2,3}d_with_indices``             k per output element (k the    input + output + indices
                                            window's elements)
``max_pool{2,3}d_with_indices_backward``    1 per grad_output element      grad_output + indices +
                                            (the scatter-add)              grad_input
``avg_pool2d``                              k per output element (k − 1    input + output
                                            adds, 1 divide)
``avg_pool2d_backward``                     k + 1 per grad_output element  grad_output + grad_input
                                            (1 divide, k adds)
``upsample_nearest{1,2,3}d`` (and           0 (a gather)                   input + output
``_upsample_nearest_exact*``)
their ``_backward``                         1 per grad_output element      grad_output + grad_input
                                            (summed into its source)
``mse_loss``                                2 per element (subtract,       self + target + output
                                            square), + 1 reduced (mean/sum)
``mse_loss_backward``                       3 per element (subtract,       grad_output + self + target
                                            scale by 2/n, times grad)      + grad_input
==========================================  =============================  ============================

Windows count every position of the kernel, padding included, as ``FlopCounterMode`` counts a
convolution's kernel over padded zeros (the CPU kernels skip the padded positions of a border
window: they run fewer compares there, never more). The pooling backward ops read ``self`` for
its sizes only (ATen's ``max_pool2d_with_indices_backward_out_cpu`` zero-fills grad_input and
scatters grad_output through ``indices``; ``avg_pool2d_backward`` divides each grad_output element
once and adds it to its window): its bytes are not counted. ``mse_loss``: ATen's ``mse_stub``
computes ``(self − target)²`` elementwise, then ``mean``/``sum`` (aten/src/ATen/native/Loss.cpp);
``mse_loss_backward``: ``(self − target) · norm · grad_output``, norm = 2/n for the mean, 2 for
the sum (same file). Torch-free on import.
"""
from __future__ import annotations

import math
from typing import Any, Callable

from symcost.graph.opsets import numel


def _arg(v, name: str, default=None):
    """The argument called ``name`` in the op's schema (positional or keyword), else ``default``."""
    for i, a in enumerate(v.op._schema.arguments):
        if a.name == name:
            if i < len(v.args):
                return v.args[i]
            return v.kwargs.get(name, default)
    return default


def _bytes(v, ins=None, outs=None):
    """Bytes of the inputs at positions ``ins`` (all if None) and of every output."""
    pos = range(len(v.in_shapes)) if ins is None else ins
    read = sum(numel(v.in_shapes[i]) * v.in_dtypes[i].itemsize for i in pos)
    return read + sum(numel(s) * d.itemsize for s, d in zip(v.out_shapes, v.out_dtypes))


def _window(v):
    """Elements in one pooling window: the product of ``kernel_size`` (one value stands for
    every spatial dimension, as ``nn.MaxPool2d(3)`` passes it)."""
    k = list(_arg(v, "kernel_size"))
    dims = 3 if "3d" in str(v.op.overloadpacket) else 2
    if len(k) == 1:
        k = k * dims
    return math.prod(k)


def _max_pool(v):
    return _window(v) * numel(v.out_shapes[0]), _bytes(v)


def _read(v):
    """The tensor inputs the op reads (all but :data:`UNREAD_INPUTS`')."""
    skip = UNREAD_INPUTS.get(str(v.op.overloadpacket), ())
    return [i for i in range(len(v.in_shapes)) if i not in skip]


def _max_pool_backward(v):
    # tensor inputs (grad_output, self, indices): self's values are not read
    return numel(v.in_shapes[0]), _bytes(v, ins=_read(v))


def _avg_pool(v):
    return _window(v) * numel(v.out_shapes[0]), _bytes(v)


def _avg_pool_backward(v):
    return (_window(v) + 1) * numel(v.in_shapes[0]), _bytes(v, ins=_read(v))


def _nearest(v):
    return 0, _bytes(v)


def _nearest_backward(v):
    return numel(v.in_shapes[0]), _bytes(v)


def _mse_loss(v):
    n = numel(v.in_shapes[0])
    return (2 + (_arg(v, "reduction", 1) != 0)) * n, _bytes(v)


def _mse_loss_backward(v):
    return 3 * numel(v.in_shapes[1]), _bytes(v)


def _embedding_bag(v):
    # _embedding_bag(weight, indices, offsets, scale_grad_by_freq, mode, ...): each of the n rows
    # looked up (d wide) added into its bag; mode 1 (mean) divides every bag's d sums by its size
    n, d = numel(v.in_shapes[1]), v.in_shapes[0][-1]
    return n * d + (numel(v.out_shapes[0]) if _arg(v, "mode", 0) == 1 else 0), _bytes(v)


def _embedding_bag_backward(v):
    # each looked-up row's gradient (its bag's, times 1/size under mean) added into the table's
    n, d = numel(v.in_shapes[1]), v.in_shapes[0][-1]
    return n * d * (2 if _arg(v, "mode", 0) == 1 else 1), _bytes(v)


def _bce_with_logits(v):
    # (1 - t)·x + log(1 + exp(-x)) per element (Loss.cpp: 1 - t, a multiply, an exp, a log1p,
    # an add), + 1 per element reduced (mean or sum)
    n = numel(v.in_shapes[0])
    return (5 + (_arg(v, "reduction", 1) != 0)) * n, _bytes(v)


#: packet -> tensor-input positions whose values the op never reads (their sizes only): neither
#: its bytes nor the fused estimate (:mod:`symcost.graph.fusion`) charge them
UNREAD_INPUTS: dict[str, tuple[int, ...]] = {
    "aten.max_pool2d_with_indices_backward": (1,), "aten.max_pool3d_with_indices_backward": (1,),
    "aten.avg_pool2d_backward": (1,),
}

#: packet -> rule ``v -> (flops_all, bytes)``
SPECIAL_RULES: dict[str, Callable[[Any], tuple]] = {
    "aten.max_pool2d_with_indices": _max_pool, "aten.max_pool3d_with_indices": _max_pool,
    "aten.max_pool2d_with_indices_backward": _max_pool_backward,
    "aten.max_pool3d_with_indices_backward": _max_pool_backward,
    "aten.avg_pool2d": _avg_pool, "aten.avg_pool2d_backward": _avg_pool_backward,
    "aten.mse_loss": _mse_loss, "aten.mse_loss_backward": _mse_loss_backward,
    "aten._embedding_bag": _embedding_bag, "aten._embedding_bag_backward": _embedding_bag_backward,
    "aten.binary_cross_entropy_with_logits": _bce_with_logits,
    **{f"aten.{p}{k}d": _nearest for p in ("upsample_nearest", "_upsample_nearest_exact") for k in (1, 2, 3)},
    **{f"aten.{p}{k}d_backward": _nearest_backward
       for p in ("upsample_nearest", "_upsample_nearest_exact") for k in (1, 2, 3)},
}
