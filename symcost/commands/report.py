"""``symcost report``: the main job (what it assumed, symbols, per-module costs, totals, the 6·N·P
form, memory and the precision policies)."""
from __future__ import annotations

import json
import time

import click

from symcost.errors import SymcostError
from symcost.hardware.efficiency import DEFAULTED

from ._options import (common, device_alias, early_checks, layout_words, memory_options, overlap_of, parallel_options,
                       parallel_request, report_cap, trace_model)
from ._loss import loss_option
from ._pipeline import pipeline_options, pipeline_request, report_pipeline


@click.command()
@click.argument("model", default="cs336-lm")
@common
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
@memory_options
@parallel_options
@device_alias
@pipeline_options
@loss_option
@click.option("--accumulate", "accumulate", default=1, show_default=True, type=click.IntRange(min=1), metavar="K",
              help="with --gpu and a parallel layout: also price one optimizer step of K micro-batches, composed "
                   "as the engine runs them (DDP/zero1 reduce once per step, FSDP2 every micro-batch; "
                   "docs/performance-model.md)")
def report(model, sets, config, attention, precision, debug, as_json, memory, optimizer, device, accumulate):
    """The main job: symbols, per-module costs, totals as formulas and the 6·N·P form, memory.

    MODEL: cs336-lm (default), gpt2, mlp, megatron-gpt, hf:MODEL_TYPE or path/file.py:factory.
    With --dp N [--shard ...]: one rank of data-parallel training (comm bytes, per-rank model states).
    With --tp N [--sp]: one rank of tensor (and sequence) parallel training (Megatron plan).
    With --pp N [--schedule ... --microbatches m]: pipeline parallelism (per-rank FLOPs, activations
    in flight, p2p bytes, bubble), composed with --dp, --tp/--sp and --ac on one mesh.
    """
    early_checks(model, sets, config, attention, precision)  # no sympy or torch needed: answers at once
    from symcost.passes.memory import default_impl, optimizer as check_optimizer, parse_memory

    parse_memory(memory)  # bad --memory / --optimizer / --torch-device: say so before tracing
    check_optimizer(optimizer)
    default_impl(device)
    pipe = pipeline_request(click.get_current_context())
    if accumulate > 1 and (pipe is not None or not click.get_current_context().find_root().meta.get("symcost.gpu")):
        raise SymcostError("--accumulate K prices an optimizer step of K micro-batches of a parallel layout: it needs "
                           "--gpu NAME and --dp/--tp/--ep/--cp (with --pp give --microbatches m instead)")
    if pipe is None:  # a policy its framework runs only with the optimizer sharded: say so before the trace
        from symcost.passes.memory.policies import check_layout

        check_layout(precision, *parallel_request(click.get_current_context()))
    if pipe is not None:
        report_pipeline(pipe, model, sets, config, attention, precision, as_json, optimizer, memory, device)
        return
    t0 = time.perf_counter()
    an, sizes = trace_model(model, sets, config, attention, precision, quiet=as_json)
    t1 = time.perf_counter()
    from symcost.render import report as rep

    ctx = click.get_current_context()
    if an.parallel is not None:  # one rank: the header's optimizer and cap, the layout line's --shard default
        from symcost.frontends.layout import layout_of

        cap, cap_from = report_cap(ctx, memory)
        assumed = rep.assumed(precision, optimizer, cap, device, cap_from)
        words = layout_words(ctx, layout_of(an), sizes or {})

        def with_cap(res):  # the rank's peak against the cap (JSON: parallel.memory.memory_cap, fits)
            pk = res["parallel"]["memory"]
            value = pk["peak"] if isinstance(pk.get("peak"), int) else pk.get("peak_at_defaults")
            pk["memory_cap"] = cap
            pk["fits"] = None if value is None else value <= cap
            return value

    section = _rank_section(an)
    if section is not None:  # --tp [--sp] or --ep: the rank's collectives, parameters and memory
        summarise, text = section
        par = summarise(an, precision, optimizer, sizes if sizes else None, device=device)
        res = rep.to_json(an, sizes if sizes else None)
        res.update(text.to_json(an, sizes if sizes else None, par))
        peak = with_cap(res)
        from symcost.frontends.layout import layout_of

        cp = None
        if layout_of(an).cp:  # --cp with --tp: the ring's exchange too (docs/parallel.md §15)
            from symcost.passes.context_parallel import summary as cp_summary
            from symcost.render import context_parallel as rcp

            cp = cp_summary(an, sizes if sizes else None)
            res.update(rcp.to_json(cp))
        priced = _priced_step(an, sizes)  # --gpu: the step per process group and its prediction
        if priced is not None:
            res["parallel"]["step"] = {**priced[0], "predicted": priced[1]}
            acc = _accumulated(an, sizes, *priced, accumulate)
            if acc is not None:
                res["parallel"]["step"]["accumulated"] = acc
        if as_json:
            click.echo(json.dumps(_activations(an, sizes, res), indent=1))
        else:
            rep.render(an, sizes, assumed=assumed, layout_words=words)
            text.render(an, sizes, par)
            _activations(an, sizes)
            if cp is not None:
                rcp.render(cp)
            if priced is not None:
                _render_priced(*priced)
                _render_accumulated(_accumulated(an, sizes, *priced, accumulate))
            _flag(rep.over_cap(peak, cap, "the rank"))
            _flag(_seconds(t0, t1))
        return
    if an.parallel is not None:  # --dp: per-rank model states and collectives (docs/parallel.md)
        from symcost.passes.parallel import summary

        par = summary(an, precision, optimizer, sizes if sizes else None, device=device)
        meta = ctx.find_root().meta
        step = None
        if meta.get("symcost.gpu"):
            from symcost.hardware.devices import get_device
            from symcost.passes.parallel import step_time

            from symcost.passes.hybrid_ep import dispatcher_of

            step = step_time(an, get_device(meta["symcost.gpu"]), sizes, overlap_of(meta, an),
                             meta.get("symcost.nodes"), meta.get("symcost.devices_per_node"),
                             dispatcher=dispatcher_of(meta.get("symcost.megatron_args")))
            from symcost.passes.performance import predict_dp

            predicted = predict_dp(an, get_device(meta["symcost.gpu"]), sizes, overlap_of(meta, an),
                                   meta.get("symcost.nodes"), meta.get("symcost.devices_per_node"),
                                   mode="compiled" if meta.get("symcost.compile") else "eager",
                                   megatron_args=meta.get("symcost.megatron_args"))
        res = rep.to_json(an, sizes if sizes else None)
        res.update(rep.parallel_json(an, sizes if sizes else None, par))
        peak = with_cap(res)
        from symcost.frontends.layout import layout_of

        cp = None
        if layout_of(an).cp:  # --cp under FSDP2: the ring's exchange too (docs/parallel.md §15)
            from symcost.passes.context_parallel import summary as cp_summary
            from symcost.render import context_parallel as rcp

            cp = cp_summary(an, sizes if sizes else None)
            res.update(rcp.to_json(cp))
        acc = _accumulated(an, sizes, step, predicted, accumulate) if step is not None else None
        if as_json:
            if step is not None:
                res["parallel"]["step"] = {**step, "predicted": predicted}
                if acc is not None:
                    res["parallel"]["step"]["accumulated"] = acc
            click.echo(json.dumps(_activations(an, sizes, res), indent=1))
        else:
            rep.render(an, sizes, assumed=assumed, layout_words=words)
            from symcost.render.data_parallel import render_parallel as render_data_parallel

            render_data_parallel(an, sizes, par, step=step)
            if step is not None:
                from symcost.render.report import console

                console().print(
                    f"predicted step (performance model, {predicted['mode']}): {predicted['step_seconds'] * 1e3:.4g} ms, "
                    f"MFU {100 * predicted['mfu_predicted']:.1f}% (roofline bound with the same {predicted['mode']} bytes "
                    f"{predicted['bound_seconds'] * 1e3:.4g} ms; the lower bound above is the fused one"
                    f"{'' if predicted['calibrated'] else '; ' + DEFAULTED})")
                _render_iteration(predicted)
                _render_buckets(step)
                _render_accumulated(acc)
            _activations(an, sizes)
            if cp is not None:
                rcp.render(cp)
            _flag(rep.over_cap(peak, cap, "the rank"))
            _flag(_seconds(t0, t1))
        return
    if accumulate > 1:
        raise SymcostError("--accumulate K applies to --dp, --tp or --ep (with --gpu); one device or --cp alone "
                           "is not composed over micro-batches")
    mem = rep.memory_section(an, sizes, memory, precision, optimizer, device=device)
    cp = None
    from symcost.frontends.layout import layout_of

    if layout_of(an).cp:  # --cp: the ring's K/V exchange per rank (docs/parallel.md §15)
        from symcost.passes.context_parallel import summary as cp_summary
        from symcost.render import context_parallel as rcp

        cp = cp_summary(an, sizes if sizes else None)
        meta = click.get_current_context().find_root().meta
        if meta.get("symcost.gpu"):  # the ring's exchange over the CP group's link, overlapped as PyTorch does
            from symcost.hardware.devices import get_device
            from symcost.passes.context_parallel import step_time as cp_step_time

            cp["step"] = cp_step_time(an, get_device(meta["symcost.gpu"]), sizes, meta.get("symcost.nodes"),
                                      meta.get("symcost.devices_per_node"))
            cp["step"]["predicted"] = _priced_step(an, sizes)[1]
    if as_json:
        res = rep.to_json(an, sizes if sizes else None, memory=mem)
        if cp is not None:
            res.update(rcp.to_json(cp))
        click.echo(json.dumps(_activations(an, sizes, res), indent=1))
    else:
        rep.render(an, sizes, memory=mem)
        _activations(an, sizes)
        if cp is not None:
            rcp.render(cp)


