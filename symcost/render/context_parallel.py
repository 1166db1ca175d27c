"""Text and JSON of :func:`symcost.passes.context_parallel.summary` (``report --cp N``)."""
from __future__ import annotations

import sympy

from symcost.render.report import console, fmt


def _num(v):
    v = sympy.sympify(v)
    return int(v) if v.is_integer else float(v)


def to_json(summary: dict) -> dict:
    """``{"context_parallel": {cp, rotate, shard, comm: {all_gather|all_to_all: {forward, backward}},
    total, params_rank}}``: bytes one rank sends (= receives) per step over the CP group (``shard``:
    FSDP2's strategy over dp_shard × cp, or None), parameter elements the rank holds; formulas
    without sizes, integers with."""
    vals = summary["values"]
    if vals is None:
        comm = {k: {ph: fmt(v) for ph, v in d.items()} for k, d in summary["comm"].items()}
        total, params = fmt(summary["total"]), fmt(summary["params_rank"])
    else:
        comm = {k: {ph: _num(v) for ph, v in d.items()} for k, d in vals["comm"].items()}
        total, params = _num(vals["total"]), _num(vals["params_rank"])
    cp = summary["cp"]
    return {"context_parallel": {"cp": int(cp) if isinstance(cp, int) else str(cp), "rotate": summary["rotate"],
                                 "shard": summary.get("shard"), "comm": comm, "total": total,
                                 "params_rank": params,
                                 **({"step": summary["step"]} if summary.get("step") else {})}}


def render(summary: dict, width: int | None = None) -> None:
    """The context-parallel section of the report: the ring's exchange bytes per rank."""
    from rich.table import Table

    from symcost.units import binary

    c = console(width)
    c.print(f"\n[bold]context parallel[/bold]: CP = {summary['cp']} ranks, ring attention "
            f"(PyTorch's context_parallel, rotate method {summary['rotate']}); bytes one rank sends "
            "(= receives) per step over the CP group")
    t = Table(box=None)
    for col in ("collective", "phase", "formula (bytes)", "value"):
        t.add_column(col, justify="right" if col == "value" else "left")
    vals = summary["values"]
    for k, d in summary["comm"].items():
        for ph, f in d.items():
            v = vals["comm"][k][ph] if vals else None
            t.add_row(k.replace("_", "-"), ph, fmt(f), binary(int(v)) if v is not None else "")
    t.add_row("total", "", fmt(summary["total"]), binary(int(vals["total"])) if vals else "")
    c.print(t)
    st = summary.get("step")
    if st:
        c.print(f"step time bound on the device (roofline compute + the ring's exchange not hidden): "
                f"{st['step_seconds'] * 1e3:.4g} ms = compute {sum(st['compute'].values()) * 1e3:.4g} ms + exposed "
                f"{st['exposed_comm_seconds'] * 1e3:.4g} ms of the ring's {sum(st['ring'].values()) * 1e3:.4g} ms over "
                f"{st['link']} ({st['link_bandwidth'] / 1e9:.4g} GB/s per direction; CP = {st['cp']} ranks "
                f"{'inside one node' if st['inside'] else 'across nodes'}); MFU ceiling {100 * st['mfu']:.1f}% "
                "(each K/V or dK/dV pass overlapped with the ring step's attention kernel as PyTorch's "
                "_templated_ring_attention(_backward) issues and waits for it; docs/parallel.md §15)")
    c.print("K/V forward by the rotate method, K/V again and the dK/dV accumulators (fp32) by all-to-all in "
            "the backward; " + (f"parameters sharded and gradients reduced by FSDP2 ({summary['shard']}) over "
                                "dp_shard × cp, the data-parallel section's DP group (docs/parallel.md §15)"
                                if summary.get("shard") else
                                "gradients are not reduced over the CP ranks (torchtitan shards them with FSDP2 "
                                "over the CP ranks even without data parallelism: not modelled yet; "
                                "docs/parallel.md §15)"))
