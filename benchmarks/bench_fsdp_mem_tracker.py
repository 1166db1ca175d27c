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
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

from fsdp_tracker_oracle import CATEGORIES, SHORT, tracker_run

MiB = 2 ** 20


def model_and_sizes(name: str, args) -> tuple:
    """(spec, sizes, the name symcost.resolve takes) of a built-in model or a tests/data/configs name."""
    import symcost

    path = os.path.join(HERE, "..", "tests", "data", "configs", f"{name}.json")
    ref = os.path.abspath(path) if os.path.exists(path) else name
    spec = symcost.resolve(ref)
    sizes = {"B": args.B, "S": args.S}
    if os.path.exists(path):
        sizes["L"] = args.llama_L
    return spec, sizes, ref


TORCHTITAN = """
import json, sys, warnings
warnings.filterwarnings("ignore")
sys.path[:0] = sys.argv[1:3]
import symcost
from fsdp_tracker_oracle import tracker_run
a = json.loads(sys.argv[3])
spec = symcost.resolve(a["model"])
r = tracker_run(spec, a["values"], a["precision"], a["shard"], a["foreach"], torchtitan_loop=True)
print(json.dumps(r["peak"]))
"""


def torchtitan_peak(model: str, values: dict, precision: str, shard: str, foreach: bool) -> int:
    """FSDPMemTracker's peak with torchtitan's estimator's loop (two tracked steps), in a fresh
    process as torchtitan runs one configuration per process (DTensor's sharding-propagation
    cache starts empty)."""
    import json
    import subprocess

    arg = json.dumps({"model": model, "values": values, "precision": precision, "shard": shard, "foreach": foreach})
    res = subprocess.run([sys.executable, "-c", TORCHTITAN, os.path.join(HERE, ".."), os.path.join(HERE, "..", "tests"),
                          arg], check=False, capture_output=True, text=True)
    if res.returncode:
        raise RuntimeError(res.stderr.strip().splitlines()[-1] if res.stderr.strip() else "torchtitan loop failed")
    return int(res.stdout.strip().splitlines()[-1])


def symcost_rank(an, sizes: dict, impl: str = "foreach") -> dict:
    """symcost's per-rank memory at ``sizes`` (DP among them): the summary's values (model states,
    saved activations) and the rank's peak from the traced storage schedule, bytes."""
    from symcost.passes.parallel import summary

    s = summary(an, sizes=sizes, impl=impl)
    mem = dict(s["values"]["memory"])
    mem["peak"] = s["peak"].get("value")
    mem["peak_where"] = s["peak"].get("where")
    return {k: (int(v) if v is not None and not isinstance(v, str) and getattr(v, "is_number", True) else v)
            for k, v in mem.items()}


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
    ap.add_argument("--no-torchtitan-loop", dest="torchtitan_loop", action="store_false",
                    help="skip the column of torchtitan's loop (a fresh process per world size)")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    import torch.distributed as dist

    import symcost

    print(f"FSDPMemTracker (torch {__import__('torch').__version__}) vs symcost, --shard {args.shard} "
          f"(fully_shard per block + root), {args.precision}, AdamW ({args.impl}); MiB per rank")
    for name in args.models:
        spec, sizes, ref = model_and_sizes(name, args)
        t = time.perf_counter()
        an = symcost.trace(spec, sizes={**sizes, "DP": min(args.dp)}, precision=args.precision, shard=args.shard)
        t_trace = time.perf_counter() - t
        values = {str(k): int(v) for k, v in an.bind(**sizes, DP=min(args.dp)).items()}
        shown = {k: v for k, v in values.items() if k != "DP"}
        print(f"\n{name} {shown}: symcost trace {t_trace:.1f} s (once, DP a symbol; pinned {an.pinned or 'none'})")
        print("  peer: FSDPMemTracker's peak of a warm step (tracked after an untracked one) and its breakdown "
              "there; 'titan': its peak with torchtitan's loop\n  (two tracked steps, a fresh process); sym: symcost's "
              "peak (from its storage schedule), its model states + saved activations, and sym peak / peer peak")
        print(f"  {'DP':>3} {'peer s':>6} {'titan s':>7} {'sym s':>6} | {'peer':>8} {'titan':>8} | {'sym peak':>8} "
              f"{'st+act':>8} {'ratio':>6} | " + " ".join(f"{SHORT[c]:>6}" for c in CATEGORIES) + " | peer peak in")
        rows = []
        for dp in args.dp:
            t = time.perf_counter()
            peer = tracker_run(spec, {**values, "DP": dp}, args.precision, args.shard, args.impl == "foreach")
            t_peer = time.perf_counter() - t
            titan, t_titan = None, None
            if args.torchtitan_loop:
                t = time.perf_counter()
                titan = torchtitan_peak(ref, {**values, "DP": dp}, args.precision, args.shard, args.impl == "foreach")
                t_titan = time.perf_counter() - t
            t = time.perf_counter()
            mine = symcost_rank(an, {**sizes, "DP": dp}, args.impl)
            t_sym = time.perf_counter() - t
            rows.append((dp, peer, mine))
            at = peer["at_peak"]
            where = peer["where"] if peer["peak"] == peer["fwd_bwd"]["Total"] else "the optimizer step"
            states_act = sum(mine[k] for k in ("params", "grads", "optimizer_state", "master", "activations"))
            ratio = f"{mine['peak'] / peer['peak']:.3f}" if mine.get("peak") else "—"
            cats = " ".join(f"{mib(at.get(c, 0)):>6}" for c in CATEGORIES)
            print(f"  {dp:>3} {t_peer:>6.1f} {'—' if t_titan is None else f'{t_titan:.1f}':>7} {t_sym:>6.3f} | "
                  f"{mib(peer['peak']):>8} {mib(titan):>8} | {mib(mine.get('peak')):>8} {mib(states_act):>8} {ratio:>6} | "
                  f"{cats} | {where}", flush=True)
        print("  model states after the optimizer step (peer: its categories; symcost: summary values; bytes) and "
              "the peer's activations at its peak (bytes)")
        print(f"  {'DP':>3} | {'peer shP':>11} {'sym params':>11} | {'peer shG':>11} {'sym grads':>11} | "
              f"{'peer opt':>11} {'sym opt+steps':>13} | {'peer act@peak':>13} {'sym saved':>12}")
        for dp, peer, mine in rows:
            a = peer["after_step"]
            steps = 4 * peer["steps"]
            print(f"  {dp:>3} | {a.get('Sharded Param', 0):>11,} {mine['params']:>11,} | "
                  f"{a.get('Sharded Grad', 0):>11,} {mine['grads']:>11,} | "
                  f"{a.get('OptState', 0):>11,} {mine['optimizer_state'] + steps:>13,} | "
                  f"{peer['at_peak'].get('Activation', 0):>13,} {mine['activations']:>12,}")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
