"""``--pp N --schedule ... --microbatches m [--virtual-stages v]``: pipeline-parallel training on
``report`` (one row per rank: FLOPs, activations held, point-to-point bytes; the bubble),
docs/parallel.md "Pipeline parallelism"."""
from __future__ import annotations

import json

import click

from symcost.frontends.spec import MESH_HINT
from symcost.errors import SymcostError

from ._options import _keep_parallel, parse_config, parse_sizes

#: --schedule (symcost.frontends.pipeline.SCHEDULES; listed here so --help imports no torch)
SCHEDULE_CHOICES = ("gpipe", "1f1b", "interleaved-1f1b")


def pipeline_options(f):
    """``--pp``, ``--schedule``, ``--microbatches``, ``--virtual-stages`` (through the click context)."""
    f = click.option("--virtual-stages", type=click.IntRange(min=1), default=None, expose_value=False,
                     callback=_keep_parallel("symcost.pp_virtual"), metavar="V",
                     help="with --pp and --schedule interleaved-1f1b: stages per rank [default: 2]")(f)
    f = click.option("--microbatches", type=click.IntRange(min=1), default=None, expose_value=False,
                     callback=_keep_parallel("symcost.pp_microbatches"), metavar="M",
                     help="with --pp: micro-batches of B sequences per step [default: PP]")(f)
    f = click.option("--schedule", type=click.Choice(SCHEDULE_CHOICES), default=None, expose_value=False,
                     callback=_keep_parallel("symcost.pp_schedule"),
                     help="with --pp: torch.distributed.pipelining schedule [default: 1f1b]")(f)
    f = click.option("--pp", type=click.IntRange(min=2), default=None, expose_value=False,
                     callback=_keep_parallel("symcost.pp"), metavar="N",
                     help="pipeline-parallel ranks: trace the stage modules, compose PyTorch's schedule "
                          "(per-rank FLOPs, activations in flight, p2p bytes, bubble); composes with "
                          "--dp/--shard, --tp/--sp and --ac on one mesh")(f)
    return f


def pipeline_request(ctx):
    """``(pp, schedule, microbatches, virtual, gpu, devices_per_node, layout, mesh sizes)`` or
    None without ``--pp`` (``gpu``: ``--gpu``/``--device`` to price the step on, or None;
    ``layout`` the whole :class:`~symcost.frontends.layout.Layout`, ``--dp``/``--tp``/``--sp``/
    ``--ac`` with the pipeline; ``mesh sizes`` ``{"PP": n, "DP": n, "TP": n}``).

    Raises:
        SymcostError: a pipeline option without ``--pp``, ``--pp`` with an option it does not
            model (``--nodes``), two devices named, an unknown device.
    """
    from ._options import layout_request

    layout, sizes = layout_request(ctx, pipeline=True)  # (its checks: --pp with --dp or --tp, ...)
    if layout.pipeline is None:
        return None
    meta = ctx.find_root().meta
    if meta.get("symcost.nodes"):
        raise SymcostError("--pp with --nodes is not modelled yet (the pipeline report is one device per "
                           "stage; --gpu and --devices-per-node price its step); give one of them")
    gpu = meta.get("symcost.gpu")  # (layout_request read --device into it)
    per_node = meta.get("symcost.devices_per_node")
    if per_node is not None and gpu is None:
        raise SymcostError("--devices-per-node with --pp needs --gpu (the device whose links price the step)")
    pipe = layout.pipeline
    return sizes["PP"], pipe.schedule, pipe.microbatches, pipe.virtual, gpu, per_node, layout, sizes


def report_pipeline(req, model, sets, config, attention, precision, as_json, optimizer):
    """Print the pipeline report (text or ``--json``)."""
    from symcost.frontends.models import resolve
    from symcost.passes.pipeline import summary

    pp, schedule, m, v, gpu, per_node, layout, mesh = req
    spec = resolve(model, parse_config(config), attention)
    sizes = parse_sizes(sets)
    unknown = [k for k in sizes if k not in spec.all_symbols]
    sizes.update({k: n for k, n in mesh.items() if k != "PP"})  # (--dp, --tp: the stage's mesh)
    if unknown:
        raise SymcostError(f"unknown symbol {unknown[0]!r} for {spec.name}; accepted: {', '.join(spec.all_symbols)}"
                          f"{MESH_HINT.get(unknown[0], '')}")
    device = None
    if gpu is not None:
        from symcost.hardware.devices import get_device

        device = get_device(gpu)
    no_cache = click.get_current_context().find_root().meta.get("symcost.no_cache")
    r = summary(spec, pp, schedule, m, v, precision, sizes, optimizer, device=device, devices_per_node=per_node,
                cache=None if no_cache else (model, parse_config(config), attention), inner=layout.inner)
    if as_json:
        out = {k: r[k] for k in ("schedule", "engine", "source", "pp", "microbatches", "virtual", "bubble",
                                 "blocks", "ranks", "divisible") + (("step",) if "step" in r else ())}
        out["layout"] = {"mesh": layout.describe(dict(mesh)), **layout.to_dict()}
        if "step" in out:
            out["step"] = {**out["step"],
                           "stage_seconds": {str(s): t for s, t in out["step"]["stage_seconds"].items()},
                           "busy": {str(k): t for k, t in out["step"]["busy"].items()},
                           "idle": {str(k): t for k, t in out["step"]["idle"].items()}}
        out["bubble_formula"] = str(r["bubble_formula"])
        out["formulas"] = {p: {k: str(e) for k, e in f.items()} for p, f in r["formulas"].items()}
        out["pinned"] = r["pinned"]
        out["stages"] = {str(s): d for s, d in r["stages"].items()}
        click.echo(json.dumps({"model": spec.name, "pipeline": out}, indent=1))
        return
    from symcost.render.pipeline import render_pipeline

    render_pipeline(spec.name, r, layout=layout.describe(dict(mesh)) if layout.inner else None)
