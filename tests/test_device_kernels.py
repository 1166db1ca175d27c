"""``--torch-device cuda`` records dropout and attention-with-dropout as CUDA dispatches them
(symcost/tracing/device_kernels.py); the CPU's kernels stay what ``cpu`` records.

Oracles: PyTorch's own dispatch of ``F.dropout`` on fake CUDA tensors (``FakeTensorMode`` makes
CUDA tensors without a GPU, and the composite ``aten::dropout`` then takes CUDA's branch of
Dropout.cpp), and the meta kernels of CUDA's fused attention ops on fake CUDA tensors (the
tensors they return, which their backward takes: derivatives.yaml). Nothing here is a number
copied from symcost's output.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from symcost.tracing.device_kernels import device_kernels


class _Ops(TorchDispatchMode):
    """The aten ops dispatched, with the dtypes and shapes of their tensor outputs."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.namespace == "aten":
            outs = out if isinstance(out, (tuple, list)) else [out]
            self.ops.append((str(func), [(o.dtype, tuple(o.shape)) for o in outs if isinstance(o, torch.Tensor)]))
        return out


def _dropout_ops(device: str, p: float, train: bool, inplace: bool, dtype, kernels: str | None = None):
    x = torch.empty(4, 8, device=device, dtype=dtype)
    with device_kernels(kernels), _Ops() as log:
        F.dropout(x, p, train, inplace=inplace)
    return log.ops