def _priced_step(an, sizes):
    """``(bound, predicted)`` of a ``--tp``/``--ep``/``--cp`` rank (their pairs too) without ``--dp``
    under ``--gpu``: :func:`symcost.passes.parallel.step_time` and
    :func:`symcost.passes.performance.predict_dp`, each process group over its own link as
    torchtitan's mesh places it (docs/performance-model.md); None without ``--gpu``."""
    meta = click.get_current_context().find_root().meta
    if not meta.get("symcost.gpu"):
        return None
    from symcost.hardware.devices import get_device
    from symcost.passes.parallel import step_time
    from symcost.passes.performance import predict_dp

    dev = get_device(meta["symcost.gpu"])
    args = (an, dev, sizes, overlap_of(meta, an), meta.get("symcost.nodes"),
            meta.get("symcost.devices_per_node"))
    from symcost.passes.hybrid_ep import dispatcher_of

    bound = step_time(*args, dispatcher=dispatcher_of(meta.get("symcost.megatron_args")))
    return bound, predict_dp(*args, mode="compiled" if meta.get("symcost.compile") else "eager",
                             megatron_args=meta.get("symcost.megatron_args"))


def _accumulated(an, sizes, step, predicted, K: int):
    """One optimizer step of ``K`` micro-batches (``--accumulate K``, K > 1) from the micro-batch's
    bound and prediction, composed as the layout's data-parallel engine runs them
    (:func:`symcost.passes.accumulation.accumulated`: DDP/zero1 reduce once per step, FSDP2 every
    micro-batch, the optimizer once); None for K = 1.

    Returns ``{"micro_batches", "reductions", "step_seconds" (predicted), "bound_seconds",
    "micro_seconds", "last_seconds", "optimizer_seconds"}``."""
    if K <= 1:
        return None
    from symcost.frontends.layout import layout_of
    from symcost.passes.accumulation import accumulated

    meta = click.get_current_context().find_root().meta
    overlap = overlap_of(meta, an)
    shard = layout_of(an).shard
    opt = predicted["optimizer_seconds"]  # (the distributed optimizer's over its shard under Megatron's zero1)
    p = accumulated(predicted, K, shard, overlap, opt)
    b = accumulated(step, K, shard, overlap)
    return {"micro_batches": K, "reductions": p["reductions"], "step_seconds": p["step_seconds"],
            "bound_seconds": b["step_seconds"], "micro_seconds": p["micro_seconds"], "last_seconds": p["last_seconds"],
            "optimizer_seconds": opt}


