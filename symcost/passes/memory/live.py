"""Live sets as ring elements: which of them can be the peak, evaluation, and the real root a
memory cap puts on one size.

A :class:`Candidate` is a point of the folded schedule where the live set may peak; one dominates
another when their difference is >= 0 at every positive integer size, which the shift
``p(x) -> p(x + 1)`` decides sufficiently (all coefficients of the shifted difference >= 0).
"""
from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import sympy

from symcost.tracing.poly import Algebra

def _nonneg(p) -> bool:
    return all(c >= 0 for c in p.values())


def _geq(a, b) -> bool:
    """Every coefficient of ``a - b`` is >= 0 (without building ``a - b``)."""
    for m, c in b.items():
        if a.get(m, 0) < c:
            return False
    return all(c >= 0 or m in b for m, c in a.items())


def _peval(p, values: tuple) -> int | Fraction:
    """``p`` at integer ``values`` (in the ring's symbol order), exactly."""
    tot = 0
    for m, c in p.items():
        t = c
        for v, e in zip(values, m):
            if e:
                t *= v**e
        tot += t
    if isinstance(tot, int):
        return tot
    return int(tot.numerator) if tot.denominator == 1 else Fraction(int(tot.numerator), int(tot.denominator))


def _sign(alg: Algebra, p) -> int:
    """+1 if ``p >= 0`` for all positive integer symbols, -1 if ``<= 0``, 0 if it depends (or the
    shift cannot tell)."""
    s = alg.shift(p)
    if _nonneg(s):
        return 1
    if all(c <= 0 for c in s.values()):
        return -1
    return 0


@dataclass
class Candidate:
    """One point of the schedule where the live set may peak: ``poly`` bytes (dynamic part) as a
    ring element, ``shifted`` = ``poly(x + 1)``."""

    poly: Any
    shifted: Any
    min_L: int  # valid for L >= min_L only (needs that many blocks)
    label: str
    #: where in the folded schedule it lies, to split it into its parts
    #: (:meth:`~symcost.passes.memory.model.MemoryModel.peak_parts`): ``(unit, event, last_pass)``
    #: for a live set after event ``event`` of unit ``unit`` (in its last pass, else its first),
    #: ``("optimizer", temporaries)`` for the optimizer step; None where it has no parts
    origin: Any = None
    #: the length symbol ``min_L`` counts: ``L``, or the symbol of a stack folded on its own
    #: (several stacks: ``MemorySchedule.units``' ``sym``)
    sym: str = "L"


def _valid_where(k: Candidate, c: Candidate) -> bool:
    """Whether ``k`` is valid wherever ``c`` is (blocks enough: ``min_L`` of the same symbol)."""
    return k.min_L <= 1 or (k.sym == c.sym and k.min_L <= c.min_L)


def _pareto(cands: list[Candidate]) -> list[Candidate]:
    """Drop candidates that another one dominates for every positive integer size."""
    kept: list[Candidate] = []
    for c in cands:
        if any(_valid_where(k, c) and _geq(k.shifted, c.shifted) for k in kept):
            continue
        kept = [k for k in kept if not (_valid_where(c, k) and _geq(c.shifted, k.shifted))]
        kept.append(c)
    return kept

def _feasible_sup(p: sympy.Expr, X: sympy.Symbol):
    """Supremum of the interval of ``{X >= 1 : p(X) <= 0}`` that starts at 1 (0 when p(1) > 0).

    The real roots of the polynomial come from sympy exactly (radicals or ``CRootOf``); the sign
    of ``p`` between consecutive roots decides where the interval ends (``oo`` if never).
    """
    poly = sympy.Poly(p, X)
    if poly.eval(1) > 0:
        return sympy.Integer(0)
    roots = sorted({r for r in poly.real_roots() if r >= 1}, key=lambda r: sympy.N(r, 30))
    for i, r in enumerate(roots):
        after = (roots[i + 1] + r) / 2 if i + 1 < len(roots) else r + 1
        if poly.eval(sympy.Rational(sympy.N(after, 40))) > 0:  # an exact rational near ``after``
            return r
    return sympy.oo
