"""The report's data-parallel section (``report --dp``, with --tp/--ep/--cp meshes): the strategy,
bytes over the links per rank and the rank's model states (moved out of render/report.py, past
~800 lines; the JSON it prints from is :func:`symcost.render.report.parallel_json`)."""
from __future__ import annotations

from typing import Mapping

from symcost.graph.analysis import Analysis
from symcost.render.report import add_peak_row, console, human, parallel_json, per_rank_table


def render_parallel(an: Analysis, sizes: Mapping[str, int], summary: dict, width: int | None = None,
                    step: dict | None = None) -> None:
    """The data-parallel section of the report: the strategy, bytes over the links per rank and
    the rank's model states."""
    c = console(width)
    js = parallel_json(an, sizes, summary)
    par = js["parallel"]
    hsdp = (f" (HSDP: dp_replicate {par['dp_replicate']} × dp_shard {par['dp_shard']}: states sharded over "
            f"dp_shard, gradients all-reduced over dp_replicate)") if par.get("dp_replicate") else ""
    if par.get("tp") is not None and par.get("ep") is not None:  # (docs/parallel.md §14.9)
        n = par["dp"] * par["ep"] if isinstance(par["dp"], int) and isinstance(par["ep"], int) else f"{par['dp']}·{par['ep']}"
        c.print(f"\n[bold]data x expert x tensor parallel[/bold]: --shard {par['shard']} on DP = {par['dp']} x EP = "
                f"{par['ep']} ({n} ranks in TP groups of {par['tp']}), one rank traced: {par['engine']}; "
                f"{par['sharded']} (of the rank's TP-local parameters)"
                + (f"; {par['params_rank']:,} parameter elements on the rank" if isinstance(par.get("params_rank"), int)
                   else ""))
    elif par.get("tp") is not None:
        c.print(f"\n[bold]data x tensor parallel[/bold]: the mesh DP = {par['dp']} x TP = {par['tp']} "
                f"({'with' if par['sp'] else 'without'} sequence parallelism), one rank traced: "
                f"{par['engine']}; {par['sharded']} (of the rank's TP-local parameters)" + hsdp)
    elif par.get("ep") is not None:  # (expert parallelism under FSDP2, docs/parallel.md §14.6)
        n = par["dp"] * par["ep"] if isinstance(par["dp"], int) and isinstance(par["ep"], int) else f"{par['dp']}·{par['ep']}"
        c.print(f"\n[bold]data x expert parallel[/bold]: --shard {par['shard']} on DP = {par['dp']} x EP = {par['ep']} "
                f"({n} ranks, each its own micro-batch), one rank traced: {par['engine']}; {par['sharded']}"
                + (f"; {par['params_rank']:,} parameter elements on the rank" if isinstance(par.get("params_rank"), int)
                   else ""))
    else:
        c.print(f"\n[bold]data parallel[/bold]: --shard {par['shard']} on DP = {par['dp']} ranks; traced "
                f"{par['engine']}; {par['sharded']}" + hsdp)
    if par.get("divisible") is False:
        local = " TP-local" if par.get("tp") is not None else ""
        what = "DP·EP (DP for the experts)" if par.get("ep") is not None else "DP"
        c.print(f"{what} does not divide every{local} sharded dimension here: the values include the padding of "
                "the shards (FSDP2: ceil(d0/DP) rows per rank), the formulas and the peak do not (docs/parallel.md)")
    t = per_rank_table(summary, js, par, bucket_rows(step))
    pk = par["memory"]
    add_peak_row(t, pk)
    c.print(t)
    if pk.get("peak") is not None:
        c.print(f"peak per rank at: {pk['where']} (model states + the live storages of the traced step: "
                "unsharded parameters, collective buffers, gradients, activations)")
    if par.get("offload"):
        from symcost.render.offload import render_offload

        render_offload(c, par["offload"], step, human)
    if step is not None and step.get("tp_comm") is not None:
        c.print(f"TP group: {(step['tp_comm']['forward'] + step['tp_comm']['backward']) * 1e3:.3f} ms of collectives over "
                f"{step['tp_link']} at {step['tp_link_bandwidth'] / 1e9:.0f} GB/s, exposed (between the ops that make "
                "and use their tensors); the figures below are the DP group's")
    if step is not None and step.get("ep_comm") is not None:
        c.print(f"EP group: {sum(step['ep_comm'].values()) * 1e3:.3f} ms of all-to-alls over {step['ep_link']} at "
                f"{step['ep_link_bandwidth'] / 1e9:.0f} GB/s, exposed (the token dispatch feeds the experts, the "
                "combine the next op); the experts' data-parallel group (DP_expert: FSDP2's, or DDP's gradient "
                "all-reduce) is overlapped as the DP group's")
    if step is not None and step.get("cp") is not None:
        cp = step["cp"]
        c.print(f"CP ring: {sum(cp['ring'].values()) * 1e3:.3f} ms of K/V and dK/dV passes over {cp['link']} at "
                f"{cp['bandwidth'] / 1e9:.0f} GB/s, {sum(cp['exposed'].values()) * 1e3:.3f} ms of it exposed (PyTorch's "
                "ring schedule: each pass beside one attention block); the figures below are the DP·CP group's")
    if step is not None:
        from symcost.passes.megatron_buckets import OVERLAPS as MEGATRON_OVERLAPS

        # the roofline's step: a lower bound, not the prediction (commands/report.py prints that
        # next); the collectives it adds exposed (TP, EP, the CP ring) named, then the DP group's
        exposed = [(f"{g} collectives", sum(d["seconds"].values())) for g, d in step["groups"].items()
                   if not d["overlapped"]]
        if step.get("cp") is not None:
            exposed.append(("CP ring", sum(step["cp"]["exposed"].values())))
        overlap_model = MEGATRON_OVERLAPS[step["overlap"]] if step.get("buckets") else step["overlap_model"]
        c.print(f"lower bound (roofline, fused; not the predicted step) per rank: {step['step_seconds'] * 1e3:.3f} ms "
                f"(compute {step['compute']['forward'] * 1e3:.3f} + {step['compute']['backward'] * 1e3:.3f} ms forward "
                "+ backward, "
                + "".join(f"{what} {sec * 1e3:.3f} ms exposed, " for what, sec in exposed)
                + f"DP group communication {step['comm']['forward'] * 1e3:.3f} + {step['comm']['backward'] * 1e3:.3f} ms "
                f"forward + backward over {step['link']} at {step['link_bandwidth'] / 1e9:.0f} GB/s "
                + (f"(dp_shard) and {step['replicate_link']} at {step['replicate_link_bandwidth'] / 1e9:.0f} GB/s "
                   "(dp_replicate) " if step.get("replicate_link") else "")
                + f"per direction, {step['nodes']} node(s); overlap {step['overlap']}: {overlap_model}); "
                f"MFU at the bound {100 * step['mfu']:.1f}%" + (f" of the {step['precision']} peak "
                                                                 f"{step['peak_flops'] / 1e12:.4g} TFLOP/s (the dtype "
                                                                 "the traced matmuls ran in)"
                                                                 if step.get("precision") else ""))


