"""Evaluate symcost's formulas at 10,000 size points vs FlopCounterMode, which needs a fresh run
of the real model per point (issue 2, Acceptance: "under 1 s ... the ratio measured side by side").

symcost: trace once, then ``Analysis.lambdify`` (numpy, vectorised over the points) and, for exact
integers at any size, a plain-Python loop over the same polynomials. FlopCounterMode: build the
real model and run forward + loss + backward under FlopCounterMode at a few small size points,
and extrapolate the mean time per point to 10,000 points (at realistic sizes each run would take
far longer, and most would not fit in memory at all: the extrapolation flatters FlopCounterMode).

Run: ``python benchmarks/bench_eval.py [MODEL ...]`` (default: gpt2 cs336-lm). Prints; asserts
nothing.
"""
from __future__ import annotations

import random
import sys
import time

import numpy as np
import sympy
import torch
from torch.utils.flop_counter import FlopCounterMode

import symcost
from symcost.tracing.fit import SYMS

N_POINTS = 10_000
N_REAL = 4  # real FlopCounterMode runs timed per model
QUANTITIES = ("flops.forward", "flops.backward", "flops.train")

# realistic ranges for the 10,000 formula points
RANGES = {"B": (1, 64), "S": (128, 8192), "H": (8, 64), "D": (64, 128), "L": (2, 80),
          "V": (32_000, 152_000), "F": (1024, 28_672), "K": (1, 8)}
# small ranges for the real runs (they must build and run on a CPU)
SMALL = {"B": (2, 4), "S": (16, 64), "H": (2, 4), "D": (8, 16), "L": (2, 3), "V": (64, 256),
         "F": (32, 96), "K": (1, 2)}


def draw(an, rng: random.Random, ranges) -> dict[str, int]:
    while True:
        v = {s: rng.randint(*ranges[s]) for s in an.symbols}
        if "D" in v:
            v["D"] -= v["D"] % 2
        if "K" in v and "H" in v:
            v["H"] = v["K"] * rng.randint(2, 4)
        full = {**v, **{a: v[b] for a, b in an.spec.tied.items()}}
        if not an.spec.check(full):
            return v


def flopcounter_run(spec, values) -> tuple[float, float, int]:
    """(seconds to build the model, seconds for forward + loss + backward, FlopCounterMode total)."""
    values = {**values, **{a: values[b] for a, b in spec.tied.items()}}
    t0 = time.perf_counter()
    model = spec.build(values).train()
    args, kwargs = spec.make_inputs(values, torch.device("cpu"))
    t1 = time.perf_counter()
    with FlopCounterMode(display=False) as fc:
        spec.loss(model(*args, **kwargs), (args, kwargs)).backward()
    return t1 - t0, time.perf_counter() - t1, fc.get_total_flops()


def bench(model: str) -> str:
    t = time.perf_counter()
    an = symcost.trace(model, precision="fp32", use_cache=False)  # timed: a fresh trace
    t_trace = time.perf_counter() - t
    rng = random.Random(0)

    # symcost, numpy: all points at once
    points = [draw(an, rng, RANGES) for _ in range(N_POINTS)]
    cols = {s: np.array([p[s] for p in points], dtype=np.int64) for s in an.symbols}
    t = time.perf_counter()
    f = an.lambdify(*QUANTITIES)
    t_lambdify = time.perf_counter() - t
    t = time.perf_counter()
    fwd, bwd, train = f(**cols)
    t_numpy = time.perf_counter() - t

    # symcost, exact Python integers: the same polynomials, one point at a time
    syms = [SYMS[s] for s in an.symbols]
    exprs = [an.quantity(q) for q in QUANTITIES]
    integral = all(c.is_Integer for e in exprs for c in sympy.Poly(e, *syms).coeffs())
    py = sympy.lambdify(syms, exprs, modules="math")
    t = time.perf_counter()
    exact = [py(*(p[s] for s in an.symbols)) for p in points]
    t_exact = time.perf_counter() - t
    big = int(np.sum(train >= 2.0**53))
    agree = all(int(x[2]) == int(y) for x, y in zip(exact, train) if y < 2.0**53)

    # FlopCounterMode: a fresh real run per point
    small = [draw(an, rng, SMALL) for _ in range(N_REAL)]
    flopcounter_run(an.spec, small[0])  # warm-up (first-call overheads)
    builds, runs, match = [], [], True
    for v in small:
        tb, tr, measured = flopcounter_run(an.spec, v)
        builds.append(tb)
        runs.append(tr)
        match &= measured == an.subs(**v)["flops.train"]
    per_point = (sum(builds) + sum(runs)) / len(small)
    t_fc = per_point * N_POINTS
    sym_total = t_numpy
    ratio = t_fc / sym_total

    print(f"== {model}: {len(an.ops)} ops, symbols {','.join(an.symbols)}; trace+derive {t_trace:.1f} s (once)")
    print(f"  symcost lambdify (numpy float64), {N_POINTS} points x {len(QUANTITIES)} totals: {t_numpy * 1e3:.2f} ms"
          f" (+ {t_lambdify * 1e3:.0f} ms to build the function)")
    print(f"  symcost exact Python ints, same points:        {t_exact * 1e3:.1f} ms"
          f" (integer coefficients: {integral}; agrees with numpy below 2**53: {agree};"
          f" {big} of {N_POINTS} totals exceed 2**53, where float64 rounds)")
    print(f"  FlopCounterMode, real CPU runs at small sizes: {per_point * 1e3:.1f} ms/point over {N_REAL} runs"
          f" (build {sum(builds) / len(small) * 1e3:.1f} + run {sum(runs) / len(small) * 1e3:.1f} ms)"
          f" (equal to symcost: {match}) -> {N_POINTS} points ~ {t_fc:.0f} s")
    return (f"bench_eval {model}: {N_POINTS} points symcost {t_numpy * 1e3:.1f} ms (numpy) / {t_exact * 1e3:.0f} ms"
            f" (exact ints) vs FlopCounterMode ~{t_fc:.0f} s extrapolated -> ratio {ratio:,.0f}x")


def main(argv: list[str]) -> None:
    lines = [bench(m) for m in (argv or ["gpt2", "cs336-lm"])]
    print()
    for line in lines:
        print(line)


if __name__ == "__main__":
    main(sys.argv[1:])
