"""The kernels a step runs on its target device where they differ from the CPU's (``--torch-device``).

symcost records a step on CPU tensors (real ones for the probes, fake ones for large steps), so
PyTorch's CPU dispatch picks the kernels. Two choices that change what a step keeps for backward
depend on the device, and :func:`device_kernels` makes them as the target device does:

* **Dropout.** ``aten::dropout`` is a composite op (aten/src/ATen/native/Dropout.cpp,
  ``dropout``): where ``is_fused_kernel_acceptable(input, p)`` holds (a CUDA, XPU, lazy or
  PrivateUse1 tensor, ``0 < p < 1``, ``numel > 0``) and ``train`` is set it runs
  ``native_dropout``, which saves a **bool** mask (1 byte per element); elsewhere (the CPU) it
  runs ``_dropout``: ``bernoulli_`` into a mask of the input's dtype, ``div_``, ``mul``, and
  autograd saves that mask (2 bytes per element in bf16, 4 in fp32). The in-place
  ``dropout_`` takes the composite path on every device. Under ``"cuda"`` an
  ``F.dropout`` call that CUDA would fuse runs ``torch.native_dropout``
  (a CPU kernel exists, so real and fake recordings run the same op). Checked against
  PyTorch's own dispatch of ``F.dropout`` on fake CUDA tensors (tests/test_device_kernels.py).
* **Attention with dropout.** ``F.scaled_dot_product_attention(..., dropout_p > 0)`` on the CPU
  has no fused kernel (``_fused_sdp_choice`` answers MATH) and decomposes into explicit matmuls
  that keep the ``[B, H, S, S]`` probabilities and their dropout mask. On CUDA (sm80 and later,
  16-bit inputs, head dim up to 256: aten/src/ATen/native/transformers/cuda/sdp_utils.cpp) the
  flash or memory-efficient kernel runs the dropout inside the kernel from a Philox seed and
  offset (two scalars) and keeps the same tensors as without dropout: query, key, value, output
  and the log-sum-exp (derivatives.yaml, ``_scaled_dot_product_flash_attention`` /
  ``_efficient_attention``). Under ``"cuda"`` such a call is recorded with ``dropout_p = 0``,
  which the CPU runs through its fused kernel (``_scaled_dot_product_flash_attention_for_cpu``):
  the same saved tensors and the same model FLOPs; the dropout's elementwise work inside the
  kernel is not counted. Where the CPU's fused kernel would not run even without dropout (a
  shape it refuses), the math path is recorded without the dropout mask.

Any other device type records what the CPU runs. Torch is imported on first use.
"""
from __future__ import annotations

import contextlib

#: target devices whose kernel choices :func:`device_kernels` models (others: the CPU's)
ROUTED = ("cuda",)


def fused_dropout(input, p: float, train: bool) -> bool:
    """Whether CUDA's ``aten::dropout`` runs the fused ``native_dropout`` for ``input``: ``train``
    and ``0 < p < 1`` and a non-empty input (Dropout.cpp ``is_fused_kernel_acceptable``, the
    device test taken as true: the target device is CUDA)."""
    return bool(train) and 0 < float(p) < 1 and input.numel() > 0


def _patched():
    """``{name: function}`` of ``torch.nn.functional`` that run CUDA's choices on the CPU."""
    import torch
    import torch.nn.functional as F

    dropout, sdpa = F.dropout, F.scaled_dot_product_attention

    def cuda_dropout(input, p=0.5, training=True, inplace=False):
        """``F.dropout`` as CUDA dispatches it: ``native_dropout`` where fused (bool mask)."""
        if not inplace and isinstance(input, torch.Tensor) and fused_dropout(input, p, training):
            return torch.native_dropout(input, float(p), True)[0]
        return dropout(input, p, training, inplace)

    def cuda_sdpa(*args, **kwargs):
        """``F.scaled_dot_product_attention`` with its dropout inside a fused kernel: recorded
        with ``dropout_p = 0`` (module docstring)."""
        if len(args) > 4:
            args = (*args[:4], 0.0, *args[5:])
        elif "dropout_p" in kwargs:
            kwargs = {**kwargs, "dropout_p": 0.0}
        return sdpa(*args, **kwargs)

    return {"dropout": cuda_dropout, "scaled_dot_product_attention": cuda_sdpa}


@contextlib.contextmanager
def device_kernels(device: str | None):
    """A context under which a recorded step runs the kernels of ``device`` (a torch device
    type, ``--torch-device``) where they differ from the CPU's (module docstring): for
    ``"cuda"``, ``torch.nn.functional.dropout`` and ``scaled_dot_product_attention`` replaced
    while it lasts (module attributes: a ``TorchFunctionMode`` would not reach the forward that
    activation checkpointing recomputes inside the backward); for None, ``"cpu"`` and any other
    type nothing changes (the CPU's kernels are recorded). Code that bound those functions to
    its own names before the step keeps the CPU's."""
    if device not in ROUTED:
        yield
        return
    import torch.nn.functional as F

    saved = {name: getattr(F, name) for name in ("dropout", "scaled_dot_product_attention")}
    try:
        for name, fn in _patched().items():
            setattr(F, name, fn)
        yield
    finally:
        for name, fn in saved.items():
            setattr(F, name, fn)
