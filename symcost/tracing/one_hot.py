"""``F.one_hot`` recorded as the same ops on real and fake tensors.

PyTorch's ``one_hot`` (aten/src/ATen/native/Onehot.cpp) takes two paths. On real CPU tensors it
checks the class range on the host (``aminmax``, then two reads of its values) and writes
``zeros(..., num_classes).scatter_(-1, index, 1)``; on CUDA it skips the host check and leaves
the range to ``scatter_``'s device assert; on fake or meta tensors, which hold no values, it
computes ``arange(num_classes) == index`` instead. A probe recorded on real tensors and a check
on fake ones would then run different ops, and every probe would leave the request's regime (a
model whose loss one-hot encodes its labels was refused: "no probe sizes ... stay in the regime").

:func:`scatter_one_hot` records ``F.one_hot`` with ``num_classes`` given as the ops the real
step runs: CUDA's path, the CPU's without its range check (a reduction over the integer labels
and two host reads, no floating-point work). ``num_classes=-1`` reads the largest label, a
size that follows the data: PyTorch's own function runs, and a fake recording refuses it.
Torch is imported on first use.
"""
from __future__ import annotations

import contextlib


@contextlib.contextmanager
def scatter_one_hot():
    """While entered, ``torch.nn.functional.one_hot(t, n)`` (n >= 0) runs ``zeros`` of shape
    ``[*t.shape, n]`` (int64) and ``scatter_(-1, t.unsqueeze(-1), 1)``, on real and fake
    tensors alike; PyTorch's own function otherwise."""
    import torch
    import torch.nn.functional as F

    original = F.one_hot

    def one_hot(tensor, num_classes=-1):
        if num_classes < 0 or not isinstance(tensor, torch.Tensor) or tensor.numel() == 0:
            return original(tensor, num_classes)
        out = torch.zeros((*tensor.shape, num_classes), dtype=torch.long, device=tensor.device)
        return out.scatter_(-1, tensor.unsqueeze(-1), 1)

    F.one_hot = one_hot
    try:
        yield
    finally:
        F.one_hot = original
