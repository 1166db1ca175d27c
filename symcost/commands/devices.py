"""``symcost devices``: the device catalogue (and a --devices-file's entries)."""
from __future__ import annotations

import json

import click


@click.command()
@click.option("--devices-file", default=None, metavar="FILE", help="also list the devices of this TOML/JSON file")
@click.option("--sources", is_flag=True,
              help="also print each device's datasheet URL, whole on one line (lines may exceed the width)")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object (every field, sources included)")
@click.option("--debug", is_flag=True, help="show tracebacks")
def devices(devices_file, sources, as_json, debug):
    """List the devices --device accepts: dense peak FLOP/s per precision, bandwidth, capacity, name,
    special-function rate (where given), datasheet date (--sources: the datasheet URLs).

    The text fits 80 columns: figures in one table (numbers never wrapped), names and datasheet
    dates in a second; the URLs, too long for any table, only with --sources or in --json.
    """
    from rich import box
    from rich.table import Table

    from symcost.hardware.devices import ALIASES, PRECISIONS, catalogue, load_file
    from symcost.render.report import console

    devs = dict(catalogue())
    if devices_file:
        devs.update(load_file(devices_file))
    if as_json:
        click.echo(json.dumps({"devices": {k: d.to_json() for k, d in devs.items()}, "aliases": ALIASES}, indent=1))
        return
    c = console()
    t = Table(title="Devices: dense peak TFLOP/s, TB/s, GB; ridge = bf16 FLOP/byte",
              title_justify="left", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    t.add_column("device", overflow="fold")  # a long user key folds; the numbers never do
    for col in (*PRECISIONS, "TB/s", "GB", "ridge"):
        t.add_column(col, justify="right", no_wrap=True)
    for k, d in devs.items():
        t.add_row(k, *[f"{d.peak[p] / 1e12:.5g}" if p in d.peak else "-" for p in PRECISIONS],
                  f"{d.bandwidth / 1e12:.3g}", f"{d.memory / 1e9:.4g}" if d.memory else "-",
                  f"{d.ridge('bf16'):.0f}")
    c.print(t)
    n = Table(title="Names, special functions (T evaluations/s: exp, erf, ...), datasheet dates "
                    "(URLs: --sources, or --json)", title_justify="left",
              box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    n.add_column("device", overflow="fold")
    n.add_column("name")
    n.add_column("special", justify="right", no_wrap=True)
    n.add_column("date", no_wrap=True)
    for k, d in devs.items():
        tr = d.transcendental_rate
        special = "-" if not tr else (f"{tr['all'] / 1e12:.3g}" if set(tr) == {"all"} else
                                      f"{min(tr.values()) / 1e12:.2g}-{max(tr.values()) / 1e12:.2g}")
        n.add_row(k, d.name, special, d.date or "-")
    c.print(n)
    aliases = {**ALIASES, **{a: k for k, d in devs.items() for a in d.aliases}}
    c.print("aliases: " + ", ".join(f"{a} = {b}" for a, b in aliases.items()))
    if sources:
        c.print("sources:")
        for k, d in devs.items():  # unwrapped, so that a URL can be copied whole
            click.echo(f"  {k}: {d.source or '-'}")
