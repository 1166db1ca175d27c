"""The mixture-of-experts pass: what the traced graph says about a model's experts.

The routing model and the static-shaped dispatch that MoE layers are traced with live in the
frontend (:mod:`symcost.frontends.moe`); which parameters are routed expert stacks and the active
parameter count are totals of the graph (:mod:`symcost.graph.totals`). This pass reads the token
slots per expert buffer off the traced ops, gathers the MoE facts the report shows, and finds the
ops that read the routed experts' weights, so that an inference step is charged the weights of the
experts its tokens hit (:func:`hit_experts`, :func:`expert_traffic`; docs/moe.md, "Experts a step
reads").
"""
from __future__ import annotations

import weakref
from typing import Any

from symcost.errors import SymcostError
from symcost.frontends.moe import routing_of_spec
from symcost.graph.totals import is_e, is_routed, params_active, params_active_matmul  # noqa: F401  (re-exported)

def slots_per_expert(an):
    """Token slots per expert buffer, read off the traced graph: the C of the ``[E, C, ·]``
    operand of the forward expert matmuls (c·B·S·R/E under capacity factor c); where the experts
    run as grouped GEMMs (transformers' ``grouped_mm``: ``[N·R, in] × [E, in, out]``, balanced
    routing) the slots N·R of its rows over the E experts (B·S·R/E, each expert's balanced
    share); None without either.

    Raises:
        SymcostError: the MoE layers of one trace disagree (should not happen: one routing model).
    """
    import sympy

    from symcost.tracing.fit import SYMS

    e = is_e(an)
    e_pinned = "E" in (getattr(an, "pinned", None) or {})
    found = set()
    for op in an.ops:
        if op.phase != "forward" or op.family != "model" or not op.in_shapes:
            continue
        s = op.in_shapes[0]
        if op.name.startswith("aten._grouped_mm") and len(s) == 2 and len(op.in_shapes[1]) == 3 \
                and e(op.in_shapes[1][0]):
            found.add(sympy.cancel(sympy.sympify(s[0]) / sympy.sympify(op.in_shapes[1][0])))
            continue
        if len(s) != 3 or not e(s[0]):
            continue
        c = sympy.sympify(s[1])
        # C = c·B·S·R/E: it falls with E where E is a symbol; where E is pinned, it grows with
        # the tokens (an attention bmm [B·H, S, D] whose B·H happens to equal E does not)
        if c.has(SYMS["E"]) if not e_pinned else (c.has(SYMS["B"]) or c.has(SYMS["S"])):
            found.add(c)
    if not found:
        return None
    if len(found) > 1:
        raise SymcostError(f"expert buffers of different sizes in one trace: {sorted(map(str, found))}")
    return found.pop()


def summary(an) -> dict[str, Any] | None:
    """The MoE facts of an Analysis (None for a dense model), as formulas:
    ``routing`` (:meth:`Routing.as_json`), ``slots_per_expert`` (C, the busiest expert's token
    slots), ``params_active``, ``params_active_matmul``."""
    r = routing_of_spec(an.spec)
    if r is None:
        return None
    return {
        "routing": r.as_json(),
        "experts_code": an.spec.extra.get("experts_code"),
        "slots_per_expert": slots_per_expert(an),
        "params_active": params_active(an),
        "params_active_matmul": params_active_matmul(an),
    }


# -- the experts a step reads -----------------------------------------------------------------------


def expected_hit_experts(E, R, N):
    """Expected number of distinct experts that N tokens hit in one MoE layer under uniform
    routing, each token choosing R distinct experts of E: ``E·(1 − (1 − R/E)^N)``.

    Derivation (docs/moe.md, "Experts a step reads"): a token picks one of the C(E, R) sets of R
    experts uniformly, so it misses a given expert with probability 1 − R/E; tokens route
    independently, so the expert is missed by all N with probability (1 − R/E)^N; by linearity of
    expectation over the E experts, E·(1 − (1 − R/E)^N) are hit. It is at most min(E, N·R)
    (Bernoulli's inequality), equals R at N = 1 and tends to E as N grows.

    Args:
        E, R, N: experts, experts per token, tokens (ints or sympy expressions).

    Returns:
        A sympy expression (a number where all three are numbers); unitless (experts).
    """
    import sympy

    E, R, N = (sympy.sympify(x) for x in (E, R, N))
    return E * (1 - (1 - R / E) ** N)


def _sym_or_pinned(an, name):
    import sympy

    from symcost.tracing.fit import SYMS

    pinned = getattr(an, "pinned", None) or {}
    if name in pinned:
        return sympy.Integer(pinned[name])
    return SYMS[name] if name in an.symbols else None


