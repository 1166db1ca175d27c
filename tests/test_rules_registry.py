"""symcost's model FLOPs reuse ``torch.utils.flop_counter.flop_registry`` (parity with
FlopCounterMode by construction). These tests pin the registry's formulas to the published ones,
worked out here by hand, so that a torch upgrade that changes them fails loudly instead of quietly
changing every number symcost prints.

If one of these fails after a torch upgrade: read the new formula in torch/utils/flop_counter.py,
decide whether symcost follows it (conventions: "exactly the formulas of torch.utils.flop_counter"),
update docs/ and the expected value here, and re-check tests/test_known_mistakes.py.
"""
from __future__ import annotations

import sympy
import torch
from torch.utils.flop_counter import FlopCounterMode, flop_registry

from symcost.graph import rules

aten = torch.ops.aten
REVIEW = "torch.utils.flop_counter changed the formula of {}: symcost's parity with FlopCounterMode relies on it"

# distinct primes, so that a formula that swaps or drops a dimension cannot match by accident
b, m, k, n = 11, 3, 5, 7


def reg(packet, *args, out=None, **kwargs):
    return flop_registry[packet](*args, out_val=out, **kwargs)


def test_matmul_family():
    # (m×k)·(k×n): m·n dot products of length k, one multiply and one add each: 2·m·k·n
    assert reg(aten.mm, (m, k), (k, n), out=(m, n)) == 2 * m * k * n, REVIEW.format("mm")
    # addmm: the bias add is not counted
    assert reg(aten.addmm, (m, n), (m, k), (k, n), out=(m, n)) == 2 * m * k * n, REVIEW.format("addmm")
    # batched: b independent products
    assert reg(aten.bmm, (b, m, k), (b, k, n), out=(b, m, n)) == 2 * b * m * k * n, REVIEW.format("bmm")
    assert reg(aten.baddbmm, (b, m, n), (b, m, k), (b, k, n), out=(b, m, n)) == 2 * b * m * k * n, \
        REVIEW.format("baddbmm")