def bucket_rows(step: dict | None) -> dict[str, list[tuple[str, str, str]]]:
    """The rows of the per-rank table that show what the step time prices under Megatron-LM's
    engine (``step["buckets"]``, :func:`symcost.passes.megatron_buckets.engine`) beside the
    trace's collectives: per data-parallel group, its buckets' bytes per rank per step (the
    gradient buffer's dtype: fp32 under ``megatron-bf16``, where the trace all-reduces in bf16),
    an all-reduce under DDP, a reduce-scatter (backward) and a parameter all-gather (priced in
    the forward) under the distributed optimizer; {} for another engine or no step."""
    b = (step or {}).get("buckets")
    if not b:
        return {}
    out: dict[str, list[tuple[str, str, str]]] = {}
    for g, d in step["groups"].items():
        bufs = [x for x in b["buffers"] if x["group"] == g and x["buckets"]]
        if not bufs:
            continue
        n = sum(len(x["buckets"]) for x in bufs)

        def formula(ring, key):  # (ring bytes per rank, as the trace's rows: 2(n-1)/n of an all-reduce's buffer)
            return f"Megatron's {n} bucket(s): {ring}({g}-1)/{g} x " + " + ".join(
                f"{sum(x['buckets']):,} x {x[key]} B" for x in bufs)

        if b["distributed"]:
            out[g] = [(f"  over the {g} group: reduce_scatter (priced)", formula("", "grad_bytes"),
                       human(d["bytes"]["backward"], "B")),
                      (f"  over the {g} group: all_gather (priced)", formula("", "param_bytes"),
                       human(d["bytes"]["forward"], "B"))]
        else:
            out[g] = [(f"  over the {g} group: all_reduce (priced)", formula("2", "grad_bytes"),
                       human(sum(d["bytes"].values()), "B"))]
    return out
