"""Recover sizes as exact polynomials in the canonical symbols from probe recordings.

Concrete recordings at several probe configurations give, for every tensor dimension (and integer
argument, and saved-storage size), one integer per probe. Each such *signature* is rebuilt as a
sparse polynomial with exact rational coefficients:

1. dependence: the base probe and one probe per symbol that changes only that symbol show which
   symbols the size depends on;
2. sparse fit: monomials in those symbols (exponents in {0, 1}, then {-1, 0, 1} for ratios such as
   H/K, then up to 3; never above what the probes' distinct values can pin down) are tried as
   supports of 1, 2, 3, ... terms; the coefficients are solved in floating point, rationalised, and accepted only if the
   polynomial reproduces *every* probe exactly in integer arithmetic, with at least two probes to
   spare;
3. a signature that no such polynomial reproduces is reported, never guessed.

Probes keep symbols apart (distinct values, none 0 or 1, so PyTorch cannot specialise or merge
them) and respect the model's constraints (K divides H and K < H, D even, ...). The caller checks
the rebuilt formulas again at fresh probes that took no part in the fit.
"""
from __future__ import annotations

import itertools
import random
from dataclasses import dataclass
from fractions import Fraction
from typing import Callable, Mapping, Sequence

import numpy as np
import sympy

from .errors import SymcostError

SYMS = {name: sympy.Symbol(name, positive=True, integer=True) for name in "BSHDLVFKMERN"}


def parse_formula(text: str) -> sympy.Expr:
    """Parse a formula string of symcost's JSON into a sympy expression in the canonical symbols.

    Plain ``sympy.sympify("B*S")`` reads ``S`` as ``sympy.S`` and ``N`` as ``sympy.N``; this
    passes the canonical symbols as locals. Only use it on symcost's own output: sympify
    evaluates code.
    """
    return sympy.sympify(text, locals=dict(SYMS))

# Base probe values and one alternate per symbol. L is fixed while fitting (layers fold).
BASE = {"B": 3, "S": 7, "H": 6, "D": 8, "L": 2, "V": 53, "F": 40, "K": 2, "M": 36, "E": 5, "R": 2}
ALTS = {
    "B": (5, 4, 2),
    "S": (11, 9, 5),
    "H": (10, 8, 4),
    "D": (12, 10, 6),
    "V": (61, 47, 59),
    "F": (44, 52, 36),
    "K": (3, 1),
    "M": (44, 28, 52),
    "E": (7, 4, 6),
    "R": (3, 4),
}
POOLS = {
    "B": range(2, 10),
    "S": range(5, 25),
    "H": range(2, 13),
    "D": range(4, 17, 2),
    "V": range(31, 98),
    "F": range(20, 73),
    "K": range(2, 9),
    "M": range(20, 65, 4),
    "E": range(3, 10),
    "R": range(2, 5),
}


@dataclass
class ProbePlan:
    """Probe configurations: ``points[0]`` is the base, ``axis[s]`` the index of s's probe."""

    symbols: tuple[str, ...]
    points: list[dict[str, int]]
    axis: dict[str, int]


def _ok(values: Mapping[str, int], check: Callable[[Mapping[str, int]], str | None]) -> bool:
    if "K" in values and "H" in values and (values["H"] % values["K"] or values["K"] >= values["H"]):
        return False
    return check(values) is None


def random_point(symbols, check, rng: random.Random, fixed: Mapping[str, int]) -> dict[str, int]:
    """A random probe respecting ``check``, with distinct values where it can."""
    for attempt in range(2000):
        v = dict(fixed)
        for s in symbols:
            if s in fixed:
                continue
            v[s] = rng.choice(POOLS[s])
        if "K" in v and "H" in v and "H" not in fixed:
            v["H"] = v["K"] * rng.choice((2, 3, 4))
        free = [v[s] for s in symbols if s not in fixed]
        if attempt < 1500 and len(set(free)) < len(free):
            continue
        if _ok(v, check):
            return v
    raise SymcostError(f"could not find probe sizes for {symbols} that satisfy the model's constraints")


def plan_probes(symbols: Sequence[str], check, n_random: int = 8, seed: int = 0,
                fixed: Mapping[str, int] | None = None) -> ProbePlan:
    """Base probe, one single-symbol change per symbol, and ``n_random`` random probes."""
    fixed = dict(fixed or {})
    base = {s: BASE[s] for s in symbols}
    base.update(fixed)
    if not _ok(base, check):
        base = random_point(symbols, check, random.Random(seed + 99), fixed)
    points = [base]
    axis = {}
    for s in symbols:
        if s in fixed:
            continue
        for alt in ALTS[s] + tuple(POOLS[s]):
            if alt == base[s]:
                continue
            p = dict(base, **{s: alt})
            if _ok(p, check):
                axis[s] = len(points)
                points.append(p)
                break
        else:
            raise SymcostError(f"could not vary {s} alone from {base} within the model's constraints")
    rng = random.Random(seed)
    for _ in range(n_random):
        points.append(random_point(symbols, check, rng, fixed))
    return ProbePlan(tuple(symbols), points, axis)


