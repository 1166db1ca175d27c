"""``symcost roofline``: per-op roofline on a device, step-time lower bound, MFU ceiling, crossings."""
from __future__ import annotations

import json

import click

from ._device import device_options, resolve_device
from ._options import common, compile_option, fp8_option, trace_model


@click.command()
@click.argument("model", default="cs336-lm")
@common
@device_options
@fp8_option
@compile_option
@click.option("--unfused", is_flag=True, help="time ops with unfused bytes (eager PyTorch) instead of fused (compiled)")
@click.option("--crossing", "crossing_symbol", default=None, metavar="SYM",
              help="solve, per matmul, the value of SYM at which it becomes compute-bound (e.g. B, S)")
@click.option("--tokens", default=None, metavar="N", help="token budget: also print compute.total (e.g. 300e9)")
@click.option("--top", default=15, show_default=True, help="ops listed in the text table (by time)")
@click.option("--plot", default=None, metavar="FILE.png", help="draw the roofline with every op (needs matplotlib)")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
def roofline(model, sets, config, attention, precision, debug, device_name, devices_file, peak_flops, bandwidth,
             unfused, crossing_symbol, tokens, top, plot, as_json):
    """Roofline of every op of MODEL's training step on a device: intensity, ridge, bound, time.

    Step-time lower bound (sum over ops of max(FLOPs/peak, bytes/bandwidth)), the MFU ceiling it
    implies, per phase and per module; --crossing B solves where each matmul crosses the ridge.
    """
    from symcost.passes import roofline as rl
    from symcost.errors import SymcostError
    from symcost.render.report import console
    from symcost.render.roofline import render_text

    dev = resolve_device(device_name, devices_file, peak_flops, bandwidth)
    n_tokens = rl.parse_count(tokens, "--tokens") if tokens is not None else None
    if top < 0:
        raise SymcostError("--top must be a non-negative integer")
    if plot:
        from symcost.render.plots import require_matplotlib

        require_matplotlib()
    an, sizes = trace_model(model, sets, config, attention, precision)
    r = rl.roofline(an, dev, sizes, fused=not unfused, crossing_symbol=crossing_symbol)
    tc = rl.tokens_compute(an, sizes, n_tokens)  # 6·N·P: P active (R of E experts)
    if plot:
        from symcost.render.plots import roofline_plot

        roofline_plot(r, plot, title=f"{an.model} on {dev.key}")
    if as_json:
        out = {"model": an.model, "precision": an.precision, "device": r["device"],
               "roofline": {k: v for k, v in r.items() if k != "device"}, **tc}
        click.echo(json.dumps(out, indent=1, default=str))
        return
    render_text(console(), an, dev, r, tc, n_tokens=n_tokens, top=top, unfused=unfused,
                crossing_symbol=crossing_symbol)
    if plot:
        console().print(f"plot written to {plot}")
