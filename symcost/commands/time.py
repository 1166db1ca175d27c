"""``symcost time``: training time of a token budget from the exact FLOPs and from 6·N·P."""
from __future__ import annotations

import json

import click

from ._device import device_options, resolve_device
from ._options import common, trace_model


@click.command(name="time")
@click.argument("model", default="cs336-lm")
@common
@device_options
@click.option("--tokens", required=True, metavar="N", help="training tokens, e.g. 15e12")
@click.option("--devices", "n_devices", default=1, show_default=True, type=int, help="devices training together")
@click.option("--mfu", "utilization", required=True, type=float, help="achieved fraction of peak, e.g. 0.4")
@click.option("--recompute", default="none", show_default=True, type=click.Choice(["none", "full"]),
              help="full activation recomputation: one more forward per step (8·N·P, Narayanan et al. 2021)")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
def time_(model, sets, config, attention, precision, debug, device_name, devices_file, peak_flops, bandwidth,
          tokens, n_devices, utilization, recompute, as_json):
    """Days and device-hours to train MODEL on --tokens: total FLOPs / (devices x peak x MFU),
    from the traced step's exact FLOPs and from 6·N·P side by side."""
    from symcost.passes import roofline as rl
    from symcost.errors import SymcostError
    from symcost.render.report import console

    dev = resolve_device(device_name, devices_file, peak_flops, bandwidth)
    n_tokens = rl.parse_count(tokens, "--tokens")
    if not 0 < utilization <= 1:
        raise SymcostError(f"--mfu must lie in (0, 1] (an MFU above 100% is impossible), got {utilization}")
    if n_devices <= 0:
        raise SymcostError("--devices must be a positive integer")
    an, sizes = trace_model(model, sets, config, attention, precision)
    from symcost.graph.fusion import estimate  # (no torch for a cached analysis: its stored estimate)

    tc = rl.tokens_compute(an, sizes, n_tokens, recompute)
    key = rl.training_precision(an)
    peak, _ = dev.peak_for(key)
    k = 8 if recompute == "full" else 6
    exact = rl.train_time(float(tc["compute.total"]), n_devices, peak, utilization)
    simple = rl.train_time(float(tc[f"compute.{k}NP"]), n_devices, peak, utilization)
    env = an.bind(**sizes)
    fused = int(estimate(an).total(an).subs(env))
    step_s = tc["flops.train_step"] / (peak * utilization)
    implied_bw = fused / step_s
    if implied_bw > dev.bandwidth:
        raise SymcostError(
            f"at MFU {utilization:g} a step takes {step_s:.4g} s per device and must move {fused:.4g} bytes: "
            f"{implied_bw / 1e12:.3g} TB/s, above {dev.key}'s {dev.bandwidth / 1e12:.3g} TB/s; "
            "lower --mfu or raise the micro-batch --set B")
    out = {"model": an.model, "device": dev.to_json(), "precision": key, "peak_flops": peak, "devices": n_devices,
           "mfu": utilization, **tc, "time.seconds": exact["seconds"], "time.days": exact["days"],
           "time.device_hours": exact["device_hours"], f"time.{k}NP.seconds": simple["seconds"],
           f"time.{k}NP.days": simple["days"], f"time.{k}NP.device_hours": simple["device_hours"],
           "implied_bandwidth": implied_bw}
    if as_json:
        click.echo(json.dumps(out, indent=1))
        return
    c = console()
    c.print(f"[bold]symcost time[/bold]: {an.model}, {n_tokens:.4g} tokens on {n_devices} x {dev.name} at MFU "
            f"{utilization:g} ({key} peak {peak / 1e12:.4g} TFLOP/s)")
    c.print(f"exact:  {float(tc['compute.total']):.4g} FLOP -> {exact['days']:.2f} days, "
            f"{exact['device_hours']:.4g} device-hours")
    c.print(f"{k}·N·P: {float(tc[f'compute.{k}NP']):.4g} FLOP -> {simple['days']:.2f} days, "
            f"{simple['device_hours']:.4g} device-hours   (P = {tc['params_matmul']:.4g} matmul parameters)")
    c.print(f"per token: {float(tc['flops.per_token']):.6g} FLOP = {tc['flops.per_token_formula']}")
