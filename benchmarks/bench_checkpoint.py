"""Activation-checkpoint plans side by side, measured on real CPU tensors.

For each model (small configs): no checkpointing, every layer (what Hugging Face's
``gradient_checkpointing_enable`` does), ``torch.utils.checkpoint.checkpoint_sequential``'s default
split (⌈√L⌉ segments, the last one plain), uniform segments of ⌈√L⌉ blocks, symcost's optimum
(least peak), symcost's least recompute within the budget of each of the others, and
``torch.compile`` with ``torch._functorch.config.activation_memory_budget`` set to the optimum's
activation fraction. Each row: symcost's predicted peak, the measured peak (``torch.profiler``
memory timeline of a steady-state step, tests/memory_oracle.py), the predicted train FLOPs
and FlopCounterMode's count of the step (it sees the recomputed forward; for torch.compile it
counts what the compiled graphs report). Then the solve time of a 32-layer plan after tracing,
as a ratio against one measured training step of the same model.

Usage: ``python benchmarks/bench_checkpoint.py [--models cs336-lm,gpt2,hf:llama] [--L 9] [--no-compile]``
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import torch  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

import symcost  # noqa: E402
from symcost.passes import checkpoint as ck  # noqa: E402
from memory_oracle import build, step_peak  # noqa: E402

SIZES = {
    "cs336-lm": {"B": 4, "S": 64, "H": 4, "D": 16, "V": 256, "F": 128},
    "gpt2": {"B": 4, "S": 64, "H": 4, "D": 16, "V": 256},
    "hf:llama": {"B": 4, "S": 64, "H": 4, "D": 16, "V": 256, "F": 128, "K": 2},
    "mlp": {"B": 4, "S": 256, "D": 32},
}


def measure(spec, sizes, make=None):
    """(measured peak bytes, FlopCounterMode FLOPs of forward + loss + backward)."""
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
    import torch._functorch.config as fcfg

    old = fcfg.activation_memory_budget
    fcfg.activation_memory_budget = budget
    try:
        torch._dynamo.reset()
        return measure(spec, sizes, lambda m: torch.compile(m))
    finally:
        fcfg.activation_memory_budget = old


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="cs336-lm,gpt2,hf:llama")
    ap.add_argument("--L", type=int, default=9)
    ap.add_argument("--no-compile", action="store_true")
    opts = ap.parse_args()
    for name in opts.models.split(","):
        an = symcost.trace(name, precision="fp32", use_cache=False)  # the plans need the live trace
        sizes = {k: v for k, v in dict(SIZES.get(name, {}), L=opts.L).items() if k in an.symbols}
        L = opts.L
        k = math.ceil(math.sqrt(L))
        plans = {
            "none": ck.Plan(an.layer_container, L, [], "none"),
            "every layer (HF)": ck.make_plan(an, "every-layer", L),
            "checkpoint_sequential": ck.make_plan(an, "sequential", L),
            f"uniform sqrt L (k={k})": ck.make_plan(an, "sqrt-L", L),
        }
        opt = ck.analyse(an, sizes)
        plans["symcost optimum"] = opt["plan_object"]
        ch = ck.chain(an, L, an.bind(**sizes))
        for other in ("checkpoint_sequential", f"uniform sqrt L (k={k})"):
            pk, rec = ch.cost(plans[other].segments)
            plans[f"symcost, least recompute within {other}'s memory"] = ck.Plan(
                an.layer_container, L, ch.optimal(pk)[0], "budget")
        print(f"\n{name} at {sizes} (fp32, AdamW foreach, steady-state step)")
        print(f"{'plan':58s} {'segments':>8s} {'pred. peak':>11s} {'meas. peak':>11s} {'err':>7s} "
              f"{'pred. FLOPs':>13s} {'FlopCounter':>13s}")
        for label, plan in plans.items():
            ex = ck.exact(an, plan, sizes)
            make = plan.apply if plan.segments else None
            if label.startswith("every layer") and name.startswith("hf:"):  # Hugging Face's own switch
                def make(m):
                    m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
                    return m
            peak, flops = measure(an.spec, sizes, make)
            print(f"{label:58s} {len(plan.segments):8d} {ex['peak']:11d} {peak:11d} "
                  f"{(peak - ex['peak']) / peak:7.2%} {ex['train_flops']:13d} {flops:13d}")
        if not opts.no_compile:
            frac = opt["activations"] / opt["activations_none"]
            try:
                peak, flops = compiled(an.spec, sizes, frac)
                print(f"{'torch.compile, activation_memory_budget=' + format(frac, '.3f'):58s} {'-':>8s} "
                      f"{'-':>11s} {peak:11d} {'':7s} {'-':>13s} {flops:13d}")
            except Exception as e:  # noqa: BLE001 - report and go on
                print(f"torch.compile failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
        # solve time for 32 layers after tracing, against one measured step
        t0 = time.perf_counter()
        ch32 = ck.chain(an, 32, an.bind(**dict(sizes, L=32)))
        ch32.optimal()
        ch32.optimal(ch32.cost(ck.uniform_segments(32, 6))[0])
        solve = time.perf_counter() - t0
        t0 = time.perf_counter()
        step_peak(an.spec, dict(sizes, L=32), "fp32")
        step = time.perf_counter() - t0
        print(f"solve for L = 32 after tracing: {solve:.3f} s (least peak + least recompute); one measured "
              f"step at L = 32: {step:.3f} s; ratio {solve / step:.2f}")


if __name__ == "__main__":
    main()