def _render_accumulated(acc) -> None:
    """The text line of :func:`_accumulated` (nothing for None)."""
    if acc is None:
        return
    from symcost.render.report import console

    console().print(f"one optimizer step of K = {acc['micro_batches']} micro-batches: predicted "
                    f"{acc['step_seconds']:.4g} s (bound {acc['bound_seconds']:.4g} s; gradients reduced "
                    f"{acc['reductions']} time(s), the optimizer once)")



def _render_iteration(predicted) -> None:
    """One line on Megatron-LM's per-iteration work that the prediction includes, where it does
    (``predicted["megatron_iteration"]``, :func:`symcost.passes.megatron_iteration.price`)."""
    it = predicted.get("megatron_iteration")
    if not it:
        return
    from symcost.render.report import console

    top = sorted(it.get("items", {}).items(), key=lambda kv: -kv[1])[:4]
    console().print(f"Megatron-LM's per-iteration work, included in the prediction: {it['seconds'] * 1e3:.4g} ms per "
                    f"optimizer step ({len(it.get('items', {}))} items, {it['syncs']:.4g} host syncs; the largest: "
                    + ", ".join(f"{k.replace('_', ' ')} {v * 1e3:.3g} ms" for k, v in top) + ")")


def _render_buckets(step) -> None:
    """One line on Megatron-LM's buckets where the step prices its engine (``step["buckets"]``,
    :func:`symcost.passes.megatron_buckets.engine`)."""
    b = step.get("buckets")
    if not b:
        return
    from symcost.render.report import console

    sizes = "; ".join(f"{x['group']} ({x['param_bytes']}-byte parameters, {x['grad_bytes']}-byte gradients): "
                      f"{len(x['buckets'])} bucket(s) of {', '.join(f'{e:,}' for e in x['buckets'][:4])}"
                      f"{' ...' if len(x['buckets']) > 4 else ''} elements" for x in b["buffers"] if x["buckets"])
    shard = b.get("optimizer_shard")
    console().print(f"data-parallel collectives as Megatron-LM runs them: {b['collectives']} per step ({b['rule']})"
                    + (f"; {sizes}" if sizes else "")
                    + (f"; the distributed optimizer steps over {shard['elements']:,} elements in {shard['tensors']} "
                       "tensors (the busiest rank's shard)" if shard else ""))


