"""``symcost mfu``: model FLOPs utilization of a measured throughput (PaLM's definition)."""
from __future__ import annotations

import json

import click

from ._device import device_options, resolve_device
from ._options import common, compile_option, every_layer_trace, trace_model
from ._pipeline import pipeline_options, pipeline_request
from symcost.hardware.efficiency import DEFAULTED


@click.command()
@click.argument("model", default="cs336-lm")
@common
@device_options
@compile_option
@click.option("--tokens-per-second", "tps", required=True, metavar="R", help="measured training throughput, all devices")
@click.option("--devices", "n_devices", default=1, show_default=True, type=int, help="devices the throughput is over")
@click.option("--recompute", default="none", show_default=True, type=click.Choice(["none", "selective", "full"]),
              help="activation recomputation in the hardware FLOPs (HFU; MFU never counts it): full (every "
                   "block's forward once more) or selective (the attention core, Korthikanti et al. 2022)")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
@pipeline_options
def mfu(model, sets, config, attention, precision, debug, device_name, devices_file, peak_flops, bandwidth,
        tps, n_devices, recompute, as_json):
    """MFU = model FLOPs per token x tokens/s / (devices x peak at the training precision);
    HFU the same with hardware FLOPs (what a fused attention backward repeats, and --recompute).

    Model FLOPs per token come from the traced step (forward + backward, no recompute; the same
    for every attention kernel) at --set sizes (B is the micro-batch per device; unset sizes are
    the model's defaults, printed). An implied MFU or HFU above 100% or an implied memory traffic
    above the device's bandwidth is an error.

    With --pp N [--schedule ... --microbatches m]: the model FLOPs per token are the pipeline's
    (all its stages, m micro-batches), --devices its ranks unless given, and the predicted MFU is
    report --pp --gpu's predicted pipeline step on --device (a catalogue GPU with an interconnect).
    """
    from symcost.passes import roofline as rl
    from symcost.hardware.devices import parse_rate
    from symcost.errors import SymcostError
    from symcost.render.report import console
    from symcost.render.roofline import model_lines

    dev = resolve_device(device_name, devices_file, peak_flops, bandwidth)
    R = parse_rate(tps, "--tokens-per-second")
    if n_devices <= 0:
        raise SymcostError("--devices must be a positive integer")
    pipe = pipeline_request(click.get_current_context())
    if pipe is not None:
        return _mfu_pp(pipe, model, sets, config, attention, precision, dev, R, n_devices, recompute, as_json)
    an, sizes = trace_model(model, sets, config, attention, precision)
    if recompute == "full":  # the step with every block checkpointed: from the trace cache, or traced
        every_layer_trace(an, model, config, attention, precision, sizes)
    from symcost.graph.fusion import estimate  # (no torch for a cached analysis: its stored estimate)

    tc = rl.tokens_compute(an, sizes, recompute=recompute)  # 6·N·P: P active (R of E experts)
    key = rl.training_precision(an, an.bind(**sizes))  # the dtype carrying most model FLOPs at these sizes
    peak, _ = dev.peak_for(key)
    u = rl.mfu(float(tc["flops.per_token"]), R, n_devices, peak)
    env = an.bind(**sizes)
    fused = int(estimate(an).total(an).subs(env))
    steps_per_s = R / (n_devices * tc["tokens_per_step"])
    implied_bw = fused * steps_per_s
    if implied_bw > dev.bandwidth:
        raise SymcostError(
            f"implied memory traffic {implied_bw / 1e12:.3g} TB/s per device ({fused:.4g} bytes per step at "
            f"{steps_per_s:.4g} steps/s) exceeds {dev.key}'s {dev.bandwidth / 1e12:.3g} TB/s; "
            "check --tokens-per-second, --devices and the micro-batch --set B")
    ceiling = rl.roofline(an, dev, sizes)["mfu_ceiling"]
    from symcost.passes.performance import predict

    compiled = bool(click.get_current_context().find_root().meta.get("symcost.compile"))
    perf = predict(an, dev, sizes, mode="compiled" if compiled else "eager")
    note = rl.precision_note(an, an.bind(**sizes))
    out = {"model": an.model, "device": dev.to_json(), "precision": key, "peak_flops": peak,
           "tokens_per_second": R, "devices": n_devices, **tc, "mfu": u, "mfu_ceiling": ceiling,
           "implied_bandwidth": implied_bw, "bytes.fused_per_step": fused,
           "predicted": {k: perf[k] for k in ("mode", "step_seconds", "bound_seconds", "terms", "mfu_predicted",
                                              "calibrated", "defaulted")}}
    hfu = float(tc["flops.per_token_hardware"]) * R / (n_devices * peak)
    if hfu > 1:
        raise SymcostError(
            f"implied HFU is {100 * hfu:.1f}% (MFU {100 * u:.1f}%): {R:.6g} tokens/s x "
            f"{float(tc['flops.per_token_hardware']):.6g} hardware FLOP/token ({recompute} recomputation, the "
            f"kernels' own) exceeds {n_devices} x {peak:.4g} FLOP/s peak; check --tokens-per-second, --devices, "
            "--recompute")
    out["hfu"] = hfu
    if note:
        out["precision_note"] = note
    if as_json:
        click.echo(json.dumps(out, indent=1))
        return
    c = console()
    c.print(f"[bold]symcost mfu[/bold]: {an.model} on {n_devices} x {dev.name} ({key} peak {peak / 1e12:.4g} TFLOP/s)")
    if note:
        c.print(f"note: {note}")
    for line in model_lines(an, sizes, tc):
        c.print(line)
    c.print(f"model FLOPs per token: {float(tc['flops.per_token']):.6g}  = {tc['flops.per_token_formula']}  "
            f"({'6·N·P / (B·S)' if 'six_np.groups' in tc else '6·P'} = {tc['flops.per_token_6P']:.6g})")
    c.print(f"MFU: {100 * u:.2f}%   at {R:.6g} tokens/s   (roofline ceiling at these sizes: {100 * ceiling:.1f}%)")
    if u > ceiling:
        c.print("note: above the roofline ceiling of a step at these sizes on this device: the per-op bound "
                "(fused bytes) says no run can reach it; check the micro-batch --set B and the throughput")
    c.print(f"predicted MFU (performance model, {perf['mode']}): {100 * perf['mfu_predicted']:.2f}% "
            f"(step {perf['step_seconds'] * 1e3:.4g} ms predicted, {perf['bound_seconds'] * 1e3:.4g} ms roofline bound"
            f"{'' if perf['calibrated'] else '; ' + DEFAULTED}; "
            "docs/performance-model.md)")
    extra = [w for w, n in (("the kernels' repeated work", tc["flops.kernel_extra_step"]),
                            (f"{recompute} recomputation", tc["flops.recompute_step"])) if n]
    c.print(f"HFU: {100 * hfu:.2f}%   hardware FLOPs per token {float(tc['flops.per_token_hardware']):.6g} "
            f"(model FLOPs{' + ' + ' + '.join(extra) if extra else ', nothing repeated'})")
    c.print(f"implied memory traffic per device: {implied_bw / 1e9:.4g} GB/s of {dev.bandwidth / 1e9:.4g} GB/s "
            "(fused bytes of a step)")


