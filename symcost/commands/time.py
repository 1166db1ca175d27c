"""``symcost time``: training time of a token budget from the exact FLOPs and from 6·N·P."""
from __future__ import annotations

import json

import click

from ._device import device_options, resolve_device
from ._options import common, every_layer_trace, overlap_of, parallel_options, parallel_request, trace_model
from ._pipeline import pipeline_options, pipeline_request
from symcost.hardware.efficiency import DEFAULTED


@click.command(name="time")
@click.argument("model", default="cs336-lm")
@common
@device_options
@click.option("--tokens", required=True, metavar="N", help="training tokens, e.g. 15e12")
@click.option("--devices", "n_devices", default=1, show_default=True, type=int, help="devices training together")
@click.option("--mfu", "mfu_text", default=None, metavar="U",
              help="achieved model-FLOP utilization, e.g. 0.4, 40% or 140/312: time = model FLOPs / "
                   "(devices x peak x U), whatever is recomputed")
@click.option("--hfu", "hfu_text", default=None, metavar="U",
              help="achieved hardware-FLOP utilization instead: time = (model + recomputed + kernel-repeated "
                   "FLOPs) / (devices x peak x U); Narayanan et al. 2021's X / peak")
@click.option("--recompute", default="none", show_default=True, type=click.Choice(["none", "selective", "full"]),
              help="activation recomputation in the hardware FLOPs (HFU): full (every block's forward once "
                   "more: 8·N·P) or selective (the attention core, Korthikanti et al. 2022)")
@click.option("--accumulate", "accumulate", default=1, show_default=True, type=click.IntRange(min=1), metavar="K",
              help="with --dp: gradient-accumulation micro-steps per optimizer step (global batch = B x K x DP)")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
