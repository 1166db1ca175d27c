"""Probe configurations of a trace: the sizes each probe recording is made at (docs/tracing.md,
"Probes"). A base probe in the request's regime (:func:`find_base`), one probe per symbol that
changes that symbol alone, and random probes (:func:`plan_probes`), all keeping symbols apart
(distinct values, none 0 or 1), within the model's constraints and in the request's regime;
random points for the checks (:func:`random_point`, :func:`random_near`). The fit of the
recordings' sizes is :mod:`symcost.tracing.fit`, which re-exports these names.
"""
from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from symcost.errors import SymcostError
from symcost.tracing.symbols import ALTS, BASE, MESH_SYMBOLS, POOLS, SYMS  # noqa: F401

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


#: Symbols that may divide another in a fitted size (exponent -1): H/K (query heads per kv head), N·R/E (token slots per expert), P/DP, P/TP (a shard), S/CP
DIVISORS = ("K", "E", "DP", "TP", "EP", "CP")


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


def pad_bounds(value: int, m: int) -> tuple[int, int | None]:
    """The range ``[lo, hi]`` (``hi`` None: no upper bound) of the regime of ``value`` for a size
    the model pads up to whole chunks of ``m`` (``ModelSpec.pads``: Mamba-2's c·⌈S/c⌉): below one
    chunk, 2..m-1 (one padded chunk of constant length m; 1 runs other kernels); m itself alone
    (one whole chunk, no padding op); above, from the first value of two chunks or more in
    ``value``'s class mod m (m + r, or 2m for r = 0; one chunk runs other ops than two or more,
    measured on transformers' Mamba-2 scan). Torch-free."""
    if value < m:
        return (2, m - 1)
    if value == m:
        return (m, m)
    r = value % m
    return (m + r if r else 2 * m, None)


def bounds_words(symbol: str, bound, m: int | None = None) -> str:
    """``bound`` (``[lo, hi]``, ``hi`` None: none) of ``symbol`` in words for the report and the
    errors, with why where ``m`` (its ``ModelSpec.pads`` chunk) is given:
    "2 ≤ S ≤ 7 (one padded chunk of 8)"."""
    lo, hi = bound
    text = (f"{symbol} = {lo}" if lo == hi else f"{lo} ≤ {symbol} ≤ {hi}" if hi is not None
            else f"{symbol} ≥ {lo}")
    if m:
        text += (f" (one padded chunk of {m})" if hi is not None and hi < m
                 else f" (one whole chunk of {m})" if hi == m else f" (two or more chunks of {m})")
    return text


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
    # A base that breaks a constraint through a tie (a follower takes its leader's small value: a
    # request K = D = 2 ties K to D, whose 8 must then divide H = 6): the leader's other values,
    # the follower with it, before a random point (with B pinned at 1 the repair above has nothing
    # to vary, and a random point's sizes, H = 14 with K = 7, may leave H no other value in its
    # pool: hf:mamba2 at B = 1 pinned H, D, K, N_state and K_conv). At most 3 candidates recorded.
    tried = 0
    for leader in dict.fromkeys(ties.values()):
        if leader not in free or tried >= 3:
            continue
        for v in pools[leader]:
            trial = _complete(dict(base, **{leader: v}), ties)
            if trial == base or not _ok(trial, check) or not varies_e(trial):
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


def frozen_blocks_differ(model, containers: Mapping[str, str], recorded: frozenset = frozenset()) -> Unvariable | None:
    """The guard of a fold over a stack's length against frozen parameters (``requires_grad=False``):
    the pin (an :class:`Unvariable` of the stack's symbol, its message the reason) where the blocks
    of a container (``containers``: container -> its length symbol, L or a model's own ``L_enc``)
    in ``model`` — the model built at the requested sizes — differ in which of their parameters are
    frozen, or where they all agree but not with block 0 of the probes' recording (``recorded``:
    that recording's frozen parameter names, unfolded): the fold names one block's parameters for
    all of them (``layers.{i}.w``), so one block's frozen status would be every block's, and a
    frozen block's missing gradient, optimizer state and step counter would be applied to all or to
    none. That changes a recorded op only where the block's backward skips a weight gradient; a
    frozen parameter beyond the probes' blocks (block 5 of the request's 12, the probes holding 2 or
    3) changes none of theirs. None where every block agrees (the usual case: nothing frozen, or a
    frozen base in every block, LoRA-style)."""
    for c, sym in containers.items():
        where = c or "the model (a list of blocks)"
        try:
            blocks = [m for _, m in model.get_submodule(c).named_children()]
        except AttributeError:
            continue
        pats = [frozenset(n for n, p in b.named_parameters() if not p.requires_grad) for b in blocks]
        if not pats:
            continue
        differ = [i for i, p in enumerate(pats) if p != pats[0]]
        if differ:
            i = differ[0]
            names = sorted(pats[0] ^ pats[i])
            e = Unvariable(sym, (
                f"the blocks of {where} differ in which parameters are frozen (requires_grad=False: block 0 has "
                f"{len(pats[0])} frozen, block {i} {len(pats[i])}; e.g. {names[0]}), so no block stands for the "
                f"others: traced unfolded at the requested {sym}"))
            e.stack = True
            return e
        # (a recorded name through a wrapper the layout added: activation checkpointing's, compile's)
        unwrapped = (n.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "") for n in recorded)
        first = f"{c}.0." if c else "0."  # (the root itself a block list: nn.Sequential of blocks)
        probe = frozenset(n[len(first):] for n in unwrapped if n.startswith(first))
        if probe != pats[0]:
            e = Unvariable(sym, (
                f"the blocks of {where} freeze other parameters at the requested {sym} = {len(blocks)} ({len(pats[0])} "
                f"frozen per block) than at the probes' {sym} ({len(probe)}), so no probe stands for them: traced "
                f"unfolded at the requested {sym}"))
            e.stack = True
            return e
    return None
