"""``symcost validate``: the roofline against compiled kernels timed on this machine."""
from __future__ import annotations

import json

import click


@click.command()
@click.option("--devices-file", default=None, metavar="FILE",
              help="a calibrated entry (symcost calibrate --out FILE); default: calibrate now")
@click.option("--device", "device_name", default=None, metavar="NAME", help="the entry's name in --devices-file")
@click.option("--quick", is_flag=True, help="the CI-sized sweep (smaller kernels and models)")
@click.option("--hardware", default="cpu", show_default=True, type=click.Choice(["cpu", "cuda"]),
              help="where the kernels run (cuda: GPU-sized kernels and steps)")
@click.option("--attempts", default=3, show_default=True, help="rounds of re-timing failing kernels (noisy machines)")
@click.option("--accept-contended", is_flag=True,
              help="check against a --devices-file calibration marked contended (taken on a busy machine) anyway")
@click.option("--decode", is_flag=True, help="instead of the sweep: compiled decode steps of a 62M-parameter Llama "
                                              "(StaticCache, T=255) at B=1, 8, 64 against the decode roofline "
                                              "(docs/inference.md)")
@click.option("--steps", is_flag=True, help="instead of the sweep: the performance model's predicted wall time of "
                                             "whole eager training steps (AdamW foreach; fp32 and bf16-mixed) "
                                             "against their measured median, within --tolerance "
                                             "(docs/performance-model.md; needs --devices-file from symcost "
                                             "calibrate)")
@click.option("--dp", "dp", default=None, type=click.IntRange(min=2), metavar="N",
              help="with --steps: DDP steps on N gloo processes of this host instead (the all-reduce's alpha-beta "
                   "measured on its own microbenchmark first; docs/performance-model.md)")
@click.option("--tolerance", default=None, type=click.FloatRange(min=0, min_open=True),
              help="with --steps: the largest |predicted / measured - 1| that passes [default: 0.15; 0.25 with --dp]")
