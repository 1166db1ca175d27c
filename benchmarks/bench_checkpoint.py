"""Activation checkpointing: how the plan search scales with L, max-batch with checkpointing, and
every plan's predicted peak against the measured one on real CPU tensors.

1. **Scaling** (``--scaling``, default on): ``symcost checkpoint MODEL --set L=32 ...`` and
   ``L=128`` as commands (a warm trace cache, as a user's second call), and the pass alone
   (``checkpoint.analyse`` after tracing: the exact search for the least peak, the trade-off
   tables with one search per budget row), their times and the ratio L = 128 / L = 32 beside
   (128/32)² = 16: the cost must not grow faster than L².
2. **max-batch** (``--max-batch``): ``symcost max-batch gpt2 --memory 24GiB --set S=1024
   --checkpoint optimal`` with a warm cache, timed (before this pass composed the schedules it
   traced the plan's step afresh: 85-93 s on this machine).
3. **Plans side by side** (``--models``): no checkpointing, every layer (Hugging Face's
   ``gradient_checkpointing_enable``), ``checkpoint_sequential``'s default split, uniform
   segments of ⌈√L⌉ blocks, symcost's optimum (least peak of the step), symcost's least recompute
   within the other plans' peaks, and ``torch.compile`` with ``activation_memory_budget`` at the
   optimum's activation fraction. Each row: symcost's predicted peak, the measured peak
   (``torch.profiler`` memory timeline of a steady-state step, tests/memory_oracle.py), their
   difference, the predicted train FLOPs and FlopCounterMode's count of the step.

Usage: ``python benchmarks/bench_checkpoint.py [--models cs336-lm,gpt2,hf:llama] [--L 9]
[--no-compile] [--no-scaling] [--no-max-batch]``
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

SIZES = {
    "cs336-lm": {"B": 4, "S": 64, "H": 4, "D": 16, "V": 256, "F": 128},
    "gpt2": {"B": 4, "S": 64, "H": 4, "D": 16, "V": 256},
    "hf:llama": {"B": 4, "S": 64, "H": 4, "D": 16, "V": 256, "F": 128, "K": 2},
    "mlp": {"B": 4, "S": 256, "D": 32},
}
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def cli(*args: str) -> float:
    """Wall seconds of ``python -m symcost.cli ARGS`` (output discarded; fails loudly)."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "symcost.cli", *args], check=True, cwd=ROOT,
                   stdout=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": ROOT})
    return time.perf_counter() - t0


def scaling(model: str = "mlp", sizes=("B=4", "S=32", "D=64")) -> None:
    """The L = 32 and L = 128 times of the command and of the pass, and their ratios."""
    from symcost.passes import checkpoint as ck

    import symcost

    base = ["checkpoint", model, "--set", *sizes, "--json"]
    cli(*base[:3], "L=8", *base[3:])  # fills the trace cache (plain and every-layer traces)
    cmd = {L: cli(*base[:3], f"L={L}", *base[3:]) for L in (32, 128)}
    request = {k: int(v) for k, v in (s.split("=") for s in sizes)}
    an = symcost.trace(model, precision="bf16-mixed", sizes=request, use_cache=False)  # live: traces the every-layer step
    vals = dict(s.split("=") for s in sizes)
    vals = {k: int(v) for k, v in vals.items()}
    ck.analyse(an, dict(vals, L=8), table=False)  # traces the every-layer step once
    cpu = {}
    wall = {}
    for L in (32, 128):
        t0, c0 = time.perf_counter(), time.process_time()
        r = ck.analyse(an, dict(vals, L=L))
        wall[L], cpu[L] = time.perf_counter() - t0, time.process_time() - c0
        print(f"  L = {L}: {r['n_segments']} segments, predicted peak {r['peak']:,} B, "
              f"activations {r['activations']:,} B, {len(r['tradeoff'])} trade-off rows")
    print(f"\nscaling with L ({model}, {' '.join(sizes)}, bf16-mixed; the bound is (128/32)^2 = 16):")
    print(f"  symcost checkpoint (command, warm cache): L = 32 {cmd[32]:.2f} s, L = 128 {cmd[128]:.2f} s, "
          f"ratio {cmd[128] / cmd[32]:.2f}")
    print(f"  checkpoint.analyse (after tracing):       L = 32 {wall[32]:.3f} s, L = 128 {wall[128]:.3f} s, "
          f"ratio {wall[128] / wall[32]:.2f} (CPU {cpu[32]:.3f} s, {cpu[128]:.3f} s, ratio {cpu[128] / cpu[32]:.2f})")


