"""FlopCounterMode's attention counts on symbolic shapes: ``torch.utils.flop_counter``'s
``sdpa_flop_count`` and ``sdpa_backward_flop_count`` (and the backward's recomputed scores) as its
own ``bmm_flop`` terms where a shape is a sympy expression (its shape checks ask questions such as
``H % K == 0`` that sympy cannot decide), the functions themselves on integers. The attention
kernels' cost rules (:mod:`symcost.graph.rules`) count with these.
"""
from __future__ import annotations

import sympy
from torch.utils.flop_counter import bmm_flop, sdpa_backward_flop_count, sdpa_flop_count


def _symbolic(*shapes) -> bool:
    return any(isinstance(x, sympy.Basic) and not x.is_Integer for sh in shapes for x in sh)


def sdpa_count(q, k, v):
    """``torch.utils.flop_counter.sdpa_flop_count`` (BHSD shapes): 2·B·H_q·S_q·S_k·(D_q + D_v).

    On symbolic shapes its own two ``bmm_flop`` terms without its shape checks: with K key/value
    heads, ``H % K != 0`` is a question sympy cannot decide (grouped-query attention is counted
    over the H query heads either way).
    """
    if not _symbolic(q, k, v):
        return sdpa_flop_count(q, k, v)
    b, h_q, s_q, d_q = q
    s_k, d_v = k[2], v[3]
    return bmm_flop((b * h_q, s_q, d_q), (b * h_q, d_q, s_k)) + bmm_flop((b * h_q, s_q, s_k), (b * h_q, s_k, d_v))


def sdpa_backward_count(go, q, k, v):
    """``sdpa_backward_flop_count``: its five ``bmm_flop`` terms (without its checks on symbolic
    shapes): recomputed scores, dP = dO·Vᵀ, dV = Pᵀ·dO, dQ = dS·K, dK = dSᵀ·Q."""
    if not _symbolic(go, q, k, v):
        return sdpa_backward_flop_count(go, q, k, v)
    b, h_q, s_q, d_q = q
    s_k, d_v = k[2], v[3]
    bh = b * h_q
    return (bmm_flop((bh, s_q, d_q), (bh, d_q, s_k)) + bmm_flop((bh, s_q, d_v), (bh, d_v, s_k))
            + bmm_flop((bh, s_k, s_q), (bh, s_q, d_v)) + bmm_flop((bh, s_q, s_k), (bh, s_k, d_q))
            + bmm_flop((bh, d_q, s_q), (bh, s_q, s_k)))


def sdpa_recompute_count(q, k):
    """The scores Q·Kᵀ a fused attention backward recomputes (BHSD shapes): 2·B·H_q·S_q·S_k·D_q,
    the first ``bmm_flop`` term of ``sdpa_backward_flop_count``. Hardware FLOPs, not model FLOPs:
    eager attention's backward (autograd of matmul, softmax, matmul) keeps the probabilities and
    runs only the four gradient matmuls."""
    b, h_q, s_q, d_q = q
    return bmm_flop((b * h_q, s_q, d_q), (b * h_q, d_q, k[2]))
