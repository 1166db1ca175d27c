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

Probes keep symbols apart (distinct values, none 0 or 1, so PyTorch cannot specialise or merge
them), respect the model's constraints (K divides H, D even, ...) and stay in the regime of the
requested sizes (``plan_probes``'s ``accept``: the caller records a probe and compares the ops it
runs with the request's). The caller checks the rebuilt formulas again at fresh probes that took
no part in the fit.
"""
from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass
from fractions import Fraction
from typing import Callable, Mapping, Sequence

import numpy as np
import sympy

from symcost.errors import SymcostError

from symcost.tracing.symbols import (ALTS, BASE, MESH_SYMBOLS, POOLS, SYMS,  # noqa: F401  (their home)
                                     parse_formula)

#: L of the probe recordings the formulas are fitted on, and of the fresh recordings that check them
FIT_L = 2
CHECK_L = 3

#: Random probes of a fit, besides the base probe and one per symbol. Three suffice for every
#: built-in and real-config model (the formulas equal those of six, compared on seven models);
#: each probe is a recording (about half a second on a CPU), and what the probes miss is
#: caught before ``trace`` returns: the formulas are checked at the request and at two fresh
#: probes with L = 3, and a mismatch, or a signature no polynomial fits, fits again on twice as
#: many random probes before anything is pinned.
N_RANDOM = 3


@dataclass
class ProbePlan:
    """Probe configurations: ``points[0]`` is the base, ``axis[s]`` the index of s's probe.

    Every point holds a value for each of ``symbols``, the fixed (pinned) ones, and the tied
    followers (equal to their leader), so a point can be recorded as it is.
    """

    symbols: tuple[str, ...]
    points: list[dict[str, int]]
    axis: dict[str, int]
    #: the model's own symbols that divide another (:func:`model_divisors`): the fit lets them take
    #: exponent -1 besides :data:`DIVISORS`
    divisors: tuple[str, ...] = ()


class Unvariable(SymcostError):
    """No probe varies ``symbol`` alone while staying in the request's regime: pin it."""

    def __init__(self, symbol: str, msg: str):
        super().__init__(msg)
        self.symbol = symbol


class NoProbes(SymcostError):
    """No base probe passes the model's constraints and stays in the request's regime
    (:func:`find_base`)."""


class FitError(SymcostError):
    """A signature no polynomial reproduces; ``deps`` are the symbols it changes with."""

    def __init__(self, msg: str, deps: Sequence[str]):
        super().__init__(msg)
        self.deps = tuple(deps)


def _complete(values: Mapping[str, int], ties: Mapping[str, str]) -> dict[str, int]:
    """``values`` with every tied follower set to its leader's value."""
    out = dict(values)
    for follower, leader in ties.items():
        if leader in out:
            out[follower] = out[leader]
    return out


def _ok(values: Mapping[str, int], check: Callable[[Mapping[str, int]], str | None]) -> bool:
    return check(values) is None


def probe_pool(symbol: str, request: int | None = None, modulus: int | None = None) -> list[int]:
    """Probe values for ``symbol``, in the order they are tried: the small alternates and pool,
    then values around the requested one (for a symbol whose small values leave the regime or
    break a constraint, e.g. D at least a rotary dimension of 64). With ``modulus`` m, only
    values in the request's residue class mod m (a partial rotary dimension int(D*f) is
    polynomial there). Never 0 or 1 (PyTorch specialises those)."""
    small = list(dict.fromkeys(ALTS.get(symbol, ()) + tuple(POOLS[symbol])))
    near: list[int] = []
    if request is not None:  # keep the request's parity where the small pool keeps one (D)
        step = modulus or (2 if all(v % 2 == 0 for v in POOLS[symbol]) else 1)
        for k in range(1, 9):
            near += [request + k * step, request - k * step]
    if modulus:
        r = (request or BASE[symbol]) % modulus
        small = [r + modulus * k for k in range(12)]
    vals = [v for v in small + near if v > 1]
    return list(dict.fromkeys(vals))


def random_pools(symbols, base: Mapping[str, int], request: Mapping[str, int] | None = None,
                 moduli: Mapping[str, int] | None = None) -> dict[str, list[int]]:
    """Values random probes draw from: the small pool where the base probe's value is in it, else
    the values around the request (where the base had to go); never a mix of both, so a size
    that depends on a symbol's parity or range (rfft's D//2 + 1) is not fitted across them."""
    request, moduli = dict(request or {}), dict(moduli or {})
    out = {}
    for s in symbols:
        small = probe_pool(s, None, moduli.get(s))
        every = probe_pool(s, request.get(s), moduli.get(s))
        near = [v for v in every if v not in small]
        out[s] = small if (base.get(s) in small or not near) else near
    return out


def _nearest(pool: Sequence[int], target: int) -> int:
    return target if target in pool else min(pool[:12] or pool, key=lambda v: (abs(v - target), v))


def random_near(base: Mapping[str, int], free, check, rng: random.Random, pools: Mapping[str, Sequence[int]],
                ties: Mapping[str, str] | None = None) -> dict[str, int]:
    """A random probe that differs from ``base`` in two or three of the ``free`` sizes (values
    from ``pools``) and passes ``check``: where :func:`random_point`'s draws of every size at once
    never meet the model's constraints together. Raises SymcostError as random_point does."""
    ties = dict(ties or {})
    # each size's values that keep the base within the constraints when it alone changes
    alone = {s: [x for x in list(pools.get(s) or POOLS[s])[:24]
                 if x != base[s] and _ok(_complete(dict(base, **{s: x}), ties), check)]
             for s in free if s not in ties}
    free = [s for s, xs in alone.items() if xs]
    for _ in range(2000):
        v = dict(base)
        for s in rng.sample(free, min(len(free), rng.choice((2, 3)))):
            v[s] = rng.choice(alone[s])
        v = _complete(v, ties)
        if v != dict(base) and _ok(v, check):
            return v
    raise SymcostError(f"could not find probe sizes for {tuple(free)} that satisfy the model's constraints")


def random_point(symbols, check, rng: random.Random, fixed: Mapping[str, int],
                 pools: Mapping[str, Sequence[int]] | None = None,
                 ties: Mapping[str, str] | None = None) -> dict[str, int]:
    """A random probe respecting ``check``, with distinct values where it can.

    ``pools`` (symbol -> values) default to the small probe pools; ``ties`` (follower -> leader)
    set followers equal to their leaders. Where K and H are both free and untied, H is drawn as a
    multiple 2..4 of K (K divides H, K < H: grouped-query attention, the common regime).
    """
    ties = dict(ties or {})
    for attempt in range(2000):
        v = dict(fixed)
        for s in symbols:
            if s in fixed:
                continue
            pool = (pools or {}).get(s) or POOLS[s]
            v[s] = rng.choice(list(pool)[:24])
        if "K" in v and "H" in v and "H" not in fixed and "K" not in fixed and "K" not in ties:
            v["H"] = v["K"] * rng.choice((2, 3, 4))
        v = _complete(v, ties)
        free = [v[s] for s in symbols if s not in fixed]
        if attempt < 1500 and len(set(free)) < len(free):
            continue
        if _ok(v, check):
            return v
    raise SymcostError(f"could not find probe sizes for {symbols} that satisfy the model's constraints")


def _probe_setup(symbols, fixed, ties, request, moduli, accept):
    """The probe planners' arguments with their defaults, the free symbols and their pools."""
    fixed, ties, request, moduli = (dict(x or {}) for x in (fixed, ties, request, moduli))
    free = [s for s in symbols if s not in fixed]
    pools = {s: probe_pool(s, request.get(s), moduli.get(s)) for s in free}
    return fixed, ties, request, moduli, accept or (lambda p: True), free, pools


def leaves_moe_values(p: Mapping[str, int], free, check, pools: Mapping[str, Sequence[int]],
                      ties: Mapping[str, str]) -> bool:
    """Whether probe ``p`` leaves an MoE's E and R enough values that pass ``check`` with the
    other sizes kept: E divides c·B·S·R at a probe and takes exponent -1, so E needs three values
    (its own included), R two. DeepSeek-V3's E (a multiple of 8, at least 16) with B = 1 needs
    S·R = 48, say. True where E is not free."""
    if "E" not in free:  # E tied to an equal symbol or pinned: the tie probe / the pin decides
        return True
    for s, need in (("E", 3), ("R", 2)):
        if s in free and s in p:
            vals = {v for v in list(pools[s])[:16] if _ok(_complete(dict(p, **{s: v}), ties), check)}
            if len(vals | {p[s]}) < need or not _ok(p, check):
                return False
    return True


#: the lattice of :func:`lattice_point`: multiples of this, the lcm(DP, 4) of a data-parallel
#: probe's base DP = 2 (frontends/parallel.py), and what K | H, an even D and E | B·S·R favour too
LATTICE = 4

#: the lattices :func:`find_base` tries in turn: :data:`LATTICE`, then the coarser ones a
#: data-parallel probe over a tensor-parallel dimension needs: every first dimension a multiple of
#: lcm(DP, 4)·t (frontends/parallel.py ``_indivisible``), t the largest TP of 2, 4, 8 the plan
#: splits at the probe, so up to lcm(2, 4)·8 = 32 at the base DP = 2 (llama-3-8b with K = TP = 8
#: pinned: V and F must be multiples of 32, the base's 56 and 40 are not)
LATTICES = (LATTICE, 8, 16, 32)


def lattice_point(p: Mapping[str, int], free, pools: Mapping[str, Sequence[int]],
                  moduli: Mapping[str, int] | None = None, ties: Mapping[str, str] | None = None,
                  lattice: int = LATTICE) -> dict[str, int]:
    """``p`` with each free size moved up to the nearest multiple of ``lattice`` in its probe
    pool (where the pool holds one), for a probe that must meet several divisibilities at once:
    every first dimension a multiple of lcm(DP, 4) under a data-parallel layout (times the
    largest TP over a tensor-parallel one), E | B·S·R for an MoE. Rounding up keeps the small
    base's orders (K = 2 < H = 6 becomes 4 < 8). Left alone: the mesh sizes (DP, TP: the lattice
    is for their base value 2) and tied followers (set from their leaders). A symbol that keeps
    the request's residue (``moduli``) is left alone on :data:`LATTICE` (as a TP layout's sizes,
    kept in their class mod 8, are multiples of 4 all or none); on a coarser lattice it moves
    within the small values of its class (its pool's first 12), never to the values around the
    request."""
    out = dict(p)
    moduli = moduli or {}
    for s in free:
        if s in MESH_SYMBOLS or s not in out or (s in moduli and lattice <= LATTICE):
            continue
        pool = list(pools[s])[:12] if s in moduli else pools[s]
        up = [v for v in pool if v % lattice == 0 and v >= out[s]]
        if up:
            out[s] = min(up)
    return _complete(out, ties or {})


def _mesh_step(p: Mapping[str, int], free, pools: Mapping[str, Sequence[int]], check,
               ties: Mapping[str, str]) -> list[dict[str, int]]:
    """``p`` with one free mesh size (DP, TP) moved to the next larger value of its pool that
    passes ``check``, one point per such size: for a base whose smallest mesh value is a regime
    of its own (HSDP's DP = R, a shard group of one rank: the pool of DP keeps multiples of R)."""
    out = []
    for g in MESH_SYMBOLS:
        if g not in free or g in ties or g not in p:
            continue
        for v in sorted(x for x in pools[g] if x > p[g]):
            q = _complete(dict(p, **{g: v}), ties)
            if _ok(q, check):
                out.append(q)
                break
    return out


def find_base(symbols: Sequence[str], check, seed: int = 0, fixed: Mapping[str, int] | None = None, *,
              accept=None, request: Mapping[str, int] | None = None, ties: Mapping[str, str] | None = None,
              moduli: Mapping[str, int] | None = None) -> dict[str, int]:
    """The base probe: the small :data:`BASE` sizes if they pass ``check`` and ``accept`` (and
    leave an MoE's E three values), else those sizes with other B, S and small E (a whole number
    of MoE token slots per expert for three values of E), else the same on the lattice of
    multiples of 4 (:func:`lattice_point`: a data-parallel probe's divisibilities), else a
    random small point, else the request itself walked towards the small sizes one symbol at a
    time (each step kept only if it stays in the regime). Arguments as :func:`plan_probes`.

    Raises:
        SymcostError: not even the request passes ``check`` and ``accept``.
    """
    fixed, ties, request, moduli, accept, free, pools = _probe_setup(symbols, fixed, ties, request, moduli, accept)

    def varies_e(p):
        return leaves_moe_values(p, free, check, pools, ties)

    def good(p):
        return _ok(p, check) and varies_e(p) and accept(p)

    base = _complete({**{s: _nearest(pools[s], BASE[s]) for s in free}, **fixed}, ties)
    if good(base):
        return base
    # A base that only misses a divisibility of the token count (an MoE probe needs E | c·B·S·R;
    # E tied to an equal D for a request D = E = 64 takes D's small value), or that leaves E too
    # few values, is repaired with other B, S (and small E) before it is given up for a random
    # point: a random point's sizes may all but rule out varying M apart from a multiple of H.
    # The checks are cheap; at most 3 candidates are recorded.
    #
    # A base that misses divisibilities of sizes beyond B, S and E is tried once more on the lattice
    # of multiples of 4 (:func:`lattice_point`): under a data-parallel layout every parameter's
    # first dimension must be a multiple of lcm(DP, 4) at a probe (frontends/parallel.py), the
    # small base's V = 53 and E = 7 are not, and an MoE's E must besides divide B·S·R three
    # times over; random points meet all of that together too rarely (issue 27: Mixtral under
    # --dp 8 was refused). At most 3 candidates are recorded per starting point. Only a layout's
    # probe (DP or TP a symbol) goes to the lattice: elsewhere its sizes may leave the small pools,
    # and random checks drawn near the request then miss a regime of few values (bloom's ALiBi:
    # H a power of two) six times out of six.
    #
    # Where those fail too (the lattice start checked only), the same with a mesh size one pool
    # value up (HSDP's base DP = R is a shard group of one rank: other ops), then coarser lattices
    # (:data:`LATTICES`: a pinned TP = 8 asks multiples of 32); each start is tried only if it
    # passes ``check`` (no recording otherwise), so a base the first starts found is unchanged.
    starts = [base]
    if set(MESH_SYMBOLS) & set(symbols):
        first = lattice_point(base, free, pools, moduli, ties)
        starts += [first] + _mesh_step(base, free, pools, check, ties) + _mesh_step(first, free, pools, check, ties)
        for lat in LATTICES[1:]:
            coarse = lattice_point(base, free, pools, moduli, ties, lattice=lat)
            starts += [coarse] + _mesh_step(coarse, free, pools, check, ties)
    seen: list[dict[str, int]] = []
    for start in starts:
        if start in seen:
            continue
        seen.append(start)
        if start is not base and good(start):
            return start
        tried = 0

        def alts(s, n=None):
            return [start[s]] + [v for v in pools[s][:n] if v != start[s]] if s in free else [start.get(s)]

        for e, b, s_ in itertools.product(alts("E", 12) if "E" in start else [None], alts("B"), alts("S")):
            trial = dict(start)
            for k, v in (("E", e), ("B", b), ("S", s_)):
                if v is not None and k in start:
                    trial[k] = v
            trial = _complete(trial, ties)
            if trial == start or not _ok(trial, check) or not varies_e(trial):
                continue
            tried += 1
            if accept(trial):
                return trial
            if tried >= 3:
                break
    rng = random.Random(seed + 99)
    for _ in range(2):
        try:
            p = random_point(symbols, check, rng, fixed, pools, ties)
        except SymcostError:
            break
        if accept(p):
            return p
    if request and all(s in request for s in free):
        # walk from the request itself (in its regime by definition) towards small sizes
        cur = _complete({**{s: request[s] for s in free}, **fixed}, ties)
        if not _ok(cur, check):
            # the request need not pass the probe check (FSDP pads a first dimension DP does not
            # divide: llama-3-8b's V = 128256 under DP = 64 over TP = 8 asks multiples of 512):
            # its free mesh sizes at the base's values first (the check's divisibilities are theirs)
            cur = _complete(dict(cur, **{g: base[g] for g in MESH_SYMBOLS if g in free and g in base}), ties)
        if good(cur):
            for s in free:
                trial = _complete(dict(cur, **{s: base[s]}), ties)
                if trial != cur and good(trial):
                    cur = trial
            return cur
    raise NoProbes(f"no probe sizes for {', '.join(free)} stay in the regime of the requested sizes")


def plan_probes(symbols: Sequence[str], check, n_random: int = 8, seed: int = 0,
                fixed: Mapping[str, int] | None = None, *, accept=None,
                request: Mapping[str, int] | None = None, ties: Mapping[str, str] | None = None,
                moduli: Mapping[str, int] | None = None, tries: int = 4,
                base: Mapping[str, int] | None = None, divisors: Sequence[str] = ()) -> ProbePlan:
    """Base probe, one single-symbol change per symbol, and ``n_random`` random probes.

    Args:
        symbols: the symbols to fit (fixed ones included, they keep their value).
        check: ``check(values) -> reason | None``, the model's constraints (cheap).
        fixed: symbol -> value held in every probe (L while fitting, pinned symbols).
        accept: ``accept(point) -> bool``, whether a probe stays in the request's regime (the
            caller records it and compares the ops it runs); default: every point.
        request: the requested values: probes of a symbol whose small values all leave the regime
            are drawn around them, and ``moduli`` residues are taken from them.
        ties: follower -> leader, equal in every probe (the follower is no symbol).
        moduli: symbol -> m: probes keep the request's residue mod m.
        tries: probes recorded per symbol (``accept`` calls) before giving up on varying it.
        base: the base probe (default: :func:`find_base`).
        divisors: the model's own symbols that divide another (:func:`model_divisors`), besides
            :data:`DIVISORS`: each gets a third probe value, as K does.

    Raises:
        Unvariable: no probe changes one symbol alone and stays in the regime (pin it).
        SymcostError: no base probe at all.
    """
    fixed, ties, request, moduli, accept, free, pools = _probe_setup(symbols, fixed, ties, request, moduli, accept)
    ok = lambda p: _ok(p, check)  # noqa: E731
    if base is None:
        base = find_base(symbols, check, seed, fixed, accept=accept, request=request, ties=ties, moduli=moduli)
    points = [base]
    axis = {}
    for s in free:
        n = 0
        for alt in pools[s]:
            if alt == base[s]:
                continue
            p = _complete(dict(base, **{s: alt}), ties)
            if not ok(p):
                continue
            n += 1
            if accept(p):
                axis[s] = len(points)
                points.append(p)
                break
            if n >= tries:
                break
        if s not in axis:
            raise Unvariable(s, f"could not vary {s} alone from {base} within the model's constraints and regime")
    rng = random.Random(seed)
    rpools = random_pools(free, base, request, moduli)
    for _ in range(n_random):
        for _attempt in range(3):
            try:
                p = random_point(symbols, check, rng, fixed, rpools, ties)
            except SymcostError:
                # every size drawn at once rarely meets all divisibilities together (a data-
                # parallel rank over tensor parallelism: each first dimension a multiple of
                # lcm(DP, 4)·TP, H and V in their classes mod 8): vary a few sizes of the base
                p = random_near(base, free, check, rng, rpools, ties)
            if accept(p):
                points.append(p)
                break
    # On two distinct values a ratio (K or E with exponent -1: H/K, N·R/E) and a linear term fit
    # alike: give each divisor symbol a third value (one more single-symbol probe) if it lacks one.
    for s in dict.fromkeys((*DIVISORS, *divisors)):
        seen = {p[s] for p in points} if s in axis else set()
        if s not in axis or len(seen) >= 3:
            continue
        n = 0
        for alt in pools[s]:
            p = _complete(dict(base, **{s: alt}), ties)
            if alt in seen or not ok(p):
                continue
            n += 1
            if accept(p):
                points.append(p)
                break
            if n >= tries:
                break
    return ProbePlan(tuple(symbols), points, axis, tuple(divisors))


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
DIVISORS = ("K", "E", "DP", "TP", "EP", "CP")  # H/K (query heads per kv head), N·R/E (token slots per expert), P/DP, P/TP (a shard), S/CP


def model_divisors(constraints) -> tuple[str, ...]:
    """The symbols a model declares to divide another (``Constraint("divides", a, b)`` with b a
    symbol: a factory's ``G`` groups of ``W`` channels, a patch side ``P`` of ``IMG``), besides
    :data:`DIVISORS`: in a fitted size they may take exponent -1 as K does (W/G channels per
    group, (IMG/P)^2 patches), and the probes give them a third value. Torch-free.

    Args:
        constraints: a :class:`symcost.frontends.spec.Constraint` sequence (``ModelSpec.constraints``).
    """
    return tuple(dict.fromkeys(c.a for c in constraints
                               if c.kind == "divides" and isinstance(c.b, str) and c.a not in DIVISORS))


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
