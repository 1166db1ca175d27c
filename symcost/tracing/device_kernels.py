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
* **Attention whose query and value head dims differ** (multi-head latent attention: DeepSeek-V2/V3's
  192 and 128). The CPU's fused kernel needs one head dim for q, k and v
  (``check_head_dim_size_cpp``), so the CPU decomposes such a call into the math path: fp32
  matmuls (the math path upcasts 16-bit inputs on the CPU) that keep the ``[B, H, S, S]``
  probabilities. CUDA's flash kernel refuses it too (``check_head_dim_size_flash``), and its
  memory-efficient kernel runs it (``can_use_mem_efficient_attention``: sm50 and later; head dims
  divisible by 8 for 16-bit inputs, 4 for fp32; a mask would be accepted too, as a bias).
  Under ``"cuda"`` a call without a mask (nor grouped-query heads) whose head dims that kernel
  accepts runs ``aten._scaled_dot_product_efficient_attention`` as CUDA's SDPA does
  (attention.cu: ``compute_log_sumexp`` where an input requires a gradient); this CPU build has no
  kernel for it, so :func:`efficient_attention_on_cpu` registers one (and one for its backward),
  computed by the math formula in fp32: the outputs and shapes of PyTorch's meta kernels, the
  log-sum-exp ``[B, H, ⌈S_q/32⌉·32]`` fp32 that autograd saves with q, k, v and the output
  (derivatives.yaml). With a mask or grouped-query heads the CPU's choice is recorded.

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
        with ``dropout_p = 0``; with query and value head dims that differ, CUDA's
        memory-efficient kernel where it takes the call (module docstring)."""
        if len(args) > 4:
            args = (*args[:4], 0.0, *args[5:])
        elif "dropout_p" in kwargs:
            kwargs = {**kwargs, "dropout_p": 0.0}
        call = _efficient_call(*args, **kwargs)
        if call is not None:
            efficient_attention_on_cpu()
            return torch.ops.aten._scaled_dot_product_efficient_attention(*call[:7], scale=call[7])[0]
        return sdpa(*args, **kwargs)

    return {"dropout": cuda_dropout, "scaled_dot_product_attention": cuda_sdpa}


def _efficient_call(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                    enable_gqa=False):
    """The arguments of ``aten._scaled_dot_product_efficient_attention`` for an SDPA call that
    the CPU's fused kernel refuses for its head dims and CUDA's memory-efficient kernel runs, or
    None (module docstring): 4-D dense tensors, q and k of one head dim, v of another, the same
    heads, no mask, no dropout, a dtype and head dims the kernel accepts. Under autocast the
    fp32 inputs are cast to its dtype first, as autocast casts SDPA's (a lower-precision op)."""
    import torch

    ts = (query, key, value)
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 and not t.is_nested for t in ts):
        return None
    kind = query.device.type
    # (SDPA is a lower-precision op of autocast: its fp32 inputs are cast first)
    low = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None
    dtypes = {low if low is not None and t.dtype == torch.float32 else t.dtype for t in ts}
    dtype = next(iter(dtypes))
    align = {torch.float16: 8, torch.bfloat16: 8, torch.float32: 4}.get(dtype)
    d_qk, d_v = query.shape[-1], value.shape[-1]
    if (len(dtypes) != 1 or align is None or attn_mask is not None or float(dropout_p) != 0 or d_qk == d_v
            or key.shape[-1] != d_qk or d_qk % align or d_v % align
            or len({query.shape[1], key.shape[1], value.shape[1]}) != 1):
        return None
    query, key, value = (t.to(dtype) if t.dtype != dtype else t for t in ts)
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in ts)
    return query, key, value, None, grad, 0.0, bool(is_causal), scale


#: the library holding :func:`efficient_attention_on_cpu`'s kernels (kept alive)
_CPU_KERNELS: list = []


def _scores(q, k, attn_bias, is_causal: bool, scale):
    """fp32 attention scores ``[B, H, S_q, S_k]``: q·kᵀ·scale (+ the bias), future keys at -inf
    under ``is_causal`` (SDPA's causal mask: the lower triangle from the top left)."""
    import math

    import torch

    s = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    x = torch.matmul(q.float(), k.float().transpose(-2, -1)) * s
    if attn_bias is not None:
        x = x + attn_bias.float()
    if is_causal:
        keep = torch.ones(x.shape[-2], x.shape[-1], dtype=torch.bool, device=x.device).tril()
        x = x.masked_fill(~keep, float("-inf"))
    return x, s


def efficient_attention_on_cpu() -> None:
    """Register CPU kernels for ``aten._scaled_dot_product_efficient_attention`` and its backward
    (CUDA-only in PyTorch; module docstring), once per process: the math formula in fp32, outputs
    in the inputs' dtype, shapes and layouts of PyTorch's meta kernels
    (torch/_meta_registrations.py: the output ``[B, H, S_q, D_v]`` laid out BSHD, the log-sum-exp
    ``[B, H, ⌈S_q/32⌉·32]`` fp32 (0 wide without ``compute_log_sumexp``), the seed and offset
    ``int64`` scalars (on the CPU: the meta kernel makes them on the meta device); gradients laid
    out BSHD). Dropout is not computed
    (:func:`_efficient_call` gives none)."""
    if _CPU_KERNELS:
        return
    import math

    import torch

    lib = torch.library.Library("aten", "IMPL")

    def forward(query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, *, scale=None):
        x, _ = _scores(query, key, attn_bias, is_causal, scale)
        lse = torch.logsumexp(x, dim=-1)
        out = torch.matmul(torch.exp(x - lse.unsqueeze(-1)), value.float())
        b, h, s_q, d_v = out.shape
        res = torch.empty(b, s_q, h, d_v, dtype=query.dtype).transpose(1, 2)
        res.copy_(out)
        width = math.ceil(s_q / 32) * 32 if compute_log_sumexp else 0
        full = torch.zeros(b, h, width, dtype=torch.float)
        if width:
            full[..., :s_q] = lse
        # (the seed and offset: int64 scalars, on the CPU here: a meta one would send the backward
        # to the meta kernel, the dispatcher choosing by every input's device)
        return res, full, torch.zeros((), dtype=torch.long), torch.zeros((), dtype=torch.long)

    def backward(grad_out, query, key, value, attn_bias, out, logsumexp, philox_seed, philox_offset, dropout_p,
                 grad_input_mask, is_causal=False, *, scale=None):
        x, s = _scores(query, key, attn_bias, is_causal, scale)
        p = torch.exp(x - logsumexp[..., :x.shape[-2]].unsqueeze(-1))
        g = grad_out.float()
        dv = torch.matmul(p.transpose(-2, -1), g)
        dp = torch.matmul(g, value.float().transpose(-2, -1))
        ds = p * (dp - (g * out.float()).sum(-1, keepdim=True))
        dq = torch.matmul(ds, key.float()) * s
        dk = torch.matmul(ds.transpose(-2, -1), query.float()) * s

        def laid(t, like):
            b, h, n, d = t.shape
            r = torch.empty(b, n, h, d, dtype=like.dtype).transpose(1, 2)
            return r.copy_(t)

        grad_bias = None
        if attn_bias is not None and grad_input_mask[3]:
            grad_bias = ds.to(attn_bias.dtype)
        return laid(dq, query), laid(dk, key), laid(dv, value), grad_bias

    lib.impl("_scaled_dot_product_efficient_attention", forward, "CPU")
    lib.impl("_scaled_dot_product_efficient_attention_backward", backward, "CPU")
    _CPU_KERNELS.append(lib)


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
