"""``symcost plan``: the best parallel layouts (DP/FSDP × TP × PP × micro-batch × checkpointing) of
N devices, ranked by predicted step time (docs/parallel.md §13)."""
from __future__ import annotations

import json

import click

from ._device import device_options, resolve_device
from ._options import parse_sizes


def _csv(text: str, accepted, what: str) -> tuple:
    from symcost.errors import SymcostError

    items = tuple(x.strip() for x in text.split(",") if x.strip())
    bad = [x for x in items if x not in accepted]
    if bad or not items:
        raise SymcostError(f"bad {what} {text!r}; accepted (comma-separated): {', '.join(accepted)}")
    return items


def _progress():
    """A progress line on stderr per traced candidate (only when stderr is a terminal)."""
    import sys

    if not sys.stderr.isatty():
        return None
    seen = [0]

    def show(row):
        seen[0] += 1
        x = row["layout"]
        click.echo(f"\rtracing candidate {seen[0]}: dp {x['dp']} tp {x['tp']} pp {x['pp']} b {x['micro_batch']} "
                   f"{x['shard']} {x['checkpoint']}\033[K", err=True, nl=False)
    return show


def _positive(text: str, what: str) -> int:
    from symcost.errors import SymcostError

    t = str(text).replace("_", "").strip()
    try:
        v = float(t)
    except ValueError:
        raise SymcostError(f"{what} must be a positive integer, got {text!r}") from None
    if v != int(v) or v < 1:
        raise SymcostError(f"{what} must be a positive integer, got {text!r}")
    return int(v)


@click.command()
@click.argument("model", default="megatron-gpt")
@click.option("--devices", "n_devices", required=True, metavar="N", help="devices training together")
@device_options
@click.option("--memory", required=True, metavar="CAP", help="memory per device, e.g. 80GiB (binary) or 80GB (10^9)")
@click.option("--global-batch", required=True, metavar="G", help="sequences per optimizer step (G = dp·b·m)")
@click.option("--set", "sets", multiple=True, metavar="SYM=INT", help="model sizes, e.g. --set H=96 D=128 L=80 S=2048")
@click.option("--precision", default="bf16-true-fp32-master", show_default=True,
              help="precision policy (Megatron-LM's: 16-bit weights and activations, fp32 master and Adam)")
@click.option("--shard", "shards", default="ddp,zero1,fsdp,hsdp", show_default=True,
              help="data-parallel sharding to try (hsdp: FSDP2 over replicate R × shard dp/R, every R | dp)")
@click.option("--checkpoint", "checkpoints", default="none,full,optimal,selective", show_default=True,
              help="activation checkpointing to try: none, full (every block), optimal (the fewest whole "
                   "blocks that fit the memory cap), selective (torchtitan's op policy, --ac selective: priced "
                   "by its composed trace only)")
@click.option("--schedule", "schedules", default="1f1b", show_default=True,
              help="pipeline schedules to try: 1f1b, interleaved-1f1b (v = 2), gpipe")
@click.option("--micro-batch", "micro", default="1,2,4,8", show_default=True, help="micro-batch sizes b to try")
@click.option("--sp", is_flag=True, help="sequence parallelism with TP (Korthikanti et al. 2022)")
@click.option("--ep", "eps", default=None, metavar="N,N,...",
              help="expert-parallel sizes to try for a model with routed experts [default: every EP torchtitan "
                   "allows; 1: none]")
@click.option("--cp", "cps", default=None, metavar="N,N,...",
              help="context-parallel sizes to try [default: powers of two leaving >= 8192 tokens per rank; "
                   "1: none]")
@click.option("--overlap", default=None, type=click.Choice(["backward", "none"]),
              help="data-parallel communication hidden under the backward, or none [default: backward; none under "
                   "--precision megatron-*: Megatron-LM's --overlap-grad-reduce is off by default]")
@click.option("--routing", default=None, metavar="MODEL",
              help="mixture-of-experts routing model, as report's: balanced (default), capacity=C (traced under it), "
                   "or skew=X (each EP row's most loaded rank: min(X, EP) times the balanced slots)")
@click.option("--megatron-args", default=None, metavar="FLAGS",
              help="under --precision megatron-*: the run's Megatron-LM flags that change its per-iteration work "
                   "(e.g. \"--log-params-norm --clip-grad 0 --log-interval 1\"; default: Megatron's), as report's")
@click.option("--top", default=5, show_default=True, type=click.IntRange(min=1), help="layouts to print")
@click.option("--trace-top", default=None, type=click.IntRange(min=0), metavar="K",
              help="screened layouts within 10%% of the cap get their per-rank peak from the composed trace "
                   "report runs for that layout, fastest first, until K fit (at most 4K traced; 0: the screen "
                   "only) [default: 3 × --top]")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
