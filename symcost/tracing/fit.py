"""Recover sizes as exact polynomials in the canonical symbols from probe recordings.

Concrete recordings at several probe configurations give, for every tensor dimension (and integer
argument, and saved-storage size), one integer per probe. Each such *signature* is rebuilt as a
sparse polynomial with exact rational coefficients:

1. dependence: the base probe and one probe per symbol that changes only that symbol show which
   symbols the size depends on;
2. sparse fit: monomials in those symbols (exponents in {0, 1}, then {-1, 0, 1} for ratios such as
   H/K, then up to 3; never above what the probes' distinct values can pin down) are tried as
   supports of 1, 2, 3, ... terms; the coefficients are solved in floating point, rationalised
   (denominators up to 720, then up to 2^20: :data:`DENOMINATORS`), and accepted only if the
   polynomial reproduces *every* probe exactly in integer arithmetic, with at least two probes to
   spare; where none does, a monomial in all but one symbol times any polynomial (up to cubic) in
   that one, interpolated exactly through its distinct values with two to spare
   (``Fitter._fit_separable``: a feature map in a residue class of the image side);
3. a signature that no such polynomial reproduces is reported, never guessed.

Probes (:mod:`symcost.tracing.probes`, re-exported here) keep symbols apart (distinct values, none 0
or 1, so PyTorch cannot specialise or merge them), respect the model's constraints (K divides H, D even, ...) and stay in the regime of the
requested sizes (``plan_probes``'s ``accept``: the caller records a probe and compares the ops it
runs with the request's). The caller checks the rebuilt formulas again at fresh probes that took
no part in the fit.
"""
from __future__ import annotations

import itertools
import math
from fractions import Fraction
from typing import Sequence

import numpy as np
import sympy

from symcost.errors import SymcostError

from symcost.tracing.probes import (  # noqa: F401  (re-exported: the probe plan)
    CHECK_L, DIVISORS, FIT_L, N_RANDOM, LATTICE, LATTICES, NoProbes, ProbePlan, Unvariable, _complete, _nearest,
    _ok, _probe_setup, _mesh_step, find_base, lattice_point, leaves_moe_values, plan_probes, probe_pool,
    random_near, random_point, random_pools,
)
from symcost.tracing.symbols import (ALTS, BASE, MESH_SYMBOLS, POOLS, SYMS,  # noqa: F401  (their home)
                                     parse_formula)


class FitError(SymcostError):
    """A signature no polynomial reproduces; ``deps`` are the symbols it changes with."""

    def __init__(self, msg: str, deps: Sequence[str]):
        super().__init__(msg)
        self.deps = tuple(deps)


#: Exponent sets tried in turn: multilinear first, then the ratio H/K (query heads per key/value
#: head: K and E are the symbols that divide another (H/K, N·R/E), so only they may take exponent -1), squares,
#: cubes. A symbol only gets exponent e where the probes hold at least |e| + 1 distinct values
#: of it (enough to determine it; the exact check on every probe, with two to spare, verifies).
EXPONENT_STAGES = ((0, 1), (-1, 0, 1), (0, 1, 2), (-1, 0, 1, 2), (0, 1, 2, 3))
#: Denominator bounds of a fitted coefficient, tried in turn (each rationalisation must reproduce
#: every probe exactly): 720 first, as before; then 2^20, for a size that strides divide, a CNN's
#: feature map after five stride-2 stages, (IMG/32)^2 = IMG^2/1024, whose coefficients 720 cannot
#: hold (a ResNet's IMG was pinned for it)
DENOMINATORS = (720, 1 << 20)


def model_divisors(constraints) -> tuple[str, ...]:
    """The symbols a model declares to divide another (``Constraint("divides", a, b)`` with b a
    symbol: a factory's ``G`` groups of ``W`` channels, a patch side ``P`` of ``IMG``), besides
    :data:`DIVISORS`: in a fitted size they may take exponent -1 as K does (W/G channels per
    group, (IMG/P)^2 patches), and the probes give them a third value. Torch-free.

    Args:
        constraints: a :class:`symcost.frontends.spec.Constraint` sequence (``ModelSpec.constraints``).
    """
    return tuple(dict.fromkeys(c.a for c in constraints  # (symbol names, not expressions such as "H*D")
                               if c.kind == "divides" and isinstance(c.b, str) and c.a.isidentifier()
                               and c.b.isidentifier() and c.a not in DIVISORS))


