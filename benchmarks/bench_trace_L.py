"""Analysis time does not grow with L (issue 2, Acceptance): trace + derive time of ``hf:llama``
at L = 2 and L = 32 at the default width (``--config num_hidden_layers=2`` vs the default config,
whose L is 32), side by side, with the ratio (must stay under 1.5) and the absolute time of the
default Llama config (must stay under 30 s on the 2-core dev machine).

The trace never builds the model at the configured L: it records at small probe sizes with L = 2
(the fit) and L = 3 (the check), folds the blocks into one with repeat L, and L only enters as a
symbol's default value. So both configurations do the same work.

Run: ``python benchmarks/bench_trace_L.py [--precision P] [--repeats N]``. Prints; asserts nothing.
"""
from __future__ import annotations

import argparse
import time

import symcost


def timed(config: dict[str, str], precision: str):
    t = time.perf_counter()
    an = symcost.trace("hf:llama", config=config, precision=precision, use_cache=False)  # timed: a fresh trace
    return time.perf_counter() - t, an


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--precision", default="bf16-mixed", help="as the CLI's default")
    ap.add_argument("--repeats", type=int, default=2, help="runs per configuration; the best is kept")
    a = ap.parse_args()

    t = time.perf_counter()
    import transformers  # noqa: F401  (the import is not the trace's)
    t_import = time.perf_counter() - t
    cold, _ = timed({}, a.precision)  # the first trace in a process pays transformers' lazy imports
    runs = {"L=2": [], "L=32 (default)": []}
    configs = {"L=2": {"num_hidden_layers": "2"}, "L=32 (default)": {}}
    ans = {}
    for _ in range(a.repeats):  # alternate, so drift in machine load hits both alike
        for name, cfg in configs.items():
            dt, an = timed(cfg, a.precision)
            runs[name].append(dt)
            ans[name] = an
    best = {k: min(v) for k, v in runs.items()}
    print(f"hf:llama trace+derive, precision {a.precision}, best of {a.repeats}:")
    for name, an in ans.items():
        L = an.spec.defaults["L"]
        tm = ", ".join(f"{k} {v:.1f} s" for k, v in an.timings.items())
        print(f"  {name:<15} {best[name]:6.2f} s   (runs: {', '.join(f'{t:.2f}' for t in runs[name])}; {tm};"
              f" default L = {L}, {len(an.ops)} folded ops, H*D = {an.spec.defaults['H'] * an.spec.defaults['D']})")
    ratio = best["L=32 (default)"] / best["L=2"]
    default = best["L=32 (default)"]
    print(f"bench_trace_L hf:llama: L=2 {best['L=2']:.2f} s, L=32 {default:.2f} s, ratio {ratio:.2f}"
          f" ({'OK' if ratio < 1.5 else 'OVER'} < 1.5); default config {default:.1f} s"
          f" ({'OK' if default < 30 else 'OVER'} < 30 s); cold first trace {cold:.1f} s"
          f" (+ {t_import:.1f} s to import transformers)")


if __name__ == "__main__":
    main()
