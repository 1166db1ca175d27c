"""Fused attention on a CUDA GPU: the kernel PyTorch's SDPA dispatcher picks, and its speed.

symcost records a step on the CPU, where ``F.scaled_dot_product_attention`` runs the CPU's fused
kernel (``aten._scaled_dot_product_flash_attention_for_cpu``) or the math path. On a CUDA device
the same call goes through ``sdp::select_sdp_backend`` (PyTorch,
aten/src/ATen/native/transformers/cuda/sdp_utils.cpp): the backends in priority order, flash,
then memory-efficient, then math, the first whose checks pass. :func:`sdpa_backend` makes that
choice from what the trace keeps of the call (dtype, head dims, sequence lengths, causal flag,
an explicit mask); the checks it models:

- **flash** (``can_use_flash_attention``): no ``attn_mask`` (``check_for_attn_mask``); q, k and v
  of the same head dim, at most 256 (``check_head_dim_size_flash``); compute capability 8.0 to
  12.1 (``check_flash_attention_hardware_support``); fp16 or bf16 (``check_dtypes_flash_attention``
  from sm80); with a gradient, not a head dim in (192, 224] on sm86-sm89 / sm120-121
  (``check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120``); causal only with
  equal query and key lengths (``check_flash_causal_non_square_seqlens``). Grouped-query heads
  are accepted.
- **memory-efficient** (``can_use_mem_efficient_attention``): compute capability 5.0 to 12.1; fp16,
  bf16 or fp32 on sm80 and later; head dims divisible by ``minimum_gemm_alignment`` (8 for 16-bit
  inputs, 4 for fp32, on sm80 and later); a mask is accepted.
- **math**: anything else (the explicit matmuls and softmax).

cuDNN attention goes first only where ``check_prefer_cudnn_attention`` holds (cuDNN newer than
9.15, sm90/sm100); the published runs this model is checked against ran flash (PyTorch 2.5-2.6
wheels ship older cuDNN), so the default order above is the one modelled.

**Speed** (:func:`attention_efficiency`): the fraction of the device's dense peak a flash kernel
reaches, by phase, head dim, causal mask and sequence length, from published kernel benchmarks
(microbenchmarks of the kernel alone, never a training step):

- compute capability 9.x (H100, H200): FlashAttention-2, the kernel PyTorch's flash backend
  ships, on an H100 80GB SXM5 in BF16 (Shah et al., "FlashAttention-3", arXiv:2407.08608, 2024,
  Figure 5: forward, head dim 64 and 128, with and without a causal mask; Figure 6: backward,
  without a mask; batch x sequence = 16k tokens, hidden 2048), TFLOP/s over the 989.5 TFLOP/s
  dense BF16 peak. The backward with a causal mask is not published: it is the unmasked backward
  times the forward's causal / unmasked ratio at the same length and head dim.
- compute capability 8.x (A100): the same curves scaled so that their best point (forward, head
  dim 128, no mask, 16k) is 73% of the peak: Dao, "FlashAttention-2", arXiv:2307.08691, 2023,
  abstract ("reaching 50-73% of the theoretical maximum FLOPs/s on A100"); the backward's best
  then falls at 63.5%.
- 10.x and later: the 9.x figures (no published FlashAttention-2 table for Blackwell).

The benchmarks' FLOP count is that of the flash-attention repository's benchmark (``flops``:
4·B·H·S_q·S_k·D forward, 2.5 times that backward, halved under a causal mask), so a kernel's
time is that count, with the causal half, over the rate; symcost counts FLOPs without the
causal half (FlopCounterMode), and :func:`kernel_flops` recomputes the kernel's own count.
Between tabulated lengths the fraction is interpolated in log2(S), outside 512..16384 it is the
nearest end's; between head dims 64 and 128 linearly, above 128 the 128 row, below 64 the 64 row
times D/64 (a head dim is the k of the score GEMM: a shorter one amortises the tile's loads over
fewer multiply-adds). The memory-efficient kernel has no such published table here: it is
priced with the same figures (fp32 on the fp32 peak), a stated assumption.
"""
from __future__ import annotations

import math

#: sequence lengths of the published tables
SEQ = (512, 1024, 2048, 4096, 8192, 16384)
#: FlashAttention-2 on H100 80GB SXM5, BF16, TFLOP/s (FlashAttention-3 paper, arXiv:2407.08608,
#: Figure 5 (forward) and Figure 6 (backward, no causal mask)): (phase, head dim, causal) -> by SEQ
FA2_H100 = {
    ("forward", 64, False): (282, 306, 318, 321, 322, 324),
    ("forward", 128, False): (309, 350, 362, 368, 370, 370),
    ("forward", 64, True): (180, 229, 262, 284, 295, 299),
    ("forward", 128, True): (191, 260, 298, 319, 333, 335),
    ("backward", 64, False): (198, 238, 264, 279, 287, 291),
    ("backward", 128, False): (214, 260, 291, 310, 318, 322),
}
#: the dense BF16 peak those TFLOP/s are a fraction of (H100 SXM5 datasheet, 1979 sparse / 2)
H100_PEAK = 989.5
#: FlashAttention-2 paper's best A100 fraction (abstract: 50-73% of the theoretical maximum)
A100_BEST = 0.73
BACKENDS = ("flash", "efficient", "math")
HALF = ("fp16", "bf16")