@click.option("--debug", is_flag=True, help="show tracebacks")
def plan(model, n_devices, device_name, devices_file, peak_flops, bandwidth, memory, global_batch, sets, precision,
         shards, checkpoints, schedules, micro, sp, eps, cps, overlap, routing, megatron_args, top, trace_top, as_json,
         debug):
    """The fastest parallel layouts of N devices that fit the memory per device (exit status 3
    when none does, as max-batch).

    Enumerates dp·tp·pp·cp = N (tp | heads, pp | layers, dp | G; cp for long sequences), the
    expert-parallel sizes of an MoE model, micro-batch b (G = dp·b·m),
    data-parallel sharding and checkpointing; keeps those whose per-rank memory fits; ranks them by
    the predicted step time (roofline compute + TP and pipeline transfers on the critical path +
    bubble + exposed data-parallel collectives). MODEL: megatron-gpt (default) or another model with
    a tensor-parallel plan. --device defaults to h100-sxm.
    """
    from symcost.errors import SymcostError
    from symcost.passes.memory.policies import policy
    from symcost.passes.plan import CHECKPOINTS, SCHEDULES, SHARDS
    from symcost.units import parse_memory

    n = _positive(n_devices, "--devices")
    g = _positive(global_batch, "--global-batch")
    cap = parse_memory(memory)
    sizes = parse_sizes(sets)
    policy(precision)
    if megatron_args is not None:
        from symcost.frontends.megatron import is_megatron
        from symcost.passes.megatron_iteration import ignored_warning, parse_args

        if not is_megatron(precision):
            raise SymcostError(f"--megatron-args applies under --precision megatron-*, not {precision}")
        parse_args(megatron_args)  # (a bad value: one line before the trace)
        line = ignored_warning(megatron_args)
        if line:
            click.echo(f"symcost: {line}", err=True)
    shards = _csv(shards, SHARDS, "--shard")
    checkpoints = _csv(checkpoints, CHECKPOINTS, "--checkpoint")
    schedules = _csv(schedules, SCHEDULES, "--schedule")
    mbs = tuple(_positive(x, "--micro-batch") for x in micro.split(",") if x.strip())
    cp_sizes = None if cps is None else tuple(_positive(x, "--cp") for x in cps.split(",") if x.strip())
    ep_sizes = None if eps is None else tuple(_positive(x, "--ep") for x in eps.split(",") if x.strip())
    if "B" in sizes or "TP" in sizes:
        raise SymcostError("plan chooses the micro-batch B and TP itself: drop B/TP from --set "
                           "(--micro-batch lists the micro-batch sizes to try)")
    if routing is not None:
        from symcost.frontends.moe import parse_routing

        parse_routing(routing)  # (bad text: one line before the trace)
    dev = resolve_device(device_name or "h100-sxm", devices_file, peak_flops, bandwidth)
    from symcost.passes.plan import plan as make_plan, trace_for_plan

    an = trace_for_plan(model, sizes, precision, sp, routing=routing)
    # (each engine's default: Megatron-LM's rows reduce their buffers after the backward, its
    # --overlap-grad-reduce being off by default; PyTorch's DDP and FSDP2 rows under the backward)
    from symcost.frontends.megatron import is_megatron

    megatron_overlap = overlap or ("none" if is_megatron(precision) else None)
    overlap = overlap or "backward"
    res = make_plan(an, sizes, dev, n, cap, g, precision, overlap=overlap, megatron_overlap=megatron_overlap,
                    shards=shards, checkpoints=checkpoints,
                    schedules=schedules, micro_batches=mbs,
                    trace_at=lambda tp: trace_for_plan(model, sizes, precision, sp, tp=tp, routing=routing),
                    model=model, trace_top=3 * top if trace_top is None else trace_top, sp=sp,
                    progress=None if as_json else _progress(), eps=ep_sizes, cps=cp_sizes, routing=routing,
                    megatron_args=megatron_args)
    if not as_json:
        import sys

        if sys.stderr.isatty():
            click.echo("\r\033[K", err=True, nl=False)
    res["model"], res["device"] = an.model, dev.key
    if as_json:
        click.echo(json.dumps({**res, "layouts": res["layouts"][:top], "fits": len(res["layouts"])}, indent=1,
                              default=float))
    else:
        from symcost.render.plan import render

        render(res, top)
    if not res["layouts"]:
        from .max_batch import NOTHING_FITS

        raise SystemExit(NOTHING_FITS)  # (as max-batch: nothing fits under --memory)
