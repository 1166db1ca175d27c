"""PyTorch's ``FSDPMemTracker`` (the peer torchtitan's ``scripts/estimate/estimation.py`` runs)
beside symcost's per-rank memory of the same FSDP2 configuration, at several world sizes
(issue 15; docs/parallel.md, "Peers: DeepSpeed's estimator and FSDPMemTracker").

The peer, run here for every world size: the model built on the meta device, wrapped per block
and then the root with ``fully_shard`` exactly as symcost's trace wraps it
(``symcost.frontends.parallel.wrap``, on ``fake_group(DP)``: PyTorch's fake process group),
materialised under ``FakeTensorMode``, then two training steps (forward, backward, AdamW step,
``zero_grad``) inside ``torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker``, module
statistics reset after the first step (the optimizer state appears in the second), as
torchtitan's estimator does. Printed: its peak and the peak's breakdown by category (sharded and
unsharded parameters, gradients, optimizer state, activations, temporaries, all-gather and
reduce-scatter buffers, inputs, buffers), and its model-state categories right after the second
optimizer step.

symcost's side: one trace (``symcost.trace(model, shard="fsdp")``, DP a symbol) and, per world
size, ``symcost.passes.parallel.summary(an, sizes=...)["values"]["memory"]``: parameters,
gradients, optimizer state (exact with FSDP2's padding) and the bytes saved for backward, and the
per-rank peak where the pass gives one (key ``peak``; the column says "n/a" until it does).

Usage: ``python benchmarks/bench_fsdp_mem_tracker.py`` (cs336-lm, DP 8 16 32 64, about a minute
on 2 cores); ``--models cs336-lm llama-3-8b`` adds the llama-3-8b config (full width, ``--llama-L``
layers, default 2; about 2 more minutes); ``--dp``, ``--B``, ``--S``, ``--precision`` change the
run. Asserts nothing; the differences are explained in docs/parallel.md.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

MiB = 2 ** 20
#: FSDPMemTracker's categories (``_FSDPRefType`` values), in the order printed
CATEGORIES = ("Sharded Param", "Unsharded Param", "Buffer", "Sharded Grad", "Unsharded Grad", "OptState",
              "Activation", "Temp", "All Gather", "Reduce Scatter", "Inputs")
SHORT = {"Sharded Param": "shP", "Unsharded Param": "unshP", "Buffer": "buf", "Sharded Grad": "shG",
         "Unsharded Grad": "unshG", "OptState": "opt", "Activation": "act", "Temp": "temp",
         "All Gather": "AG", "Reduce Scatter": "RS", "Inputs": "inp"}


def model_and_sizes(name: str, args) -> tuple:
    """(spec, sizes) of a built-in model or a tests/data/configs name."""
    import symcost

    path = os.path.join(HERE, "..", "tests", "data", "configs", f"{name}.json")
    spec = symcost.resolve(path if os.path.exists(path) else name)
    sizes = {"B": args.B, "S": args.S}
    if os.path.exists(path):
        sizes["L"] = args.llama_L
    return spec, sizes


def tracker_run(spec, values: dict, precision: str, shard: str = "fsdp", foreach: bool = True) -> dict:
    """Rank 0 of ``values["DP"]`` ranks (fake process group, fake tensors), wrapped as symcost
    wraps the model: one untracked AdamW training step (FSDP2's lazy init, the optimizer state
    made), then one step under ``FSDPMemTracker``.

    Returns:
        ``peak`` (bytes: the tracker's peak ``Total`` over the tracked step, what torchtitan's
        estimator reports), ``at_peak`` {category: bytes at that peak}, ``fwd_bwd`` {category:
        bytes at the peak of forward + backward, read before the optimizer step}, ``after_step``
        {category: bytes right after the optimizer step}, ``steps`` (number of optimizer step
        counters: one 4-byte fp32 tensor per parameter tensor).
    """
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    from symcost.frontends.parallel import fake_group, wrap
    from symcost.tracing.record import find_layer_container, precision_context

    with torch.device("meta"):
        model = spec.build(values)
    layers = spec.layers if spec.layers is not None else find_layer_container(spec, model, values)
    param_dtype, autocast = precision_context(precision)
    if param_dtype != torch.float32:
        model.to(param_dtype)  # on the meta device, before the parameters become DTensors (as symcost)
    wrap(model, layers, shard, fake_group(values["DP"]))

    def plain(snap):
        ((dev, cats),) = snap.items()
        return {str(getattr(k, "value", k)): v for k, v in cats.items()}

    def step(tracker=None):
        with autocast():
            loss = spec.loss(model(*args, **kwargs), (args, kwargs))
        loss.backward()
        fwd_bwd = plain(tracker.get_tracker_snapshot("peak")) if tracker else None
        opt.step()
        after = plain(tracker.get_tracker_snapshot("current")) if tracker else None
        opt.zero_grad()
        return fwd_bwd, after

    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device="cpu")
        opt = torch.optim.AdamW(model.parameters(), foreach=foreach)
        args, kwargs = spec.make_inputs(values, torch.device("cpu"))
        step()  # untracked: FSDP2's lazy init and the optimizer state exist before the tracked step
        tracker = FSDPMemTracker(model, opt)
        tracker.track_inputs((args, kwargs))
        with tracker:
            fwd_bwd, after = step(tracker)
        at_peak = plain(tracker.get_tracker_snapshot("peak"))
    return {"peak": at_peak["Total"], "at_peak": at_peak, "fwd_bwd": fwd_bwd, "after_step": after,
            "steps": sum(1 for st in opt.state.values() if "step" in st)}


def symcost_rank(an, sizes: dict) -> dict:
    """symcost's per-rank memory at ``sizes`` (DP among them): the summary's values, bytes."""
    from symcost.passes.parallel import summary

    mem = summary(an, sizes=sizes)["values"]["memory"]
    return {k: (int(v) if v is not None else None) for k, v in mem.items()}


def mib(b) -> str:
    return "n/a" if b is None else f"{b / MiB:.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="*", default=["cs336-lm"],
                    help="built-in names or tests/data/configs names (default: %(default)s)")
    ap.add_argument("--dp", nargs="*", type=int, default=[8, 16, 32, 64])
    ap.add_argument("--B", type=int, default=4)
    ap.add_argument("--S", type=int, default=256)
    ap.add_argument("--llama-L", type=int, default=2, help="layers of a config from tests/data/configs")
    ap.add_argument("--precision", default="bf16-mixed")
    ap.add_argument("--shard", default="fsdp", choices=["fsdp", "zero3"])
    ap.add_argument("--impl", default="foreach", choices=["foreach", "for-loop"],
                    help="AdamW implementation (foreach: what torch.optim runs on CUDA, and torchtitan)")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    import torch.distributed as dist

    import symcost

    print(f"FSDPMemTracker (torch {__import__('torch').__version__}) vs symcost, --shard {args.shard} "
          f"(fully_shard per block + root), {args.precision}, AdamW ({args.impl}); MiB per rank")
    for name in args.models:
        spec, sizes = model_and_sizes(name, args)
        t = time.perf_counter()
        an = symcost.trace(spec, sizes={**sizes, "DP": min(args.dp)}, precision=args.precision, shard=args.shard)
        t_trace = time.perf_counter() - t
        values = {str(k): int(v) for k, v in an.bind(**sizes, DP=min(args.dp)).items()}
        shown = {k: v for k, v in values.items() if k != "DP"}
        print(f"\n{name} {shown}: symcost trace {t_trace:.1f} s (once, DP a symbol; pinned {an.pinned or 'none'})")
        head = (f"  {'DP':>3} {'peer s':>7} {'sym s':>6} | {'peer peak':>10} {'sym peak':>9} | "
                + " ".join(f"{SHORT[c]:>7}" for c in CATEGORIES))
        print("  FSDPMemTracker's peak of the step (where: fb = forward/backward, opt = optimizer step), its peak of "
              "forward+backward and that one's breakdown;\n  symcost's peak (n/a: not given yet) and its model states "
              "+ saved activations")
        print(f"  {'DP':>3} {'peer s':>7} {'sym s':>6} | {'peer peak':>10} {'where':>5} {'peer f+b':>9} | "
              f"{'sym peak':>9} {'sym st+act':>10} | " + " ".join(f"{SHORT[c]:>7}" for c in CATEGORIES))
        rows = []
        for dp in args.dp:
            t = time.perf_counter()
            peer = tracker_run(spec, {**values, "DP": dp}, args.precision, args.shard, args.impl == "foreach")
            t_peer = time.perf_counter() - t
            t = time.perf_counter()
            mine = symcost_rank(an, {**sizes, "DP": dp})
            t_sym = time.perf_counter() - t
            rows.append((dp, peer, mine))
            fb = peer["fwd_bwd"]
            where = "opt" if peer["peak"] > fb["Total"] else "fb"
            states_act = sum(mine[k] for k in ("params", "grads", "optimizer_state", "master", "activations"))
            cats = " ".join(f"{mib(fb.get(c, 0)):>7}" for c in CATEGORIES)
            print(f"  {dp:>3} {t_peer:>7.1f} {t_sym:>6.3f} | {mib(peer['peak']):>10} {where:>5} {mib(fb['Total']):>9} | "
                  f"{mib(mine.get('peak')):>9} {mib(states_act):>10} | {cats}", flush=True)
        print("  model states after the optimizer step (peer: its categories; symcost: summary values; bytes) and "
              "activations at the forward+backward peak")
        print(f"  {'DP':>3} | {'peer shP':>11} {'sym params':>11} | {'peer shG':>11} {'sym grads':>11} | "
              f"{'peer opt':>11} {'sym opt+steps':>13} | {'peer act@f+b':>12} {'sym saved':>12}")
        for dp, peer, mine in rows:
            a = peer["after_step"]
            steps = 4 * peer["steps"]
            print(f"  {dp:>3} | {a.get('Sharded Param', 0):>11,} {mine['params']:>11,} | "
                  f"{a.get('Sharded Grad', 0):>11,} {mine['grads']:>11,} | "
                  f"{a.get('OptState', 0):>11,} {mine['optimizer_state'] + steps:>13,} | "
                  f"{peer['fwd_bwd'].get('Activation', 0):>12,} {mine['activations']:>12,}")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
