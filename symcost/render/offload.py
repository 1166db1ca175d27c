"""Text and JSON of FSDP2's CPU offload on one rank (``report --dp N --shard fsdp --offload``):
:func:`symcost.passes.offload.summary` rendered, nothing computed."""
from __future__ import annotations

from typing import Any

import sympy


def offload_json(off: dict, at_sizes: bool, fmt) -> dict[str, Any]:
    """``parallel.offload`` of ``report --json``: ``host`` {params, grads, optimizer,
    master_weights, total} (the rank's model states on the host, bytes), ``h2d`` and ``d2h``
    {forward, backward, train} (bytes copied between host and device per step); formulas as
    strings (``fmt``: the report's formula text) without sizes, integers with them (``at_sizes``)."""

    def num(v):
        v = sympy.sympify(v)
        return int(v) if v.is_integer else float(v)

    src = off["values"] if at_sizes else off
    conv = num if at_sizes else fmt
    return {k: {p: conv(v) for p, v in src[k].items()} for k in ("host", "h2d", "d2h")}


def render_offload(c, js: dict, step: dict | None, human) -> None:
    """The offload lines of the text report on console ``c``: host bytes, the copies per step and,
    with ``--gpu``, their time over the host link (``step``: :func:`symcost.passes.parallel.step_time`);
    ``human``: the report's unit formatting."""

    def h(v):
        return human(v, "B") if isinstance(v, (int, float)) else str(v)

    host, h2d, d2h = js["host"], js["h2d"], js["d2h"]
    c.print(f"CPU offload (FSDP2 CPUOffloadPolicy): on the host {h(host['total'])} per rank (parameters "
            f"{h(host['params'])}, gradients {h(host['grads'])}, optimizer state {h(host['optimizer'])}"
            + (f", master weights {h(host['master_weights'])}" if host.get("master_weights") not in (0, "0") else "")
            + "; the optimizer steps there); the peak above is the device's")
    c.print(f"host<->device copies per step: H2D {h(h2d['train'])} (parameter shards before each all-gather: "
            f"{h(h2d['forward'])} forward + {h(h2d['backward'])} backward), D2H {h(d2h['train'])} (gradient shards)")
    if step is not None and step.get("transfer") is not None:
        tr = step["transfer"]
        c.print(f"copies over {step['host_link']} at {step['host_bandwidth'] / 1e9:.0f} GB/s per direction: "
                f"{tr['forward'] * 1e3:.3f} + {tr['backward'] * 1e3:.3f} ms forward + backward, counted with the "
                "communication of their phase")


def activation_json(act: dict, at_sizes: bool, fmt) -> dict[str, Any]:
    """``offload_activations`` of ``report --json`` (:func:`symcost.passes.offload.activation_summary`):
    ``host`` {total} (pinned host bytes of the packed saved tensors), ``d2h`` and ``h2d`` {forward,
    backward, train} (bytes copied per step), formulas as strings (``fmt``) without sizes, integers
    with them (``at_sizes``); with a device, ``seconds`` {forward, backward}, ``host_link``,
    ``host_bandwidth``."""

    def num(v):
        v = sympy.sympify(v)
        return int(v) if v.is_integer else float(v)

    src = act["values"] if at_sizes else act
    conv = num if at_sizes else fmt
    out = {k: {p: conv(v) for p, v in src[k].items()} for k in ("host", "d2h", "h2d")}
    for k in ("seconds", "host_link", "host_bandwidth"):
        if k in act:
            out[k] = act[k]
    return out


def render_activation_offload(c, js: dict, human) -> None:
    """The activation offload lines of the text report on console ``c`` (``js``: :func:`activation_json`)."""

    def h(v):
        return human(v, "B") if isinstance(v, (int, float)) else str(v)

    c.print(f"activation offload (save_on_cpu(pin_memory=True) around the forward): {h(js['host']['total'])} "
            f"of pinned host memory (every tensor autograd saves, parameters included, once per save); "
            f"D2H {h(js['d2h']['forward'])} in the forward, H2D {h(js['h2d']['backward'])} in the backward "
            "(each copy back live on the device while its backward node runs); the peak is the device's")
    if "seconds" in js:
        s = js["seconds"]
        c.print(f"copies over {js['host_link']} at {js['host_bandwidth'] / 1e9:.0f} GB/s per direction: "
                f"{s['forward'] * 1e3:.3f} + {s['backward'] * 1e3:.3f} ms forward + backward")
