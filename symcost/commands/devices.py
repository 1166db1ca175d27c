"""``symcost devices``: the device catalogue (and a --devices-file's entries)."""
from __future__ import annotations

import json

import click


@click.command()
@click.option("--devices-file", default=None, metavar="FILE", help="also list the devices of this TOML/JSON file")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
@click.option("--debug", is_flag=True, help="show tracebacks")
def devices(devices_file, as_json, debug):
    """List the devices --device accepts: dense peak FLOP/s per precision, bandwidth, capacity, source."""
    from rich.table import Table

    from ..devices import ALIASES, PRECISIONS, catalogue, load_file
    from ..report import console

    devs = dict(catalogue())
    if devices_file:
        devs.update(load_file(devices_file))
    if as_json:
        click.echo(json.dumps({"devices": {k: d.to_json() for k, d in devs.items()}, "aliases": ALIASES}, indent=1))
        return
    t = Table(title="Devices (dense peak TFLOP/s; ridge = bf16 peak / bandwidth)", title_justify="left")
    for col in ("device", "name", *PRECISIONS, "TB/s", "memory GB", "ridge bf16", "source (date)"):
        t.add_column(col, overflow="fold")
    for k, d in devs.items():
        ridge = d.ridge("bf16")
        t.add_row(k, d.name, *[f"{d.peak[p] / 1e12:g}" if p in d.peak else "-" for p in PRECISIONS],
                  f"{d.bandwidth / 1e12:.3g}", f"{d.memory / 1e9:g}" if d.memory else "-", f"{ridge:.0f}",
                  f"{d.source} ({d.date})")
    c = console()
    c.print(t)
    c.print("aliases: " + ", ".join(f"{a} = {b}" for a, b in ALIASES.items()))