def max_batch() -> None:
    args = ["max-batch", "gpt2", "--memory", "24GiB", "--set", "S=1024", "--checkpoint", "optimal", "--json"]
    cold = cli(*args)
    warm = cli(*args)
    plain = cli(*args[:-3], "--json")
    print(f"\nsymcost max-batch gpt2 --memory 24GiB --set S=1024 --checkpoint optimal: {cold:.2f} s (cache as found), "
          f"{warm:.2f} s warm; without --checkpoint {plain:.2f} s (before: 85-93 s)")


def measure(spec, sizes, make=None):
    """(measured peak bytes, FlopCounterMode FLOPs of forward + loss + backward)."""
    from torch.utils.flop_counter import FlopCounterMode

    from memory_oracle import build, step_peak

    sp = spec if make is None else dataclasses.replace(spec, build=lambda v: make(spec.build(v)))
    peak = step_peak(sp, sizes, "fp32")["peak"]
    model, args, kwargs, _ = build(sp, sizes, "fp32")
    with FlopCounterMode(display=False) as fc:
        out = model(*args, **kwargs)
        loss = sp.loss(out, (args, kwargs))
        del out
        loss.backward()
    return peak, fc.get_total_flops()


def compiled(spec, sizes, budget):
    """torch.compile (inductor, CPU) with activation_memory_budget = ``budget``."""
    import torch
    import torch._functorch.config as fcfg

    old = fcfg.activation_memory_budget
    fcfg.activation_memory_budget = budget
    try:
        torch._dynamo.reset()
        return measure(spec, sizes, lambda m: torch.compile(m))
    finally:
        fcfg.activation_memory_budget = old


def plans_side_by_side(name: str, L: int, compile_: bool) -> None:
    import symcost
    from symcost.passes import checkpoint as ck

    want = dict(SIZES.get(name, {}), L=L)
    an = symcost.trace(name, precision="fp32", sizes={k: v for k, v in want.items() if k not in ("B", "S", "L")},
                       attention="eager" if name.startswith("hf:") else None, use_cache=False)  # plans are applied
    sizes = {k: v for k, v in want.items() if k in an.symbols}
    k = math.ceil(math.sqrt(L))
    ch = ck.chain(an, L, an.bind(**sizes))
    plans = {
        "none": ck.Plan(an.layer_container, L, [], "none"),
        "every layer (HF)": ck.make_plan(an, "every-layer", L),
        "checkpoint_sequential": ck.make_plan(an, "sequential", L),
        f"uniform sqrt L (k={k})": ck.make_plan(an, "sqrt-L", L),
    }
    opt = ck.analyse(an, sizes)
    plans["symcost optimum (least peak)"] = opt["plan_object"]
    for other in ("checkpoint_sequential", f"uniform sqrt L (k={k})"):
        cap = ch.peak(plans[other].segments)
        plans[f"symcost, least recompute within {other}'s peak"] = ck.Plan(
            an.layer_container, L, ch.step_optimal(cap)[0], "memory")
    print(f"\n{name} at {want} (fp32, AdamW foreach, steady-state step)")
    print(f"{'plan':58s} {'segments':>8s} {'pred. peak':>11s} {'meas. peak':>11s} {'under':>7s} "
          f"{'pred. FLOPs':>13s} {'FlopCounter':>13s}")
    for label, plan in plans.items():
        ex = ck.exact(an, plan, sizes, ch=ch)
        make = plan.apply if plan.segments else None
        if label.startswith("every layer") and name.startswith("hf:"):  # Hugging Face's own switch
            def make(m):
                m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
                return m
        peak, flops = measure(an.spec, want, make)
        print(f"{label:58s} {len(plan.segments):8d} {ex['peak']:11d} {peak:11d} "
              f"{(peak - ex['peak']) / peak:7.2%} {ex['train_flops']:13d} {flops:13d}")
    if compile_:
        frac = opt["activations"] / opt["activations_none"]
        try:
            peak, flops = compiled(an.spec, want, frac)
            print(f"{'torch.compile, activation_memory_budget=' + format(frac, '.3f'):58s} {'-':>8s} "
                  f"{'-':>11s} {peak:11d} {'':7s} {'-':>13s} {flops:13d}")
        except Exception as e:  # noqa: BLE001 - report and go on
            print(f"torch.compile failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="cs336-lm,gpt2,hf:llama")
    ap.add_argument("--L", type=int, default=9)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--no-scaling", action="store_true")
    ap.add_argument("--no-max-batch", action="store_true")
    opts = ap.parse_args()
    os.environ.setdefault("SYMCOST_CACHE_DIR", tempfile.mkdtemp(prefix="symcost-bench-cache-"))
    if not opts.no_scaling:
        scaling()  # the issue's case: small activations, the optimizer step is the peak
        scaling("cs336-lm", ("B=8", "S=1024"))  # activations dominate: every block checkpointed
    if not opts.no_max_batch:
        max_batch()
    for name in filter(None, opts.models.split(",")):
        plans_side_by_side(name, opts.L, not opts.no_compile)


if __name__ == "__main__":
    main()
