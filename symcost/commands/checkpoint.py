"""``symcost checkpoint``: the activation-checkpoint plan of a model, its law and its trade-off.

Registered in :data:`symcost.cli.COMMANDS`. The pass is :func:`symcost.passes.checkpoint.analyse`; this
module parses and prints.
"""
from __future__ import annotations

import json

import click

from symcost.errors import SymcostError
from ._optimizer import optimizer_impl_option
from ._options import common, early_checks, every_layer_trace, optimizer_option, trace_model

PLANS = ("optimal", "none", "every-layer", "sqrt", "sqrt-L", "sequential")


def _json(an, r: dict, sizes: dict, optimizer: str, impl: str) -> dict:
    ck = {k: r[k] for k in ("plan", "interval", "segments", "activations", "peak", "recompute_flops",
                            "train_flops", "tradeoff")}
    ck.update({
        "kind": r["kind"], "L": r["L"], "n_segments": r["n_segments"],
        "activations_none": r["activations_none"], "peak_none": r["peak_none"],
        "train_flops_none": r["train_flops_none"], "k_star": r["k_star"], "k_best": r["k_best"],
        "block": r["block"], "law": r["law"], "solve_seconds": round(r["solve_seconds"], 4),
        "op_tradeoff": r["op_tradeoff"], "optimality_gap": r["optimality_gap"],
        "peak_where": r.get("peak_where"),
    })
    return {"model": an.model, "precision": an.precision, "optimizer": optimizer, "optimizer_impl": impl,
            "sizes": {**sizes}, "checkpoint": ck}


@click.command(name="checkpoint")
@click.argument("model", default="cs336-lm")
@common
@click.option("--memory", "memory", default=None,
              help="memory cap per device (80GiB, 80GB, or whole bytes from 1 MiB up): the least recompute that fits")
@click.option("--budget", type=float, default=None,
              help="activation budget, a fraction in (0, 1] of the activations without checkpointing: "
                   "the least recompute within it")
@click.option("--plan", "kind", default="optimal", show_default=True,
              help="without --memory/--budget: optimal (least peak), none, every-layer, sqrt (uniform, "
                   "the integer k nearest k*), sqrt-L (segments of ceil(sqrt L)), sequential "
                   "(checkpoint_sequential's default split)")
@optimizer_option
@optimizer_impl_option
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
def checkpoint(model, sets, config, attention, precision, debug, memory, budget, kind, optimizer, device, impl,
               as_json):
    """Activation checkpointing of MODEL: the √L law from the traced graph, the exact optimum
    (dynamic programming over the blocks), its peak (the checkpointed step traced), recompute
    FLOPs and the trade-off table. See docs/checkpoint.md. The peaks include the optimizer step
    as --optimizer runs it (--optimizer-impl; default: what torch.optim picks on --torch-device).
    """
    early_checks(model, sets, config, attention, precision)  # before sympy and torch
    if memory is not None and budget is not None:
        raise SymcostError("give --memory or --budget, not both")
    from symcost.passes import checkpoint as ckpt
    from symcost.passes.memory import optimizer as check_optimizer, parse_memory, resolve_impl

    cap = parse_memory(memory) if memory is not None else None
    if budget is not None and not (0 < budget <= 1):
        raise SymcostError(f"--budget takes a fraction in (0, 1] of the activations without checkpointing, got {budget}")
    if kind not in PLANS:
        raise SymcostError(f"unknown --plan {kind!r}; accepted: {', '.join(PLANS)}")
    check_optimizer(optimizer)
    # (as eval's memory pass: "default" is the policy's engine's, else torch.optim's choice on the device)
    impl = resolve_impl(impl, device, precision, optimizer)
    an, sizes = trace_model(model, sets, config, attention, precision, quiet=as_json)
    if getattr(an, "stacks", None):  # several stacks of blocks: planned per stack (docs/checkpoint.md)
        if budget is not None:
            raise SymcostError(f"{an.model} has {len(an.stacks)} stacks of blocks; --budget (the one-chain segment "
                               "model) is not planned over several stacks: give --memory CAP or --plan")
        from symcost.passes.checkpoint.stacks import PLANS as STACK_PLANS, analyse_stacks

        if cap is None and kind not in STACK_PLANS:  # (before the second trace)
            raise SymcostError(f"--plan {kind} is not planned on a model of several stacks (each checkpoint holds one "
                               f"block there); accepted: {', '.join(STACK_PLANS)}, or --memory CAP")
        ck = _stack_every_layer(model, config, attention, precision, sizes, as_json)
        r = analyse_stacks(an, ck, sizes, memory=cap, kind=kind, optimizer=optimizer, impl=impl)
        r.pop("plan_object")
        if as_json:
            click.echo(json.dumps({"model": an.model, "precision": an.precision, "optimizer": optimizer,
                                   "optimizer_impl": impl, "sizes": {**sizes}, "checkpoint": r}, indent=1))
            return
        _print_stacks(an, r, cap, optimizer, impl)
        return
    if "L" in an.symbols and an.layer_container is not None:
        every_layer_trace(an, model, config, attention, precision, sizes, quiet=as_json)
    r = ckpt.analyse(an, sizes, memory=cap, budget=budget, kind=kind, optimizer=optimizer, impl=impl)
    if as_json:
        click.echo(json.dumps(_json(an, r, sizes, optimizer, impl), indent=1))
        return
    _print(an, r, sizes, cap, budget, optimizer, impl)


