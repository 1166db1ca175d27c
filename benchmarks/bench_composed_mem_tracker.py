"""PyTorch's ``FSDPMemTracker`` beside symcost's per-rank memory on composed layouts (issue 27):
FSDP2 × TP (torchtitan's 2-D mesh ``(dp_shard, tp)``), HSDP (``(dp_replicate, dp_shard)``) and
FSDP2 with activation checkpointing, at world sizes 8 to 512 (docs/parallel.md, "Peers:
DeepSpeed's estimator and FSDPMemTracker"; benchmarks/bench_fsdp_mem_tracker.py does plain FSDP2).

The peer, per row: rank 0 of the layout on PyTorch's fake process group of DP·TP ranks
(``Layout.fake_mesh``: ``init_device_mesh`` with torchtitan's dimension names and order), the
model built on the meta device and parallelised by the same PyTorch calls symcost's trace makes,
in torchtitan's order (``Layout.parallelize``: ``parallelize_module`` with the Megatron plan over
``tp``, then ``checkpoint`` per block for ``--ac``, then ``fully_shard`` per block and the root over
``dp_shard`` or the 2-D HSDP mesh), materialised under ``FakeTensorMode``; one untracked training
step (forward, loss under ``loss_parallel`` where the logits are vocabulary-sharded, backward,
AdamW foreach step, ``zero_grad``), then one step inside
``torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker``. Printed: its peak, the category
breakdown at the peak, and its model states right after the optimizer step.

DTensor's sharding propagation runs each op it has not cached on fake tensors of the *global*
shapes in the active fake mode (torch/distributed/tensor/_sharding_prop.py), which the tracker
would count; some signatures (``loss_parallel``'s backward) miss the cache in every step. A real
run allocates none of it (DTensor's own fake mode there), so the tracked step runs that function
with the dispatch modes off, as tests/data/tp_rank.py ``fake_peak`` does (``--count-propagation``
leaves it in: the tracker's peak then includes those global-shape temporaries).

symcost's side: one trace per (model, layout) with DP and TP symbols (HSDP's R pinned), then per
row ``symcost.passes.parallel.summary(an, sizes=..., impl="foreach")``: the rank's peak from its
storage schedule and its model states.

Usage: ``python benchmarks/bench_composed_mem_tracker.py`` (cs336-lm, the default rows, 2 to 3.5
minutes on 2 cores with cold traces); ``--models cs336-lm llama-3-8b`` adds the llama-3-8b config
(full width, ``--llama-L`` layers, default 2; about 3.5 minutes more; two of its rows are refused
by symcost's trace and print the tracker alone, docs/parallel.md); ``--rows fsdpxtp:64x8 hsdp:8x64 ac-selective:16``
picks rows (``fsdpxtp:DPxTP``, ``hsdp:RxSHARD``, ``ac-full:DP``, ``ac-selective:DP``); ``--B``,
``--S`` change the batch. Asserts nothing; the differences are explained in docs/parallel.md.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

from bench_fsdp_mem_tracker import model_and_sizes  # noqa: E402  (the same models and sizes)
from fsdp_tracker_oracle import CATEGORIES, SHORT  # noqa: E402

MiB = 2 ** 20
#: default rows: (kind, first size, second size); world sizes 8 .. 512
DEFAULT_ROWS = ("fsdpxtp:8x1", "fsdpxtp:16x4", "fsdpxtp:64x8", "fsdpxtp:128x4", "hsdp:4x16", "hsdp:8x64",
                "ac-selective:8", "ac-full:64")


def parse_row(text: str):
    """``(kind, Layout, {DP, TP?}, world size)`` of a row spec such as ``fsdpxtp:16x4``,
    ``hsdp:4x16`` (R × shard degree), ``ac-selective:8`` or ``ac-full:64``."""
    from symcost.frontends.layout import Layout

    kind, _, size = text.partition(":")
    if kind == "fsdpxtp":
        dp, tp = (int(x) for x in size.split("x"))
        if tp == 1:
            return kind, Layout(shard="fsdp"), {"DP": dp}, dp
        return kind, Layout(shard="fsdp", tp=True), {"DP": dp, "TP": tp}, dp * tp
    if kind == "hsdp":
        r, sh = (int(x) for x in size.split("x"))
        return kind, Layout(shard="fsdp", replicate=r), {"DP": r * sh}, r * sh
    if kind in ("ac-full", "ac-selective"):
        return kind, Layout(shard="fsdp", ac=kind[3:]), {"DP": int(size)}, int(size)
    raise SystemExit(f"unknown row {text!r}: fsdpxtp:DPxTP, hsdp:RxSHARD, ac-full:DP, ac-selective:DP")


def tracker_layout_run(spec, layout, values: dict, precision: str, foreach: bool = True,
                       count_propagation: bool = False) -> dict:
    """Rank 0 of ``layout`` at ``values`` (fake process group, fake tensors), parallelised by
    ``Layout.parallelize`` (torchtitan's order): one untracked step, then one step under
    ``FSDPMemTracker``. Returns ``peak`` (bytes), ``at_peak`` {category: bytes at the peak},
    ``after_step`` {category: bytes right after the optimizer step}, ``steps`` (AdamW step
    counters), ``where`` (the phase and deepest FSDP module whose peak is the step's, or the
    optimizer step / the loss)."""
    import torch
    from memory_oracle import AUTOCAST, DTYPES
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPModState
    from torch.distributed.tensor._sharding_prop import ShardingPropagator
    from torch.utils._python_dispatch import _disable_current_modes

    from symcost.tracing.record import find_layer_container

    mesh = layout.fake_mesh(values)
    with torch.device("meta"):
        model = spec.build(values)
    layers = spec.layers if spec.layers is not None else find_layer_container(spec, model, values)
    if precision in DTYPES and DTYPES[precision] != torch.float32:
        model.to(DTYPES[precision])
    cast = AUTOCAST.get(precision)
    loss_context = layout.parallelize(model, layers, mesh)

    def plain(snap):
        ((_device, cats),) = snap.items()
        return {str(getattr(k, "value", k)): v for k, v in cats.items()}

    def step(tracker=None):
        with loss_context():  # (as symcost's recorder: forward and loss under autocast, in the loss context)
            with (torch.autocast("cpu", dtype=cast) if cast else contextlib.nullcontext()):
                out = model(*args, **kwargs)
                loss = spec.loss(out, (args, kwargs))
            del out
            loss.backward()
        del loss
        fwd_bwd = plain(tracker.get_tracker_snapshot("peak")) if tracker else None
        opt.step()
        after = plain(tracker.get_tracker_snapshot("current")) if tracker else None
        opt.zero_grad()
        return fwd_bwd, after

    orig = ShardingPropagator._propagate_tensor_meta_non_cached

    def unseen(self, op_schema):
        with _disable_current_modes():
            return orig(self, op_schema)

    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device="cpu")
        opt = torch.optim.AdamW(model.parameters(), foreach=foreach)
        args, kwargs = spec.make_inputs(values, torch.device("cpu"))
        step()
        tracker = FSDPMemTracker(model, opt)
        tracker.track_inputs((args, kwargs))
        if not count_propagation:
            ShardingPropagator._propagate_tensor_meta_non_cached = unseen
        try:
            with tracker:
                fwd_bwd, after = step(tracker)
        finally:
            ShardingPropagator._propagate_tensor_meta_non_cached = orig
    at_peak = plain(tracker.get_tracker_snapshot("peak"))
    where = []
    for stats in tracker.memory_tracking.values():
        for state, phase in ((_FSDPModState.PEAK_FW, "fw"), (_FSDPModState.PEAK_BW, "bw")):
            snaps = stats.snapshots.get(state)
            if snaps and any(cats.get("Total") == fwd_bwd["Total"] for cats in snaps[-1].values()):
                where.append((len(stats.mod_fqn), f"{phase} {stats.mod_fqn or '(root)'}"))
    if at_peak["Total"] != fwd_bwd["Total"]:
        place = "optimizer step"
    else:
        place = max(where)[1] if where else "loss (outside FSDP modules)"
    return {"peak": at_peak["Total"], "at_peak": at_peak, "after_step": after,
            "steps": sum(1 for st in opt.state.values() if "step" in st), "where": place}


def symcost_rank(an, sizes: dict) -> dict:
    """symcost's per-rank values at ``sizes``: model states (summary values), saved activations,
    the peak from the storage schedule and where it is, bytes."""
    from symcost.passes.parallel import summary

    s = summary(an, sizes=sizes, impl="foreach")
    mem = {k: int(v) for k, v in s["values"]["memory"].items() if k != "peak" and getattr(v, "is_number", True)}
    mem["peak"] = int(s["peak"]["value"]) if s["peak"].get("value") is not None else None
    mem["where"] = s["peak"].get("where")
    return mem


def mib(b) -> str:
    return "n/a" if b is None else f"{b / MiB:.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="*", default=["cs336-lm"],
                    help="built-in names or tests/data/configs names (default: %(default)s)")
    ap.add_argument("--rows", nargs="*", default=list(DEFAULT_ROWS),
                    help="fsdpxtp:DPxTP, hsdp:RxSHARD, ac-full:DP, ac-selective:DP (default: %(default)s)")
    ap.add_argument("--B", type=int, default=4)
    ap.add_argument("--S", type=int, default=256)
    ap.add_argument("--llama-L", type=int, default=2, help="layers of a config from tests/data/configs")
    ap.add_argument("--precision", default="bf16-mixed")
    ap.add_argument("--count-propagation", action="store_true",
                    help="let the tracker count DTensor's global-shape sharding-propagation temporaries")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist

    import symcost

    rows = [parse_row(r) for r in args.rows]
    print(f"FSDPMemTracker (torch {torch.__version__}) vs symcost on composed layouts, {args.precision}, "
          f"AdamW foreach; MiB per rank (rank 0)")
    for name in args.models:
        spec, sizes, _ = model_and_sizes(name, args)
        traces: dict = {}
        print(f"\n{name} {sizes}")
        print(f"  {'row':<16} {'world':>5} {'peer s':>6} | {'peer':>9} {'sym peak':>9} {'ratio':>6} | "
              + " ".join(f"{SHORT[c]:>7}" for c in CATEGORIES) + " | peer peak in | sym peak in")
        after = []
        for text, (kind, layout, mesh_sizes, world) in zip(args.rows, rows):
            an = values = None
            for cached in traces.get(layout, []):  # a trace of this layout whose pinned sizes allow the row's
                try:
                    values = {str(k): int(v) for k, v in cached.bind(**sizes, **mesh_sizes).items()}
                    an = cached
                    break
                except symcost.SymcostError:
                    continue
            failed = None
            if an is None:
                t = time.perf_counter()
                try:
                    an = symcost.trace(spec, layout=layout, sizes={**sizes, **mesh_sizes}, precision=args.precision)
                except symcost.SymcostError as e:  # (the peer still runs: the row shows what symcost refused)
                    failed = str(e).splitlines()[0]
                    print(f"  (trace {layout.describe(mesh_sizes)} failed after {time.perf_counter() - t:.1f} s: "
                          f"{failed})", flush=True)
                    values = {**spec.defaults, **sizes, **mesh_sizes}
                    values.update({a: values[b] for a, b in spec.tied.items()})
                else:
                    traces.setdefault(layout, []).append(an)
                    print(f"  (trace {layout.describe(mesh_sizes)}: {time.perf_counter() - t:.1f} s, "
                          f"pinned {an.pinned or 'none'})", flush=True)
                    values = {str(k): int(v) for k, v in an.bind(**sizes, **mesh_sizes).items()}
            t = time.perf_counter()
            try:
                peer = tracker_layout_run(spec, layout, values, args.precision,
                                          count_propagation=args.count_propagation)
            except Exception as e:  # noqa: BLE001 (a benchmark row: report and go on)
                print(f"  {text:<16} {world:>5} peer failed: {type(e).__name__}: {str(e).splitlines()[0][:150]}")
                continue
            t_peer = time.perf_counter() - t
            mine = symcost_rank(an, {**sizes, **mesh_sizes}) if an is not None else {"peak": None, "where": "(no trace)"}
            ratio = f"{mine['peak'] / peer['peak']:.3f}" if mine.get("peak") else "—"
            cats = " ".join(f"{mib(peer['at_peak'].get(c, 0)):>7}" for c in CATEGORIES)
            print(f"  {text:<16} {world:>5} {t_peer:>6.1f} | {mib(peer['peak']):>9} {mib(mine.get('peak')):>9} "
                  f"{ratio:>6} | {cats} | {peer['where']} | {mine.get('where')}", flush=True)
            after.append((text, peer, mine))
        print("  model states after the optimizer step (peer: its categories; symcost: summary values), bytes; "
              "peer opt includes AdamW's 4-byte step counters, added to symcost's column")
        print(f"  {'row':<16} | {'peer shP':>13} {'sym params':>13} | {'peer shG':>13} {'sym grads':>13} | "
              f"{'peer opt':>13} {'sym opt+steps':>13} | {'peer buf':>11}")
        for text, peer, mine in after:
            if "params" not in mine:
                continue
            a = peer["after_step"]
            print(f"  {text:<16} | {a.get('Sharded Param', 0):>13,} {mine['params']:>13,} | "
                  f"{a.get('Sharded Grad', 0):>13,} {mine['grads']:>13,} | "
                  f"{a.get('OptState', 0):>13,} {mine['optimizer_state'] + 4 * peer['steps']:>13,} | "
                  f"{a.get('Buffer', 0):>11,}")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
