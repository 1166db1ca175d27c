"""``--pp N --schedule ... --microbatches m [--virtual-stages v]``: pipeline-parallel training on
``report`` (one row per rank: FLOPs, activations held, point-to-point bytes; the bubble),
docs/parallel.md "Pipeline parallelism"."""
from __future__ import annotations

import json

import click

from symcost.frontends.spec import MESH_HINT
from symcost.errors import SymcostError

from ._options import _keep_parallel, overlap_of, parse_config, parse_sizes

#: --schedule (symcost.frontends.pipeline.SCHEDULES; listed here so --help imports no torch)
SCHEDULE_CHOICES = ("gpipe", "1f1b", "interleaved-1f1b")


def pipeline_options(f):
    """``--pp``, ``--schedule``, ``--microbatches``, ``--virtual-stages`` (through the click context)."""
    f = click.option("--pp-split", default=None, expose_value=False, callback=_keep_parallel("symcost.pp_split"),
                     metavar="SPLIT",
                     help="with --pp: the blocks of each stage: even (Megatron-LM's default: L/stages each, the "
                          "first ones one more), torchtitan (its default: the embedding and the output weigh a "
                          "block each, torchtitan:A,B other weights), or N,N,... per stage [default: even]")(f)
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
    from symcost.frontends.pipeline import check_schedule, schedule_order

    # PyTorch's refusals (1F1B with fewer micro-batches than stages, virtual stages on a one-stage
    # schedule) in one line before any trace, not after the stage traces (newcomer walkthrough)
    check_schedule(pipe.schedule, sizes["PP"], pipe.microbatches, pipe.virtual)
    schedule_order(pipe.schedule, sizes["PP"], pipe.microbatches, pipe.virtual)
    return sizes["PP"], pipe.schedule, pipe.microbatches, pipe.virtual, gpu, per_node, layout, sizes


def _request(model, sets, config, attention, mesh, precision=None):
    """``(spec, sizes, cache)`` of a pipeline request: the model's spec (as the run traces it under
    ``precision``, ``--torch-device`` and ``--routing``: :func:`symcost.frontends.megatron.for_run`,
    :func:`symcost.frontends.moe.with_routing`), the ``--set`` sizes with the stage's mesh sizes
    (``--dp``, ``--tp``), and the trace cache's key (None with ``--no-cache`` or ``--routing``: the
    stage entries do not carry the routing).

    Raises:
        SymcostError: a ``--set`` symbol the model does not have.
    """
    from symcost.commands._options import resolve_model, torch_device_of
    from symcost.frontends.megatron import for_run

    from symcost.commands._loss import loss_of

    ctx = click.get_current_context(silent=True)
    spec = resolve_model(model, parse_config(config), attention)
    routing = ctx.meta.get("symcost.routing") if ctx is not None else None
    if routing is not None:  # (--routing: the stages' MoE layers traced under it, as report's one rank)
        from symcost.frontends.moe import with_routing

        spec = with_routing(spec, routing)
    spec = for_run(spec, precision, torch_device_of(ctx), loss_of(ctx))
    sizes = parse_sizes(sets)
    unknown = [k for k in sizes if k not in spec.all_symbols]
    if unknown:
        raise SymcostError(f"unknown symbol {unknown[0]!r} for {spec.name}; accepted: {', '.join(spec.all_symbols)}"
                           f"{MESH_HINT.get(unknown[0], '')}")
    sizes.update({k: n for k, n in mesh.items() if k != "PP"})  # (--dp, --tp: the stage's mesh)
    no_cache = click.get_current_context().find_root().meta.get("symcost.no_cache")
    # (the stage traces' cache key has no routing: a routed request traces its stages afresh)
    return spec, sizes, None if no_cache or routing is not None else (model, parse_config(config), attention)


#: the keys of ``report --json``'s contract the pipeline report fills at top level with the most
#: loaded rank's step (``pipeline.ranks[i].totals``: each rank's)
RANK_TOTALS = ("flops", "flops_hw", "flops_all", "bytes", "transcendentals", "attention_flops", "unsupported_ops")


def _most_loaded(ranks) -> dict:
    """The rank that sets the pace: the most FLOPs run per step (recomputation included), the
    lowest rank on a tie."""
    return max(ranks, key=lambda row: (row["totals"]["flops_hw"]["train"], -row["rank"]))