@parallel_options
@pipeline_options
def time_(model, sets, config, attention, precision, debug, device_name, devices_file, peak_flops, bandwidth,
          tokens, n_devices, mfu_text, hfu_text, recompute, accumulate, as_json):
    """Days and device-hours to train MODEL on --tokens, from the traced step's exact FLOPs and
    from 6·N·P (8·N·P under --recompute full with --hfu) side by side.

    Give the achieved utilization as exactly one of --mfu (model FLOPs: the same for every
    attention kernel and recomputation) or --hfu (hardware FLOPs: with what is recomputed);
    the other is derived and both are printed. MODEL is counted at its own default sizes unless
    --set gives others; the sizes used are printed.

    With --pp N [--schedule ... --microbatches m] --gpu NAME (and --dp, --tp, --ep): the run from
    the pipeline step report --pp --gpu predicts (PyTorch's schedule over the stages' predicted
    times), m micro-batches of B sequences per step and pipeline.

    With --dp N [--shard S] --gpu NAME: the whole run on N data-parallel ranks from one rank's
    step time (roofline compute + the communication --overlap leaves exposed, over the device's
    interconnect; docs/parallel.md), its MFU derived, not given. The same with --tp, --ep, --cp
    (alone, paired, or with --dp) and --gpu: each process group over its own link.
    """
    from symcost.passes import roofline as rl
    from symcost.errors import SymcostError
    from symcost.render.report import console
    from symcost.render.roofline import model_lines

    n_tokens = rl.parse_count(tokens, "--tokens")
    ctx = click.get_current_context()
    pipe = pipeline_request(ctx)
    if pipe is not None:  # --pp: report --pp --gpu's predicted pipeline step
        return _time_pp(pipe, model, sets, config, attention, precision, device_name, devices_file, peak_flops,
                        bandwidth, n_tokens, n_devices, mfu_text, hfu_text, recompute, accumulate, as_json)
    dp, shard = parallel_request(ctx)
    meta = ctx.find_root().meta
    ranked = meta.get("symcost.gpu") and any(meta.get(f"symcost.{k}") is not None for k in ("tp", "ep", "cp"))
    if dp is not None or ranked:  # (a --tp/--ep/--cp rank without --dp: priced per process group too)
        return _time_dp(model, sets, config, attention, precision, device_name, devices_file, peak_flops,
                        bandwidth, n_tokens, n_devices, mfu_text, hfu_text, recompute, accumulate, as_json, dp, shard)
    if accumulate != 1:
        raise SymcostError("--accumulate needs --dp N (on one device the time of a token budget does not depend on it)")
    dev = resolve_device(device_name, devices_file, peak_flops, bandwidth)
    if (mfu_text is None) == (hfu_text is None):
        raise SymcostError("give the achieved utilization as exactly one of --mfu (model FLOPs) or --hfu "
                           "(hardware FLOPs, recomputation included), e.g. --mfu 0.45 or --hfu 140/312")
    given = "mfu" if mfu_text is not None else "hfu"
    utilization = rl.parse_fraction(mfu_text if given == "mfu" else hfu_text, f"--{given}")
    if n_devices <= 0:
        raise SymcostError("--devices must be a positive integer")
    an, sizes = trace_model(model, sets, config, attention, precision)
    if recompute == "full":  # the step with every block checkpointed: from the trace cache, or traced
        every_layer_trace(an, model, config, attention, precision, sizes)
    from symcost.graph.fusion import estimate  # (no torch for a cached analysis: its stored estimate)

    tc = rl.tokens_compute(an, sizes, n_tokens, recompute)  # 6·N·P: P active (R of E experts)
    key = rl.training_precision(an, an.bind(**sizes))  # the dtype carrying most model FLOPs at these sizes
    peak, _ = dev.peak_for(key)
    ratio = tc["flops.train_step_hardware"] / tc["flops.train_step"]  # hardware / model FLOPs of a step
    u_mfu, u_hfu = (utilization, utilization * ratio) if given == "mfu" else (utilization / ratio, utilization)
    if u_hfu > 1:
        raise SymcostError(
            f"--mfu {utilization:g} implies HFU {u_hfu:.4g}: the step's hardware FLOPs ({recompute} recomputation, "
            f"the kernels' own) are {ratio:.4g}x its model FLOPs; no device runs above its peak")
    total = "compute.total" if given == "mfu" else "compute.hardware"
    k = 8 if recompute == "full" and given == "hfu" else 6
    exact = rl.train_time(float(tc[total]), n_devices, peak, utilization)
    simple = rl.train_time(float(tc[f"compute.{k}NP"]), n_devices, peak, utilization)
    env = an.bind(**sizes)
    fused = int(estimate(an).total(an).subs(env))
    step_s = tc["flops.train_step"] / (peak * u_mfu)
    implied_bw = fused / step_s
    if implied_bw > dev.bandwidth:
        raise SymcostError(
            f"at MFU {u_mfu:.4g} a step takes {step_s:.4g} s per device and must move {fused:.4g} bytes: "
            f"{implied_bw / 1e12:.3g} TB/s, above {dev.key}'s {dev.bandwidth / 1e12:.3g} TB/s; "
            f"lower --{given} or raise the micro-batch --set B")
    note = rl.precision_note(an, an.bind(**sizes))
    from symcost.passes.performance import predict

    compiled = bool(click.get_current_context().find_root().meta.get("symcost.compile"))
    perf = predict(an, dev, sizes, mode="compiled" if compiled else "eager")
    steps = n_tokens / tc["tokens_per_step"] / n_devices  # steps each device runs (data parallel, no comm)
    predicted = {k: perf[k] for k in ("mode", "step_seconds", "bound_seconds", "terms", "mfu_predicted", "calibrated",
                                                  "defaulted")}
    predicted.update({"time.seconds": steps * perf["step_seconds"], "time.days": steps * perf["step_seconds"] / 86400,
                      "bound.time.seconds": steps * perf["bound_seconds"]})
    out = {"model": an.model, "device": dev.to_json(), "precision": key, "peak_flops": peak, "devices": n_devices,
           "mfu": u_mfu, "hfu": u_hfu, "utilization_given": given, **tc,
           "time.seconds": exact["seconds"], "time.days": exact["days"],
           "time.device_hours": exact["device_hours"], f"time.{k}NP.seconds": simple["seconds"],
           f"time.{k}NP.days": simple["days"], f"time.{k}NP.device_hours": simple["device_hours"],
           "implied_bandwidth": implied_bw, "predicted": predicted}
    if note:
        out["precision_note"] = note
    if as_json:
        click.echo(json.dumps(out, indent=1))
        return
    c = console()
    c.print(f"[bold]symcost time[/bold]: {an.model}, {n_tokens:.4g} tokens on {n_devices} x {dev.name} "
            f"({key} peak {peak / 1e12:.4g} TFLOP/s)")
    if note:
        c.print(f"note: {note}")
    for line in model_lines(an, sizes, tc):
        c.print(line)
    mark = {"mfu": " (given)" if given == "mfu" else " (derived)", "hfu": " (given)" if given == "hfu" else " (derived)"}
    c.print(f"MFU {u_mfu:.4g} ({100 * u_mfu:.1f}%){mark['mfu']}, HFU {u_hfu:.4g} ({100 * u_hfu:.1f}%){mark['hfu']}")
    c.print(f"  hardware FLOPs = {ratio:.4g} x model FLOPs (recompute {recompute}"
            f"{'; the kernels repeat work' if tc['flops.kernel_extra_step'] else ''})")
    what = "model" if given == "mfu" else "hardware"
    c.print(f"exact:  {float(tc[total]):.4g} {what} FLOP -> {exact['days']:.4g} days, "
            f"{exact['device_hours']:.4g} device-hours")
    c.print(f"{k}·N·P: {float(tc[f'compute.{k}NP']):.4g} FLOP -> {simple['days']:.4g} days, "
            f"{simple['device_hours']:.4g} device-hours")
    c.print(f"per token: {float(tc['flops.per_token']):.6g} model FLOP = {tc['flops.per_token_formula']}")
    c.print(f"predicted (performance model, {perf['mode']} step {perf['step_seconds'] * 1e3:.4g} ms, MFU "
            f"{100 * perf['mfu_predicted']:.1f}%): {predicted['time.days']:.4g} days; roofline bound (step "
            f"{perf['bound_seconds'] * 1e3:.4g} ms): {predicted['bound.time.seconds'] / 86400:.4g} days"
            f"{'' if perf['calibrated'] else f' ({DEFAULTED})'}")