def _mfu_pp(pipe, model, sets, config, attention, precision, dev, R, n_devices, recompute, as_json):
    """``mfu --pp``: the measured MFU = the pipeline's model FLOPs per token x R / (devices x peak),
    beside the predicted MFU of ``report --pp --gpu``'s pipeline step
    (:func:`symcost.commands._pipeline.predicted_pipeline`: model FLOPs of the step / (ranks x
    peak x predicted step)); one JSON object or text."""
    from symcost.errors import SymcostError
    from symcost.render.report import console

    from ._pipeline import predicted_pipeline

    if recompute != "none":
        raise SymcostError("--recompute does not apply with --pp: give --ac (the stages trace the recomputation)")
    p = predicted_pipeline(pipe, model, sets, config, attention, precision, dev)
    devices = p["ranks"] if n_devices == 1 else n_devices
    pr, st = p["predicted"], p["step"]
    key, peak = p["precision"], p["peak_flops"]
    u = p["flops_per_token"] * R / (devices * peak)
    if u > 1:
        raise SymcostError(f"implied MFU is {100 * u:.1f}%: {R:.6g} tokens/s x {p['flops_per_token']:.6g} model "
                           f"FLOP/token exceeds {devices} x {peak:.4g} FLOP/s peak; check --tokens-per-second, --devices")
    out = {"model": p["spec"].name, "device": dev.to_json(), "peak_flops": peak, "tokens_per_second": R,
           "devices": devices, "pp": pipe[0], "schedule": pipe[1], "microbatches": pipe[2], "ranks": p["ranks"],
           "tokens_per_step": p["tokens_per_step"], "flops.per_token": p["flops_per_token"], "mfu": u,
           "predicted": {k: pr[k] for k in ("step_seconds", "mode", "overlap", "bubble", "model_flops", "mfu_predicted",
                                            "calibrated", "defaulted")},
           "bound": {"step_seconds": st["step_seconds"], "mfu": st["mfu"]}}
    out["precision"] = key
    if as_json:
        click.echo(json.dumps(out, indent=1))
        return
    c = console()
    c.print(f"[bold]symcost mfu[/bold]: {out['model']} on {devices} x {dev.name} (--pp {pipe[0]}, {pipe[1]}, "
            f"{pipe[2]} micro-batches; peak {peak / 1e12:.4g} TFLOP/s)")
    c.print(f"model FLOPs per token: {p['flops_per_token']:.6g} (the pipeline's step, all its ranks, over its "
            f"{p['tokens_per_step']} tokens)")
    c.print(f"MFU: {100 * u:.3g}%   at {R:.6g} tokens/s")
    c.print(f"predicted MFU (performance model, {pr['mode']}; report --pp --gpu's step "
            f"{pr['step_seconds'] * 1e3:.4g} ms): {100 * pr['mfu_predicted']:.3g}%; roofline bound: step "
            f"{st['step_seconds'] * 1e3:.4g} ms, MFU {100 * st['mfu']:.3g}%"
            f"{'' if pr['calibrated'] else f' ({DEFAULTED})'}")