def pipeline_json(spec, r, layout, mesh, precision, assumed, ans) -> dict:
    """``report --pp --json``: ``report --json``'s contract keys (symcost.render.report.to_json) at
    top level (``flops.*`` and the other totals: the most loaded rank's step, ``rank`` says which;
    ``params*``: the whole model's, summed over the stages; ``memory``: the highest rank peak and
    the cap), ``layout`` with ``mesh`` as ``{dimension: size}`` (torchtitan's names and order;
    ``describe``: the same in words), and ``pipeline``: the schedule, each rank (its totals under
    ``totals``, ``fits`` against the cap) and each stage."""
    out = {k: r[k] for k in ("schedule", "engine", "source", "pp", "microbatches", "virtual", "bubble",
                             "blocks", "ranks", "divisible") + (("step",) if "step" in r else ())}
    words = layout.describe(dict(mesh))
    dims = {d: int(layout.dim_size(d, lambda sym: mesh[sym])) for d in layout.dims}
    out["layout"] = {"mesh": words, **layout.to_dict()}  # (pipeline.layout.mesh: the words, as before)
    if "step" in out:
        out["step"] = {**out["step"],
                       "stage_seconds": {str(s): t for s, t in out["step"]["stage_seconds"].items()},
                       "busy": {str(k): t for k, t in out["step"]["busy"].items()},
                       "idle": {str(k): t for k, t in out["step"]["idle"].items()}}
    out["bubble_formula"] = str(r["bubble_formula"])
    out["formulas"] = {p: {k: str(e) for k, e in f.items()} for p, f in r["formulas"].items()}
    out["pinned"] = r["pinned"]
    if r.get("stacks"):  # (several stacks cut as one list: each stage's blocks, what crosses, why pinned)
        out["stacks"] = r["stacks"]
        out["pin_reasons"] = r["pin_reasons"]
    out["stages"] = {str(s): d for s, d in r["stages"].items()}
    busiest = _most_loaded(r["ranks"])
    res = {"model": spec.name, "precision": precision, "attention": spec.extra.get("attention"),
           "layout": {"mesh": dims, "describe": words, **layout.to_dict()},
           "symbols": r["symbols"], "tied_symbols": dict(spec.tied),
           # (L pinned in a stage is that stage's own block count: pipeline.pinned has it per stage kind)
           "pinned_symbols": {k: v for an in ans.values() for k, v in an.pinned.items() if k != "L"},
           **{k: sum(st["params_model"][k] for st in r["stages"].values())
              for k in ("params", "params_embedding", "params_nonembedding", "params_active")},
           "params_matmul": sum(st["params_matmul"] for st in r["stages"].values()),
           **{k: busiest["totals"][k] for k in RANK_TOTALS},
           "attention_flops_count": r["attention_flops_count"], "rank": busiest["rank"],
           "task": spec.extra.get("task")}  # (as report --json: hf: models' head other than the causal LM's)
    res["flops"] = {**res["flops"], "train_simplified": res["flops"]["train"]}  # (its value at these sizes)
    from symcost.passes.moe import summary as moe_summary

    moe = [f for f in (moe_summary(an) for an in ans.values()) if f]  # (a dense model: none)
    res["moe"] = {"routing": moe[0]["routing"]} if moe else None
    peaks = [(row["peak_with_optimizer"], row["rank"]) for row in r["ranks"] if "peak_with_optimizer" in row]
    cap = assumed["memory_cap"]
    for row in r["ranks"]:
        if "peak_with_optimizer" in row:
            row["fits"] = row["peak_with_optimizer"] <= cap
    if peaks:
        peak, rank = max(peaks)
        res["memory"] = {"peak": peak, "rank": rank, "memory_cap": cap, "memory_cap_from": assumed["memory_cap_from"],
                         "fits": peak <= cap, "ranks_over_cap": [rk for pk, rk in peaks if pk > cap],
                         "bytes_per_param": assumed["bytes_per_param"], "optimizer_name": assumed["optimizer_name"]}
    res["pipeline"] = out
    return res