def _capability(cc) -> tuple[int, int] | None:
    if cc is None:
        return None
    if isinstance(cc, str):
        major, _, minor = cc.partition(".")
        return int(major), int(minor or 0)
    return int(cc[0]), int(cc[1])


def sdpa_backend(cc, dtype: str, d_qk: int, d_v: int, s_q: int, s_k: int, causal: bool, mask: bool,
                 grad: bool = True) -> str:
    """The backend ``select_sdp_backend`` runs (``"flash"``, ``"efficient"`` or ``"math"``) for an
    SDPA call with these properties on a device of compute capability ``cc`` (``"9.0"`` or
    ``(9, 0)``; None: not a CUDA device, ``"math"``). ``dtype`` is a precision key (``bf16``,
    ``fp16``, ``fp32``, ...). The checks are those of the module docstring (sdp_utils.cpp)."""
    c = _capability(cc)
    if c is None:
        return "math"
    sm = c[0] * 10 + c[1]
    if (not mask and d_qk == d_v and d_qk <= 256 and 80 <= sm <= 121 and dtype in HALF
            and not (grad and (86 <= sm <= 89 or 120 <= sm <= 121) and 192 < d_qk <= 224)
            and not (causal and s_q != s_k)):
        return "flash"
    align = 8 if dtype in HALF else 4
    if (50 <= sm <= 121 and dtype in (*HALF, "fp32", "tf32") and d_qk % align == 0 and d_v % align == 0
            and d_qk > 0 and d_v > 0 and not (sm < 80 and dtype == "bf16")):
        return "efficient"
    return "math"


def _interp_seq(row, s: float) -> float:
    x = math.log2(min(max(s, SEQ[0]), SEQ[-1]))
    xs = [math.log2(v) for v in SEQ]
    for i in range(len(SEQ) - 1):
        if x <= xs[i + 1]:
            f = (x - xs[i]) / (xs[i + 1] - xs[i])
            return row[i] + f * (row[i + 1] - row[i])
    return row[-1]


def _tflops(phase: str, d: int, causal: bool, s: float) -> float:
    """FlashAttention-2's H100 TFLOP/s at head dim ``d`` (interpolated, module docstring)."""
    def at(dim: int) -> float:
        if phase == "backward" and causal:
            ratio = _interp_seq(FA2_H100[("forward", dim, True)], s) / _interp_seq(FA2_H100[("forward", dim, False)], s)
            return _interp_seq(FA2_H100[("backward", dim, False)], s) * ratio
        return _interp_seq(FA2_H100[(phase, dim, causal)], s)
    if d <= 64:
        return at(64) * max(1, d) / 64
    if d >= 128:
        return at(128)
    f = (d - 64) / 64
    return at(64) + f * (at(128) - at(64))


def attention_efficiency(cc, phase: str, head_dim: int, causal: bool, seq: float) -> float:
    """Fraction of the device's dense peak (at the attention's precision) a flash kernel reaches:
    ``phase`` ``"forward"`` or ``"backward"``, ``head_dim`` D, ``seq`` the key length S_k
    (module docstring: FlashAttention-2 on H100 for 9.x and later, scaled to the FlashAttention-2
    paper's A100 best for 8.x). Raises ValueError for an unknown phase."""
    if phase not in ("forward", "backward"):
        raise ValueError(f"unknown attention phase {phase!r}; accepted: forward, backward")
    c = _capability(cc) or (9, 0)
    t = _tflops(phase, head_dim, causal, seq)
    if c[0] == 8:
        return t / FA2_H100[("forward", 128, False)][-1] * A100_BEST
    return t / H100_PEAK


def causal_fraction(s_q: int, s_k: int, causal: bool) -> float:
    """Fraction of the S_q x S_k score pairs a causal kernel computes (1 without a mask): query i
    (of the last S_q positions) sees S_k - S_q + 1 + i keys, so pairs = S_q·S_k - S_q·(S_q - 1)/2
    (Dao 2023, sec. 3.1, the mask aligned to the bottom right; the same count as
    :meth:`symcost.graph.conventions.Conventions.causal_attention_cost`)."""
    if not causal or s_q <= 0 or s_k <= 0:
        return 1.0
    return max(0.0, (s_q * s_k - s_q * (s_q - 1) / 2) / (s_q * s_k))


def kernel_flops(phase: str, batch_heads: int, s_q: int, s_k: int, d_qk: int, d_v: int) -> float:
    """The FLOPs a fused attention kernel multiplies, without the causal saving (FlopCounterMode's
    ``sdpa_flop_count`` / ``sdpa_backward_flop_count``): forward 2·BH·S_q·S_k·(D_qk + D_v) (Q·Kᵀ and
    P·V); backward 2·BH·S_q·S_k·(3·D_qk + 2·D_v) (the recomputed scores, dP, dV, dQ, dK): with
    D_qk = D_v = D, 4·BH·S²·D and 10·BH·S²·D, the flash-attention benchmark's count."""
    per = 2 * batch_heads * s_q * s_k
    return per * (d_qk + d_v) if phase == "forward" else per * (3 * d_qk + 2 * d_v)
