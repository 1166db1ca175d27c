"""``symcost calibrate``: measure this machine's peak matmul FLOP/s and bandwidth (a device entry)."""
from __future__ import annotations

import json

import click


@click.command()
@click.option("--device", "device", default="cpu", show_default=True, help="cpu or cuda")
@click.option("--out", default=None, metavar="FILE", help="write the entry as a --devices-file (JSON)")
@click.option("--name", default="this-machine", show_default=True, help="the entry's key (--device NAME)")
@click.option("--quick", is_flag=True, help="smaller kernels (seconds, less accurate)")
@click.option("--efficiency/--no-efficiency", default=True, show_default=True,
              help="also measure the performance model's parameters (eager GEMM sweep, bandwidth, launch "
                   "overhead, AdamW step; docs/performance-model.md) into the entry's efficiency table")
@click.option("--threads", default=None, type=click.IntRange(min=1), metavar="N",
              help="torch threads to measure with (torch.set_num_threads; default: torch's); validate --steps "
                   "runs the steps with the same number")
@click.option("--json", "as_json", is_flag=True, help="print the entry as JSON")
@click.option("--debug", is_flag=True, help="show tracebacks")
def calibrate(device, out, name, quick, efficiency, threads, as_json, debug):
    """Measure peak matmul FLOP/s (large square matmuls) and memory bandwidth (large copies,
    element-wise ops and a reduction), each compiled with torch.compile and timed with
    torch.utils.benchmark; print them and optionally write a device entry the other commands
    take with --devices-file FILE --device NAME. Each kernel is timed several times while other
    processes' CPU use is watched; a kernel timed on a busy machine is timed again, and if the
    machine stays busy the entry is marked contended (quality.contended in the file)."""
    from symcost.hardware import calibrate as cal
    from symcost.hardware.devices import write_file
    from symcost.render.report import console

    log = (lambda s: None) if as_json else (lambda s: console().print("  " + s))
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    entry = cal.calibrate(device, quick=quick, log=log, efficiency=efficiency)
    if out:
        write_file({name: entry}, out)
    if as_json:
        click.echo(json.dumps({name: entry}, indent=1))
        return
    c = console()
    peaks = ", ".join(f"{k} {entry[k] / 1e9:.1f} GFLOP/s" for k in ("fp32", "bf16", "fp16") if k in entry)
    c.print(f"[bold]{name}[/bold] ({entry['name']}): {peaks}; bandwidth {entry['bandwidth'] / 1e9:.2f} GB/s; "
            f"ridge {entry['fp32'] / entry['bandwidth']:.2f} FLOP/byte (fp32)")
    q = entry.get("quality", {})
    if q.get("contended"):
        c.print(f"[bold yellow]contended[/bold yellow]: the machine stayed busy while {len(q['kernels'])} kernel(s) "
                f"were timed ({'; '.join(q['reasons'])}; retried {q['retried']}, load average {q['loadavg']}); "
                "the rates may be far too low: calibrate again when the machine is idle"
                + (" (the file is marked contended: validate refuses it without --accept-contended)" if out else ""))
    else:
        c.print(f"quality: not contended ({q.get('criteria', '')})")
    if out:
        c.print(f"written to {out}: use --devices-file {out} --device {name}")