def report_pipeline(req, model, sets, config, attention, precision, as_json, optimizer, memory="80GiB", torch_device=None):
    """Print the pipeline report (text or ``--json``)."""
    import time

    from symcost.passes.pipeline import summary, trace_stages
    from symcost.render.report import assumed as assumed_of

    from ._options import layout_words, report_cap

    pp, schedule, m, v, gpu, per_node, layout, mesh = req
    ctx = click.get_current_context()
    cap, cap_from = report_cap(ctx, memory)
    assumed = assumed_of(precision, optimizer, cap, torch_device, cap_from)
    spec, sizes, cache = _request(model, sets, config, attention, mesh, precision)
    device = None
    if gpu is not None:
        from symcost.hardware.devices import get_device

        device = get_device(gpu)
    t0 = time.perf_counter()
    # (summary reads them back)
    _, ans = trace_stages(spec, pp, v, precision, sizes, cache, layout.inner, layout.pipeline.split)
    t1 = time.perf_counter()
    meta = ctx.find_root().meta  # (the predicted step's kernels and overlap, as report --dp --gpu takes them)
    r = summary(spec, pp, schedule, m, v, precision, sizes, optimizer, device=device, devices_per_node=per_node,
                cache=cache, inner=layout.inner, split=layout.pipeline.split,
                mode="compiled" if meta.get("symcost.compile") else "eager",
                overlap=overlap_of(meta, None, precision, getattr(layout.inner, "shard", None),
                                   getattr(layout.inner, "fsdp_mp", None)),
                megatron_args=meta.get("symcost.megatron_args"))
    t2 = time.perf_counter()
    if as_json:
        click.echo(json.dumps(pipeline_json(spec, r, layout, mesh, precision, assumed, ans), indent=1))
        return
    from symcost.render.pipeline import render_pipeline

    cached = any(an.__dict__.get("cached_from") for an in ans.values())
    timing = (f"computed in {t2 - t0:.1f} s: the stage traces {t1 - t0:.1f} s"
              + (" (read back from the trace cache; --no-cache traces afresh)" if cached else "")
              + f", each rank's step through the schedule and the rest {t2 - t1:.1f} s")
    render_pipeline(spec.name, r, layout=layout_words(ctx, layout, dict(mesh)) if layout.inner else None,
                    assumed=assumed, precision=precision, attention=spec.extra.get("attention"), timing=timing)


