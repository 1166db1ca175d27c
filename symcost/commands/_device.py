"""Options every device-aware command shares: --device, --devices-file, --peak-flops, --bandwidth."""
from __future__ import annotations

import click


def device_options(f):
    """Add the device options (see :func:`symcost.hardware.devices.get_device`)."""
    f = click.option("--bandwidth", default=None, metavar="BYTE/S",
                     help="memory bandwidth, e.g. 3.35e12 or 3.35TB/s (overrides the device's)")(f)
    f = click.option("--peak-flops", default=None, metavar="FLOP/S",
                     help="peak FLOP/s at every precision, e.g. 989e12 or 989T (overrides the device's)")(f)
    f = click.option("--devices-file", default=None, metavar="FILE",
                     help="TOML/JSON file of extra devices (symcost calibrate --out writes one)")(f)
    f = click.option("--device", "device_name", default=None, metavar="NAME",
                     help="device from `symcost devices` (h100, a100-40gb, tpu-v5p, ...) or --devices-file")(f)
    return f


def resolve_device(device_name, devices_file, peak_flops, bandwidth):
    """The :class:`~symcost.hardware.devices.Device` the options name (errors are one line)."""
    from symcost.hardware.devices import get_device

    return get_device(device_name, devices_file, peak_flops, bandwidth)
