"""Per-block costs of activation checkpointing from the trace (:func:`block_costs`) and the
symbolic √L law over them (:func:`law`, :func:`integer_k`; Chen et al. 2016, Sec. 4.1)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

import sympy

from symcost.errors import SymcostError
from symcost.tracing.fit import SYMS
from symcost.passes.checkpoint.segments import plan_cost, uniform_segments
from symcost.passes.checkpoint_ops import require_block_list


@dataclass
class BlockCosts:
    """What one block costs, from the trace (sympy polynomials; bytes and FLOPs).

    ``generic`` is the block that stands for the repeated ones; ``special`` the end block that
    runs other ops (``"first"``/``"last"``, or None) with its own ``(a, x, f)``.
    """

    a: sympy.Expr  # bytes saved for backward inside one generic block
    x: sympy.Expr  # bytes of the block's input (= the previous block's output) a checkpoint keeps
    f: sympy.Expr  # forward model FLOPs of one generic block
    n_ops: int  # forward ops of the generic block (the chain length one level down)
    special: str | None = None
    special_costs: tuple | None = None  # (a, x, f) of the special end block
    container: str = ""
    outside: sympy.Expr = sympy.Integer(0)  # activations saved outside the blocks

    def sequence(self, L: int, env: Mapping) -> tuple[list[int], list[int], list[int]]:
        """Per-block ``(a, x, f)`` integers for ``L`` blocks at the sizes ``env``."""
        ev = lambda e: int(sympy.sympify(e).xreplace(env))  # noqa: E731
        g = (ev(self.a), ev(self.x), ev(self.f))
        seq = [g] * L
        if self.special and L >= 1:
            s = tuple(ev(v) for v in self.special_costs)
            seq[0 if self.special == "first" else L - 1] = s
        return [t[0] for t in seq], [t[1] for t in seq], [t[2] for t in seq]


def _special(an) -> str | None:
    """Which end block of the L = 2 fold stands apart (``"first"``, ``"last"``, None): from the
    trace's fold, or, for an analysis read from the trace cache (no fold at hand), from its
    schedule's units and the ops block 0 runs once."""
    c = an.layer_container
    pre = f"{c}." if c else ""
    if getattr(an, "role", None) is None:
        if an.schedule is not None and any(u.label == "forward, last block" for u in an.schedule.units):
            return "last"
        L = SYMS["L"]
        once = any(op.layer is not None and op.phase == "forward" and not sympy.sympify(op.repeat).has(L)
                   for op in an.ops)
        return "first" if once else None
    _, r0, _ = an.role(f"{pre}0")
    _, r1, _ = an.role(f"{pre}1")
    if r0 == 1 and r1 != 1:
        return "first"
    if r1 == 1 and r0 != 1:
        return "last"
    return None


def block_costs(an, lead_outside: bool = False) -> BlockCosts:
    """The per-block ``a``, ``x``, ``f`` of a traced model (see :class:`BlockCosts`).

    ``lead_outside``: a model whose first blocks are of another kind (``ModelSpec.lead_blocks``)
    is described by its repeated kind, the leading blocks' saved bytes counted in ``outside``
    (``symcost plan``'s screen: every pipeline stage priced as one of L/PP repeated blocks, an
    upper bound of the stage that holds the lighter leading ones) instead of refused.

    ``a`` is the trace's saved bytes of a block (``saved_tensors_hooks``, docs/memory.md), ``x``
    the bytes of the output of the block's last forward op (the tensor the next block takes and
    a checkpoint keeps), ``f`` the block's forward model FLOPs (FlopCounterMode's convention).

    Raises:
        SymcostError: the model has no one list of repeated blocks (:func:`require_block_list`), or its first blocks
            are of another kind than the rest (``ModelSpec.lead_blocks``: DeepSeek-V3's dense
            blocks), which the per-block costs here do not describe (unless ``lead_outside``).
    """
    from symcost.graph import rules

    require_block_list(an)
    lead = getattr(an.spec, "lead_blocks", 0) or 0
    if lead and not lead_outside:
        raise SymcostError(
            f"{an.model}: its first {lead} blocks are of another kind than the rest "
            f"({an.spec.extra.get('lead_blocks_note', 'leading blocks')}); checkpoint planning folds one kind "
            "of block (and one special end block), so it does not plan this model yet")
    L = SYMS["L"]
    special = _special(an)
    groups: dict[str, dict] = {}
    for op in an.ops:
        if op.layer is None or op.phase != "forward":
            continue
        key = "generic" if sympy.sympify(op.repeat).has(L) else "special"
        g = groups.setdefault(key, {"f": sympy.Integer(0), "last": None, "n": 0})
        g["f"] += op.cost.flops
        g["n"] += 1
        if op.out_shapes:
            g["last"] = op
    saved = {"generic": sympy.Integer(0), "special": sympy.Integer(0), "outside": sympy.Integer(0)}
    c = an.layer_container
    pre = f"{c}." if c else ""
    for module, nb, _dtype, rep in an.saved:
        if sympy.sympify(rep).has(L):
            saved["generic"] += nb
        elif module.startswith(pre) and module[len(pre):].split(".", 1)[0] in ("0", "{L-1}") and special:
            saved["special"] += nb
        else:
            saved["outside"] += rep * nb

    def out_bytes(op):
        return rules.nbytes(op.out_shapes[0], op.out_dtypes[0]) if op is not None else sympy.Integer(0)

    gen = groups.get("generic")
    if gen is None:
        raise SymcostError(f"{an.model}: no forward ops in the repeated blocks")
    sc = None
    if special and "special" in groups:
        sg = groups["special"]
        sc = (sympy.expand(saved["special"]), sympy.expand(out_bytes(sg["last"])), sympy.expand(sg["f"]))
    return BlockCosts(a=sympy.expand(saved["generic"]), x=sympy.expand(out_bytes(gen["last"])),
                      f=sympy.expand(gen["f"]), n_ops=gen["n"], special=special if sc else None,
                      special_costs=sc, container=c, outside=sympy.expand(saved["outside"]))


