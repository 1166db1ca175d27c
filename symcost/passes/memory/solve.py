"""Solving the memory model: the largest B (or S) whose peak fits under a cap, exact at the
boundary, the component that dominates, why nothing fits, and gradient-accumulation plans
(B_global = B_micro × K × N_devices, conventions.md).
"""
from __future__ import annotations

import math
import time

import sympy
from sympy.polys.domains import QQ
from sympy.polys.rings import ring as _ring

from symcost.errors import SymcostError
from symcost.units import binary, dominant_text, gib, parse_memory
from symcost.passes.memory.live import _feasible_sup, _geq, _peval
from symcost.passes.memory.results import AccumulationPlan, NothingFits, Solution


class Solver:
    """Mixed into :class:`~symcost.passes.memory.model.MemoryModel`: what needs its ``peak``,
    ``components`` and live sets (``_cands``, ``_poly``, ``static``)."""

    # -- solving -------------------------------------------------------------------------------------
    def solve(self, cap: int | str, var: str = "B", accumulate: bool = False, **sizes: int) -> Solution:
        """Largest integer ``var`` (``B``, ``S``, or a size of the model such as the image side
        ``IMG``) with peak <= ``cap`` at the other ``sizes``.

        Each candidate live set, with the other sizes substituted, is a polynomial in ``var``
        (non-decreasing: a sum of storage sizes); sympy solves ``static + c(var) <= cap`` for each
        that can win (``solve_univariate_inequality``) and the answer is the floor of the smallest
        supremum. Then M(value) <= cap < M(value + 1) is checked by exact integer evaluation.
        Where the trace's formulas hold for ``var`` only within a residue class (``an.residues``:
        an image side that strides floor, ConvNeXt's IMG ≡ r mod 32), the answer is the largest
        value of that class, checked against the next one: M(value) <= cap < M(value + m)
        (``Solution.next_value``, ``modulus``); the model's limits (``spec.check``: IMG at least
        a patch) are met by the answer.

        Raises:
            SymcostError: ``var`` not a symbol of the model, pinned by the trace (its peak is no
                formula in it), or set in ``sizes``; bad sizes/cap.
        """
        t0 = time.perf_counter()
        cap = parse_memory(cap)
        if var in (getattr(self.an, "pinned", {}) or {}):
            why = (getattr(self.an, "pin_reasons", {}) or {}).get(var, "its regime")
            raise SymcostError(f"cannot solve for {var}: this trace pinned it at {self.an.pinned[var]} ({why}), so its "
                               f"peak is no formula in {var}; solve for B at --set {var}=... instead")
        if var not in self.gens:
            raise SymcostError(f"cannot solve for {var!r}: not a symbol of {self.an.model} "
                               f"(symbols: {', '.join(self.gens)})")
        sizes = dict(sizes)
        if var in sizes:
            raise SymcostError(f"--set {var}=... conflicts with solving for {var}")
        # a symbol whose sizes are polynomials only within a residue class (an image side that
        # strides floor: ConvNeXt's IMG mod 32): the admissible values are first, first + m, ...
        m, r = (getattr(self.an, "residues", {}) or {}).get(var, (1, 0))
        first = r if r >= 1 else m
        bound = (getattr(self.an, "bounds", None) or {}).get(var)  # (a padded size's regime: Analysis.bounds)
        if bound is not None and first < bound[0]:
            first = bound[0]  # (in the class: pad_bounds' lower end is)
        env = self._env({**sizes, var: first})
        fixed = {s: env[s] for s in self._syms if str(s) != var}
        L = fixed  # (every stack's length but var's: MemoryModel._cands)
        X = sympy.Symbol(var, positive=True)
        vi = self.gens.index(var)

        if var in self.alg.inverted:  # (1/var is a generator of its own: the peak is no polynomial in var)
            raise SymcostError(f"cannot solve for {var}: sizes divide by it (W/{var} per group, a shard), so the "
                               f"peak is no polynomial in {var}; solve for B or S at --set {var}=... instead")
        Ru, xu = _ring([X], QQ)
        vals = [int(fixed[sy]) if j != vi else None for j, sy in enumerate(self._syms)]
        for mesh in self.alg.inverted:  # the ring's generators 1/G (own divisors), 1/DP, 1/TP (tracing/poly.py)
            vals.append(sympy.polys.domains.QQ(1, vals[self.gens.index(mesh)]))

        def univariate(p):
            """``p`` with the other sizes substituted: a polynomial in ``var`` (ring ``Ru``)."""
            out: dict = {}
            for m, c in p.items():
                t = c
                for j, e in enumerate(m):
                    if j != vi and e:
                        t *= vals[j] ** e
                out[(m[vi],)] = out.get((m[vi],), 0) + t
            return Ru.from_dict({k: v for k, v in out.items() if v})

        static_u = univariate(self._poly(self.static))
        cands = [univariate(c.poly) + static_u for c in self._cands(L, accumulate)]
        # univariate dominance on var >= 1
        sh = [(u.compose(xu, xu + 1), u) for u in cands]
        kept = []
        for s_, u in sh:
            if any(_geq(k[0], s_) for k in kept):
                continue
            kept = [k for k in kept if not _geq(s_, k[0])]
            kept.append((s_, u))

        def M(x: int) -> int:
            return int(max(_peval(u, (x,)) for u in cands))

        bounds = []
        ineqs = []
        for _, u in kept:
            expr = u.as_expr()
            ineqs.append(expr)
            if not expr.has(X):
                bounds.append(sympy.oo if expr <= cap else sympy.Integer(0))
                continue
            bounds.append(_feasible_sup(expr - cap, X))
        sup = min(bounds, key=lambda b: float("inf") if b is sympy.oo else float(b)) if bounds else sympy.oo
        shown = " and ".join(f"{sympy.sstr(e)} <= {cap}" for e in ineqs[:3]) + (" ..." if len(ineqs) > 3 else "")
        limited_by = None
        if sup is sympy.oo:
            raise SymcostError(f"the peak memory of {self.an.model} does not grow with {var}; no largest {var}")
        value = int(sympy.floor(sup))
        # exact integer check (the floor of an exact root needs no mending; if it ever did, the
        # mending is counted in Solution.adjusted)
        adjusted = 0
        while value >= 1 and M(value) > cap:
            value -= 1
            adjusted += 1
        while M(value + 1) <= cap:
            value += 1
            adjusted += 1
        # the model's own limits (e.g. S <= n_positions, IMG a multiple of 4), checked on the full
        # set of values: pinned (B = 1), defaulted and tied symbols included
        check = self.an.spec.check
        named = {str(s): int(v) for s, v in fixed.items()}

        def valid(x):
            return check(self.full_values({**named, var: x}))

        # the admissible values are periodic: the trace's residue class (m, r) and the model's
        # "multiple" limits on var (and "divides" ones where var is the multiple) repeat every period
        period = m
        for c in getattr(self.an.spec, "constraints", ()) or ():
            if c.kind == "multiple" and c.a == var and isinstance(c.b, int):
                period = math.lcm(period, c.b)
            elif c.kind == "divides" and c.b == var and isinstance(named.get(c.a), int):
                period = math.lcm(period, named[c.a])

        def periodic(x):
            return (x - r) % m == 0 and not any(
                (c.kind == "multiple" and c.a == var and isinstance(c.b, int) and x % c.b)
                or (c.kind == "divides" and c.b == var and isinstance(named.get(c.a), int) and x % named[c.a])
                for c in getattr(self.an.spec, "constraints", ()) or ())

        def down(x):  # the largest periodic-admissible value <= x (0: none)
            for y in range(x, max(0, x - period), -1):
                if periodic(y):
                    return y
            return 0

        least = next((y for y in range(1, period + 1) if periodic(y)), 1)
        if bound is not None:
            least = max(least, first)
        memory_value = value
        if bound is not None and bound[1] is not None and value > bound[1]:
            from symcost.tracing.probes import bounds_words

            value = bound[1]
            limited_by = (f"the trace's regime {bounds_words(var, bound, (getattr(self.an.spec, 'pads', None) or {}).get(var))} "
                          f"(trace again at a larger {var}); memory alone would allow {var} = {memory_value}")
        elif bound is not None and value < bound[0]:
            value = 0  # (not even the regime's smallest value fits)
        value = down(value) if value >= 1 else 0
        if value >= 1 and valid(value):
            # the largest admissible value the model's other limits allow (a limit such as S <=
            # n_positions: valid below it), by bisection over value - k*period
            why = valid(value)
            # (bisection on the smallest k whose value is valid: valid for every larger k)
            lo, hi = 0, (value - least) // period + 1
            while lo < hi:
                mid = (lo + hi) // 2
                if valid(value - mid * period) is None:
                    hi = mid
                else:
                    lo = mid + 1
            limited_by = f"{why}; memory alone would allow {var} = {memory_value}"
            value = value - lo * period if lo <= (value - least) // period else 0
        nxt = value + period if value >= 1 else least
        sol = Solution(var=var, value=value, cap=cap,
                       memory_at=M(value) if value >= 1 else None,
                       memory_next=M(nxt), next_value=nxt, modulus=period,
                       sizes={**dict(getattr(self.an, "pinned", {}) or {}), **{str(s): int(v) for s, v in fixed.items()}},
                       bound=sup, inequality=shown, limited_by=limited_by, adjusted=adjusted)
        sol.checked = (value == 0 or sol.memory_at <= cap) and (limited_by is not None or sol.memory_next > cap)
        if value == 0:
            sol.dominant = self.dominant(**{**{str(s): int(v) for s, v in fixed.items()}, var: least})
        sol.seconds = time.perf_counter() - t0
        return sol

    def dominant(self, **sizes: int) -> tuple[str, int]:
        """The largest component at ``sizes``: (name, bytes)."""
        comp = self.components(**sizes)
        names = {"params": "parameters", "grads": "gradients", "optimizer": "optimizer state",
                 "master_weights": "master weights", "activations": "activations", "kv_cache": "KV cache"}
        name = max(names, key=lambda k: comp[k])
        return names[name], comp[name]

    def no_fit_reason(self, sol: Solution, **sizes: int) -> str | None:
        """Why no ``sol.var`` fits under ``sol.cap`` (None when one does), with the numbers in
        bytes: the model's own limit (``sol.limited_by``); else the static memory at ``var = 1``
        (parameters + optimizer state + master weights + buffers + inputs, as :attr:`static`)
        when it alone exceeds the cap; else the peak at ``var = 1``, static + its largest live
        set (activations, gradients, temporaries). ``sizes``: the other sizes, as given to
        :meth:`solve`.
        """
        if sol.value >= 1:
            return None
        v = sol.var
        if sol.limited_by:
            return f"no {v} >= 1 is valid: {sol.limited_by}"
        at1 = {**{k: x for k, x in sizes.items() if k != v}, v: 1}
        comp = self.components(**at1)
        parts = {"parameters": comp["params"], "optimizer state": comp["optimizer"],
                 "master weights": comp["master_weights"], "gradient buffer": comp["grad_buffer"],
                 "buffers": comp["buffers"], "inputs": comp["inputs"],
                 "KV cache": comp["kv_cache"]}
        static = sum(parts.values())
        cap = f"the cap {sol.cap:,} bytes ({binary(sol.cap)})"
        if static > sol.cap:
            shown = " + ".join(f"{name} {b:,}" for name, b in parts.items() if b or name == "parameters")
            return (f"the static memory alone exceeds {cap}: {shown} = {static:,} bytes ({binary(static)}) "
                    f"at {v} = 1")
        peak = comp["peak"]
        name, nbytes = self.dominant(**at1)
        return (f"the peak at {v} = 1, {peak:,} bytes ({binary(peak)}), exceeds {cap}: static memory "
                f"{static:,} bytes + the largest live set {peak - static:,} bytes (activations, gradients, "
                f"temporaries); {dominant_text(name, nbytes, sol.cap)}")

    def plan_accumulation(self, global_batch: int, devices: int, cap: int | str,
                          **sizes: int) -> AccumulationPlan:
        """Micro-batch and accumulation steps K for ``global_batch`` over ``devices``.

        B_global = B_micro x K x N_devices (conventions.md), with B_micro the largest divisor of
        the per-device batch whose accumulation micro-step fits under ``cap`` (K = 1 if the whole
        per-device batch fits without accumulation).

        Raises:
            SymcostError: non-positive numbers, ``global_batch`` not divisible by ``devices``,
                B set in ``sizes``, or not even B = 1 fits (the message names the dominant part).
        """
        cap = parse_memory(cap)
        for what, v in (("global batch", global_batch), ("devices", devices)):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise SymcostError(f"{what} must be a positive integer, got {v!r}")
        if global_batch % devices:
            raise SymcostError(
                f"global batch {global_batch} is not divisible by {devices} devices "
                f"(B_global = B_micro x K x N_devices); use a multiple of {devices}"
            )
        b = global_batch // devices
        sizes = dict(sizes)
        sizes.pop("B", None)
        full = self.peak(B=b, **sizes)
        F = lambda B: int(sympy.sympify(self.an.flops("train")).xreplace(self._env({**sizes, "B": B})))  # noqa: E731
        if full <= cap:
            return AccumulationPlan(global_batch, devices, b, b, 1, b, True, full, full, F(b),
                                    F(b) * devices, cap, "the per-device batch fits without accumulation")
        sol = self.solve(cap, "B", accumulate=True, **sizes)
        if sol.value < 1:
            name, nbytes = sol.dominant
            raise NothingFits(
                f"not even a micro-batch of 1 fits under {gib(cap)} (peak {gib(sol.memory_next)}); "
                f"{dominant_text(name, nbytes, cap)}"
            )
        bmax = min(sol.value, b)
        micro = max(d for d in range(1, bmax + 1) if b % d == 0)
        K = b // micro
        exact = micro == bmax
        note = ""
        if not exact:
            k2 = -(-b // bmax)
            note = (f"no exact split of the per-device batch {b} uses the largest micro-batch that fits "
                    f"({bmax}); using its largest divisor B_micro = {micro} (K = {K}); the nearest inexact "
                    f"split is B_micro × K × N_devices = {bmax} × {k2} × {devices} = {bmax * k2 * devices}")
        mem = self.peak(accumulate=True, B=micro, **sizes)
        return AccumulationPlan(global_batch, devices, b, micro, K, sol.value, exact, mem, full,
                                K * F(micro), K * F(micro) * devices, cap, note)
