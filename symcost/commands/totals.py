"""``symcost formulas`` and ``symcost eval``: the same totals as formulas or as integers.

The two commands differ only in evaluating; :func:`totals_command` builds both.
"""
from __future__ import annotations

import json

import click

from ._options import common, trace_model


def totals_command(name: str, evaluate: bool, doc: str):
    """``formulas`` (evaluate=False) and ``eval`` (True): the same totals as formulas or integers."""

    @click.command(name=name, help=doc)
    @click.argument("model")
    @common
    @click.option("--json", "as_json", is_flag=True, help="print one JSON object")
    @click.option("--optimizer", default="adamw", show_default=True,
                  help="adamw, adam, sgd, sgd-nomomentum, adafactor")
    def command(model, sets, config, attention, precision, debug, as_json, optimizer):
        from .. import report as rep

        an, sizes = trace_model(model, sets, config, attention, precision)
        mem = rep.memory_section(an, sizes, "80GiB", precision, optimizer, evaluate=evaluate)
        if as_json:
            click.echo(json.dumps(rep.to_json(an, sizes if evaluate else None, memory=mem), indent=1))
        elif evaluate:
            rep.render_values(an, sizes, memory=mem)
        else:
            rep.render(an, {}, table=False, memory=mem)

    return command


formulas = totals_command("formulas", False, "Closed-form totals of MODEL as formulas in the canonical symbols.")
eval_ = totals_command("eval", True, "Totals of MODEL as integers at --set sizes (others at the model's defaults).")
