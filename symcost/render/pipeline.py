"""Text rendering of a pipeline-parallel summary (:func:`symcost.passes.pipeline.summary`)."""
from __future__ import annotations

from typing import Any

import sympy
from rich.console import Console
from rich.table import Table

from symcost.render.report import console as _console
from symcost.hardware.efficiency import DEFAULTED


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def _flops(n: float) -> str:
    for unit, k in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if n >= k:
            return f"{n / k:.3g} {unit}"
    return f"{n:.0f} FLOP"


def _seconds(x: float) -> str:
    for unit, k in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if x >= k:
            return f"{x / k:.3g} {unit}"
    return f"{x * 1e9:.3g} ns"


def render_pipeline(name: str, r: dict[str, Any], console: Console | None = None, layout: str | None = None,
                    assumed: dict | None = None, precision: str | None = None, attention: str | None = None,
                    timing: str | None = None) -> None:
    """Per-rank table (stages, blocks, FLOPs per step, micro-batches in flight, activations held,
    p2p bytes sent and received, model states) and the bubble, then each stage kind's formulas.
    ``layout``: the composed mesh in words (``pp 4 (1f1b) × dp_shard 2 (fsdp) × tp 2``), when the
    pipeline has other dimensions; each rank's collectives per group are then listed.
    ``assumed`` (:func:`symcost.render.report.assumed`) and ``precision``: the report's header
    rows (precision, optimizer and memory cap; a rank whose peak is above the cap is flagged),
    ``attention`` the model's attention implementation, ``timing`` the title line's seconds."""
    from rich.table import Table as Grid

    from symcost.render.report import assumption_rows, over_cap

    console = console or _console()
    v = r["virtual"]
    console.print(f"[bold]{name}[/bold]: pipeline of PP={r['pp']} ranks, {r['schedule']} "
                  f"({r['engine']}), m={r['microbatches']} micro-batches"
                  + (f", v={v} stages per rank" if v > 1 else "")
                  + (f", blocks per stage {', '.join(map(str, r['blocks']))} (--pp-split {r['split']})"
                     if r.get("split", "even") != "even" or len(set(r.get("blocks") or [])) > 1 else "")
                  + (f"; {timing}" if timing else ""))
    cap = (assumed or {}).get("memory_cap")
    if precision is not None:  # what it assumed, as the one-device report's header says it
        g = Grid.grid(padding=(0, 2))
        g.add_column(no_wrap=True, style="bold")
        g.add_column()
        assumption_rows(g, precision, assumed or {})
        g.add_row("attention", (attention + " (explicit matmuls)" if attention == "eager" else attention)
                  if attention else "the model's own code")
        values = {k: d["value"] for k, d in (r.get("symbols") or {}).items() if "value" in d}
        if values:
            g.add_row("sizes", " ".join(f"{k}={n}" for k, n in values.items()) + " (B: the micro-batch; L: the "
                      "whole model's blocks)")
        console.print(g)
    if layout:
        console.print(f"  layout: {layout}; each stage module parallelised over the other dimensions in "
                      "torchtitan's order, one rank of each traced; the numbers below are per device")
    console.print(f"  schedule: {r['source']}")
    ptdp = (r["pp"] - 1) / (v * r["microbatches"])
    flex = "" if abs(ptdp - r["bubble"]) < 1e-9 else \
        f" (PyTorch's interleaved rounds: m = {r['microbatches']} is not a multiple of PP, so not PTD-P's {ptdp:.4f})"
    console.print(f"  bubble (idle/busy, PyTorch's action lists on a dependency clock): {r['bubble']:.4f}"
                  f"   formula {r['bubble_formula']}{flex}")
    st = r.get("step")
    if st:
        pr = st.get("predicted")
        if pr:
            console.print(f"  step on {st['device']}: predicted {_seconds(pr['step_seconds'])} ({pr['mode']}; "
                          "PyTorch's action lists on a dependency clock with each stage's performance-model time per "
                          "micro-batch, its TP collectives and p2p sends α–β, then each rank's DP collectives "
                          f"(overlap {pr['overlap']}) and AdamW step); predicted MFU {pr['mfu_predicted']:.1%}"
                          + ("" if pr["calibrated"] else "; " + DEFAULTED))
        console.print(f"  step {'bound' if pr else 'on ' + st['device']}: {_seconds(st['step_seconds'])} "
                      f"(roofline bound: PyTorch's action lists on a dependency clock, each stage's roofline time per "
                      f"micro-batch + its p2p bytes over the {st['link']}); MFU {st['mfu']:.1%} (a ceiling)")
        console.print(f"  bubble at these times: {st['bubble']:.4f} (rank {st['bubble_rank']} idles "
                      f"{_seconds(st['bubble_seconds'])} of the step; rank {st['busiest_rank']}, the busiest, "
                      f"sets the pace: the stages' times differ)")
    if not r["divisible"]:
        console.print(f"  L does not divide into {r['pp'] * v} stages: blocks per stage {r['blocks']}")
    t = Table(title="per rank, one step")
    recompute = any(row.get("flops_hardware", row["flops"]) != row["flops"] for row in r["ranks"])
    for col in ("rank", "stages", "blocks", "FLOPs") + (("FLOPs run",) if recompute else ()) + (
            "in flight", "activations held", "p2p sent", "p2p recv", "model states", "peak"):
        t.add_column(col, justify="right", overflow="fold")
    for row in r["ranks"]:
        t.add_row(str(row["rank"]), ",".join(map(str, row["stages"])), str(row["blocks"]), _flops(row["flops"]),
                  *((_flops(row["flops_hardware"]),) if recompute else ()),
                  str(row["in_flight"]), _bytes(row["activations"]), _bytes(row["send"]), _bytes(row["recv"]),
                  _bytes(row["model_states"]) + (" on the host" if "host" in row else ""), (_bytes(row["peak_with_optimizer"])
                                                + (" [bold red]> cap[/bold red]" if cap and row["peak_with_optimizer"] > cap
                                                   else "")) if "memory" in row else "-")
    console.print(t)
    for row in r["ranks"]:
        line = over_cap(row.get("peak_with_optimizer"), cap, f"rank {row['rank']}")
        if line:
            console.print("  " + line)
    if recompute:
        console.print("  FLOPs: model FLOPs (MFU's); FLOPs run: with activation checkpointing's recomputation")
    if any("memory" in row for row in r["ranks"]):
        console.print("  peak: the rank's step run through PyTorch's schedule on fake tensors (parameters, "
                      "gradients, the engine's buffers, the highest live set), plus optimizer state")
    for row in r["ranks"]:
        if "activation_offload" in row:  # --offload-activations
            a = row["activation_offload"]
            console.print(f"  rank {row['rank']} activation offload (save_on_cpu(pin_memory=True)): pinned host "
                          f"{_bytes(a['host'])} at most (the micro-batches in flight); copies per step D2H "
                          f"{_bytes(a['d2h'])}, H2D {_bytes(a['h2d'])}"
                          + (f" ({_seconds(a['seconds']['forward'])} + {_seconds(a['seconds']['backward'])} over the "
                             "host link, not in the step time)" if "seconds" in a else "")
                          + "; the peak is the device's")
        if "host" in row:  # FSDP2's CPU offload (--offload): the model states on the host
            h, tr = row["host"], row.get("transfer")
            console.print(f"  rank {row['rank']} CPU offload (FSDP2 CPUOffloadPolicy): on the host {_bytes(h['total'])} "
                          f"(parameters {_bytes(h['params'])}, gradients {_bytes(h['grads'])}, optimizer state "
                          f"{_bytes(h['optimizer'] + h['master_weights'])}); the peak is the device's"
                          + (f"; copies per step H2D {_bytes(tr['h2d'])}, D2H {_bytes(tr['d2h'])}" if tr else "")
                          + (f", {_seconds(row['transfer_seconds'])} over the host link (not in the step time)"
                             if "transfer_seconds" in row else ""))
    if layout:
        for row in r["ranks"]:
            comm = {g: d for g, d in (row.get("comm") or {}).items() if g != "PP"}
            if comm:
                console.print(f"  rank {row['rank']} collectives per step: " + "; ".join(
                    f"{g} " + ", ".join(f"{k.replace('_', '-')} {_bytes(b)}" for k, b in sorted(d.items()))
                    for g, d in sorted(comm.items())))
    if st:
        tt = Table(title=f"per rank, the step on {st['device']}")
        for col in ("rank", "forward per micro-batch", "backward per micro-batch", "busy", "idle", "idle/busy") + (
                ("predicted forward", "predicted backward", "predicted busy", "DP exposed", "AdamW") if pr else ()):
            tt.add_column(col, justify="right")
        for row in r["ranks"]:
            mine = [st["stage_seconds"][s] for s in row["stages"]]
            busy, idle = row["busy_seconds"], row["idle_seconds"]
            extra = ()
            if pr:
                pm, rk = [pr["stage_seconds"][s] for s in row["stages"]], row["rank"]
                extra = (_seconds(sum(x["forward"] for x in pm)), _seconds(sum(x["backward"] for x in pm)),
                         _seconds(pr["busy"][rk]), _seconds(pr["dp_exposed"][rk]), _seconds(pr["optimizer"][rk]))
            tt.add_row(str(row["rank"]), _seconds(sum(x["forward"] for x in mine)),
                       _seconds(sum(x["backward"] for x in mine)), _seconds(busy), _seconds(idle),
                       f"{idle / busy:.3f}" if busy else "-", *extra)
        console.print(tt)
    v = r.get("virtual", 1)
    each = f"L/(PP·v) blocks each, v = {v} stages per rank" if v > 1 else "L/PP blocks each"
    uneven = " where L divides evenly; the table above holds the actual split" if r.get("blocks") and \
        len(set(r["blocks"])) > 1 else ""
    if r.get("stacks"):  # (several stacks cut as one list: passes.pipeline_stacks)
        each = "the stacks' blocks cut as one list, " + "; ".join(
            f"stage{st['stage']} " + " + ".join(f"{c}[{a}:{b}]" for c, (a, b) in st["held"].items())
            + (f" (receives {', '.join(st['recv'])})" if st["recv"] else "") for st in r["stacks"])
        uneven = ""
    console.print(f"formulas per micro-batch and stage ({each}{uneven}):")
    for part, f in r["formulas"].items():
        pins = (r.get("pinned") or {}).get(part)
        if pins:  # (no other value of these runs the same ops at the requested sizes: say so)
            why = (r.get("pin_reasons") or {}).get(part) or {}
            reasons = sorted({why[k] for k in pins if k in why})
            console.print(f"  [bold]{part}[/bold] traced with " + ", ".join(f"{k} = {v}" for k, v in pins.items())
                          + (f" pinned ({'; '.join(reasons)})" if reasons and r.get("stacks")
                             else " pinned (no other value runs the same ops in this regime)"))
        console.print(f"  [bold]{part}[/bold]: flops {f['flops']}")
        if "flops_hardware" in f and sympy.simplify(f["flops_hardware"] - f["flops"]) != 0:
            console.print(f"      flops run (recomputation included) {f['flops_hardware']}")
        console.print(f"      saved {f['saved']}")
        console.print(f"      send {f['send']}   recv {f['recv']}")
