"""``symcost formulas`` and ``symcost eval``: the same totals as formulas or as integers.

The two commands differ only in evaluating; :func:`totals_command` builds both. ``eval`` takes
``--memory`` and ``--optimizer`` (its memory section has the largest batch under that cap);
``formulas`` prints formulas only, the memory formulas under ``--optimizer`` included, and no
number evaluated at default sizes.
"""
from __future__ import annotations

import json

import click

from ._options import common, early_checks, memory_options, optimizer_option, trace_model

#: memory JSON keys that are numbers at some sizes, not formulas (left out of ``formulas``)
EVALUATED_KEYS = ("max_batch", "max_batch_reason", "memory_at_max", "memory_cap", "fits", "fits_reason",
                  "peak_parts")


def totals_command(name: str, evaluate: bool, doc: str):
    """``formulas`` (evaluate=False) and ``eval`` (True): the same totals as formulas or integers."""

    @click.command(name=name, help=doc)
    @click.argument("model")
    @common
    @click.option("--json", "as_json", is_flag=True, help="print one JSON object")
    @(memory_options if evaluate else optimizer_option)
    def command(model, sets, config, attention, precision, debug, as_json, optimizer, device, memory=None):
        early_checks(model, sets, config, attention, precision)  # no sympy or torch needed: answers at once
        from symcost.passes.memory import default_impl, optimizer as check_optimizer, parse_memory

        if memory is not None:
            parse_memory(memory)
        check_optimizer(optimizer)
        default_impl(device)
        an, sizes = trace_model(model, sets, config, attention, precision, quiet=as_json)
        from symcost.render import report as rep

        mem = rep.memory_section(an, sizes, memory or "80GiB", precision, optimizer, evaluate=evaluate,
                                 device=device)
        if mem is not None and not evaluate:
            mem = formulas_only(mem)
        if as_json:
            click.echo(json.dumps(rep.to_json(an, sizes if evaluate else None, memory=mem), indent=1))
        elif evaluate:
            rep.render_values(an, sizes, memory=mem)
        else:
            rep.render(an, {}, table=False, memory=mem)

    return command


def formulas_only(mem: dict) -> dict:
    """The memory section without what is a number at some sizes (the largest batch under a cap,
    the peak's value at the defaults): ``formulas`` prints formulas."""
    js = {k: v for k, v in mem.get("json", {}).items() if k not in EVALUATED_KEYS}
    lines = [ln for ln in mem.get("lines", []) if not ln.startswith(("largest batch", "not even B", "peak at",
                                                                     "[bold red]does not fit"))
             and " at the sizes above: " not in ln and " at the model's defaults: " not in ln]
    rows = [(label, formula, "") for label, formula, _ in mem.get("rows", [])]
    title = mem.get("title", "Memory").replace(" (values at the model's defaults)", "")
    return {**mem, "json": js, "lines": lines, "rows": rows, "title": title}


formulas = totals_command("formulas", False, "Closed-form totals of MODEL as formulas in the canonical symbols.")
eval_ = totals_command("eval", True, "Totals of MODEL as integers at --set sizes (others at the model's defaults).")
