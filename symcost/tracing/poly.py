"""Polynomials with exact coefficients as plain data: the algebra of fitted sizes.

A fitted size (bytes of a storage, elements of a parameter) is a polynomial in the model's symbols
with rational coefficients. :class:`Algebra` wraps sympy's sparse polynomial rings
(``sympy.polys.rings``, ``ZZ`` or ``QQ``) and converts to and from sympy expressions and
:data:`Terms`, the JSON form the memory schedule is stored in. The memory pass builds its live
sets in the same rings.
"""
from __future__ import annotations

from fractions import Fraction
from typing import Any

import sympy
from sympy.polys.domains import QQ, ZZ
from sympy.polys.rings import ring as _ring

from symcost.tracing.fit import SYMS

#: A polynomial as plain data (JSON): ``[[e_1, ..., e_n, "p/q"], ...]``, exponents in the order
#: of the symbols it is written in (``MemorySchedule.gens``), then, for each of the model's own
#: divisors given with them (``MemorySchedule.inverses``: a ``G`` that divides ``W``), the exponent
#: of its inverse, then, for each mesh symbol (``DP``, ``TP``, :data:`MESH`, in that order) among
#: them, the exponent of its inverse (:data:`INV_DP`, :data:`INV_TP`).
Terms = list

#: The generator standing for ``1/DP`` in a data-parallel trace's ring: a rank's storages hold
#: shards, whose sizes are ``x/DP`` (docs/parallel.md, "The rank's peak"). Sizes are at most
#: linear in DP and in 1/DP (``symcost.tracing.fit.LINEAR_ONLY``), so ``DP`` and ``1/DP`` are two
#: generators of a polynomial ring and every size is a polynomial in them.
INV_DP = sympy.Symbol("DP_inv", positive=True)

#: The generator standing for ``1/TP`` in a tensor-parallel trace's ring (a rank's weight shards,
#: its S/TP tokens under sequence parallelism, its 1/TP of the heads), as :data:`INV_DP`.
INV_TP = sympy.Symbol("TP_inv", positive=True)

#: The mesh symbols whose inverse is a generator of the ring, each with that generator, in the
#: order their inverses follow the symbols. A trace has one (a 1-D mesh: ``--dp`` or ``--tp``) or
#: both (the 2-D mesh of ``--dp`` with ``--tp``: a rank's storages are shards of shards, sizes
#: ``x/(DP·TP)``).
#: The generator standing for ``1/EP`` in an expert-parallel trace's ring (a rank's E/EP experts).
INV_EP = sympy.Symbol("EP_inv", positive=True)

MESH = {"DP": INV_DP, "TP": INV_TP, "EP": INV_EP}


def mesh_symbols(gens) -> tuple[str, ...]:
    """The mesh symbols (:data:`MESH`) among ``gens``, in :data:`MESH`'s order."""
    return tuple(g for g in MESH if g in tuple(gens))


def mesh_symbol(gens) -> str | None:
    """The first mesh symbol (``DP`` or ``TP``) among ``gens`` (:func:`mesh_symbols`), or None."""
    got = mesh_symbols(gens)
    return got[0] if got else None


def inverse(name: str) -> sympy.Symbol:
    """The generator standing for ``1/name`` in a ring: :data:`MESH`'s for a mesh size, else
    ``<name>_inv`` (a model's own divisor, ``G`` of ``W/G`` channels per group: ``G_inv``)."""
    return MESH.get(name) or sympy.Symbol(f"{name}_inv", positive=True)


def _inv(expr, names=("DP",)):
    """``expr`` with every ``X**-k`` of a symbol ``X`` in ``names`` (a mesh size of :data:`MESH`,
    or a model's own divisor) written as its inverse generator (:func:`inverse`) ``**k``
    (expanded first)."""
    expr = sympy.expand(sympy.sympify(expr))
    for name in (names,) if isinstance(names, str) else names:
        X, inv = SYMS[name], inverse(name)
        if expr.has(X):
            expr = expr.replace(lambda e, X=X: e.is_Pow and e.base == X and e.exp.is_negative,
                                lambda e, inv=inv: inv ** (-e.exp))
    return expr


def _inv_dp(expr):
    """``expr`` with every ``DP**-k`` written ``INV_DP**k`` (expanded first)."""
    return _inv(expr, ("DP",))


class NotIntegral(ValueError):
    """A coefficient that the integer ring ``ZZ`` cannot hold (use ``QQ``)."""


