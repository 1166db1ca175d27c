"""``aten._grouped_mm`` as a recorded step runs it, at any dtype and any size.

transformers' default experts implementation (``grouped_mm``, transformers/integrations/moe.py
``grouped_mm_experts_forward``) sorts the N·R routed token slots by expert and multiplies them
by the experts' stacked weights with one grouped GEMM, ``torch._grouped_mm(x, w, offs)``:
``offs`` (int32 ``[E]``) are the cumulative slot counts of the experts, the only thing routing
decides; the shapes are static. Two checks of PyTorch's own kernels stand between that op and
symcost's recordings, though neither changes what the op keeps or costs:

* the meta kernel (torch/_meta_registrations.py ``_meta_grouped_mm_common``, which FakeTensorMode
  runs) asks for bf16 operands, the CUDA kernel's rule, while the CPU kernel runs fp32 (what an
  fp32 or autocast step passes: transformers casts the tokens to the weights' dtype);
* every kernel asks for rows of 16-byte multiples ("strides should be multiple of 16 bytes":
  hidden and expert widths multiples of 8 in bf16, of 4 in fp32), which symcost's small probe
  sizes often are not.

:func:`run` therefore answers the op itself: on fake tensors a new output of the kernel's shape
(:func:`out_shape`), dtype and layout (rows padded to 16 bytes, :func:`out_strides`); on real
tensors PyTorch's kernel where it accepts the operands, else the same products group by group
(``torch.mm`` per group, values equal) into an output of that layout. Either way the recording holds one
``aten._grouped_mm`` with its operands and output, as the step runs it where the kernel accepts
the sizes; its cost is :func:`symcost.graph.rules` ``_grouped_mm``'s.
"""
from __future__ import annotations

import torch
import torch.utils._python_dispatch

GROUPED_MM = torch.ops.aten._grouped_mm.default


def out_shape(a_shape, b_shape, n_groups: int) -> tuple[int, ...]:
    """The output shape of ``_grouped_mm(a, b, offs)`` (torch/_meta_registrations.py,
    ``_create_grouped_mm_output_tensor``), ``n_groups`` = ``offs.shape[0]``:

    * 2-D ``[M, K_total]`` × 2-D ``[K_total, N]`` (groups along K, a weight gradient) -> ``[G, M, N]``;
    * 2-D ``[M_total, K]`` × 3-D ``[G, K, N]`` (groups along the rows: the experts' forward) -> ``[M_total, N]``;
    * 3-D ``[G, M, K]`` × 2-D ``[K, N_total]`` -> ``[M, N_total]``;
    * 3-D ``[G, M, K]`` × 3-D ``[G, K, N]`` (a batched product) -> ``[G, M, N]``.
    """
    a2, b2 = len(a_shape) == 2, len(b_shape) == 2
    if a2 and b2:
        return (n_groups, a_shape[0], b_shape[1])
    if a2:
        return (a_shape[0], b_shape[-1])
    if b2:
        return (a_shape[1], b_shape[-1])
    return (a_shape[0], a_shape[1], b_shape[-1])


def out_strides(shape, dtype) -> tuple[int, ...]:
    """The output's strides as PyTorch's kernels lay it out: rows padded to a multiple of 16 bytes
    (the CPU kernel, and the CUDA build's meta kernel, ``_create_grouped_mm_output_tensor``:
    ``size_padded = ceil(N / (16 / itemsize)) · (16 / itemsize)``), so a ``[15, 10]`` fp32 output
    has strides ``(12, 1)`` and a storage of 14·12 + 10 elements."""
    align = max(1, 16 // dtype.itemsize)
    padded = -(-shape[-1] // align) * align
    if len(shape) == 3:
        return (shape[1] * padded, padded, 1)
    return (padded, 1)


def _empty(shape, dtype, device):
    return torch.empty_strided(shape, out_strides(shape, dtype), dtype=dtype, device=device)


def _by_groups(a, b, offs, out_dtype):
    """The grouped product, one ``torch.mm`` per group (the CPU's fallback arithmetic), into an
    output laid out as the kernel lays it out (:func:`out_strides`)."""
    bounds = [0] + [int(x) for x in offs.tolist()] if offs is not None else []
    dtype = out_dtype or a.dtype
    out = _empty(out_shape(a.shape, b.shape, len(bounds) - 1 if offs is not None else a.shape[0]),
                 dtype, a.device)
    out.zero_()
    a2, b2 = a.dim() == 2, b.dim() == 2
    if not a2 and not b2:
        out.copy_(torch.bmm(a, b))
        return out
    for g, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
        if a2 and b2:
            out[g] = (a[:, s:e] @ b[s:e]).to(dtype)
        elif a2:
            out[s:e] = (a[s:e] @ b[g]).to(dtype)
        else:
            out[:, s:e] = (a[g] @ b[:, s:e]).to(dtype)
    return out


def run(func, args, kwargs):
    """Run ``aten._grouped_mm`` (``func``) for a recording: module docstring. Returns its output."""
    from torch._subclasses.fake_tensor import FakeTensor

    names = ("self", "mat2", "offs", "bias", "out_dtype")
    bound = dict(zip(names, args))
    bound.update(kwargs)
    a, b, offs = bound["self"], bound["mat2"], bound.get("offs")
    out_dtype = bound.get("out_dtype")
    if isinstance(a, FakeTensor) or isinstance(b, FakeTensor):
        n = offs.shape[0] if offs is not None else a.shape[0]
        return _empty(out_shape(tuple(a.shape), tuple(b.shape), n), out_dtype or a.dtype, a.device)
    try:
        return func(*args, **kwargs)
    except RuntimeError:
        if bound.get("bias") is not None:
            raise
        return _by_groups(a, b, offs, out_dtype)


class _Kernels(torch.utils._python_dispatch.TorchDispatchMode):
    """Every ``aten._grouped_mm`` through :func:`run`; every other op as it is."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is GROUPED_MM:
            return run(func, args, kwargs)
        return func(*args, **kwargs)


def kernels():
    """A context under which ``aten._grouped_mm`` runs as :func:`run` runs it, for model code run
    outside the recorder (the decode step's cache fill, :func:`symcost.tracing.record.record`);
    the recorder itself answers the op the same way."""
    return _Kernels()
