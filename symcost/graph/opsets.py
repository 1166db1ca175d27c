"""Torch-free facts about ops that the passes read from a (possibly cached) Analysis.

:mod:`symcost.graph.rules` (which imports torch) re-exports them; passes that walk the graph of a cached
analysis import them from here so that evaluating a cached analysis never imports torch.
"""
from __future__ import annotations

import math

#: Ops through which a parameter stays "the same weight" (dtype casts by autocast, copies).
#: ``prims.convert_element_type`` is autocast's cast after AOTAutograd's decomposition (``--compile``:
#: the partitioned graphs cast each weight to bf16 with it, not with ``aten._to_copy``).
PASS_THROUGH = {"aten._to_copy", "prims.convert_element_type", "aten.clone", "aten.contiguous", "aten.expand",
                "aten._unsafe_view"}

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


#: Bytes per element by dtype name (``str(torch.float32)`` without ``torch.``), as
#: ``torch.dtype.itemsize`` gives them (conventions: fp32 4, bf16/fp16 2, fp8 1), so that byte counts
#: of a cached analysis (whose dtypes are names) need no torch.
ITEMSIZE = {
    "float64": 8, "double": 8, "float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1,
    "complex128": 16, "cdouble": 16, "complex64": 8, "cfloat": 8, "complex32": 4, "chalf": 4,
    "int64": 8, "long": 8, "int32": 4, "int": 4, "int16": 2, "short": 2, "int8": 1, "uint8": 1,
    "uint16": 2, "uint32": 4, "uint64": 8, "bool": 1,
}


def dtype_name(dtype) -> str:
    """``torch.bfloat16`` or ``"bfloat16"`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def dtype_names(dtypes) -> list[str]:
    """The names of a sequence of dtypes without turning them into torch dtypes: a cached
    analysis keeps its ops' dtypes as names (``symcost.graph.serialize``), which read as torch
    dtypes only when asked one by one."""
    raw = getattr(dtypes, "names", None)
    return list(raw()) if callable(raw) else [dtype_name(d) for d in dtypes]


def itemsize(dtype) -> int:
    """Bytes per element of a torch dtype or a dtype name (:data:`ITEMSIZE`; a name not listed
    there asks torch).

    Raises:
        AttributeError: a name torch does not know either.
    """
    size = getattr(dtype, "itemsize", None)
    if isinstance(size, int):
        return size
    name = dtype_name(dtype)
    if name in ITEMSIZE:
        return ITEMSIZE[name]
    import torch

    return getattr(torch, name).itemsize


def nbytes(shape, dtype):
    """numel x element size, in bytes (conventions: fp32 4, bf16/fp16 2, fp8 1); ``dtype`` a torch
    dtype or its name."""
    return numel(shape) * itemsize(dtype)


#: BLAS GEMMs and the input position of their [k, n] operand: the one a CPU BLAS copies into
#: contiguous panels before its micro-kernel runs (Goto & van de Geijn, "Anatomy of
#: high-performance matrix multiplication", ACM TOMS 34(3), 2008, sec. 4-5: "packing" B)
GEMM_PACKED_OPERAND = {"aten.mm": 1, "aten.addmm": 2, "aten.bmm": 1, "aten.baddbmm": 2}


def packed_operand(name: str, in_shapes, in_dtypes, out_shapes):
    """``(bytes of B, m, n)`` for a GEMM ``C[..., m, n] = A[..., m, k] · B[..., k, n]`` of
    :data:`GEMM_PACKED_OPERAND` (symbolic or concrete), else None. With m = 1 or n = 1 the op is a
    matrix-vector product (BLAS gemv), which packs nothing: the caller checks m and n at sizes."""
    packet = name.rsplit(".", 1)[0] if name.count(".") >= 2 else name
    i = GEMM_PACKED_OPERAND.get(packet)
    if i is None or len(in_shapes) <= i or not out_shapes or len(out_shapes[0]) < 2:
        return None
    m, n = out_shapes[0][-2], out_shapes[0][-1]
    return nbytes(in_shapes[i], dtype_names(in_dtypes)[i]), m, n


def numel(shape) -> int:
    """Number of elements of a shape (a tuple of ints or sympy expressions; 1 for a 0-d tensor)."""
    return math.prod(shape) if shape else 1


def same_tensor(node: dict) -> bool:
    """Whether an op node of the Analysis graph passes its input through as "the same tensor"
    (a view, or a cast/copy in :data:`PASS_THROUGH`): walks from a parameter to the ops that
    really use it look through such nodes."""
    return node.get("family") == "view" or node.get("op", "").rsplit(".", 1)[0] in PASS_THROUGH


#: In-place writes into part of a tensor, packet -> position of the source among the op's tensor
#: inputs: ``self.index_copy_(dim, index, source)`` (a ``StaticCache`` writing the step's keys
#: and values into its preallocated cache) reads the index and the source and writes the
#: source's elements into ``self``; the rest of ``self`` is neither read nor written, so its
#: traffic is index + source read + numel(source) elements of ``self`` written (not all of
#: ``self`` read and written, as the inputs-plus-outputs count of other ops would say).
PARTIAL_WRITES = {"aten.index_copy_": 2,
                  # self.scatter_(dim, index, value | src): numel(index) elements of self written
                  # (F.one_hot's labels, symcost.tracing.one_hot)
                  "aten.scatter_": 1}


def partial_write_bytes(v) -> tuple:
    """``(bytes read, bytes written)`` of a :data:`PARTIAL_WRITES` op (an :class:`OpView` or a
    :class:`~symcost.graph.ops.SymOp`: anything with ``in_shapes``, ``in_dtypes``, ``out_dtypes``
    and the op's name)."""
    src = PARTIAL_WRITES[v.name.rsplit(".", 1)[0]]  # "aten.index_copy_.default" -> its packet
    names = dtype_names(v.in_dtypes)  # by name: a cached analysis' op needs no torch here
    read = sum(nbytes(s, d) for k, (s, d) in enumerate(zip(v.in_shapes, names)) if k != 0)
    return read, numel(v.in_shapes[src]) * itemsize(names[0])