#: Exponent sets tried in turn: multilinear first, then the ratio H/K (query heads per key/value
#: head: K and E are the symbols that divide another (H/K, N·R/E), so only they may take exponent -1), squares,
#: cubes. A symbol only gets exponent e where the probes hold at least |e| + 1 distinct values
#: of it (enough to determine it; the exact check on every probe, with two to spare, verifies).
EXPONENT_STAGES = ((0, 1), (-1, 0, 1), (0, 1, 2), (-1, 0, 1, 2), (0, 1, 2, 3))
DIVISORS = ("K", "E")  # H/K (query heads per kv head), N·R/E (token slots per expert)


def _monomials(deps: Sequence[str], exps: Sequence[int]):
    choices = [[e for e in exps if e >= 0 or s in DIVISORS] for s in deps]
    for combo in itertools.product(*choices):
        yield dict(zip(deps, combo))


class Fitter:
    """Fit integer signatures (one value per probe) to sparse polynomials; memoised."""

    def __init__(self, plan: ProbePlan):
        self.plan = plan
        self.cache: dict[tuple[int, ...], sympy.Expr] = {}
        syms = plan.symbols
        self.X = {s: np.array([p[s] for p in plan.points], dtype=np.float64) for s in syms}
        self.Xi = {s: [Fraction(p[s]) for p in plan.points] for s in syms}
        self.distinct = {s: len(set(self.Xi[s])) for s in syms}

    def __call__(self, sig: tuple[int, ...], what: str = "size") -> sympy.Expr:
        if sig not in self.cache:
            self.cache[sig] = self._fit(sig, what)
        return self.cache[sig]

    def _fit(self, sig: tuple[int, ...], what: str) -> sympy.Expr:
        if all(v == sig[0] for v in sig):
            return sympy.Integer(sig[0])
        base = sig[0]
        deps = [s for s, i in self.plan.axis.items() if sig[i] != base]
        if not deps:  # varies only jointly (should not happen for polynomials): use all symbols
            deps = list(self.plan.axis)
        y = np.array(sig, dtype=np.float64)
        n = len(sig)
        for exps in EXPONENT_STAGES:
            monos = [
                m for m in _monomials(deps, exps)
                if all(abs(e) + 1 <= self.distinct[s] for s, e in m.items())  # determinable
            ]
            cols = [self._column(m) for m in monos]
            max_terms = 4 if len(monos) <= 16 else (3 if len(monos) <= 64 else 2)
            for k in range(1, max_terms + 1):
                if n - k < 2:
                    break
                for subset in itertools.combinations(range(len(monos)), k):
                    used = set()
                    for j in subset:
                        used.update(s for s, e in monos[j].items() if e)
                    if len(used) != len(deps):
                        continue
                    A = np.stack([cols[j] for j in subset], axis=1)
                    coef, *_ = np.linalg.lstsq(A, y, rcond=None)
                    if not np.allclose(A @ coef, y, rtol=0, atol=1e-6 * max(1.0, np.abs(y).max())):
                        continue
                    fr = [Fraction(c).limit_denominator(720) for c in coef]
                    if any(c == 0 for c in fr):
                        continue
                    terms = [(fr[t], monos[j]) for t, j in enumerate(subset)]
                    if self._exact(terms, sig):
                        return sympy.Add(*[
                            sympy.Rational(c.numerator, c.denominator)
                            * sympy.Mul(*[SYMS[s] ** e for s, e in m.items() if e])
                            for c, m in terms
                        ])
        pts = ", ".join(
            f"{{{', '.join(f'{s}={p[s]}' for s in self.plan.symbols)}}}->{v}"
            for p, v in list(zip(self.plan.points, sig))[:4]
        )
        raise SymcostError(
            f"a {what} cannot be expressed as a (Laurent) polynomial in {', '.join(self.plan.symbols)} "
            f"(probes: {pts}, ...); symcost will not guess it"
        )

    def _column(self, mono: dict[str, int]) -> np.ndarray:
        col = np.ones(len(self.plan.points))
        for s, e in mono.items():
            if e:
                col = col * self.X[s] ** e
        return col

    def _exact(self, terms, sig) -> bool:
        for i, v in enumerate(sig):
            total = Fraction(0)
            for c, m in terms:
                t = c
                for s, e in m.items():
                    if e:
                        t *= self.Xi[s][i] ** e
                total += t
            if total != v:
                return False
        return True
