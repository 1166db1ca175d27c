"""Text and JSON of :func:`symcost.passes.tensor_parallel.summary` (``report --tp N [--sp]``)."""
from __future__ import annotations

from typing import Mapping

import sympy

from symcost.render.report import console, fmt


def _num(v):
    v = sympy.sympify(v)
    return int(v) if v.is_integer else float(v)


def to_json(an, sizes: Mapping[str, int] | None, summary: dict) -> dict:
    """``comm`` {all_gather, reduce_scatter, all_reduce, total} (bytes one rank sends, =
    receives, per step) and ``parallel`` {tp, sp, engine, memory_per_rank {params, grads,
    optimizer_state, master, total, activations}, memory {peak, where, parts, formula}: the
    rank's peak, :func:`symcost.render.report.peak_json`; replicated [{module, params, elements,
    share (of the model's parameters, with sizes)}]:
    the weight matrices every rank holds whole, :func:`symcost.passes.tensor_parallel.replicated`;
    grads_beyond_shards: gradient elements beyond the rank's parameter shards, the
    vocabulary-parallel embedding's whole gradient}: formulas without sizes, numbers with."""
    from symcost.render.report import peak_json

    vals = summary.get("values") if sizes is not None else None
    peak = peak_json(summary, vals is not None)
    env = an.bind(**sizes) if vals is not None else None
    total = an.params.xreplace(env) if env is not None else None
    beyond = sympy.sympify(summary.get("grads_beyond_shards", 0))
    whole = [{"module": g["module"], "params": g["params"],
              "elements": fmt(g["elements"]) if env is None else _num(g["elements"].xreplace(env)),
              **({"share": float(g["elements"].xreplace(env) / total)} if total else {})}
             for g in summary.get("replicated", [])]
    if vals is None:
        return {"comm": {k: fmt(v) for k, v in summary["comm"].items()},
                "parallel": {"tp": "TP" if "TP" in an.symbols else an.pinned.get("TP"), "sp": summary["sp"],
                             "engine": summary["engine"],
                             "memory_per_rank": {k: fmt(v) for k, v in summary["memory"].items()},
                             "memory": peak, "replicated": whole,
                             "grads_beyond_shards": fmt(beyond)}}
    return {"comm": {k: _num(v) for k, v in vals["comm"].items()},
            "parallel": {"tp": _num(vals["tp"]), "sp": summary["sp"], "engine": summary["engine"],
                         "memory_per_rank": {k: _num(v) for k, v in vals["memory"].items()},
                         "memory": peak, "replicated": whole,
                         "grads_beyond_shards": _num(beyond.xreplace(env))}}


def render(an, sizes: Mapping[str, int], summary: dict, width: int | None = None) -> None:
    """The tensor-parallel section of the report: bytes over the links and memory per rank."""
    c = console(width)
    js = to_json(an, sizes, summary)
    par = js["parallel"]
    c.print(f"\n[bold]tensor parallel[/bold]: TP = {par['tp']} ranks"
            f"{' with sequence parallelism' if par['sp'] else ''}; traced {par['engine']}")
    from symcost.render.report import add_peak_row, per_rank_table

    t = per_rank_table(summary, js, par)
    add_peak_row(t, par["memory"])
    c.print(t)
    if par["replicated"]:  # what the plan did not split: every rank holds all of it
        parts = []
        for g in par["replicated"][:4]:
            share = f", {100 * g['share']:.0f}% of the parameters" if "share" in g else ""
            parts.append(f"{g['module'] or '(root)'} ({', '.join(g['params'])}{share})")
        more = f" and {len(par['replicated']) - 4} more" if len(par["replicated"]) > 4 else ""
        c.print("left whole on every rank (the plan does not split them): " + "; ".join(parts) + more)
    beyond = par["grads_beyond_shards"]
    if beyond not in (0, "0"):  # (the vocabulary-parallel embedding's gradient: whole, Replicate, on every rank)
        n = f"{beyond:,}" if isinstance(beyond, int) else beyond
        c.print(f"gradients: {n} elements beyond the rank's shards (PyTorch returns the vocabulary-parallel "
                "embedding's gradient whole, a Replicate [V, d] DTensor beside its Shard(0) weight; "
                "docs/parallel.md §11)")
    if par["memory"].get("peak") is not None:
        c.print(f"peak per rank at: {par['memory']['where']} (model states of the rank's shards + the live "
                "storages of the traced step: activations, collective outputs, gradients, optimizer temporaries)")