def _render_priced(step, predicted) -> None:
    """The text lines of :func:`_priced_step`: the bound's compute and each group's exposed time,
    then the prediction."""
    from symcost.render.report import console, human

    c = console()
    groups = ", ".join(f"{g} {human(sum(d['bytes'].values()), 'B')} over {d['link']} ({d['ranks']} ranks)"
                       for g, d in step["groups"].items())
    ring = (f"; CP ring {human(sum(step['cp']['bytes'].values()), 'B')} over {step['cp']['link']}, "
            f"{sum(step['cp']['exposed'].values()) * 1e3:.4g} ms exposed") if "cp" in step else ""
    c.print(f"lower bound (roofline; not the predicted step) per rank, {step['ranks']} ranks on {step['nodes']} node(s): "
            f"{step['step_seconds'] * 1e3:.4g} ms = compute {step['compute']['forward'] * 1e3:.4g} + "
            f"{step['compute']['backward'] * 1e3:.4g} ms + {step['exposed_comm_seconds'] * 1e3:.4g} ms exposed "
            f"communication ({groups or 'no collectives'}{ring}); MFU {100 * step['mfu']:.1f}%")
    c.print(f"predicted step (performance model, {predicted['mode']}): {predicted['step_seconds'] * 1e3:.4g} ms, "
            f"MFU {100 * predicted['mfu_predicted']:.1f}% ({predicted['collectives']} collectives' latency "
            f"{predicted['latency_seconds'] * 1e3:.3g} ms, {predicted['exposed_comm_seconds'] * 1e3:.4g} ms exposed"
            f"{'' if predicted['calibrated'] else '; ' + DEFAULTED})")
    _render_iteration(predicted)


def _rank_section(an):
    """The per-rank pass and its renderer of a ``--tp [--sp]`` trace (docs/parallel.md §11:
    :mod:`symcost.passes.tensor_parallel`) or an ``--ep`` trace (§14:
    :mod:`symcost.passes.expert_parallel`), as ``(summary, render module)``; None for other traces."""
    from symcost.passes.tensor_parallel import is_tensor_parallel

    if is_tensor_parallel(an):
        from symcost.passes.tensor_parallel import summary
        from symcost.render import tensor_parallel as text

        return summary, text
    if an.parallel == "ep":
        from symcost.passes.expert_parallel import summary
        from symcost.render import expert_parallel as text

        return summary, text
    return None


def _activations(an, sizes, res: dict | None = None):
    """Activation offload (``--offload-activations``) of the report: with ``res`` (the JSON),
    ``res["offload_activations"]`` added (:func:`symcost.render.offload.activation_json`) and
    ``res`` returned; without, its text lines printed. Nothing where the trace has none. With
    ``--gpu`` the copies are priced over its host link."""
    from symcost.frontends.layout import layout_of

    if not layout_of(an).offload_activations:
        return res
    from symcost.passes.offload import activation_summary
    from symcost.render.offload import activation_json, render_activation_offload
    from symcost.render.report import console, fmt, human

    gpu = click.get_current_context().find_root().meta.get("symcost.gpu")
    device = None
    if gpu and sizes:
        from symcost.hardware.devices import get_device

        device = get_device(gpu)
    act = activation_summary(an, sizes if sizes else None, device)
    js = activation_json(act, bool(sizes), fmt)
    if res is not None:
        res["offload_activations"] = js
        return res
    render_activation_offload(console(), js, human)
    return None


def _flag(line: str | None) -> None:
    """Print a report's over-the-cap line (:func:`symcost.render.report.over_cap`), if any."""
    if line:
        from symcost.render.report import console

        console().print(line)


def _seconds(t0: float, t1: float) -> str:
    """The closing line of a one-rank report: the seconds of the whole command since the trace
    started (the header's ``traced in`` are the trace's alone, and those of the run that wrote a
    cached entry), and of the rank's collectives and peak after it."""
    now = time.perf_counter()
    return (f"report in {now - t0:.1f} s: the trace (or reading it back) {t1 - t0:.1f} s, the rank's collectives, "
            f"peak and the rest {now - t1:.1f} s")
