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
    """Two AdamW training steps of rank 0 of ``values["DP"]`` ranks under ``FSDPMemTracker``
    (fake process group, fake tensors), wrapped as symcost wraps the model.

    Returns:
        ``peak`` (bytes: the tracker's peak ``Total``), ``at_peak`` {category: bytes at the peak},
        ``after_step`` {category: bytes right after the second optimizer step}, ``steps``
        (number of optimizer step counters: one 4-byte fp32 tensor per parameter tensor).
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

    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device="cpu")
        opt = torch.optim.AdamW(model.parameters(), foreach=foreach)
        args, kwargs = spec.make_inputs(values, torch.device("cpu"))
        tracker = FSDPMemTracker(model, opt)
        tracker.track_inputs((args, kwargs))
        with tracker:
            for it in range(2):
                with autocast():
                    loss = spec.loss(model(*args, **kwargs), (args, kwargs))
                loss.backward()
                opt.step()
                if it == 1:
                    after = plain(tracker.get_tracker_snapshot("current"))
                opt.zero_grad()
                if it == 0:
                    tracker.reset_mod_stats()  # the first step has no optimizer state (torchtitan)
        at_peak = plain(tracker.get_tracker_snapshot("peak"))
    return {"peak": at_peak["Total"], "at_peak": at_peak, "after_step": after,
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
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    import torch.distributed as dist

    import symcost

    print(f"FSDPMemTracker (torch {__import__('torch').__version__}) vs symcost, --shard {args.shard} "
          f"(fully_shard per block + root), {args.precision}, AdamW (foreach); MiB per rank")
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
        print("  FSDPMemTracker's peak and its breakdown at the peak; symcost's peak (n/a: not given yet)")
        print(head)
        rows = []
        for dp in args.dp:
            t = time.perf_counter()
            peer = tracker_run(spec, {**values, "DP": dp}, args.precision, args.shard)
            t_peer = time.perf_counter() - t
            t = time.perf_counter()
            mine = symcost_rank(an, {**sizes, "DP": dp})
            t_sym = time.perf_counter() - t
            rows.append((dp, peer, mine))
            cats = " ".join(f"{mib(peer['at_peak'].get(c, 0)):>7}" for c in CATEGORIES)
            print(f"  {dp:>3} {t_peer:>7.1f} {t_sym:>6.3f} | {mib(peer['peak']):>10} {mib(mine.get('peak')):>9} | {cats}",
                  flush=True)
        print("  model states after the optimizer step (peer: its categories; symcost: summary values) and activations")
        print(f"  {'DP':>3} | {'peer shP':>9} {'sym params':>10} | {'peer shG':>9} {'sym grads':>10} | "
              f"{'peer opt':>9} {'sym opt+steps':>13} | {'peer act@peak':>13} {'sym saved':>10} {'act/saved':>9}")
        for dp, peer, mine in rows:
            a = peer["after_step"]
            steps = 4 * peer["steps"]
            act = peer["at_peak"].get("Activation", 0)
            print(f"  {dp:>3} | {mib(a.get('Sharded Param', 0)):>9} {mib(mine['params']):>10} | "
                  f"{mib(a.get('Sharded Grad', 0)):>9} {mib(mine['grads']):>10} | "
                  f"{mib(a.get('OptState', 0)):>9} {mib(mine['optimizer_state'] + steps):>13} | "
                  f"{mib(act):>13} {mib(mine['activations']):>10} {act / mine['activations']:>9.3f}")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
