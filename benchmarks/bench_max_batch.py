"""Time ``max-batch`` (symbolic, after tracing) against a binary search that measures each probe.

The binary search is what one does without symcost: run a real training step (real CPU tensors,
forward + backward + AdamW step, steady state) at a batch size, read the peak from
``torch.profiler``'s memory events (tests/memory_oracle.py), double B until it no longer fits,
then bisect. symcost solves ``peak(B) <= cap`` with sympy on the traced formula instead.

Usage: ``python benchmarks/bench_max_batch.py [--model cs336-lm] [--cap-batch 48] [--precision fp32]``
(the cap is set to the measured peak at ``--cap-batch`` plus a little, so both answers can be
compared; it prints the two answers, the two times and their ratio).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import symcost  # noqa: E402
from symcost.passes import memory  # noqa: E402
from memory_oracle import step_peak  # noqa: E402

SIZES = {
    "cs336-lm": {"S": 64, "H": 4, "D": 16, "L": 2, "V": 512, "F": 128},
    "gpt2": {"S": 64, "H": 4, "D": 16, "L": 2, "V": 512},
    "mlp": {"S": 64, "D": 64, "L": 4},
}


def binary_search(spec, sizes, precision, cap) -> tuple[int, int, float]:
    """(largest B whose measured peak <= cap, number of measured steps, seconds)."""
    t0 = time.perf_counter()
    n = 0

    def fits(b):
        nonlocal n
        n += 1
        return step_peak(spec, {**sizes, "B": b}, precision, "adamw", foreach=True)["peak"] <= cap

    if not fits(1):
        return 0, n, time.perf_counter() - t0
    lo, hi = 1, 2
    while fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo, n, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="cs336-lm", choices=sorted(SIZES))
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16-true"])
    ap.add_argument("--cap-batch", type=int, default=48, help="the cap is the measured peak at this B, plus 0.5 %%")
    args = ap.parse_args()
    sizes = SIZES[args.model]

    t0 = time.perf_counter()
    an = symcost.trace(args.model, precision=args.precision, sizes=sizes, use_cache=False)  # timed; builds the model
    t_trace = time.perf_counter() - t0
    spec = an.spec
    cap = int(step_peak(spec, {**sizes, "B": args.cap_batch}, args.precision)["peak"] * 1.005)

    t0 = time.perf_counter()
    mm = memory.memory_model(an, args.precision, "adamw", "foreach")
    sol = mm.solve(cap, "B", **sizes)
    t_sym = time.perf_counter() - t0

    b_search, probes, t_search = binary_search(spec, sizes, args.precision, cap)

    print(f"model {args.model} {sizes}, precision {args.precision}, AdamW (foreach), cap {cap:,} bytes")
    print(f"{'method':<44}{'B_max':>8}{'seconds':>12}")
    print(f"{'symcost max-batch (memory model + sympy solve)':<44}{sol.value:>8}{t_sym:>12.4f}")
    print(f"{'  (tracing, once per model and precision)':<44}{'':>8}{t_trace:>12.4f}")
    print(f"{f'binary search, PyTorch measured ({probes} steps)':<44}{b_search:>8}{t_search:>12.4f}")
    print(f"ratio binary search / symcost solve: {t_search / t_sym:,.1f}x "
          f"(with tracing: {t_search / (t_sym + t_trace):,.2f}x)")
    print(f"symcost check: M({sol.value}) = {sol.memory_at:,} <= cap < M({sol.value + 1}) = {sol.memory_next:,}: "
          f"{sol.checked}; answers {'agree' if sol.value == b_search else 'differ'}")


if __name__ == "__main__":
    main()