#: Combinations of monomials the sparse search of a factor's cofactor (:meth:`Fitter._fit_factored`)
#: may try per exponent stage: its number of terms grows while C(monomials, terms) stays within
#: this (the main search keeps its fixed 4 / 3 / 2 terms, so no other signature is slowed)
COFACTOR_BUDGET = 100_000
#: The most terms a cofactor may have (tried fewest first): Mamba-2's conv output B·(S + K_conv − 1)
#: and a U-Net's inputs 8·C·IMG² + 4·S·XD + 8 are 3; 6 terms and 100,000 combinations made every
#: signature that the factored form does not fit (Swin's windows off the modulus) cost seconds
#: (Swin-T's trace 13 s -> 52 s)
COFACTOR_TERMS = 4


#: symbols whose exponent is at most 1 in size: DP divides a size (a shard) or multiplies one (a
#: buffer of DP shards, a split into DP chunks), never twice in one dimension
LINEAR_ONLY = MESH_SYMBOLS


def _monomials(deps: Sequence[str], exps: Sequence[int], divisors: Sequence[str] = DIVISORS):
    choices = [[e for e in exps if (e >= 0 or s in divisors) and (abs(e) <= 1 or s not in LINEAR_ONLY)]
               for s in deps]
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
        #: sizes a signature may combine where the sparse search fails (build.py sets the
        #: parameters' sizes: buffers that pack parameters)
        self.hints: list[sympy.Expr] = []
        #: the sizes of the data-parallel process groups whose shards a buffer may hold, in the
        #: symbols (build.py sets them under --tp with --ep: FSDP2's dense group DP·EP/TP)
        self.hint_groups: tuple[sympy.Expr, ...] = ()
        #: the symbols that may take exponent -1 (that divide another): :data:`DIVISORS` and the
        #: model's own (``plan.divisors``: :func:`model_divisors` of the model's constraints)
        self.divisors: tuple[str, ...] = tuple(dict.fromkeys((*DIVISORS, *plan.divisors)))

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
        if sum(g in self.plan.symbols for g in MESH_SYMBOLS) > 1 and any(g in deps for g in MESH_SYMBOLS):
            # the 2-D mesh: a size times DP^±1·TP^±1 (a shard of a shard, ...), found by the
            # scaling that leaves the probes along the DP and TP axes equal to the base; else
            # sizes that add whole, TP-local and shard terms (x + y/TP + z/(DP·TP)): with the
            # denominators cleared, a polynomial the first stages find at once
            got = self._fit_scaled(sig, what, deps)
            if got is None and len(deps) > 2:
                got = self._fit_cleared(sig, deps)
            if got is not None:
                return got
        for g in MESH_SYMBOLS:
            # a shard (size/DP) or DP shards (DP·size) of a size in the model's symbols: fit the
            # size itself (a block's shards sum many monomials, each /DP: too many terms for the
            # sparse search below); the same for TP
            # (TP alone too: a head count the request pins, K/TP, takes two values of TP where
            # K = 2·TP leaves TP one other probe value; 3 - TP/2 fits those two as well as 4/TP)
            # (DP alone too where the probes hold two values of it, HSDP's DP = R·shard with a
            # shard group of one rank in another regime: c - k·DP fits a shard's rows c'/DP there)
            if g in deps and (len(deps) > 1 or g != "DP" or self.distinct[g] < 3):
                got = self._fit_group(sig, what, g)
                if got is not None:
                    return got
        if "DP" in self.plan.symbols and len(deps) > 2:
            # a data-parallel trace packs parameters into buffers: try their sizes first (the
            # sparse search below takes seconds per signature before it gives up on such a sum)
            hinted = self._fit_hints(sig)
            if hinted is not None:
                return hinted
        # multilinear and ratios first; then a product of a size fitted before and a cofactor
        # (a convolution's padded output, channels times positions: more terms than the search
        # below tries over many symbols, and its squares and cubes take minutes to fail there)
        got = self._sparse(sig, deps, EXPONENT_STAGES[:2])
        if got is None and len(deps) >= 5:  # (fewer: the search below reaches as many terms; Swin's windows fail fast)
            got = self._fit_factored(sig, deps)
        if got is None:
            got = self._sparse(sig, deps, EXPONENT_STAGES[2:])
        if got is not None:
            return got
        got = self._fit_separable(sig, deps)
        if got is not None:
            return got
        hinted = self._fit_hints(sig)
        if hinted is not None:
            return hinted
        pts = ", ".join(
            f"{{{', '.join(f'{s}={p[s]}' for s in self.plan.symbols)}}}->{v}"
            for p, v in list(zip(self.plan.points, sig))[:4]
        )
        raise FitError(
            f"a {what} cannot be expressed as a (Laurent) polynomial in {', '.join(self.plan.symbols)} "
            f"(probes: {pts}, ...); symcost will not guess it", deps
        )

    def _fit_scaled(self, sig: tuple[int, ...], what: str, deps: list[str]):
        """``sig`` as (a size) · DP^a · TP^b, a and b in -1, 0, 1 (not both 0), the size free of
        each symbol scaled by, or None: the scaling is one under which the probes along those
        symbols' axes equal the base (one division per candidate); the size is fitted, and
        checked at every probe."""
        mesh = [g for g in MESH_SYMBOLS if g in deps]
        combos = sorted((c for c in itertools.product((-1, 1, 0), repeat=len(mesh)) if any(c)),
                        key=lambda c: sum(map(abs, c)))
        for combo in combos:
            scaled = [Fraction(v) for v in sig]
            for g, e in zip(mesh, combo):
                scaled = [x / self.Xi[g][i] ** e for i, x in enumerate(scaled)]
            if any(x.denominator != 1 for x in scaled):
                continue
            scaled_by = [g for g, e in zip(mesh, combo) if e]
            if any(scaled[self.plan.axis[g]] != scaled[0] for g in scaled_by):
                continue
            try:
                inner = self(tuple(int(x) for x in scaled), what)
            except FitError:
                continue
            if not any(inner.has(SYMS[g]) for g in scaled_by):
                return sympy.expand(inner * sympy.Mul(*[SYMS[g] ** e for g, e in zip(mesh, combo)]))
        return None

    def _fit_cleared(self, sig: tuple[int, ...], deps: list[str]):
        """``sig`` times ``DP``, ``TP`` or ``DP·TP`` (those among ``deps``) fitted by the first
        exponent stages (no recursion), divided back, where the result has each mesh symbol at
        exponent -1, 0 or 1 (:data:`LINEAR_ONLY`); or None."""
        mesh = [g for g in MESH_SYMBOLS if g in deps]
        for k in range(1, len(mesh) + 1):
            for gs in itertools.combinations(mesh, k):
                scaled = [Fraction(v) for v in sig]
                for g in gs:
                    scaled = [x * self.Xi[g][i] for i, x in enumerate(scaled)]
                got = self._sparse(tuple(int(x) for x in scaled), deps, EXPONENT_STAGES[:1] + EXPONENT_STAGES[2:3])
                if got is None:
                    continue
                out = sympy.expand(got / sympy.Mul(*[SYMS[g] for g in gs]))
                if all(abs(t.as_powers_dict().get(SYMS[g], 0)) <= 1 for t in sympy.Add.make_args(out) for g in gs):
                    return out
        return None

    def _fit_factored(self, sig: tuple[int, ...], deps: list[str]):
        """``sig`` as (a size fitted before, of two or more terms) times a cofactor, or None: a
        depthwise convolution's padded output holds B·(H·D + 2·K·N_state)·(S + K_conv − 1)
        elements, six monomials in seven symbols (Mamba-2), more than :meth:`_sparse` tries, but
        its channels H·D + 2·K·N_state are the convolution weight's size, fitted before. Each
        earlier signature (:attr:`cache`) that divides ``sig`` at every probe is tried, most
        symbols first, then each symbol alone (a batch B times a sum of three monomials in four
        other symbols, beyond the sparse search over five); the quotient is fitted by the sparse search over its own dependencies
        (multilinear, ratios, squares; as many terms as :data:`COFACTOR_BUDGET` allows). Exact at
        every probe (with two to spare), since both factors are."""
        out = None
        sig_set = set(deps)
        cands = []
        for dsig, expr in self.cache.items():
            if len(dsig) != len(sig) or not isinstance(expr, sympy.Expr) or not isinstance(expr, sympy.Add):
                continue
            names = {str(x) for x in expr.free_symbols}
            if not names or not names <= sig_set or any(v == 0 for v in dsig):
                continue
            if any(a % b for a, b in zip(sig, dsig)):
                continue
            cands.append((-len(names), len(sympy.Add.make_args(expr)), dsig, expr))
        cands.sort(key=lambda c: (c[0], c[1], c[2]))
        cands = cands[:6]  # (each failing candidate costs a sparse search: Swin-T 13 s -> 52 s at 24)
        for s in deps:  # then one symbol: B·(8·C·IMG² + 4·S·XD + 8), a U-Net's inputs' bytes
            col = tuple(int(x) for x in self.Xi[s])
            if not any(a % b for a, b in zip(sig, col)):
                cands.append((0, 1, col, SYMS[s]))
        for _, _, dsig, expr in cands:
            q = tuple(a // b for a, b in zip(sig, dsig))
            if all(v == q[0] for v in q):
                out = sympy.Integer(q[0]) * expr
            else:
                qdeps = [s for s, i in self.plan.axis.items() if q[i] != q[0]]
                if not qdeps or not set(qdeps) <= sig_set:
                    continue
                # fewest terms first over every stage (a cofactor of three monomials with a square
                # before one of eight multilinear ones that the probes cannot tell apart)
                co = None
                for k in range(1, COFACTOR_TERMS + 1):
                    co = self._sparse(q, qdeps, EXPONENT_STAGES[:3], budget=COFACTOR_BUDGET, terms=k)
                    if co is not None:
                        break
                if co is None:
                    continue
                out = co * expr
            # the product must need every dependency (as the sparse search's supports do)
            if {str(x) for x in out.free_symbols} == sig_set:
                return sympy.expand(out)
        return None

    def _sparse(self, sig: tuple[int, ...], deps: list[str], stages, budget: int | None = None,
                terms: int | None = None):
        """The sparse search: ``sig`` as at most four monomials of ``deps`` with exponents of
        ``stages`` (three over more than 16 monomials, two over more than 64; with ``budget``,
        as many as keep the combinations tried per stage within it; with ``terms``, exactly that
        many, within those bounds), exact at every probe with two to spare; or None."""
        y = np.array(sig, dtype=np.float64)
        n = len(sig)
        for exps in stages:
            monos = [
                m for m in _monomials(deps, exps, self.divisors)
                if all(abs(e) + 1 <= self.distinct[s] for s, e in m.items())  # determinable
            ]
            cols = [self._column(m) for m in monos]
            max_terms = 4 if len(monos) <= 16 else (3 if len(monos) <= 64 else 2)
            if budget is not None:
                while max_terms < len(monos) and math.comb(len(monos), max_terms + 1) <= budget:
                    max_terms += 1
            for k in range(terms or 1, (min(terms, max_terms) if terms else max_terms) + 1):
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
                    terms = None
                    for bound in DENOMINATORS:
                        fr = [Fraction(c).limit_denominator(bound) for c in coef]
                        if any(c == 0 for c in fr):
                            break
                        trial = [(fr[t], monos[j]) for t, j in enumerate(subset)]
                        if self._exact(trial, sig):
                            terms = trial
                            break
                    if terms is not None:
                        return sympy.Add(*[
                            sympy.Rational(c.numerator, c.denominator)
                            * sympy.Mul(*[SYMS[s] ** e for s, e in m.items() if e])
                            for c, m in terms
                        ])
        return None

    def _fit_separable(self, sig: tuple[int, ...], deps: list[str]):
        """``sig`` as (a monomial in every dependency but one, x) times (a polynomial in x of
        degree up to 3, every term allowed), or None: a feature map's size in a residue class of
        the image side, B·H·D·(IMG/8 + 1/2)^2 (a Swin stage padded to whole windows), is a dense
        quadratic in IMG times the other sizes, more terms than the sparse search tries over
        four symbols. The quotient by the monomial must be equal at probes of equal x; the
        polynomial in x is the interpolant of its distinct values (exact, rational) and holds
        only with two of them to spare."""
        if not 2 <= len(deps) <= 5:
            return None
        for x in deps:
            xs = self.Xi[x]
            distinct = sorted(set(xs))
            if len(distinct) < 4:  # (a degree-1 polynomial with two values to spare)
                continue
            others = [s for s in deps if s != x]
            choices = [(1, -1, 2) if s in self.divisors else (1, 2) for s in others]
            for exps in sorted(itertools.product(*choices), key=lambda e: sum(map(abs, e))):
                q: dict[Fraction, Fraction] = {}
                ok = True
                for i, v in enumerate(sig):
                    m = Fraction(1)
                    for s, e in zip(others, exps):
                        m *= self.Xi[s][i] ** e
                    val = Fraction(v) / m
                    if q.setdefault(xs[i], val) != val:
                        ok = False
                        break
                if not ok:
                    continue
                X = SYMS[x]
                poly = sympy.expand(sympy.interpolate([(sympy.Rational(k.numerator, k.denominator),
                                                        sympy.Rational(w.numerator, w.denominator))
                                                       for k, w in sorted(q.items())], X))
                degree = sympy.Poly(poly, X).degree() if poly.has(X) else 0
                if degree > 3 or degree > len(distinct) - 3 or poly == 0:
                    continue
                mono = sympy.Mul(*[SYMS[s] ** e for s, e in zip(others, exps)])
                return sympy.expand(poly * mono)
        return None

    def _fit_group(self, sig: tuple[int, ...], what: str, g: str):
        """``sig`` as (a size in the model's symbols) · ``g``^±1 (a shard, or ``g`` shards), or
        None."""
        dp = self.Xi[g]
        depth = getattr(self, "_group_depth", 0)
        if depth >= 2:  # (a signature scaled by g twice is no shard of a size: stop)
            return None
        self._group_depth = depth + 1
        try:
            for e in (-1, 1):
                scaled = [Fraction(v) / dp[i] ** e for i, v in enumerate(sig)]
                if any(x.denominator != 1 for x in scaled):
                    continue
                try:
                    inner = self(tuple(int(x) for x in scaled), what)
                except FitError:
                    continue
                if SYMS[g] not in inner.free_symbols:
                    return sympy.expand(inner * SYMS[g] ** e)
            return None
        finally:
            self._group_depth = depth

    def _fit_hints(self, sig: tuple[int, ...]):
        """``sig`` as a rational combination of :attr:`hints` (and each hint / DP where DP is a
        symbol), or None: a buffer that packs several parameters (FSDP2's all-gather buffer of a
        block) has a size that sums many monomials, more than the sparse search tries, but few
        parameter sizes. Accepted, as every fit, only if it reproduces every probe exactly with
        two to spare."""
        if not self.hints:
            return None
        variants = [list(self.hints)]
        if "DP" in self.plan.symbols:  # shards, then whole and shards mixed
            variants += [[h / SYMS["DP"] for h in self.hints], list(self.hints) + [h / SYMS["DP"] for h in self.hints]]
        if "TP" in self.plan.symbols and self.hint_groups:
            # a block's TP-local parameters, some split over TP and some replicated (the router and
            # norms under --ep --tp), whole (FSDP2's all-gather buffer) or as one rank's shards over
            # a data-parallel group (its reduce-scatter output; docs/parallel.md §14.9)
            # (the columns are near-collinear on the probes, where lstsq's least-norm answer is no
            # rational combination: their subsets of up to 4 sizes are tried, fewest first)
            local = list(self.hints) + [h / SYMS["TP"] for h in self.hints]
            for exprs in [local] + [[h / g for h in local] for g in self.hint_groups]:
                got = self._fit_subsets(sig, exprs)
                if got is not None:
                    return got
        for exprs in variants:
            got = self._fit_combination(sig, exprs)
            if got is not None:
                return got
        return None

    def _fit_subsets(self, sig: tuple[int, ...], exprs: list, most: int = 4):
        """``sig`` as a rational combination of at most ``most`` of ``exprs`` (fewest first), or None
        (:meth:`_fit_combination` on each subset)."""
        import itertools

        syms = [SYMS[s] for s in self.plan.symbols]
        rows = [[p[s] for s in self.plan.symbols] for p in self.plan.points]
        cols = [np.array([float(f(*r)) for r in rows]) for f in (sympy.lambdify(syms, e, "math") for e in exprs)]
        y = np.array(sig, dtype=np.float64)
        tol = 1e-9 * max(1.0, float(np.abs(y).max()))
        for k in range(1, min(most, len(exprs), len(sig) - 2) + 1):
            for sub in itertools.combinations(range(len(exprs)), k):
                A = np.stack([cols[i] for i in sub], axis=1)
                coef, *_ = np.linalg.lstsq(A, y, rcond=None)
                if np.abs(A @ coef - y).max() > tol:  # (floats first: the exact check on a near fit only)
                    continue
                got = self._fit_combination(sig, [exprs[i] for i in sub])
                if got is not None:
                    return got
        return None

    def _fit_combination(self, sig: tuple[int, ...], exprs: list):
        syms = [SYMS[s] for s in self.plan.symbols]
        fns = [sympy.lambdify(syms, e, "math") for e in exprs]
        rows = [[p[s] for s in self.plan.symbols] for p in self.plan.points]
        cols = [np.array([float(f(*r)) for r in rows]) for f in fns]
        n = len(sig)
        if n - len(cols) < 2:
            return None
        A = np.stack(cols, axis=1)
        coef, *_ = np.linalg.lstsq(A, np.array(sig, dtype=np.float64), rcond=None)
        fr = [Fraction(c).limit_denominator(720) for c in coef]
        expr = sympy.Add(*[sympy.Rational(c.numerator, c.denominator) * e for c, e in zip(fr, exprs) if c != 0])
        for r, v in zip(rows, sig):
            got = sympy.nsimplify(expr.subs(dict(zip(syms, r))))
            if got != v:
                return None
        return sympy.expand(expr)

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