def max_batch_pipeline(req, model, sets, config, attention, precision, as_json, optimizer, cap: int) -> int:
    """``max-batch --pp``: the largest micro-batch B whose steady-state step fits under ``cap``
    bytes on every pipeline rank (the most loaded rank sets it), from the ranks' peaks as
    ``report --pp`` gives them (PyTorch's schedule run on fake tensors per rank, plus the
    optimizer state: ``peak_with_optimizer``). The peak is a number per B, not a formula: B = 1
    and 2 are run, a first guess of the boundary is extrapolated from them (the activations of
    a step grow about linearly in B), widened until it brackets the boundary and bisected: B fits
    and B + 1 does not, both run (exact at the boundary). Returns B (0: not even 1 fits).

    Raises:
        SymcostError: as ``report --pp``; a peak that cannot be run (its reason).
    """
    from symcost.passes.pipeline import summary

    pp, schedule, m, v, _, _, layout, mesh = req
    spec, sizes, cache = _request(model, sets, config, attention, mesh, precision)
    runs: dict[int, tuple[int, int]] = {}
    rows_at: dict[int, dict] = {}  # B -> the most loaded rank's row (what its peak is made of)

    def peak(b: int, opt: str = optimizer) -> tuple[int, int]:
        """(the highest rank peak at B = b, that rank)."""
        if opt != optimizer:  # (another optimizer: the same rank runs, read back; only the state differs)
            r = summary(spec, pp, schedule, m, v, precision, {**sizes, "B": b}, opt, cache=cache, inner=layout.inner,
                        split=layout.pipeline.split)
            return max((int(row["peak_with_optimizer"]), row["rank"]) for row in r["ranks"])
        if b not in runs:
            r = summary(spec, pp, schedule, m, v, precision, {**sizes, "B": b}, optimizer, cache=cache,
                        inner=layout.inner, split=layout.pipeline.split)
            rows = [(row.get("peak_with_optimizer"), row["rank"], row.get("memory_note")) for row in r["ranks"]]
            missing = next((row for row in rows if row[0] is None), None)
            if missing is not None:
                raise SymcostError(f"max-batch --pp: rank {missing[1]}'s peak could not be run: {missing[2]}")
            runs[b] = max((int(x), rk) for x, rk, _ in rows)
            rows_at[b] = r["ranks"][runs[b][1]]
        return runs[b]

    best = 0
    if peak(1)[0] <= cap:
        # lo fits, hi does not: a first guess from B = 1 and 2 (the activations of a step grow
        # about linearly in B), widened until it brackets the boundary, then bisected
        p1, p2 = peak(1)[0], peak(2)[0]
        guess = max(2, 1 + (cap - p1) // max(p2 - p1, 1))
        lo, hi = 1, None
        while hi is None:
            if peak(guess)[0] <= cap:
                lo, guess = guess, 2 * guess
            else:
                hi = guess
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if peak(mid)[0] <= cap else (lo, mid)
        best = lo
        peak(best + 1)
    shown = max(best, 1)  # the peak whose parts are shown: the answer's, else the smallest case's
    parts = _peak_parts(rows_at[shown])
    alts = _alternatives(runs[1], cap, optimizer, layout, sizes, pp, spec, peak) if best < 1 else None
    out = {"model": spec.name, "solve": "B", "value": best, "memory_cap": cap, "layout": layout.describe(dict(mesh)),
           "pipeline": {"pp": pp, "schedule": schedule, "microbatches": m, "virtual": v},
           "peaks": {str(b): {"peak": pk, "rank": rk} for b, (pk, rk) in sorted(runs.items())},
           "peak_parts": {"B": shown, "rank": runs[shown][1], **{k: b for k, _, b in parts}}}
    if alts is not None:
        out["alternatives"] = [{"option": o, "peak": pk, "fits": fits, "note": note} for o, pk, fits, note in alts]
    if as_json:
        click.echo(json.dumps(out, indent=1))
        return best
    from rich.table import Table

    from symcost.render.report import console, human

    from ._options import layout_words

    c = console()
    c.print(f"{spec.name}: {layout_words(click.get_current_context(), layout, dict(mesh))}, {m} micro-batches per step")
    c.print(f"  memory cap: {human(cap, 'B')} ({cap:,} bytes); M(B): the most loaded rank's peak at micro-batch B")
    if best < 1:
        c.print(f"[bold red]  even B = 1 does not fit[/bold red]: M(1) = {human(runs[1][0], 'B')} (rank {runs[1][1]}) "
                "> cap")
    else:
        hi = runs[best + 1]
        c.print(f"[bold]  largest micro-batch B = {best}[/bold]")
        c.print(f"  check: M({best}) = {human(runs[best][0], 'B')} ({runs[best][0]:,} B, rank {runs[best][1]}) ≤ cap "
                f"< M({best + 1}) = {human(hi[0], 'B')} (rank {hi[1]}) ✓")
    t = Table(title=f"What the peak at B = {shown} is made of (rank {runs[shown][1]})", title_justify="left")
    t.add_column("part")
    t.add_column("bytes", justify="right")
    t.add_column("")
    for _, label, nbytes in parts:
        t.add_row(label, f"{nbytes:,}", human(nbytes, "B"))
    c.print(t)
    if alts is not None:
        c.print("  what to try (same model and sizes):")
        for o, pk, fits, note in alts:
            if pk is None:
                c.print(f"    {o}: {note}")
            else:
                c.print(f"    {o}: " + (f"fits B = 1 (M(1) = {human(pk, 'B')})" if fits else
                                         f"still does not fit (M(1) = {human(pk, 'B')})") + (f"; {note}" if note else ""))
    c.print("  peaks: PyTorch's schedule run per rank on fake tensors with the optimizer state (report --pp's "
            f"peak), at B = {', '.join(str(b) for b in sorted(runs))}")
    return best


def _peak_parts(row: dict) -> list[tuple[str, str, int]]:
    """``(key, label, bytes)`` of a rank's ``peak_with_optimizer`` (:func:`symcost.passes.pipeline.summary`),
    the last row the sum."""
    mem = row["memory"]
    rest = row["peak_with_optimizer"] - mem["peak"]
    parts = [("params", "parameters", mem["params"]), ("buffers", "buffers", mem["buffers"]),
             ("grads", "gradients", mem["grads"]),
             ("kept", "the pipeline engine's buffers (p2p, kept micro-batch outputs)", mem["kept"]),
             ("top", "highest live set of the step (activations in flight, temporaries)", mem["top"]),
             ("optimizer", "optimizer state and master weights (and a gradient buffer wider than the traced one)",
              rest),
             ("peak", "peak (the sum)", row["peak_with_optimizer"])]
    return parts


def _alternatives(at1, cap, optimizer, layout, sizes, pp, spec, peak) -> list[tuple[str, int | None, bool | None, str]]:
    """What to try when not even B = 1 fits: ``(option, the most loaded rank's peak at B = 1
    with it, whether that fits (None: not run here), note)``."""
    out: list[tuple[str, int | None, bool | None, str]] = []
    if optimizer != "sgd-nomomentum":
        pk = peak(1, "sgd-nomomentum")[0]
        out.append(("--optimizer sgd-nomomentum", pk, pk <= cap, "no optimizer state"))
    if layout.ac is None:
        out.append(("--ac selective or --ac full", None, None, "checkpoints every block: fewer activations held "
                                                                "(not run here)"))
    if layout.shard in (None, "ddp", "zero1"):
        out.append(("--dp N --shard fsdp" if layout.shard is None else "--shard fsdp", None, None,
                    "shards parameters, gradients and optimizer state over the data-parallel ranks (not run here)"))
    L = spec.values(dict(sizes)).get("L", 0)
    if L >= 2 * pp:
        out.append((f"--pp {2 * pp}", None, None, f"half the blocks per rank (L = {L}; not run here)"))
    out.append((f"--memory {at1[0]}B or more", at1[0], True, "the cap at the most loaded rank's peak at B = 1"))
    return out


def predicted_pipeline(req, model, sets, config, attention, precision, device, optimizer: str = "adamw") -> dict:
    """The pipeline step of ``report --pp ... --gpu`` for ``time --pp`` and ``mfu --pp``: the same
    :func:`symcost.passes.pipeline.summary` (stage traces, PyTorch's schedule, the bound's
    ``step`` and its ``step["predicted"]``, docs/performance-model.md "A pipeline rank") on
    ``device`` (a :class:`~symcost.hardware.devices.Device` with an interconnect), and what a run
    of it is made of.

    Returns:
        ``{"spec", "summary" (summary's dict), "step" (the bound's), "predicted" (the
        prediction's), "microbatches" m, "B", "S", "precision" and "peak_flops" (the device's
        peak for the dtype the stages' matmuls ran in), "ranks" (PP × the stage's mesh: DP·TP, DP·EP
        under --ep, EP under --ep --tp), "replicas" (pipelines with their own micro-batches: DP,
        DP·EP under --ep, DP·EP/TP under --ep --tp), "tokens_per_step" (B·S·m·replicas),
        "flops_per_token" (model FLOPs of one optimizer step on all ranks / its tokens)}``.

    Raises:
        SymcostError: as ``report --pp``; a device without an interconnect.
    """
    from symcost.passes.pipeline import summary, trace_stages
    from symcost.passes.roofline import training_precision

    pp, schedule, m, v, _, per_node, layout, mesh = req
    spec, sizes, cache = _request(model, sets, config, attention, mesh, precision)
    # (as report --pp: the stage traces once, summary reads them back)
    _, ans = trace_stages(spec, pp, v, precision, sizes, cache, layout.inner, layout.pipeline.split)
    meta = click.get_current_context().find_root().meta
    r = summary(spec, pp, schedule, m, v, precision, sizes, optimizer, device=device, devices_per_node=per_node,
                cache=cache, inner=layout.inner, split=layout.pipeline.split,
                mode="compiled" if meta.get("symcost.compile") else "eager",
                overlap=overlap_of(meta, None, precision, getattr(layout.inner, "shard", None),
                                   getattr(layout.inner, "fsdp_mp", None)),
                megatron_args=meta.get("symcost.megatron_args"))
    values = spec.values(dict(sizes))
    dp, tp, ep = (int(mesh.get(k, 1)) for k in ("DP", "TP", "EP"))
    # (--ep --tp: the EP ranks hold the TP groups, §14.8; with --etp the (ep, tp) mesh: EP·TP ranks)
    stage = dp * (ep * (tp if layout.etp else 1) if layout.ep else tp)
    replicas = dp * ((ep // tp if layout.tp and not layout.etp else ep) if layout.ep else 1)
    B, S = int(values["B"]), int(values["S"])
    pr = r["step"]["predicted"]
    # the pipeline's model FLOPs per step are its PP ranks' (pr["model_flops"]); every rank of a
    # stage's mesh runs its own share
    total = pr["model_flops"] * stage
    key = training_precision(ans["first"])  # (the peak predict_price divides by)
    return {"spec": spec, "summary": r, "step": r["step"], "predicted": pr, "microbatches": m, "B": B, "S": S,
            "precision": key, "peak_flops": device.peak_for(key)[0],
            "ranks": pp * stage, "replicas": replicas, "tokens_per_step": B * S * m * replicas,
            "flops_per_token": total / (B * S * m * replicas)}
