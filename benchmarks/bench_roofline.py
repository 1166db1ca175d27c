"""The roofline pass (per-op bounds, fused bytes, step bound, MFU ceiling) against the trace it
reads, timed in the same run: the pass should cost a fraction of tracing.

Run: ``python benchmarks/bench_roofline.py [MODEL ...]`` (default: mlp cs336-lm gpt2). Prints,
per model, trace seconds, fusion-estimate seconds, roofline seconds (at the model's defaults on
h100) and the ratio roofline / trace. Asserts nothing.
"""
from __future__ import annotations

import sys
import time

import symcost
from symcost.hardware import devices
from symcost.graph import fusion
from symcost.passes import roofline


def main(models):
    dev = devices.get_device("h100")
    print(f"{'model':<10} {'trace s':>8} {'fusion s':>9} {'roofline s':>11} {'roofline/trace':>15}")
    for m in models:
        t0 = time.perf_counter()
        an = symcost.trace(m, use_cache=False)  # timed: a fresh trace (fusion needs its recordings)
        t1 = time.perf_counter()
        fusion.estimate(an)
        t2 = time.perf_counter()
        roofline.roofline(an, dev)
        t3 = time.perf_counter()
        print(f"{m:<10} {t1 - t0:8.2f} {t2 - t1:9.3f} {t3 - t2:11.2f} {(t3 - t2) / (t1 - t0):15.2f}")


if __name__ == "__main__":
    main(sys.argv[1:] or ["mlp", "cs336-lm", "gpt2"])
