"""The mixture-of-experts pass: what the traced graph says about a model's experts.

The routing model and the static-shaped dispatch that MoE layers are traced with live in the
frontend (:mod:`symcost.frontends.moe`); which parameters are routed expert stacks and the active
parameter count are totals of the graph (:mod:`symcost.graph.totals`). This pass reads the token
slots per expert buffer off the traced ops and gathers the MoE facts the report shows.
"""
from __future__ import annotations

from typing import Any

from symcost.errors import SymcostError
from symcost.frontends.moe import routing_of_spec
from symcost.graph.totals import is_e, is_routed, params_active, params_active_matmul  # noqa: F401  (re-exported)

def slots_per_expert(an):
    """Token slots per expert buffer, read off the traced graph: the C of the ``[E, C, ·]``
    operand of the forward expert matmuls (c·B·S·R/E under capacity factor c); None without one.

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
        "slots_per_expert": slots_per_expert(an),
        "params_active": params_active(an),
        "params_active_matmul": params_active_matmul(an),
    }