def test_convolution_forward():
    N, cin, cout, g, kh, kw = 2, 6, 9, 3, 3, 5
    # regular grouped 2-D conv: weight [cout, cin/g, kh, kw]; every output pixel of every output
    # channel is a dot product of length (cin/g)·kh·kw: 2·N·cout·(cin/g)·kh·kw·Ho·Wo
    x, w, out = (N, cin, 13, 17), (cout, cin // g, kh, kw), (N, cout, 11, 13)
    args = (x, w, None, [1, 1], [0, 0], [1, 1], False, [0, 0], g)
    want = 2 * N * cout * (cin // g) * kh * kw * 11 * 13
    for packet in (aten.convolution, aten._convolution):
        assert reg(packet, *args, out=out) == want, REVIEW.format(packet)
    # transposed: weight [cin, cout/g, kh, kw]; each INPUT pixel is scattered through the kernel:
    # 2·N·cin·(cout/g)·kh·kw·Hi·Wi (the spatial size is the input's, not the output's)
    xt, wt, outt = (N, cin, 13, 17), (cin, cout // g, kh, kw), (N, cout, 27, 37)
    argst = (xt, wt, None, [2, 2], [1, 1], [1, 1], True, [0, 0], g)
    assert reg(aten.convolution, *argst, out=outt) == 2 * N * cin * (cout // g) * kh * kw * 13 * 17, \
        REVIEW.format("convolution (transposed)")


def test_convolution_backward():
    N, cin, cout, g, kk = 2, 6, 9, 3, 3
    x, w, go = (N, cin, 19), (cout, cin // g, kk), (N, cout, 17)  # conv1d, no padding: 19 -> 17
    gi, gw, gb = x, w, (cout,)

    def bwd(mask, outs, transposed=False, xs=x, ws=w, gos=go):
        return reg(aten.convolution_backward, gos, xs, ws, [cout], [1], [0], [1], transposed, [0], g,
                   mask, out=outs)

    grad_input = 2 * N * cout * (cin // g) * kk * 17  # conv_transpose(grad_out, w): output-grad pixels
    # grad_weight: conv_flop_count(t(x)=[cin, N, 19], t(grad_out)=[cout, N, 17], t(gw)=[cin/g, cout, k])
    # = 2 · cin · cout · N · 17 · k. It does not divide by the groups (the true grouped work is g
    # times less); that is the published formula, pinned here as it is. symcost's rule divides
    # this term by the groups (docs/conventions.md, divergences; tests/test_kernels.py).
    grad_weight = 2 * cin * cout * N * 17 * kk
    assert bwd([True, True, True], (gi, gw, gb)) == grad_input + grad_weight, REVIEW.format("convolution_backward")
    assert bwd([True, False, False], (gi, None, None)) == grad_input, REVIEW.format("convolution_backward")
    assert bwd([False, True, False], (None, gw, None)) == grad_weight, REVIEW.format("convolution_backward")
    # transposed conv backward: grad_input is a regular conv of grad_out with w; its spatial size is
    # grad_input's; grad_weight = conv(t(grad_out), t(x))
    xt, wt, got = (N, cin, 17), (cin, cout // g, kk), (N, cout, 19)
    gin_t = 2 * N * cin * (cout // g) * kk * 17
    gw_t = 2 * cout * cin * N * 17 * kk  # batch = t(grad_out)[0] = cout; weight t(x) = [cin, N, 17]
    assert bwd([True, True, False], (xt, wt, None), True, xt, wt, got) == gin_t + gw_t, \
        REVIEW.format("convolution_backward (transposed)")


def test_attention_kernels():
    B, Hq, Hkv, Sq, Sk, Dq, Dv = 2, 6, 3, 5, 7, 4, 8
    q, kk, v = (B, Hq, Sq, Dq), (B, Hkv, Sk, Dq), (B, Hkv, Sk, Dv)
    # forward: scores Q·K^T (2·B·Hq·Sq·Sk·Dq) and P·V (2·B·Hq·Sq·Sk·Dv); K/V heads are broadcast
    # to the Hq query heads (grouped-query attention); no causal halving
    fwd = 2 * B * Hq * Sq * Sk * Dq + 2 * B * Hq * Sq * Sk * Dv
    for packet in (aten._scaled_dot_product_efficient_attention, aten._scaled_dot_product_flash_attention,
                   aten._scaled_dot_product_cudnn_attention):
        assert reg(packet, q, kk, v) == fwd, REVIEW.format(packet)
    # backward: recompute Q·K^T (Dq), dP = dO·V^T (Dv), dV = P^T·dO (Dv), dQ = dS·K (Dq),
    # dK = dS^T·Q (Dq): 2·B·Hq·Sq·Sk·(3·Dq + 2·Dv); with Dq = Dv = D that is 10·B·H·Sq·Sk·D
    go = (B, Hq, Sq, Dv)
    bwd = 2 * B * Hq * Sq * Sk * (3 * Dq + 2 * Dv)
    for packet in (aten._scaled_dot_product_efficient_attention_backward,
                   aten._scaled_dot_product_flash_attention_backward,
                   aten._scaled_dot_product_cudnn_attention_backward):
        assert reg(packet, go, q, kk, v) == bwd, REVIEW.format(packet)
        # symcost: the registry's count as hardware FLOPs; model FLOPs without the recomputed
        # scores Q·K^T (2·B·Hq·Sq·Sk·Dq), the four products eager attention's backward runs
        c = rules.cost(_view(packet.default, [go, q, kk, v], [q, kk, v], (go, q, kk, v)))
        assert (c.flops, c.flops_hw, c.flops_all) == (bwd - 2 * B * Hq * Sq * Sk * Dq, bwd, bwd)


def test_raw_attention_kernels_read_bshd_as_bhsd():
    """The raw kernels (registered get_raw=True: they receive tensors) take [B, S, H, D] (BMHK for
    the efficient one), but the registry hands those shapes to sdpa_flop_count, which reads
    [B, H, S, D]: S and H swap, 4·B·S·H²·D instead of 4·B·H·S²·D. symcost counts the layout the
    kernel takes (rules._raw_attention_shapes); if torch fixes this, the divergence entry in
    docs/conventions.md goes and this pin changes."""
    Bv, Sv, Hv, Dv = 2, 7, 3, 5
    q = torch.empty(Bv, Sv, Hv, Dv, device="meta")
    swapped = 4 * Bv * Sv * Hv**2 * Dv
    assert flop_registry[aten._flash_attention_forward](q, q, q, None, None, Sv, Sv) == swapped, \
        REVIEW.format("_flash_attention_forward")
    assert flop_registry[aten._efficient_attention_forward](q, q, q, None, None, None, None, None) == swapped, \
        REVIEW.format("_efficient_attention_forward")
    assert flop_registry[aten._flash_attention_backward](q, q, q, q, q, None, None, None, Sv, Sv) == swapped * 10 // 4, \
        REVIEW.format("_flash_attention_backward")
    assert flop_registry[aten._efficient_attention_backward](q, q, q, q, None, q, None, None, Sv, Sv) == \
        swapped * 10 // 4, REVIEW.format("_efficient_attention_backward")


def test_registry_takes_sympy_shapes():
    """symcost hands the registry sympy shapes; the issue's own examples."""
    B, S, H, D = sympy.symbols("B S H D", positive=True, integer=True)
    mm = reg(aten.mm, (B * S, H * D), (H * D, 3 * H * D), out=(B * S, 3 * H * D))
    assert sympy.expand(mm - 6 * B * D**2 * H**2 * S) == 0
    q = (B, H, S, D)
    fwd = reg(aten._scaled_dot_product_flash_attention, q, q, q)
    bwd = reg(aten._scaled_dot_product_flash_attention_backward, q, q, q, q)
    assert sympy.expand(fwd - 4 * B * D * H * S**2) == 0
    assert sympy.expand(bwd - 10 * B * D * H * S**2) == 0


def _view(op, in_shapes, out_shapes, args, kwargs=None):
    f32 = torch.float32
    return rules.OpView(op, str(op), in_shapes, [f32] * len(in_shapes), out_shapes, [f32] * len(out_shapes),
                        tuple(args), dict(kwargs or {}))


def test_symcost_rules_for_what_the_registry_lacks():
    """The CPU flash-attention kernels (absent from the registry in this torch) get the registry's
    own sdpa formulas (the backward's as hardware FLOPs, less the recomputed scores as model
    FLOPs); should torch register them, its formula must be the same."""
    B, S, H, D = sympy.symbols("B S H D", positive=True, integer=True)
    q = (B, H, S, D)
    lse = (B, H, S)
    fwd_op = aten._scaled_dot_product_flash_attention_for_cpu.default
    bwd_op = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    fwd = rules.cost(_view(fwd_op, [q, q, q], [q, lse], (q, q, q, 0.0, True)))
    bwd = rules.cost(_view(bwd_op, [q, q, q, q, q, lse], [q, q, q], (q, q, q, q, q, lse, 0.0, True)))
    assert sympy.expand(fwd.flops - 4 * B * H * S**2 * D) == 0
    assert sympy.expand(bwd.flops - 8 * B * H * S**2 * D) == 0
    assert sympy.expand(bwd.flops_hw - 10 * B * H * S**2 * D) == 0
    assert rules.classify(fwd_op) == rules.classify(bwd_op) == "model"
    for op, ours, args in ((fwd_op, fwd.flops_hw, (q, q, q)), (bwd_op, bwd.flops_hw, (q, q, q, q))):
        if op.overloadpacket in flop_registry:
            assert sympy.expand(reg(op.overloadpacket, *args) - ours) == 0, REVIEW.format(op)


def test_symcost_conv_backward_rule_missing_outputs():
    """convolution_backward with output_mask leaving out grad_input (a first layer) and grad_bias:
    the recording holds only grad_weight, the registry formula must still see it as output 1."""
    op = aten.convolution_backward.default
    N, C, Fo, S = sympy.symbols("B D F S", positive=True, integer=True)
    x, w, go = (N, C, S), (Fo, C, 3), (N, Fo, S)
    args = (go, x, w, None, [1], [1], [1], False, [0], 1, [False, True, False])
    c = rules.cost(_view(op, [go, x, w], [w], args))
    # t(x)=[C, N, S], t(go)=[F, N, S], spatial of t(gw)=[C, F, 3]: 2·C·F·N·S·3
    assert sympy.expand(c.flops - 6 * C * Fo * N * S) == 0


def test_model_family_is_the_registry_plus_cpu_attention():
    for packet in (aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten.convolution, aten.convolution_backward,
                   aten._scaled_dot_product_efficient_attention, aten._scaled_dot_product_flash_attention):
        assert packet in flop_registry, f"{packet} left torch.utils.flop_counter.flop_registry"
        assert rules.classify(packet.default) == "model", packet


def test_flopcounter_mode_still_counts_real_ops():
    """FlopCounterMode itself (the oracle of the exactness tests) on real tensors."""
    a, bb = torch.randn(m, k), torch.randn(k, n)
    x, w = torch.randn(2, 6, 13), torch.randn(9, 2, 3)
    with FlopCounterMode(display=False) as fc:
        torch.mm(a, bb)
        torch.nn.functional.linear(torch.randn(b, m, k), torch.randn(n, k), torch.randn(n))  # 3-D input
        torch.nn.functional.conv1d(x, w, groups=3)  # -> [2, 9, 11]
    assert fc.get_total_flops() == 2 * m * k * n + 2 * b * m * k * n + 2 * 2 * 9 * 2 * 3 * 11


def test_operator_dunders_are_the_pointwise_ops_they_alias():
    """``a | b`` on tensors dispatches ``aten.__or__``, which carries no tags in torch 2.13; each
    operator dunder is costed as the op it aliases, ``bitwise_or`` and the rest, which PyTorch
    tags pointwise."""
    for dunder, alias in (("__or__", "bitwise_or"), ("__and__", "bitwise_and"), ("__xor__", "bitwise_xor"),
                          ("__lshift__", "bitwise_left_shift"), ("__rshift__", "bitwise_right_shift")):
        op, ref = getattr(aten, dunder).Tensor, getattr(aten, alias).Tensor
        assert torch.Tag.pointwise in ref.tags
        assert rules.classify(op) == rules.classify(ref) == "pointwise", dunder


def test_grouped_mm_rule_counts_its_groups_gemms():
    """``aten._grouped_mm`` (transformers' grouped_mm experts) has no registry formula; symcost's
    rule counts its groups' matmuls, by hand: the forward ``[N·R, K] × [E, K, N]`` is Σ_e
    2·n_e·K·N = 2·(N·R)·K·N whatever the split, the weight gradient (contraction split,
    ``[K, N·R] × [N·R, N] -> [E, K, N]``) 2·K·(N·R)·N, not E times that; bytes are the operands,
    the offsets and the output (numel × 4 in fp32). Should torch register a formula, it must
    agree."""
    op = aten._grouped_mm.default
    assert rules.classify(op) == "model"
    E, K, N, T = sympy.symbols("E K N T", positive=True, integer=True)  # T = N·R rows
    fwd = rules.cost(_view(op, [(T, K), (E, K, N), (E,)], [(T, N)], ((T, K), (E, K, N), (E,))))
    assert sympy.expand(fwd.flops - 2 * T * K * N) == 0 and fwd.flops_all == fwd.flops
    assert sympy.expand(fwd.bytes - 4 * (T * K + E * K * N + E + T * N)) == 0
    gw = rules.cost(_view(op, [(K, T), (T, N), (E,)], [(E, K, N)], ((K, T), (T, N), (E,))))
    assert sympy.expand(gw.flops - 2 * K * T * N) == 0
    if op.overloadpacket in flop_registry:
        assert sympy.expand(reg(op.overloadpacket, (T, K), (E, K, N), (E,), out=(T, N)) - fwd.flops) == 0, \
            REVIEW.format(op)
    # the other ops of that experts code: tokens per expert (histc), slot -> token (floor_divide)
    assert rules.classify(aten.histc.default) == "special"
    assert rules.classify(aten.floor_divide.default) == "pointwise"
    h = rules.cost(_view(aten.histc.default, [(T,)], [(E,)], ((T,), E, 0, E - 1)))
    assert h.flops == 0 and sympy.expand(h.flops_all - T) == 0
