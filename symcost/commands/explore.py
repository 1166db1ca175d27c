"""``symcost explore``: one self-contained HTML page with sliders over the model's formulas.

Registered in :data:`symcost.cli.COMMANDS`. Traces the model under each precision and layout
asked for (one trace each, through the trace cache the other commands use) and hands the
analyses to :func:`symcost.render.explore.explore`, which builds the page.
"""
from __future__ import annotations

import click

from symcost.errors import SymcostError
from ._options import common, early_checks, parse_config, parse_sizes

LAYOUTS = ("none", "ddp", "fsdp")
AC_MODES = ("none", "full")


def _list(text: str, what: str, accepted: tuple[str, ...] | None = None) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise SymcostError(f"{what}: give at least one value")
    bad = [t for t in items if accepted is not None and t not in accepted]
    if bad:
        raise SymcostError(f"{what} {bad[0]!r}: accepted: {', '.join(accepted)}")
    return list(dict.fromkeys(items))


@click.command(name="explore")
@click.argument("model", default="cs336-lm")
@common
@click.option("--layout", "layouts", default="none,ddp,fsdp", show_default=True,
              help="layouts to trace, comma-separated: none (one device), ddp, fsdp (one rank of --dp DP "
                   "--shard ddp|fsdp, DP a slider)")
@click.option("--ac", "acs", default="none,full", show_default=True,
              help="activation checkpointing to trace, comma-separated: none, full (--ac full)")
@click.option("--device", "device_name", default="h100", show_default=True, metavar="NAME",
              help="the device selected at first (any of `symcost devices` can be picked on the page)")
@click.option("--kv/--no-kv", "kv", default=True, show_default=True,
              help="also trace the decode step (a model with a KV cache: hf: models and config.json) and show "
                   "its KV cache, under serve's precision (bf16-true unless --precision is given: the first)")
@click.option("--out", "out", default=None, metavar="FILE.html",
              help="where to write the page [default: MODEL-explore.html]")
def explore(model, sets, config, attention, precision, debug, layouts, acs, device_name, kv, out):
    """Write an interactive page of MODEL's costs: one self-contained HTML file (no server, no
    network) with a slider for every symbol, the precision, device, layout (one device, DDP or
    FSDP over DP ranks) and activation checkpointing, and live plots of memory by category
    against B and S with the device's capacity, the step-time bound, the roofline with the
    model's ops and the checkpoint trade-off. Every number is one of symcost's formulas (sympy's
    JavaScript printer), equal to what report, roofline and checkpoint print at the same sizes.

    --precision takes a comma-separated list (each is traced): bf16-mixed,fp32.
    """
    precisions = _list(precision, "--precision")
    for p in precisions:
        early_checks(model, sets, config, attention, p)  # one line each, before any trace
    layouts_ = _list(layouts, "--layout", LAYOUTS)
    acs_ = _list(acs, "--ac", AC_MODES)
    sizes = parse_sizes(sets)
    cfg = parse_config(config)
    from symcost.hardware.devices import get_device

    dev = get_device(device_name)
    if dev.serial_passes or dev.memory is None:
        raise SymcostError(f"--device {device_name}: the page models catalogue accelerators with a memory "
                           "capacity (symcost devices)")
    from symcost.frontends.layout import Layout
    from symcost.render.explore import explore as build

    analyses = []
    for p in precisions:
        for lay in layouts_:
            for ac in acs_:
                layout = Layout(shard=None if lay == "none" else lay, ac=None if ac == "none" else ac)
                analyses.append(_trace(model, cfg, attention, p, sizes, layout))
    if kv and _has_kv_cache(model, cfg, attention):
        dsizes = {k: v for k, v in sizes.items() if k not in ("S", "DP")}
        dsizes["S"] = 1  # one new token per sequence (as trace_model reads a decode request)
        ctx = click.get_current_context()
        served = ("bf16-true" if ctx.get_parameter_source("precision") == click.core.ParameterSource.DEFAULT
                  else precisions[0])  # (serve's default: served weights are bf16)
        analyses.append(_trace(model, cfg, attention, served, dsizes, Layout(), step="decode"))
    page = build(analyses, sizes, dev.key)
    path = page.save(out or f"{model.replace('/', '_').replace(':', '_')}-explore.html")
    click.echo(f"wrote {path} ({len(page.html) / 2**10:.0f} KiB; open it in a browser: no server, no network)")


def _has_kv_cache(model, cfg, attention) -> bool:
    """Whether the model has an inference step (a KV cache): ``hf:`` models and config.json
    files, not the built-in models."""
    from ._options import resolve_model

    return resolve_model(model, cfg, attention).infer is not None


def _trace(model, cfg, attention, precision, sizes, layout, step=None):
    """One analysis through the trace cache, as :func:`._options.trace_model` reads it for the
    same options (``report --dp 8 --shard fsdp --ac full`` shares the entry; ``step="decode"``:
    ``serve``'s decode step)."""
    import click as _click

    from symcost.graph.cache import cached_trace
    from . import _options
    from ._options import _check_set_vs_config, _trace_fresh

    ctx = _click.get_current_context(silent=True)
    use_cache = not (ctx is not None and ctx.find_root().meta.get("symcost.no_cache"))
    sizes = dict(sizes)
    if layout.shard is not None:
        sizes.setdefault("DP", 8)
    sizes.pop("DP", None) if layout.shard is None else None
    options = dict(layout.cache_options()) if layout else {}
    if _options.model_task() is not None:
        options["task"] = _options.model_task()
    if step is not None:
        options.update(step=step, kv_cache="dynamic")
    an = cached_trace(model, cfg, attention, precision, sizes,
                      lambda: _trace_fresh(model, cfg, attention, precision, sizes, False, step=step,
                                           layout=layout or None),
                      use_cache, options=options or None)
    _check_set_vs_config(model, an.spec, sizes, cfg, attention)
    return an