CASES = [(0.1, True, False), (0.5, True, False), (0.0, True, False), (0.1, False, False), (1.0, True, False),
         (0.1, True, True)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("p,train,inplace", CASES)
def test_dropout_as_cuda_dispatches_it(p, train, inplace, dtype):
    """The ops recorded on the CPU under ``cuda`` are those PyTorch dispatches for a CUDA tensor:
    ``native_dropout`` with a bool mask where CUDA fuses, the composite path (or nothing) else."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        cuda = _dropout_ops("cuda", p, train, inplace, dtype)
    routed = _dropout_ops("cpu", p, train, inplace, dtype, kernels="cuda")
    assert routed == cuda
    if 0 < p < 1 and train and not inplace:
        assert cuda[0][0] == "aten.native_dropout.default" and cuda[0][1][1][0] == torch.bool


@pytest.mark.parametrize("p,train,inplace", CASES)
def test_cpu_keeps_the_cpu_kernels(p, train, inplace):
    """``cpu`` (and no device) record exactly what the CPU dispatches without symcost."""
    plain = _dropout_ops("cpu", p, train, inplace, torch.bfloat16)
    assert _dropout_ops("cpu", p, train, inplace, torch.bfloat16, kernels="cpu") == plain
    if 0 < p < 1 and train:
        assert "aten.bernoulli_.float" in [op for op, _ in plain]


def _saved(fn, *args) -> list[tuple[torch.dtype, tuple[int, ...]]]:
    out = []

    def pack(t):
        out.append((t.dtype, tuple(t.shape)))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return out


def test_dropout_saves_a_bool_mask_under_cuda():
    """What autograd keeps for CUDA's dropout: the bool mask native_dropout returns (its
    backward, ``native_dropout_backward(grad, mask, scale)``), 1 byte per element."""
    x = torch.randn(3, 5, dtype=torch.bfloat16, requires_grad=True)
    with FakeTensorMode(allow_non_fake_inputs=True):
        mask = torch.native_dropout(torch.empty(3, 5, device="cuda", dtype=torch.bfloat16), 0.1, True)[1]
    with device_kernels("cuda"):
        saved = _saved(lambda t: F.dropout(t, 0.1, True), x)
    assert saved == [(mask.dtype, tuple(mask.shape))] == [(torch.bool, (3, 5))]
    cpu = _saved(lambda t: F.dropout(t, 0.1, True), x)
    assert cpu == [(torch.bfloat16, (3, 5))]  # (the CPU's: a mask in the input's dtype)


def test_sdpa_with_dropout_keeps_what_the_fused_kernel_keeps():
    """SDPA with dropout under ``cuda`` keeps q, k, v, the output and the log-sum-exp, the
    tensors CUDA's flash kernel returns for its backward (its meta kernel on fake CUDA tensors;
    the Philox seed and offset, 24 bytes, aside), and no [B, H, S, S] tensor; the CPU's math
    path keeps S × S probabilities and masks."""
    B, H, S, D = 2, 4, 64, 16
    q = torch.randn(B, H, S, D, dtype=torch.bfloat16, requires_grad=True)

    def attn(t):
        return F.scaled_dot_product_attention(t, t, t, dropout_p=0.1, is_causal=True)

    with FakeTensorMode(allow_non_fake_inputs=True):
        qc = torch.empty(B, H, S, D, device="cuda", dtype=torch.bfloat16)
        out = torch.ops.aten._scaled_dot_product_flash_attention(qc, qc, qc, 0.1, True)
    kernel = [(out[0].dtype, tuple(out[0].shape)), (out[1].dtype, tuple(out[1].shape))]  # output, logsumexp
    with device_kernels("cuda"), _Ops() as log:
        saved = _saved(attn, q)
    assert sorted(set(saved), key=str) == sorted(set([(q.dtype, (B, H, S, D))] + kernel), key=str)
    assert any("flash_attention" in op for op, _ in log.ops)
    math = _saved(attn, q)
    assert any(shape[-2:] == (S, S) for _, shape in math)


@pytest.mark.parametrize("seed", [291, 292])
def test_mla_attention_runs_cuda_memory_efficient_kernel(seed):
    """SDPA with query and value head dims apart (DeepSeek's MLA), which the CPU decomposes into
    the math path, runs CUDA's memory-efficient kernel under ``cuda``: at random sizes, dtypes and
    causal flags the op recorded is ``aten._scaled_dot_product_efficient_attention`` (and its
    backward), the output and the gradients equal PyTorch's own SDPA on the CPU, and autograd keeps
    exactly q, k, v and the tensors the kernel's meta kernel returns on fake CUDA tensors
    (the output and the log-sum-exp; derivatives.yaml) with no [B, H, S, S] tensor, where the
    CPU's math path keeps S × S probabilities. With a mask or equal head dims the CPU's choice
    stays."""
    import random

    rng = random.Random(seed)
    dtype = rng.choice((torch.float32, torch.bfloat16))
    a = 4 if dtype == torch.float32 else 8
    B, H, S = rng.randint(1, 3), rng.randint(1, 4), rng.randint(5, 40)
    Dq, Dv = a * rng.randint(2, 5), a * rng.randint(1, 3)
    Dq += a if Dq == Dv else 0
    causal = rng.random() < 0.5
    q, k = (torch.randn(B, H, S, Dq, dtype=dtype, requires_grad=True) for _ in range(2))
    v = torch.randn(B, H, S, Dv, dtype=dtype, requires_grad=True)

    def attn(*t):
        return F.scaled_dot_product_attention(*t, is_causal=causal)

    want = attn(q.float(), k.float(), v.float())
    grads = torch.autograd.grad(want.sum(), (q, k, v))
    with device_kernels("cuda"), _Ops() as log:
        saved = _saved(lambda *t: attn(*t).float().sum().backward(), q, k, v)
    names = [op for op, _ in log.ops]
    assert "aten._scaled_dot_product_efficient_attention.default" in names
    assert "aten._scaled_dot_product_efficient_attention_backward.default" in names
    tol = {"atol": 1e-5, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 3e-2}
    with device_kernels("cuda"):
        got = attn(q, k, v)
        torch.testing.assert_close(got.float(), want.detach(), **tol)
        for g, w in zip(torch.autograd.grad(got.float().sum(), (q, k, v)), grads):
            torch.testing.assert_close(g.float(), w.float(), **tol)
    with FakeTensorMode(allow_non_fake_inputs=True):
        qc, kc, vc = (torch.empty(t.shape, device="cuda", dtype=dtype) for t in (q, k, v))
        out = torch.ops.aten._scaled_dot_product_efficient_attention(qc, kc, vc, None, True, 0.0, causal)
    kernel = [(out[0].dtype, tuple(out[0].shape)), (out[1].dtype, tuple(out[1].shape))]
    inputs = [(dtype, tuple(t.shape)) for t in (q, k, v)]
    tensors = [s for s in saved if s[1] != ()]  # (the Philox seed and offset: int64 scalars, aside)
    assert sorted(tensors, key=str) == sorted(inputs + kernel, key=str), (tensors, inputs + kernel)
    assert not any(len(s) == 4 and s[-2:] == (S, S) for _, s in saved)
    math = _saved(lambda *t: attn(*t).float().sum().backward(), q, k, v)
    assert any(shape[-2:] == (S, S) for _, shape in math)
    with device_kernels("cuda"), _Ops() as log:  # (a mask, or one head dim: the CPU's kernels)
        F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(S, S, dtype=torch.bool))
        F.scaled_dot_product_attention(q, k, k)
    assert not any("efficient" in op for op, _ in log.ops)
