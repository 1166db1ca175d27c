"""Fused attention on a CUDA GPU in the performance model (issue 29): the kernel PyTorch's SDPA
dispatcher picks (sdp_utils.cpp), its published speed (the FlashAttention-2 and -3 papers'
benchmarks), the causal flag and mask kept on the traced op, and the predicted kernel time."""
from __future__ import annotations

import random

import pytest
import torch

from symcost.hardware import attention as attn


@pytest.mark.parametrize("cc, dtype, d_qk, d_v, s_q, s_k, causal, mask, grad, want", [
    ("9.0", "bf16", 128, 128, 8192, 8192, True, False, True, "flash"),
    ("8.0", "fp16", 64, 64, 512, 512, False, False, True, "flash"),
    ("9.0", "bf16", 128, 128, 4096, 4096, False, True, True, "efficient"),  # check_for_attn_mask
    ("9.0", "fp32", 128, 128, 4096, 4096, True, False, True, "efficient"),  # flash: fp16/bf16 only
    ("9.0", "bf16", 192, 128, 4096, 4096, True, False, True, "efficient"),  # flash: same head dims
    ("9.0", "bf16", 320, 320, 1024, 1024, False, False, True, "efficient"),  # flash: head dim <= 256
    ("9.0", "bf16", 128, 128, 1, 4096, True, False, False, "efficient"),  # causal, s_q != s_k
    ("8.6", "bf16", 200, 200, 1024, 1024, False, False, True, "efficient"),  # sm86 training, d in (192, 224]
    ("8.6", "bf16", 200, 200, 1024, 1024, False, False, False, "flash"),  # ... without a gradient
    ("7.0", "fp16", 64, 64, 1024, 1024, False, False, True, "efficient"),  # flash needs sm80
    ("7.0", "bf16", 64, 64, 1024, 1024, False, False, True, "math"),  # bf16 below sm80
    ("9.0", "bf16", 60, 60, 1024, 1024, False, True, True, "math"),  # 16-bit: head dim % 8
    ("9.0", "fp32", 6, 6, 1024, 1024, False, True, True, "math"),  # fp32: head dim % 4
    (None, "bf16", 64, 64, 1024, 1024, True, False, True, "math"),  # not a CUDA device
])
def test_the_backend_is_the_dispatchers(cc, dtype, d_qk, d_v, s_q, s_k, causal, mask, grad, want):
    """Each case is one check of PyTorch's select_sdp_backend (aten/src/ATen/native/transformers/
    cuda/sdp_utils.cpp: can_use_flash_attention, can_use_mem_efficient_attention), by hand."""
    assert attn.sdpa_backend(cc, dtype, d_qk, d_v, s_q, s_k, causal, mask, grad) == want


def test_the_speed_is_the_published_benchmark():
    """FlashAttention-2 on H100 SXM5, BF16, TFLOP/s as printed in the FlashAttention-3 paper
    (arXiv:2407.08608, Fig. 5: forward hdim 128 at 8k, 370 without and 333 with a causal mask;
    hdim 64 at 512, 282; Fig. 6: backward hdim 128 at 16k, 322), over the 989.5 TFLOP/s dense
    peak; on A100 (sm80) the best forward point is the FlashAttention-2 abstract's 73%."""
    e = attn.attention_efficiency
    assert e("9.0", "forward", 128, False, 8192) * 989.5 == pytest.approx(370)
    assert e("9.0", "forward", 128, True, 8192) * 989.5 == pytest.approx(333)
    assert e("9.0", "forward", 64, False, 512) * 989.5 == pytest.approx(282)
    assert e("9.0", "backward", 128, False, 16384) * 989.5 == pytest.approx(322)
    # the causal backward (not published): the unmasked backward x the forward's causal ratio
    assert e("9.0", "backward", 128, True, 4096) * 989.5 == pytest.approx(310 * 319 / 368)
    assert e("8.0", "forward", 128, False, 16384) == pytest.approx(0.73)
    # between the points: log2(S) and head dim interpolation stays between the neighbours
    mid = e("9.0", "forward", 96, True, 3000) * 989.5
    assert min(262, 284, 298, 319) < mid < max(262, 284, 298, 319)
    assert e("9.0", "forward", 32, False, 1024) == pytest.approx(e("9.0", "forward", 64, False, 1024) / 2)
    with pytest.raises(ValueError):
        e("9.0", "sideways", 64, False, 1024)


def test_kernel_flops_are_flop_counters():
    """The kernels' own FLOPs (the recomputed scores backward) equal torch.utils.flop_counter's
    sdpa_flop_count / sdpa_backward_flop_count at random shapes, grouped-query heads included."""
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    rng = random.Random(29)
    for _ in range(5):
        b, h, s_q, s_k, d = (rng.randint(1, 4), rng.randint(1, 8), rng.randint(1, 300), rng.randint(1, 300),
                             rng.choice([16, 64, 80, 128]))
        q, k, v = (b, h, s_q, d), (b, h, s_k, d), (b, h, s_k, d)
        assert attn.kernel_flops("forward", b * h, s_q, s_k, d, d) == sdpa_flop_count(q, k, v)
        assert attn.kernel_flops("backward", b * h, s_q, s_k, d, d) == sdpa_backward_flop_count(q, q, k, v)


