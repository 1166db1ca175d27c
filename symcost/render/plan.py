"""Text of :func:`symcost.passes.plan.plan` (``symcost plan``): the top layouts as one table."""
from __future__ import annotations

from rich import box
from rich.table import Table

from symcost.render.report import console, human


def _gib(b: float) -> str:
    return f"{b / 2**30:.1f} GiB"


def render(res: dict, top: int = 5, width: int | None = None) -> None:
    """The fastest ``top`` layouts that fit: layout, per-rank memory, comm bytes per step by link,
    bubble, MFU and step time; then what was assumed."""
    c = console(width)
    c.print(f"[bold]plan[/bold] {res['model']} on {res['devices']} × {res['device']}, "
            f"{_gib(res['memory_cap'])} per device, global batch {res['global_batch']} "
            f"({human(res['params'], '').strip()} parameters): {len(res['layouts'])} of {res['considered']} layouts fit")
    # compact (one space between columns, units in the headers): 100 columns hold the table
    t = Table(show_header=True, header_style="bold", box=box.SIMPLE_HEAD, padding=(0, 0, 0, 1), pad_edge=False)
    rows = res["layouts"][:top]
    # expert and context parallelism: two more columns where any row shown has them (§13.6)
    ep_cp = any(r["layout"].get("ep", 1) > 1 or r["layout"].get("cp", 1) > 1 for r in rows)
    for h in ("#", "dp×tp×pp" + ("×cp ep" if ep_cp else ""), "b×m", "shard", "ckpt", "sched", "mem GiB", "TP GiB",
              "PP GiB", "DP GiB", *(("EP/CP GiB",) if ep_cp else ()), "bubble", "MFU", "step s", "bound s"):
        t.add_column(h, justify="left" if h in ("shard", "ckpt", "sched") else "right",
                     no_wrap=not h[:2] in ("TP", "PP", "DP", "EP"), overflow="fold")
    short = {"interleaved-1f1b": "i-1f1b", "network": "net"}
    for i, r in enumerate(rows, 1):
        lay, cb, ln = r["layout"], r["comm_bytes"], r["links"]
        link = lambda k: f"{cb[k] / 2**30:.1f} {short.get(ln[k], ln[k])}" if cb.get(k) else "0"  # noqa: E731
        dp_cell = link("dp") + (f" +{link('dp_replicate')} rep" if cb.get("dp_replicate") else "")
        mesh = f"{lay['dp']}×{lay['tp']}×{lay['pp']}"
        extra = ()
        if ep_cp:
            mesh += f"×{lay.get('cp', 1)} {lay.get('ep', 1)}"
            extra = (" ".join(x for x in ((link("ep") + " ep") if cb.get("ep") else "",
                                          (link("cp") + " cp") if cb.get("cp") else "") if x) or "0",)
        t.add_row(str(i), mesh + (" c" if r.get("composed") else ""), f"{lay['micro_batch']}×{lay['microbatches']}",
                  lay["shard"] + (f" R{lay['replicate']}" if lay.get("replicate", 1) > 1 else ""), (lay["checkpoint"] if lay["checkpoint"] != "optimal" else
                                 f"{lay['checkpointed_blocks']}/{lay['blocks']}"),
                  short.get(lay["schedule"], lay["schedule"]),
                  (f"{r['memory']['traced_peak'] / 2**30:.1f} tr" if r.get("peak_source") == "traced" else
                   f"{r['memory']['total'] / 2**30:.1f} sc"), link("tp"), link("pp"), dp_cell, *extra, f"{r['bubble']:.3f}",
                  f"{r['mfu']:.1%}", f"{r['step_seconds']:.3f}", f"{r.get('bound_seconds', r['step_seconds']):.3f}")
    c.print(t)
    c.print("mem: per rank, tr: the peak of the layout's composed trace (report's for that layout), sc: "
            "screened (model states + activations in flight, no transient working set); TP/PP/DP: GiB per rank per step, sent (= received), and the link they cross "
            "(node: the scale-up link; net: the network, one NIC per device); i-1f1b: interleaved 1F1B; "
            "ckpt k/n: k of the stage's n blocks checkpointed, the fewest that fit; hsdp R: R replicas of "
            "dp/R shards, DP GiB then the dp_shard group's + the dp_replicate group's (rep); "
            "×cp ep: context- and expert-parallel ranks, c: composed from the trace (EP/CP, docs/parallel.md §13.6). "
            f"Links: {res.get('links', '')}")
    for note in res.get("notes", ()):
        c.print(note)
    if not res["layouts"]:
        c.print("no layout fits: a larger memory cap, more devices, checkpointing or sharding")
    if "traced" in res:
        c.print(f"traced: {res['traced']} screened layouts within {res['near']:.0%} of the cap, fastest first, until "
                f"{res['trace_top']} fit (--trace-top); {len(res['dropped'])} of them over the cap when traced, dropped"
                + (f", and {res['pruned']} more at a micro-batch as large of a layout that was" if res.get("pruned") else ""))
    meg = (f" Megatron-LM's ddp/zero1 rows: --overlap {res['megatron_overlap']}"
           + (" (Megatron's default: no --overlap-grad-reduce)." if res["megatron_overlap"] == "none" else ".")
           if res.get("megatron_overlap") else "")
    c.print(f"overlap model: {res['overlap']}.{meg} Ranked by the predicted step (step s, MFU: the performance "
            "model's compute, launches and AdamW step, docs/performance-model.md); bound s: the roofline at the "
            "datasheet peak, the same communication (a lower bound). docs/parallel.md §13.")
