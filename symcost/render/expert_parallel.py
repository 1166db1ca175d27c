"""Text and JSON of :func:`symcost.passes.expert_parallel.summary` (``report --ep N``)."""
from __future__ import annotations

from typing import Mapping

import sympy

from symcost.render.report import console, fmt


def _num(v):
    v = sympy.sympify(v)
    return int(v) if v.is_integer else float(v)


def to_json(an, sizes: Mapping[str, int] | None, summary: dict) -> dict:
    """``comm`` {all_gather, reduce_scatter, all_reduce, all_to_all, total} (bytes one rank
    sends, = receives, per step) and ``parallel`` {ep, engine, params_rank (parameter elements the
    rank holds), experts {params, params_rank}:
    elements of the stacked expert weights in the model and on the rank, memory_per_rank
    {params, grads, optimizer_state, master, total, activations}, memory {peak, where, parts,
    formula}: the rank's peak, :func:`symcost.render.report.peak_json`}: formulas without sizes,
    numbers with."""
    from symcost.render.report import peak_json

    vals = summary.get("values") if sizes is not None else None
    peak = peak_json(summary, vals is not None)
    if vals is None:
        return {"comm": {k: fmt(v) for k, v in summary["comm"].items()},
                "parallel": {"ep": "EP" if "EP" in an.symbols else an.pinned.get("EP"), "engine": summary["engine"],
                             "params_rank": fmt(summary["params_rank"]),
                             "experts": {k: fmt(v) for k, v in summary["experts"].items()},
                             "memory_per_rank": {k: fmt(v) for k, v in summary["memory"].items()},
                             "memory": peak}}
    return {"comm": {k: _num(v) for k, v in vals["comm"].items()},
            "parallel": {"ep": _num(vals["ep"]), "engine": summary["engine"], "params_rank": _num(vals["params_rank"]),
                         "experts": {k: _num(v) for k, v in vals["experts"].items()},
                         "memory_per_rank": {k: _num(v) for k, v in vals["memory"].items()},
                         "memory": peak}}


def render(an, sizes: Mapping[str, int], summary: dict, width: int | None = None) -> None:
    """The expert-parallel section of the report: all-to-all bytes, experts and memory per rank."""
    c = console(width)
    js = to_json(an, sizes, summary)
    par = js["parallel"]
    c.print(f"\n[bold]expert parallel[/bold]: EP = {par['ep']} ranks; traced {par['engine']}")
    from symcost.render.report import add_peak_row, per_rank_table

    t = per_rank_table(summary, js, par)
    for k, label in (("params", "expert parameters (model)"), ("params_rank", "expert parameters (rank)")):
        v = par["experts"][k]
        t.add_row(label, fmt(summary["experts"][k]), f"{v:,}" if isinstance(v, int) else "")
    v = par["params_rank"]
    t.add_row("parameters (rank)", fmt(summary["params_rank"]), f"{v:,}" if isinstance(v, int) else "")
    add_peak_row(t, par["memory"])
    c.print(t)
    c.print("the dense (non-expert) parameters are whole on every EP rank; without --dp nothing reduces their "
            "gradients across the EP ranks (docs/parallel.md §14)")
    if par["memory"].get("peak") is not None:
        c.print(f"peak per rank at: {par['memory']['where']} (model states of the rank's parameters + the live "
                "storages of the traced step: activations, all-to-all outputs, gradients, optimizer temporaries)")