def _time_dp(model, sets, config, attention, precision, device_name, devices_file, peak_flops, bandwidth,
             n_tokens, n_devices, mfu_text, hfu_text, recompute, accumulate, as_json, dp, shard):
    """``time --dp``: the run's time from one rank's step time
    (:func:`symcost.passes.parallel.train_time_dp`); one JSON object or text."""
    from symcost.errors import SymcostError
    from symcost.passes.parallel import train_time_dp
    from symcost.render.report import console, human

    meta = click.get_current_context().find_root().meta
    gpu = meta.get("symcost.gpu")
    if gpu and device_name and gpu != device_name:
        raise SymcostError(f"--gpu {gpu} and --device {device_name} name two devices; give one")
    if not (gpu or device_name):
        raise SymcostError("time --dp needs the device its ranks run on: --gpu NAME (e.g. --gpu h100-sxm)")
    flag = "--dp" if dp is not None else "--gpu"
    if mfu_text is not None or hfu_text is not None:
        raise SymcostError(f"with {flag} the step time, hence the MFU, comes from the roofline and the interconnect "
                           "(docs/parallel.md); leave out --mfu/--hfu")
    if recompute != "none":
        raise SymcostError("--recompute applies to --hfu on one device; with --dp trace the recomputation itself "
                           "(e.g. symcost checkpoint) ")
    if dp is not None and n_devices not in (1, dp):
        raise SymcostError(f"--devices {n_devices} and --dp {dp} disagree: with --dp the devices are the DP ranks")
    dev = resolve_device(gpu or device_name, devices_file, peak_flops, bandwidth)
    an, sizes = trace_model(model, sets, config, attention, precision, quiet=as_json)
    out = train_time_dp(an, dev, sizes, n_tokens, accumulate, overlap_of(meta, an),
                        meta.get("symcost.nodes"), meta.get("symcost.devices_per_node"))
    if dp is None and n_devices not in (1, out["ranks"]):
        raise SymcostError(f"--devices {n_devices} and the mesh's {out['ranks']} ranks disagree: the devices are "
                           "the mesh's ranks")
    out = {"model": an.model, "device": dev.to_json(), "shard": shard, **out}
    from symcost.passes.performance import predict_dp

    compiled = bool(meta.get("symcost.compile"))
    pd = predict_dp(an, dev, sizes, overlap_of(meta, an), meta.get("symcost.nodes"),
                    meta.get("symcost.devices_per_node"), mode="compiled" if compiled else "eager",
                    megatron_args=meta.get("symcost.megatron_args"))
    # one optimizer step of K micro-steps as the engine runs them (passes/accumulation.py): the
    # prediction's optimizer step once per K
    from symcost.frontends.layout import layout_of
    from symcost.passes.accumulation import accumulated

    opt = pd["optimizer_seconds"] if accumulate > 1 else 0.0
    acc = accumulated(pd, accumulate, layout_of(an).shard, overlap_of(meta, an), opt)
    seconds = float(out["steps"]) * acc["step_seconds"]
    out["predicted"] = {**pd, "accumulated": acc, "time.seconds": seconds, "time.days": seconds / 86400}
    if as_json:
        click.echo(json.dumps(out, indent=1))
        return
    st = out["step"]
    c = console()
    mesh = "" if out["ranks"] == out["dp"] else f" ({out['ranks']} ranks)"
    from symcost.frontends.layout import layout_of

    where = f"DP = {out['dp']}{mesh}" if dp is not None else f"{out['ranks']} ranks ({layout_of(an).describe(sizes)})"
    c.print(f"[bold]symcost time[/bold]: {an.model}, {n_tokens:.4g} tokens on {where} x {dev.name} "
            f"({'--shard ' + shard + '; ' if shard else ''}{out['precision']} peak {out['peak_flops'] / 1e12:.4g} "
            "TFLOP/s per device)")
    reps = out["global_batch"] // (out["micro_batch"] * out["accumulation"])
    c.print(f"global batch = B x K x {'DP' if reps == out['dp'] else 'replicas'} = {out['micro_batch']} x "
            f"{out['accumulation']} x {reps} = "
            f"{out['global_batch']} sequences of S = {out['sizes']['S']} tokens ({out['tokens_per_step']} tokens "
            f"per optimizer step; {out['steps']:.6g} steps)")
    c.print(f"step per rank (one micro-batch): {st['step_seconds'] * 1e3:.4g} ms = compute "
            f"{st['compute']['forward'] * 1e3:.4g} + {st['compute']['backward'] * 1e3:.4g} ms, communication "
            + (f"{human(sum(st['bytes'].values()), 'B')} per rank over {st['link']} at "
               f"{st['link_bandwidth'] / 1e9:.4g} GB/s per direction" if dp is not None else
               ", ".join(f"{g} {human(sum(d['bytes'].values()), 'B')} over {d['link']}" for g, d in st["groups"].items())
               + (f", CP ring {human(sum(st['cp']['bytes'].values()), 'B')} over {st['cp']['link']}" if "cp" in st
                  else "") + " per rank")
            + f" ({st['nodes']} node(s)), {st['exposed_comm_seconds'] * 1e3:.4g} ms exposed (--overlap {st['overlap']})")
    c.print(f"MFU per rank {out['mfu']:.4g} ({100 * out['mfu']:.1f}%); model FLOPs of the run {float(out['compute.total']):.4g}")
    c.print(f"time: {out['time.days']:.4g} days, {out['time.device_hours']:.4g} device-hours "
            f"({out['time.seconds']:.4g} s)")
    c.print(f"predicted (performance model, {pd['mode']}): step {pd['step_seconds'] * 1e3:.4g} ms (compute "
            f"{pd['compute']['forward'] * 1e3:.4g} + {pd['compute']['backward'] * 1e3:.4g} ms with launches and AdamW, "
            f"{pd['collectives']} collectives' latency {pd['latency_seconds'] * 1e3:.3g} ms, "
            f"{pd['exposed_comm_seconds'] * 1e3:.4g} ms exposed), MFU {100 * pd['mfu_predicted']:.1f}%: "
            f"{out['predicted']['time.days']:.4g} days; the figures above are the roofline bound"
            f"{'' if pd['calibrated'] else f' ({DEFAULTED})'}")