def _print(an, r: dict, sizes: dict, cap, budget, optimizer: str, impl: str) -> None:
    from rich.table import Table

    from symcost.render.report import console, human

    c = console()
    law = r["law"]
    c.print(f"[bold]symcost checkpoint[/bold] {an.model}: L = {r['L']} blocks, precision {an.precision}, "
            f"optimizer {optimizer} ({impl})")
    c.print("  per block, from the trace: a (saved inside) = "
            f"{law['a']} = {human(r['block']['a'], 'B')};  x (block input kept) = {law['x']} = "
            f"{human(r['block']['x'], 'B')} (+ {r['block']['rng_state']} B of RNG state per checkpoint);  "
            f"f (forward) = {law['f']} = {human(r['block']['f'], 'FLOP')} (rerun up to the last saved tensor: "
            f"{human(r['block']['f_last'], 'FLOP')})")
    c.print(f"  law (Chen et al. 2016): M(k) = {law['memory']}   (checkpoint every k blocks)")
    c.print(f"    k* = {law['k_star']} = {r['k_star']:.3f}   segments L/k* = {law['segments_star']};  "
            f"M(k*) = {law['memory_star']};  recompute = {law['recompute']} (one forward of the blocks)")
    if r["k_star"] < 1:
        c.print("    k* < 1: a block's input is much smaller than what it saves inside, so checkpointing "
                "every block is the least-memory uniform plan (as Megatron and Hugging Face do)")
    uniform = [row for row in r["tradeoff"] if row.get("k")]
    if uniform:
        best = min(uniform, key=lambda row: (row["activations"], row["recompute_flops"], row["k"]))
        if best["k"] != r["k_best"] and r["block"]["head"] > 0:
            c.print(f"    the law leaves out the head: what the step holds at the end of the forward besides the "
                    f"blocks ({human(r['block']['head'], 'B')}: the output, the loss and what is saved outside the "
                    f"blocks). While k·a stays under it, recomputing a longer segment costs no memory, so over "
                    f"uniform plans the least memory is at k = {best['k']} ({best['segments']} segments, "
                    f"{human(best['activations'], 'B')}; k = {r['k_best']} near k*: "
                    f"{human(next(row['activations'] for row in uniform if row['k'] == r['k_best']), 'B')}), "
                    "the trade-off table below")
    c.print(f"  one level down, over the chain of the {law['ops_per_block']} forward ops per block: "
            f"M(j) = {law['op_memory']};  j* = {law['op_j_star']} ops;  M(j*) = {law['op_memory_star']}")
    how = (f"least recompute with peak ≤ {human(cap, 'B')}" if cap is not None else
           f"least recompute with activations ≤ {budget} × those without checkpointing" if budget is not None
           else f"plan {r['kind']}")
    c.print(f"[bold]  plan ({how}):[/bold] {len(r['plan'])} checkpointed segment(s)"
            + (f", every {r['interval']} block(s)" if r["interval"] else ""))
    c.print("    " + (", ".join(r["plan"]) if r["plan"] else "(nothing checkpointed)"))
    t = Table(title="Predicted (peak: the steady-state step with the plan, its traced schedule composed per block)",
              title_justify="left")
    for col in ("", "no checkpointing", "this plan"):
        t.add_column(col, justify="right")
    t.add_row("activations (segment model)", human(r["activations_none"], "B"), human(r["activations"], "B"))
    t.add_row("peak of the step", human(r["peak_none"], "B"), human(r["peak"], "B") if r["peak"] is not None else "-")
    t.add_row("recompute FLOPs", "0", human(r["recompute_flops"], "FLOP"))
    t.add_row("train FLOPs", human(r["train_flops_none"], "FLOP"), human(r["train_flops"], "FLOP"))
    c.print(t)
    tt = Table(title="Trade-off: checkpoint every k blocks (⌈L/k⌉ segments)", title_justify="left")
    for col in ("k", "segments", "activations", "recompute FLOPs", "extra vs. step"):
        tt.add_column(col, justify="right")
    rows = [row for row in r["tradeoff"] if "k" in row]
    if len(rows) > 40:
        keep = {1, 2, 3, r["k_best"], r["k_best"] - 1, r["k_best"] + 1, r["L"]}
        step = max(1, r["L"] // 12)
        rows = [rows[0]] + [row for row in rows[1:] if row["k"] in keep or row["k"] % step == 0]
    rows = [row for row in rows if "k" in row]
    for row in rows:
        tt.add_row("none" if row["k"] is None else str(row["k"]), str(row["segments"]),
                   human(row["activations"], "B"), human(row["recompute_flops"], "FLOP"),
                   f"{row['recompute_flops'] / r['train_flops_none']:.1%}")
    c.print(tt)
    bt = Table(title="Trade-off: activation budget (the segment model's least recompute within it; peak of the step)",
               title_justify="left")
    for col in ("budget", "segments", "activations", "peak", "recompute FLOPs", "extra vs. step"):
        bt.add_column(col, justify="right")
    for row in r["tradeoff"]:
        if "budget" in row:
            bt.add_row(f"{row['budget']:.1f}", str(row["segments"]), human(row["activations"], "B"),
                       human(row["peak"], "B"), human(row["recompute_flops"], "FLOP"),
                       f"{row['recompute_flops'] / r['train_flops_none']:.1%}")
    c.print(bt)
    if r["op_tradeoff"]:
        ot = Table(title="One level down, per block: tensors kept vs. ops rerun (ILP, scipy milp)", title_justify="left")
        for col in ("budget per block", "kept", "recompute (all FLOPs)", "model FLOPs", "ops rerun"):
            ot.add_column(col, justify="right")
        for row in r["op_tradeoff"]:
            ops = ", ".join(sorted({o.split(".")[0] for o in row["recompute_ops"]}))
            ot.add_row(human(row["budget"], "B"), human(row["saved_bytes"], "B"), human(row["recompute_flops"], "FLOP"),
                       human(row["recompute_model_flops"], "FLOP"), ops)
        c.print(ot)
    if r.get("peak_where"):
        c.print(f"  the plan's peak is reached at: {r['peak_where']}")
    if r["kind"] in ("optimal", "memory") and r["optimality_gap"]:
        c.print(f"  (the search is exact on a model of the step at most {human(r['optimality_gap'], 'B')} above "
                "the composed schedule: no plan peaks lower by more than that)")
    c.print(f"  solved in {r['solve_seconds']:.3f} s after tracing")


def _stack_every_layer(model, config, attention, precision, sizes, quiet, layout=None):
    """The step of a model of several stacks with every block of every stack checkpointed
    (``--ac full``: :func:`symcost.frontends.checkpointing.checkpoint_blocks`), from the trace cache
    (the entry ``report --ac full`` uses) or traced. ``layout``: another layout with ``ac="full"``
    (a data-parallel rank's: ``report --dp N --shard S --ac full``'s entry; ``sizes`` then hold
    its mesh sizes)."""
    from symcost.frontends.layout import Layout
    from symcost.graph.cache import cached_trace

    from ._loss import loss_of
    from ._options import _trace_fresh, model_task, parse_config, torch_device_of

    ctx = click.get_current_context(silent=True)
    use_cache = not (ctx is not None and ctx.find_root().meta.get("symcost.no_cache"))
    cfg = parse_config(config)
    layout = layout if layout is not None else Layout(ac="full")
    options = dict(layout.cache_options())
    if model_task() is not None:
        options["task"] = model_task()
    torch_device = torch_device_of(ctx)
    if torch_device != "cuda":
        options["torch_device"] = torch_device
    loss = loss_of(ctx)
    if loss is not None:
        options["loss"] = loss
    return cached_trace(model, cfg, attention, precision, sizes,
                        lambda: _trace_fresh(model, cfg, attention, precision, sizes, quiet, layout=layout,
                                             torch_device=torch_device, loss=loss),
                        use_cache, options=options)


def _print_stacks(an, r: dict, cap, optimizer: str, impl: str) -> None:
    """The tables of a plan over several stacks (:func:`symcost.passes.checkpoint.stacks.analyse_stacks`)."""
    from rich.table import Table

    from symcost.render.report import console, human

    c = console()
    lens = ", ".join(f"{s['symbol']} = {s['L']} ({name})" for name, s in r["stacks"].items())
    c.print(f"[bold]symcost checkpoint[/bold] {an.model}: {len(r['stacks'])} stacks of blocks, {lens}; precision "
            f"{an.precision}, optimizer {optimizer} ({impl})")
    for name, s in r["stacks"].items():
        law, b = s["law"], s["block"]
        c.print(f"  [bold]{name}[/bold] ({s['symbol']} blocks), per block, from the trace: a (saved inside) = {law['a']} = "
                f"{human(b['a'], 'B')};  x (block input kept) = {law['x']} = {human(b['x'], 'B')};  f (forward) = "
                f"{law['f']} = {human(b['f'], 'FLOP')} (rerun by its checkpoint: {human(b['r'] or 0, 'FLOP')})")
        c.print(f"    law (Chen et al. 2016): M(k) = {law['memory']};  k* = {law['k_star']} = {s['k_star']:.3f};  "
                f"M(k*) = {law['memory_star']}")
        if s["k_star"] < 1:
            c.print("    k* < 1: a block's input is much smaller than what it saves inside, so per block the "
                    "least memory is each block under its own checkpoint")
    how = f"least recompute with peak ≤ {human(cap, 'B')}" if cap is not None else f"plan {r['kind']}"
    c.print(f"[bold]  plan ({how}):[/bold] "
            + "; ".join(f"{name}: {s['n_checkpointed']} of {s['L']} blocks" for name, s in r["stacks"].items()))
    c.print("    " + (", ".join(r["plan"]) if r["plan"] else "(nothing checkpointed)"))
    t = Table(title="Predicted (peak: the steady-state step with the plan, the traced schedules of both stacks "
                    "composed block by block)", title_justify="left")
    for col in ("", "no checkpointing", "every block", "this plan"):
        t.add_column(col, justify="right")
    t.add_row("peak of the step", human(r["peak_none"], "B"), human(r["peak_every_layer"], "B"), human(r["peak"], "B"))
    t.add_row("recompute FLOPs", "0", human(r["tradeoff"][-1]["recompute_flops"], "FLOP"),
              human(r["recompute_flops"], "FLOP"))
    t.add_row("train FLOPs", human(r["train_flops_none"], "FLOP"),
              human(r["train_flops_none"] + r["tradeoff"][-1]["recompute_flops"], "FLOP"), human(r["train_flops"], "FLOP"))
    c.print(t)
    tt = Table(title="Trade-off: the first n blocks of one stack checkpointed (the other stacks plain)",
               title_justify="left")
    for col in ("stack", "n", "peak", "recompute FLOPs", "extra vs. step"):
        tt.add_column(col, justify="right")
    for row in r["tradeoff"]:
        n = sum(row["checkpointed"].values()) if row["what"] in ("none", "every-layer") else row["checkpointed"][row["what"]]
        tt.add_row(row["what"], str(n), human(row["peak"], "B"), human(row["recompute_flops"], "FLOP"),
                   f"{row['recompute_flops'] / r['train_flops_none']:.1%}")
    c.print(tt)
    if r.get("peak_where"):
        c.print(f"  the plan's peak is reached at: {r['peak_where']}")
    if r.get("composition_gap"):
        c.print(f"  (the composed step of no block or every block checkpointed differs from that traced step's own "
                f"peak by up to {human(r['composition_gap'], 'B')}: the plan's peak is that approximate)")
    c.print(f"  solved in {r['solve_seconds']:.3f} s after tracing")