# --------------------------------------------------------------------------------------------
# the symbolic law
# --------------------------------------------------------------------------------------------


def law(bc: BlockCosts) -> dict:
    """The √L law of a uniform chain of L blocks checkpointed every k blocks (Chen et al. 2016,
    Sec. 4.1), from the traced ``a``, ``x`` (bytes) and ``f`` (FLOPs).

    Returns a dict of sympy expressions: ``memory`` M(k) = (L/k)·x + k·a (bytes; kept inputs of
    the L/k segments plus one segment's activations during its recomputation), ``k_star`` the
    stationary point sqrt(L·x/a) of dM/dk = 0 (sympy.solve), ``segments_star`` = L/k* =
    sqrt(L·a/x), ``memory_star`` = M(k*) = 2·sqrt(L·a·x), ``recompute`` L·f (one extra forward
    of the blocks, for any k < L), and the same one level down (``op_*``): the chain of the
    L·m forward ops of the blocks (m ops per block, the residual stream x between them, a/m
    bytes saved per op on average) checkpointed every j ops: M(j) = (L·m/j)·x + j·a/m,
    j* = m·sqrt(L·x/a), M(j*) = 2·sqrt(L·a·x) again, now reachable where k* < 1 (docs/checkpoint.md).
    """
    L, k, j = SYMS["L"], sympy.Symbol("k", positive=True), sympy.Symbol("j", positive=True)
    a, x, f = bc.a, bc.x, bc.f
    M = L / k * x + k * a
    ks = [s for s in sympy.solve(sympy.diff(M, k), k) if s.is_positive is not False]
    k_star = sympy.simplify(ks[0]) if ks else sympy.Integer(1)
    m = sympy.Integer(max(bc.n_ops, 1))
    Mop = L * m / j * x + j * a / m
    js = [s for s in sympy.solve(sympy.diff(Mop, j), j) if s.is_positive is not False]
    j_star = sympy.simplify(js[0]) if js else sympy.Integer(1)
    return {
        "k": k, "a": a, "x": x, "f": f, "memory": M, "k_star": k_star,
        "segments_star": sympy.simplify(L / k_star),
        "memory_star": sympy.simplify(M.subs(k, k_star)),
        "recompute": sympy.expand(L * f),
        "j": j, "ops_per_block": m, "op_memory": Mop, "op_j_star": j_star,
        "op_memory_star": sympy.simplify(Mop.subs(j, j_star)),
    }


def integer_k(law_: dict, env: Mapping, L: int, head: int = 0) -> int:
    """The best integer interval near k*: the integer neighbours of the stationary point (and
    1, L), the one with the least activation peak (:func:`plan_cost`) with ⌈L/k⌉ segments."""
    ks = float(law_["k_star"].xreplace({**env, SYMS["L"]: L}))
    cands = {1, L, max(1, math.floor(ks)), min(L, max(1, math.ceil(ks)))}
    a = int(law_["a"].xreplace(env))
    x = int(law_["x"].xreplace(env))
    return min(sorted(cands), key=lambda k: (plan_cost(uniform_segments(L, k), [a] * L, [x] * L, [0] * L,
                                                       head)[0], k))
