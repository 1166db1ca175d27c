"""Per-op cost rules: FLOPs (model and all), bytes moved, on symbolic (or concrete) shapes.

Each rule is a small pure function of the op's input and output shapes (tuples of sympy
expressions or ints) and returns numbers of the same kind, so a rule gives a closed form when
handed symbolic shapes and a count when handed concrete ones.

Model FLOPs reuse ``torch.utils.flop_counter.flop_registry`` (mm, addmm, bmm, baddbmm, the
convolutions and their backward, the fused attention kernels): the same formulas as
``FlopCounterMode``, by construction. Rules are added only where that registry has none: the CPU
flash-attention kernel ``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward,
counted with the registry's own ``sdpa_flop_count`` / ``sdpa_backward_flop_count``.

All-op FLOPs add the per-element counts below (one FLOP = one add or multiply, see
docs/conventions.md):

============================================  ===========================================
op family                                     FLOPs
============================================  ===========================================
pointwise (``torch.Tag.pointwise``)           1 per output element
reduction (``torch.Tag.reduction``)           1 per input element
``_softmax`` / ``_log_softmax``               5 per element (max, subtract, exp, sum, divide/log)
``_softmax_backward_data`` / log-softmax bwd  4 per element
``native_layer_norm``                         7 per element (mean 1, centre 1, square 1,
                                              variance 1, normalise 1, affine 2)
``native_layer_norm_backward``                14 per element (twice the forward)
``native_dropout``                            2 per element (compare, scale)
``nll_loss_forward`` / backward               1 per target element
``embedding_dense_backward``                  1 per gradient element (scatter-add)
data movement (copy, cat, index, embedding)   0
views (``view``, ``t``, ``expand``, ...)       0 FLOPs and 0 bytes
============================================  ===========================================

Bytes: inputs read plus outputs written, each once (the unfused lower bound); the destination of
``copy_``/``fill_``/``zero_`` is written, not read; views and allocations without writes move 0.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import sympy
import torch
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

aten = torch.ops.aten

Shape = tuple  # of sympy.Expr or int


@dataclass
class OpView:
    """What a rule sees of one op: name, overload, shapes, dtypes and the argument tree.

    ``args``/``kwargs`` hold the op's arguments with every tensor replaced by its shape tuple
    (the form ``flop_registry`` functions accept) and every integer by its (symbolic) value.
    """

    op: Any
    name: str
    in_shapes: Sequence[Shape]
    in_dtypes: Sequence[torch.dtype]
    out_shapes: Sequence[Shape]
    out_dtypes: Sequence[torch.dtype]
    args: tuple
    kwargs: dict


@dataclass
class Cost:
    """FLOPs (model and all) and bytes of one op execution."""

    flops: Any = 0  # model FLOPs (matmul class), FlopCounterMode's convention
    flops_all: Any = 0  # model FLOPs + elementwise/reduction/normalisation FLOPs
    bytes: Any = 0  # bytes read + written


def numel(shape: Shape):
    """Number of elements of a shape (1 for a 0-d tensor)."""
    return math.prod(shape) if shape else 1


def nbytes(shape: Shape, dtype: torch.dtype):
    """numel x element size, in bytes (conventions: fp32 4, bf16/fp16 2, fp8 1)."""
    return numel(shape) * dtype.itemsize


def _traffic(v: OpView, skip_first_input: bool = False):
    ins = list(zip(v.in_shapes, v.in_dtypes))[1 if skip_first_input else 0:]
    return sum(nbytes(s, d) for s, d in ins) + sum(nbytes(s, d) for s, d in zip(v.out_shapes, v.out_dtypes))


# ----------------------------------------------------------------------------------------------
# the registry: packet name -> rule; families by tag below
RULES: dict[str, Callable[[OpView], Cost]] = {}


def rule(*names: str):
    """Register a rule for the given op packets (``"aten.mm"``) or overloads (``"aten.mm.default"``)."""

    def deco(fn):
        for n in names:
            RULES[n] = fn
        return fn

    return deco


def _model_flops(v: OpView):
    fn = flop_registry[v.op.overloadpacket]
    out = v.out_shapes[0] if len(v.out_shapes) == 1 else tuple(v.out_shapes)
    return fn(*v.args, out_val=out, **v.kwargs)


def _registry_rule(v: OpView) -> Cost:
    f = _model_flops(v)
    return Cost(f, f, _traffic(v))


@rule("aten.convolution_backward")
def _conv_backward(v: OpView) -> Cost:
    """The registry's ``conv_backward_flop``, with the op's outputs put back in their positions.

    The op returns ``(grad_input, grad_weight, grad_bias)`` with ``None`` where ``output_mask`` is
    False (e.g. no grad_input for a first layer fed the data batch); the recording keeps tensors
    only, but the registry formula reads ``out_shape[1]`` as grad_weight's shape.
    """
    mask = v.args[10] if len(v.args) > 10 else v.kwargs["output_mask"]
    shapes = iter(v.out_shapes)
    out = tuple(next(shapes) if m else None for m in mask)
    f = flop_registry[v.op.overloadpacket](*v.args, out_val=out, **v.kwargs)
    return Cost(f, f, _traffic(v))


@rule("aten._scaled_dot_product_flash_attention_for_cpu")
def _sdpa_cpu(v: OpView) -> Cost:
    """CPU flash attention (missing from FlopCounterMode): 4*B*H*S_q*S_k*D, as sdpa_flop_count."""
    q, k, val = v.in_shapes[:3]
    f = sdpa_flop_count(q, k, val)
    return Cost(f, f, _traffic(v))


@rule("aten._scaled_dot_product_flash_attention_for_cpu_backward")
def _sdpa_cpu_bwd(v: OpView) -> Cost:
    """Its backward: recompute + 4 matmuls = 10*B*H*S_q*S_k*D, as sdpa_backward_flop_count."""
    grad_out, q, k, val = v.in_shapes[:4]
    f = sdpa_backward_flop_count(grad_out, q, k, val)
    return Cost(f, f, _traffic(v))


VIEW_OPS = {
    "aten.view", "aten._unsafe_view", "aten.t", "aten.transpose", "aten.permute", "aten.expand",
    "aten.unsqueeze", "aten.squeeze", "aten.slice", "aten.select", "aten.split",
    "aten.split_with_sizes", "aten.unbind", "aten.detach", "aten.alias", "aten.as_strided",
    "aten._reshape_alias", "aten.reshape", "aten.diagonal", "aten.narrow", "aten.unfold",
    "aten.view_as_real", "aten.view_as_complex", "aten.chunk", "aten.lift_fresh",
    "aten.movedim", "aten.swapaxes", "aten._unsafe_view", "aten.flatten", "aten.unflatten",
}
ALLOC_OPS = {"aten.empty", "aten.empty_like", "aten.new_empty", "aten.new_empty_strided", "aten.empty_strided"}
MOVE_OPS = {
    "aten.copy_", "aten.clone", "aten._to_copy", "aten.cat", "aten.stack", "aten.index_select",
    "aten.gather", "aten.scatter", "aten.scatter_add", "aten.index", "aten.index_put",
    "aten.index_put_", "aten.embedding", "aten.zeros", "aten.zeros_like", "aten.ones", "aten.ones_like",
    "aten.full", "aten.full_like", "aten.new_zeros", "aten.new_ones", "aten.new_full", "aten.fill_",
    "aten.zero_", "aten.arange", "aten.constant_pad_nd", "aten.repeat", "aten.contiguous",
    "aten.masked_fill", "aten.masked_fill_", "aten.tril", "aten.triu", "aten.tril_", "aten.triu_",
    "aten.where", "aten.roll", "aten.flip", "aten.randint", "aten.rand", "aten.randn", "aten.bernoulli_",
    "aten.slice_backward", "aten.select_backward", "aten.index_add", "aten.index_add_", "aten.scalar_tensor",
    "aten.lift_fresh_copy", "aten.expand_copy", "aten.scatter_reduce", "aten.sort", "aten.topk",
    "aten.cumsum", "aten.new_tensor", "aten._local_scalar_dense", "aten.unsqueeze_copy",
}
#: Ops through which a parameter stays "the same weight" (dtype casts by autocast, copies).
PASS_THROUGH = {"aten._to_copy", "aten.clone", "aten.contiguous", "aten.expand", "aten._unsafe_view"}
OVERWRITE_OPS = {"aten.copy_", "aten.fill_", "aten.zero_"}
PER_ELEMENT_OUT = {  # FLOPs per element of the first output
    "aten._softmax": 5, "aten._log_softmax": 5, "aten._softmax_backward_data": 4,
    "aten._log_softmax_backward_data": 4, "aten.native_dropout": 2,
}
PER_ELEMENT_IN = {  # FLOPs per element of the first input
    "aten.native_layer_norm": 7, "aten.native_layer_norm_backward": 14,
    "aten.native_group_norm": 7, "aten.native_group_norm_backward": 14,
    "aten.native_batch_norm": 7, "aten.native_batch_norm_backward": 14,
    "aten._native_batch_norm_legit": 7, "aten._native_batch_norm_legit_no_training": 7,
    "aten._fused_rms_norm": 4, "aten._fused_rms_norm_backward": 8,
    "aten.embedding_dense_backward": 1,
}


def bias_positions(op) -> tuple[int, ...]:
    """Tensor-input positions of a matmul-class op that hold a bias, not a matmul operand."""
    packet = str(op.overloadpacket)
    if packet in ("aten.addmm", "aten.baddbmm", "aten.addbmm"):
        return (0,)
    if "convolution" in packet and "backward" not in packet:
        return (2,)
    return ()


def classify(op) -> str:
    """The family of an aten overload: model|view|alloc|move|pointwise|reduction|special|unsupported."""
    packet = str(op.overloadpacket)
    if str(op) in RULES or packet in RULES or op.overloadpacket in flop_registry:
        return "model"
    if packet in VIEW_OPS or getattr(op, "is_view", False):
        return "view"
    if packet in ALLOC_OPS:
        return "alloc"
    if packet in PER_ELEMENT_OUT or packet in PER_ELEMENT_IN or packet in (
        "aten.nll_loss_forward", "aten.nll_loss_backward", "aten.nll_loss2d_forward", "aten.nll_loss2d_backward"
    ):
        return "special"
    if packet in MOVE_OPS:
        return "move"
    tags = getattr(op, "tags", ())
    if torch.Tag.pointwise in tags:
        return "pointwise"
    if torch.Tag.reduction in tags:
        return "reduction"
    return "unsupported"


def cost(v: OpView, family: str | None = None) -> Cost:
    """The :class:`Cost` of one op.

    Args:
        v: the op's shapes (symbolic or concrete) and arguments.
        family: ``classify(v.op)``, if already known.

    Returns:
        Cost with model FLOPs, all FLOPs and bytes; an unsupported op costs 0 and the caller
        lists it (it is never silently dropped).
    """
    family = family or classify(v.op)
    packet = str(v.op.overloadpacket)
    if family == "model":
        fn = RULES.get(str(v.op)) or RULES.get(packet) or _registry_rule
        return fn(v)
    if family in ("view", "alloc"):
        return Cost()
    if family == "unsupported":
        return Cost()
    traffic = _traffic(v, skip_first_input=packet in OVERWRITE_OPS)
    if family == "move":
        return Cost(0, 0, traffic)
    if family == "pointwise":
        return Cost(0, numel(v.out_shapes[0]) if v.out_shapes else 0, traffic)
    if family == "reduction":
        return Cost(0, numel(v.in_shapes[0]), traffic)
    # special
    if packet in PER_ELEMENT_OUT:
        return Cost(0, PER_ELEMENT_OUT[packet] * numel(v.out_shapes[0]), traffic)
    if packet in PER_ELEMENT_IN:
        return Cost(0, PER_ELEMENT_IN[packet] * numel(v.in_shapes[0]), traffic)
    if packet.startswith("aten.nll_loss"):
        target = v.in_shapes[2] if packet.endswith("backward") else v.in_shapes[1]
        return Cost(0, numel(target), traffic)
    raise AssertionError(f"no cost for family {family} of {packet}")


def expand_flops(x):
    """Expand a sympy result (identity on ints)."""
    return sympy.expand(x) if isinstance(x, sympy.Basic) else x