def test_causal_fraction_counts_the_unmasked_pairs():
    """A causal mask aligned to the bottom right (the KV-cache convention): counted on the mask."""
    rng = random.Random(7)
    for _ in range(4):
        s_q = rng.randint(1, 40)
        s_k = s_q + rng.randint(0, 40)
        mask = torch.ones(s_q, s_k, dtype=torch.bool).tril(diagonal=s_k - s_q)
        assert attn.causal_fraction(s_q, s_k, True) == pytest.approx(mask.sum().item() / (s_q * s_k))
    assert attn.causal_fraction(10, 10, False) == 1.0


def test_the_trace_keeps_the_causal_flag_and_the_mask():
    """``attention_flags`` reads the call's own arguments: SDPA's is_causal and attn_mask."""
    from symcost.graph.concrete import attention_flags
    from symcost.graph.rules import OpView

    fwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    q = (2, 4, 16, 8)
    view = lambda args, kwargs: OpView(fwd, "x", [q] * 3, [torch.float32] * 3, [], [], args, kwargs)  # noqa: E731
    assert attention_flags(view((q, q, q, 0.0, True), {})) == (True, False)
    assert attention_flags(view((q, q, q, 0.0, False), {"attn_mask": (16, 16)})) == (False, True)
    assert attention_flags(view((q, q, q), {})) == (False, False)
    mm = OpView(torch.ops.aten.mm.default, "aten.mm.default", [(2, 2)] * 2, [torch.float32] * 2, [], [], ((2, 2),) * 2, {})
    assert attention_flags(mm) is None


@pytest.mark.heavy
def test_a_traced_sdpa_step_is_priced_by_its_kernel(traced):
    """A transformers Llama under SDPA (a causal call, no mask) traced once: its attention ops keep
    (causal, unmasked), keep it through the analysis' JSON, and on an H100 the fp32 step runs
    the memory-efficient kernel (flash takes 16-bit inputs only) at FLOPs x the causal fraction
    over the published rate x the fp32 peak, at random sizes; off a CUDA device (a CPU file)
    attention is priced as before (no kernel choice)."""
    from symcost.graph.analysis import Analysis
    from symcost.hardware.devices import get_device
    from symcost.passes.performance import predict

    an = traced("hf:llama", "fp32", "sdpa")
    ops = [op for op in an.ops if "attention" in op.name and op.family == "model"]
    assert ops and all(op.attn_flags == (True, False) for op in ops)
    back = Analysis.from_dict(an.to_dict())
    assert [op.attn_flags for op in back.ops if "attention" in op.name and op.family == "model"] == [(True, False)] * len(ops)
    dev = get_device("h100-sxm")
    rng = random.Random(3)
    for _ in range(2):
        sizes = {"B": rng.randint(1, 4), "S": rng.choice([300, 1024, 5000])}
        p = predict(an, dev, sizes)
        env = an.bind(**sizes)
        nodes = [n for n in p["nodes"] if "kernel" in n]
        assert len(nodes) == len(ops) and {n["kernel"] for n in nodes} == {"efficient"}
        for n in nodes:
            op = next(o for o in an.ops if o.index == n["index"])
            phase = "backward" if op.name.rsplit(".", 1)[0].endswith("_backward") else "forward"
            qi = 1 if phase == "backward" else 0
            b, h, s, d = (int(x.subs(env)) if hasattr(x, "subs") else int(x) for x in op.in_shapes[qi])
            assert s == sizes["S"] and b == sizes["B"]
            F = attn.kernel_flops(phase, b * h, s, s, d, d) * (s + 1) / (2 * s)
            rate = attn.attention_efficiency("9.0", phase, d, True, s) * dev.peak["fp32"]
            assert n["seconds"] == pytest.approx(n["repeat"] * F / rate, rel=1e-9)
        assert p["terms"]["attention"] == pytest.approx(sum(n["seconds"] for n in nodes if n["kind"] == "attention"))
    cpu = predict(an, get_device("h100-sxm").__class__(key="cpu", name="cpu", peak={"fp32": 1e11}, bandwidth=4e10),
                  {"B": 1, "S": 64})
    assert cpu["terms"]["attention"] == 0 and not any("kernel" in n for n in cpu["nodes"])


def test_compute_capability_is_read_and_written():
    """A device file's ``efficiency.compute_capability`` ("major.minor", NVIDIA's numbering) reads
    as a pair, is written back the same, and anything else is refused in one line; the catalogue's
    A100 is 8.0 and H100 9.0 (CUDA C++ Programming Guide, "Compute Capabilities")."""
    from symcost.errors import SymcostError
    from symcost.hardware.devices import get_device
    from symcost.hardware.efficiency import parse_efficiency

    e = parse_efficiency({"compute_capability": "8.6"}, "f [x]")
    assert e.compute_capability == (8, 6) and e.to_json()["compute_capability"] == "8.6"
    assert "compute_capability" not in e.defaulted
    for bad in ("sm90", "9.x", True):
        with pytest.raises(SymcostError, match="compute_capability"):
            parse_efficiency({"compute_capability": bad}, "f [x]")
    assert get_device("a100-80gb").efficiency.compute_capability == (8, 0)
    assert get_device("h100-sxm").efficiency.compute_capability == (9, 0)