def hit_experts(an):
    """Experts per MoE layer whose weights an inference step of ``an`` reads: the expected
    distinct experts its N = B·S tokens hit (:func:`expected_hit_experts`, B and S the symbols
    or their pinned values: N = B in a decode step) under the ``balanced`` routing model, a sympy
    expression in B, S, E, R; E under ``capacity=c`` (the padded dispatch computes every
    expert's buffer, empty or not, so it reads every expert). None for a dense model.

    The real experts code reads no weight of an expert no token hit: transformers' loop visits
    the experts in ``nonzero`` of the hit mask, and a grouped GEMM skips empty groups.
    """
    import sympy

    r = routing_of_spec(getattr(an, "spec", None))
    if r is None or not any(is_routed(an, n) for n in an.param_shapes):
        return None
    E, R = _sym_or_pinned(an, "E"), _sym_or_pinned(an, "R")
    if E is None or R is None:
        return None
    if r.kind != "balanced":
        return E
    N = sympy.Integer(1)
    for s in ("B", "S"):
        v = _sym_or_pinned(an, s)
        N = N * (v if v is not None else 1)
    return expected_hit_experts(E, R, N)


def hit_fraction(an):
    """:func:`hit_experts` / E: the share of each routed expert stack an inference step reads
    (1 for a dense model or under ``capacity``), a sympy expression."""
    import sympy

    h = hit_experts(an)
    if h is None:
        return sympy.Integer(1)
    return h / _sym_or_pinned(an, "E")


def expert_reads(an) -> dict[int, tuple[tuple[int, ...], tuple[int, ...]]]:
    """The ops of ``an`` that read routed expert weights, from the traced graph: op index ->
    ``(input positions, output positions)`` holding a stack of E experts' weights.

    Walks from every :func:`is_routed` parameter through views to the ops that consume it (the
    batched expert matmuls, an expert bias's add); a cast or copy of the stack on the way (an
    autocast ``_to_copy``) is itself such an op, its output a stack too. The input position is
    the one whose traced shape is that of the edge from the stack (the weight operand ``[E, in,
    out]``, never the ``[E, C, in]`` token buffer). Forward ops only (an inference step).
    """
    from symcost.graph.opsets import same_tensor

    g = an.graph
    reads: dict[int, tuple[set, set]] = {}
    for name in an.param_shapes:
        if not is_routed(an, name):
            continue
        frontier = [f"param:{name}"]
        seen = set()
        while frontier:
            u = frontier.pop()
            for x in g.successors(u):
                d = g.nodes[x]
                if d.get("kind") != "op" or d.get("phase") != "forward":
                    continue
                if d.get("family") == "view":
                    if x not in seen:
                        seen.add(x)
                        frontier.append(x)
                    continue
                shape = tuple(g.edges[u, x]["shape"])
                ins = [k for k, s in enumerate(d.get("in_shapes") or []) if tuple(s) == shape]
                acc = reads.setdefault(x, (set(), set()))
                acc[0].update(ins)
                if same_tensor(d):  # a copy of the stack: it writes one too, which others read
                    acc[1].update(range(len(d.get("out_shapes") or [])))
                    if x not in seen:
                        seen.add(x)
                        frontier.append(x)
    return {int(i): (tuple(sorted(a)), tuple(sorted(b))) for i, (a, b) in reads.items()}


_TRAFFIC: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()


def expert_traffic(an) -> dict[int, tuple]:
    """What reading only the experts hit changes in each op's traffic (for
    :func:`symcost.passes.roofline.roofline`'s ``extra_bytes``): op index -> ``(bytes, written,
    fused bytes, fused written)``, formulas: (f − 1) × the bytes of the op's expert-weight inputs
    and outputs (:func:`expert_reads`), f = :func:`hit_fraction` (bytes; negative or 0). The
    fused figures count only what the fused estimate charges the op
    (:attr:`symcost.graph.fusion.FusionEstimate.charged`). Empty for a dense model or where f
    is 1 (``capacity`` routing)."""
    import sympy

    from symcost.graph import fusion
    from symcost.graph.opsets import nbytes

    f = hit_fraction(an)
    if f == 1:
        return {}
    if an in _TRAFFIC:
        return _TRAFFIC[an]
    ops = {op.index: op for op in an.ops}
    charged = fusion.estimate(an).charged or {}
    out = {}
    for i, (ins, outs) in expert_reads(an).items():
        op = ops.get(i)
        if op is None:
            continue
        cins, couts = charged.get(i, (ins, outs))
        r = sum((nbytes(op.in_shapes[k], op.in_dtypes[k]) for k in ins), sympy.Integer(0))
        w = sum((nbytes(op.out_shapes[k], op.out_dtypes[k]) for k in outs), sympy.Integer(0))
        rf = sum((nbytes(op.in_shapes[k], op.in_dtypes[k]) for k in ins if k in cins), sympy.Integer(0))
        wf = sum((nbytes(op.out_shapes[k], op.out_dtypes[k]) for k in outs if k in couts), sympy.Integer(0))
        out[i] = tuple((f - 1) * x for x in (r + w, w, rf + wf, wf))
    _TRAFFIC[an] = out
    return out