@click.option("--plot", default=None, metavar="FILE.png", help="draw measured vs predicted (needs matplotlib)")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
@click.option("--debug", is_flag=True, help="show tracebacks")
def validate(devices_file, device_name, quick, hardware, attempts, accept_contended, decode, steps, dp, tolerance, plot,
             as_json, debug):
    """Compile and time a sweep of kernels (square and skinny matmuls, matrix-vector, add, GELU,
    softmax, a Linear+GELU block) and the training steps of mlp and cs336-lm on this CPU; print
    per kernel FLOPs, bytes, intensity, predicted bound and time, measured time and FLOP/s, the
    ratio; exit 1 when a check fails (see docs/roofline.md). --hardware cuda runs GPU-sized
    kernels on the GPU. A --devices-file entry that calibrate marked contended (measured on a busy
    machine) is refused unless --accept-contended."""
    import sys

    from symcost.errors import SymcostError

    if dp is not None and not steps:
        raise SymcostError("--dp N applies to validate --steps (DDP steps on N gloo processes); leave it out otherwise")
    from symcost.validation import validate as val
    from symcost.hardware.devices import get_device
    from symcost.render.report import console

    if attempts < 1:
        raise SymcostError("--attempts must be a positive integer")
    if plot:
        from symcost.render.plots import require_matplotlib

        require_matplotlib()
    dev = get_device(device_name, devices_file) if devices_file else None
    if device_name and not devices_file:
        raise SymcostError("validate measures this machine: --device names an entry of --devices-file "
                           "(symcost calibrate --out FILE writes one)")
    if dev is not None and dev.contended and not accept_contended:
        q = dev.quality
        raise SymcostError(
            f"{devices_file} [{dev.key}] was calibrated on a busy machine (contended: {'; '.join(q.get('reasons', []))}"
            f"; {len(q.get('kernels', []))} kernel(s)), so its rates may be far too low and checks against it "
            "fail for the wrong reason: run symcost calibrate again on an idle machine, or pass --accept-contended")
    log = (lambda s: None) if as_json else (lambda s: console().print("  " + s))
    if steps:
        return _steps(dev, devices_file, quick, hardware, attempts, tolerance, as_json, log, dp)
    if decode:
        v = val.validate_decode(dev, attempts=attempts, log=log, hardware=hardware)
    else:
        v = val.validate(dev, quick=quick, attempts=attempts, log=log, hardware=hardware)
    if plot:
        from symcost.render.plots import validation_plot

        validation_plot(v.rows, plot, title=f"measured vs predicted on {v.device.name}")
    if as_json:
        click.echo(json.dumps(v.to_json(), indent=1, default=str))
    else:
        from rich.table import Table

        c = console()
        d = v.device
        c.print(f"[bold]symcost validate[/bold] on {d.name}: fp32 peak {d.peak_for('fp32')[0] / 1e9:.1f} GFLOP/s, "
                f"bandwidth {d.bandwidth / 1e9:.2f} GB/s, ridge {d.ridge('fp32'):.2f} FLOP/byte ({hardware})")
        from rich import box

        t = Table(title="per kernel: GFLOP, MiB, predicted and measured ms, reaches = predicted / measured "
                        "(bound: memory, compute, transc = special functions; FLOP/s and byte/s: --json)",
                  title_justify="left", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
        t.add_column("kernel", overflow="fold")  # names fold; the numbers never wrap
        for col in ("GFLOP", "MiB", "FLOP/B", "bound", "pred ms", "meas ms", "reaches"):
            t.add_column(col, justify="right", no_wrap=True)
        short = {"transcendental": "transc"}
        for r in v.rows:
            t.add_row(r["kernel"], f"{r['flops'] / 1e9:.3g}", f"{r['bytes'] / 2**20:.4g}", f"{r['intensity']:.3g}",
                      short.get(r["bound"], r["bound"]), f"{r['predicted'] * 1e3:.4g}", f"{r['measured'] * 1e3:.4g}",
                      f"{100 / r['ratio']:.0f}%")
        c.print(t)
        for s in v.scaling:
            verdict = {True: "agrees", False: "DISAGREES", None: "n/a (FLOPs and bytes grow alike)"}[s["agrees"]]
            c.print(f"scaling {s['family']}: {s['from']} -> {s['to']}: time x{s['time_ratio']:.2f}, predicted "
                    f"x{s['predicted_ratio']:.2f} ({s['bound']}-bound): {verdict}")
        for r in v.rows:
            if "floor_ratio" in r:
                c.print(f"{r['kernel']}: timed again in round {r['floor_round']}, it reaches "
                        f"{100 / r['floor_ratio']:.0f}% of the bound from that round's own calibration "
                        f"({100 / r['ratio']:.0f}% of the best rates): the 50% check uses the former")
        if v.contention is not None:
            c.print(f"other processes used {100 * v.contention:.0f}% of this machine's CPU while kernels were timed")
        if v.device.contended:
            c.print("[bold yellow]warning[/bold yellow]: the calibration was taken on a busy machine ("
                    + "; ".join(v.device.quality.get("reasons", [])) + "): failed checks may be the machine's, "
                    "not the model's")
        c.print(f"{len(v.failures)} failed check(s) after {v.attempts} round(s)")
        for f in v.failures:
            c.print(f"FAILED: {f}")
        if plot:
            c.print(f"plot written to {plot}")
    if v.failures:
        sys.exit(1)


def _steps(dev, devices_file, quick, hardware, attempts, tolerance, as_json, log, dp=None):
    """``validate --steps``: predicted against measured eager training steps (one table or JSON;
    exit 1 when a case is beyond the tolerance)."""
    import sys

    from symcost.errors import SymcostError
    from symcost.render.report import console
    from symcost.validation import steps as st

    if dev is None:
        raise SymcostError("validate --steps needs the calibrated device: symcost calibrate --out FILE, then "
                           "--devices-file FILE (its efficiency table holds the measured parameters)")
    if hardware != "cpu":
        raise SymcostError("validate --steps times steps on this CPU only (benchmarks/gpu_check.sh calibrates a GPU)")
    if dp is not None:
        tolerance = 0.25 if tolerance is None else tolerance
        v = st.validate_dp_steps(dev, st.DP_CASES[:1] if quick else st.DP_CASES, ranks=dp, tolerance=tolerance,
                                 log=log)
    else:
        tolerance = 0.15 if tolerance is None else tolerance
        v = st.validate_steps(dev, st.QUICK_CASES if quick else st.STEP_CASES, tolerance=tolerance,
                              attempts=attempts, log=log)
    if as_json:
        click.echo(json.dumps(v.to_json(), indent=1, default=str))
    else:
        from rich import box
        from rich.table import Table

        c = console()
        c.print(f"[bold]symcost validate --steps[/bold] on {v.device.name} ({v.threads} threads): predicted "
                f"(performance model) vs measured median of eager training steps with AdamW (foreach)")
        t = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
        t.add_column("case", overflow="fold")
        for col in ("bound ms", "pred ms", "meas ms", "error"):
            t.add_column(col, justify="right", no_wrap=True)
        for r in v.rows:
            t.add_row(r["case"], f"{r['bound'] * 1e3:.1f}", f"{r['predicted'] * 1e3:.1f}",
                      f"{r['measured'] * 1e3:.1f}", f"{100 * r['error']:+.1f}%")
        c.print(t)
        if v.contention is not None:
            c.print(f"other processes used {100 * v.contention:.0f}% of this machine's CPU while steps were timed")
        errs = sorted(abs(r["error"]) for r in v.rows)
        c.print(f"median |error| {100 * errs[len(errs) // 2]:.1f}%, worst {100 * errs[-1]:.1f}%; "
                f"{len(v.failures)} case(s) beyond {100 * tolerance:.0f}%")
        for f in v.failures:
            c.print(f"FAILED: {f}")
    if v.failures:
        sys.exit(1)