class Algebra:
    """The polynomial ring ``ZZ[gens]`` or ``QQ[gens]`` (``sympy.polys.rings.ring``) of a
    model's symbols.

    Elements are ``PolyElement``s (exact coefficients; with ``ZZ``, the usual case of byte
    counts, plain Python integers, which keeps the arithmetic fast); besides the ring's own
    operations this gives the conversions to and from sympy expressions and plain
    :data:`Terms`, and the shift ``p(x) -> p(x + 1)`` that decides signs over positive integers.
    Converting a non-integer coefficient into ``ZZ`` raises :class:`NotIntegral`.

    With ``DP`` among the symbols (a data-parallel trace) the ring has one more generator,
    :data:`INV_DP` = 1/DP, after the symbols: ``values`` appends its value, ``expr`` writes it
    back as ``1/DP``, and the shift leaves it alone (0 < 1/DP <= 1, so a polynomial whose
    coefficients are all >= 0 after shifting the other symbols is still >= 0; the relation
    DP·(1/DP) = 1 is not used, which keeps every sign test sufficient). With ``TP`` (a
    tensor-parallel trace) the same holds for :data:`INV_TP` = 1/TP, and with both (a 2-D mesh)
    the ring has both inverses, DP's first. ``meshes`` names the symbols (:func:`mesh_symbols`);
    ``mesh`` the first or None; ``inv_dp`` is True when the ring has such a generator (the name is
    kept from when DP was the only one).

    ``inverses``: the model's own divisors among ``gens`` (``Constraint("divides", "G", "W")``,
    :func:`symcost.tracing.fit.model_divisors`) whose inverse is a generator too, as a mesh
    size's (``G_inv`` = 1/G, :func:`inverse`), before the mesh sizes' inverses: a block-diagonal
    weight [G, W/G, W/G] holds W²/G elements, W²·G_inv in the ring (a polynomial; without the
    generator the size pinned W and G). ``inverted``: every symbol with an inverse generator,
    in the ring's order (``inverses``, then ``meshes``).
    """

    def __init__(self, gens: tuple[str, ...], domain=QQ, inverses: tuple[str, ...] = ()):
        self.gens = tuple(gens)
        self.domain = domain
        self.meshes = mesh_symbols(self.gens)
        self.mesh = self.meshes[0] if self.meshes else None
        self.inverses = tuple(g for g in dict.fromkeys(inverses) if g in self.gens and g not in MESH)
        self.inverted = self.inverses + self.meshes
        self.inv_dp = bool(self.inverted)
        self.k = len(self.gens)  # the ring's generators: the symbols, then the inverses (own, then mesh)
        syms = [SYMS[g] for g in self.gens] + [inverse(m) for m in self.inverted] or [sympy.Symbol("_one")]
        self.R, *self.x = _ring(syms, domain)
        self.n = len(syms)
        self._shifted: dict[tuple, Any] = {}
        self._from_expr: dict = {}

    def gen(self, name: str):
        return self.x[self.gens.index(name)]

    def from_expr(self, expr):
        """A sympy polynomial in the symbols (or a number) as a ring element."""
        got = self._from_expr.get(expr)
        if got is None:
            try:
                got = self._from_expr[expr] = self.R(_inv(expr, self.inverted) if self.inv_dp else sympy.sympify(expr))
            except ValueError as e:  # a rational coefficient in ZZ
                raise NotIntegral(str(e)) from e
        return got

    def from_terms(self, terms: Terms):
        d = {}
        for t in terms:
            d[tuple(t[:-1]) if self.gens else (0,)] = self._coeff(Fraction(t[-1]))
        return self.R.from_dict(d) if d else self.R.zero

    def _coeff(self, f: Fraction):
        if self.domain == ZZ:
            if f.denominator != 1:
                raise NotIntegral(f"{f} is not an integer")
            return int(f)
        return QQ(f.numerator, f.denominator)

    def terms(self, p) -> Terms:
        out = []
        for m, c in sorted(p.items()):
            out.append([*(m if self.gens else ()), str(c)])
        return out

    def expr(self, p) -> sympy.Expr:
        if not self.gens:
            return sympy.Rational(str(p.coeff(1)) if p else 0)
        e = p.as_expr()
        return e.xreplace({inverse(m): 1 / SYMS[m] for m in self.inverted}) if self.inv_dp else e

    def values(self, vals: tuple) -> tuple:
        """Values of the ring's generators from those of the symbols (in ``gens`` order): the
        inverses of ``inverted`` appended (exact rationals: own divisors, then :data:`MESH`'s order)."""
        if not self.inv_dp:
            return tuple(vals)
        return (*vals, *(QQ(1, int(vals[self.gens.index(m)])) for m in self.inverted))

    def scale(self, p, k):
        """``k * p`` for a rational ``k`` (int or Fraction)."""
        k = Fraction(k)
        if self.domain == ZZ:
            return self.R.from_dict({m: self._coeff(Fraction(int(c)) * k) for m, c in p.items()}) if p else p
        return p * QQ(k.numerator, k.denominator)

    def shift(self, p):
        """``p(x + 1)``, a polynomial in y = x - 1 >= 0: when all its coefficients are >= 0, p >= 0
        at every positive integer point (a sufficient test). Shifted monomials are cached. The
        inverse generators (1/DP, 1/TP, 1/G: > 0) are not shifted."""
        out = self.R.zero
        k = self.k
        for m, c in p.items():
            s = self._shifted.get(m)
            if s is None:
                s = self.R.one
                for x, e in zip(self.x[:k], m):
                    if e:
                        s = s * (x + 1) ** e
                for x, e in zip(self.x[k:], m[k:]):
                    if e:
                        s = s * x ** e
                self._shifted[m] = s
            out += s * c
        return out


def terms_expr(gens, terms: Terms, inverses: tuple[str, ...] = ()) -> sympy.Expr:
    """:data:`Terms` in the symbols ``gens`` as a sympy expression (after the symbols' exponents,
    those of the inverses of the own divisors ``inverses`` (``MemorySchedule.inverses``), then of
    the mesh symbols among them, :data:`MESH`'s order)."""
    own = [g for g in dict.fromkeys(inverses) if g in gens and g not in MESH]
    syms = [SYMS[g] for g in gens] + [1 / SYMS[m] for m in own + list(mesh_symbols(gens))]
    return sympy.Add(*[sympy.Rational(str(t[-1])) * sympy.Mul(*[s ** e for s, e in zip(syms, t[:-1]) if e])
                       for t in terms])