def _time_pp(pipe, model, sets, config, attention, precision, device_name, devices_file, peak_flops, bandwidth,
             n_tokens, n_devices, mfu_text, hfu_text, recompute, accumulate, as_json):
    """``time --pp``: the run's time from the pipeline step ``report --pp --gpu`` predicts
    (:func:`symcost.commands._pipeline.predicted_pipeline`): tokens / (B·S·m·replicas) optimizer
    steps, each the predicted step (and the bound's beside it); one JSON object or text."""
    from fractions import Fraction

    from symcost.errors import SymcostError
    from symcost.render.report import console

    from ._pipeline import predicted_pipeline

    gpu = pipe[4]
    if gpu and device_name and gpu != device_name:
        raise SymcostError(f"--gpu {gpu} and --device {device_name} name two devices; give one")
    if not (gpu or device_name):
        raise SymcostError("time --pp needs the device its ranks run on: --gpu NAME (e.g. --gpu h100-sxm)")
    if mfu_text is not None or hfu_text is not None:
        raise SymcostError("with --pp the step time, hence the MFU, is predicted (report --pp --gpu's pipeline step, "
                           "docs/performance-model.md); leave out --mfu/--hfu")
    if recompute != "none" or accumulate != 1:
        raise SymcostError("--recompute and --accumulate do not apply with --pp: give --ac for recomputation and "
                           "--microbatches for the micro-batches of a step")
    dev = resolve_device(gpu or device_name, devices_file, peak_flops, bandwidth)
    p = predicted_pipeline(pipe, model, sets, config, attention, precision, dev)
    if n_devices not in (1, p["ranks"]):
        raise SymcostError(f"--devices {n_devices} and the mesh's {p['ranks']} ranks disagree: with --pp the devices "
                           "are the mesh's ranks")
    steps = Fraction(n_tokens, p["tokens_per_step"])
    pr, st = p["predicted"], p["step"]
    seconds, bound = float(steps) * pr["step_seconds"], float(steps) * st["step_seconds"]
    pp, schedule, m = pipe[0], pipe[1], pipe[2]
    out = {"model": p["spec"].name, "device": dev.to_json(), "precision": p["precision"], "peak_flops": p["peak_flops"],
           "pp": pp, "schedule": schedule, "microbatches": m,
           "ranks": p["ranks"], "micro_batch": p["B"], "replicas": p["replicas"],
           "global_batch": p["B"] * m * p["replicas"], "tokens": n_tokens, "tokens_per_step": p["tokens_per_step"],
           "steps": float(steps), "flops.per_token": p["flops_per_token"],
           "compute.total": p["flops_per_token"] * n_tokens,
           "time.seconds": seconds, "time.days": seconds / 86400, "time.device_hours": seconds * p["ranks"] / 3600,
           "mfu": pr["mfu_predicted"],
           "predicted": {k: pr[k] for k in ("step_seconds", "mode", "overlap", "bubble", "model_flops", "mfu_predicted",
                                            "calibrated", "defaulted")},
           "bound": {"step_seconds": st["step_seconds"], "mfu": st["mfu"], "time.seconds": bound}}
    if as_json:
        click.echo(json.dumps(out, indent=1))
        return
    c = console()
    c.print(f"[bold]symcost time[/bold]: {out['model']}, {n_tokens:.4g} tokens on {p['ranks']} x {dev.name} "
            f"(--pp {pp}, {schedule}, {m} micro-batches of B = {p['B']} per step and pipeline, {p['replicas']} "
            f"pipeline(s) with their own micro-batches)")
    c.print(f"global batch {out['global_batch']} sequences of S = {p['S']} ({out['tokens_per_step']} tokens per "
            f"optimizer step; {out['steps']:.6g} steps); model FLOPs per token {out['flops.per_token']:.6g}")
    c.print(f"predicted (performance model, {pr['mode']}; report --pp --gpu's step): step "
            f"{pr['step_seconds'] * 1e3:.4g} ms, MFU {100 * pr['mfu_predicted']:.1f}%: {out['time.days']:.4g} days, "
            f"{out['time.device_hours']:.4g} device-hours"
            f"{'' if pr['calibrated'] else f' ({DEFAULTED})'}")
    c.print(f"roofline bound: step {st['step_seconds'] * 1e3:.4g} ms, MFU {100 * st['mfu']:.1f}%: "
            f"{bound / 86400:.4g} days")
