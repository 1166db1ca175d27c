"""``symcost plan``'s second stage: the per-rank peak of the best screened layouts from the
composed trace ``report`` runs for that layout (docs/parallel.md §13.5).

The screen (:class:`symcost.passes.plan.Planner`) composes every layout's per-rank memory from
formulas over one tensor-parallel trace; it has no transient working set and bounds the
pipeline's end stages from above. For the candidates that matter (the fastest ``k`` the screen
puts within ``near`` of the cap), :func:`refine` asks the same functions ``report`` asks for that
layout, so that plan's number for a layout is report's:

* no pipeline (pp = 1): one rank of the layout's mesh traced on PyTorch's fake process group
  (:class:`symcost.frontends.layout.Layout`: FSDP2/DDP over ``dp_*`` with HSDP's replicate
  degree, the Megatron plan over ``tp``, activation checkpointing per block), read from or
  written to the trace cache under the entry ``report --dp … --tp … --ac …`` keeps
  (:func:`symcost.graph.cache.cached_trace` with the layout's ``cache_options``), and its peak
  :func:`symcost.passes.parallel.rank_peak` (the traced storage schedule on top of the model
  states): ``report``'s ``parallel.memory.peak``;
* a pipeline (pp > 1): :func:`symcost.passes.pipeline.summary` with the layout's inner mesh
  (the stage modules traced as one rank of (DP, TP), PyTorch's schedule run per rank on fake
  tensors, both cached), the most loaded rank's ``peak_with_optimizer``: ``report --pp``'s.

A layout without a traced counterpart (``optimal`` checkpointing of 0 < k < n blocks: block-level
partial checkpointing is not a layout option; one plain device) keeps its screened memory.
"""
from __future__ import annotations

from typing import Any, Mapping

from symcost.errors import SymcostError


def mesh_of(lay: Mapping[str, Any], sp: bool = False):
    """The :class:`~symcost.frontends.layout.Layout` ``report`` traces for a plan row's
    ``layout`` dict (dp, tp, pp, shard, replicate, checkpoint, checkpointed_blocks, blocks,
    schedule, microbatches, virtual), or None where it has none (partial block checkpointing;
    a single plain device; expert or context parallelism, which plan composes). ``sp``: sequence parallelism with tp > 1."""
    from symcost.frontends.layout import Layout, Pipeline

    if lay.get("ep", 1) > 1 or lay.get("cp", 1) > 1:
        return None  # (EP and CP rows are composed: docs/parallel.md §13.6)
    ck = lay["checkpoint"]
    if ck == "optimal":
        k = lay.get("checkpointed_blocks")
        ck = {0: "none", lay.get("blocks"): "full"}.get(k)
        if ck is None:
            return None
    ac = None if ck == "none" else ck
    dp, tp, pp = lay["dp"], lay["tp"], lay["pp"]
    hsdp = lay["shard"] == "hsdp"
    shard = ("fsdp" if hsdp else lay["shard"]) if dp > 1 else None
    pipe = Pipeline(lay["schedule"], lay["microbatches"], lay.get("virtual", 1)) if pp > 1 else None
    mesh = Layout(shard=shard, tp=tp > 1, sp=bool(sp and tp > 1), pipeline=pipe, ac=ac,
                  replicate=lay.get("replicate") if hsdp else None)
    if not mesh.shard and not mesh.tp and pipe is None:
        return None  # (one device: report's one-device memory section, not a rank of a mesh)
    return mesh


def traced_peak(model: str, lay: Mapping[str, Any], sizes: Mapping[str, int], precision: str,
                optimizer: str = "adamw", sp: bool = False, use_cache: bool = True,
                routing: str | None = None) -> dict[str, Any] | None:
    """The per-rank peak (bytes) of a plan row's layout from its composed trace, as ``report``
    gives it for ``report MODEL --dp dp [--shard s --dp-replicate R] [--tp tp [--sp]] [--pp pp
    --schedule … --microbatches m --virtual-stages v] [--ac …] --set B=b …`` (module docstring).

    Args:
        model: a model name or config path as the command line takes it.
        lay: the row's ``layout`` (:meth:`symcost.passes.plan.Planner.evaluate`).
        sizes: the request's ``--set`` sizes (B, DP, TP, PP are the layout's).
        precision, optimizer: the memory policy.
        routing: ``--routing capacity=C`` (the MoE layers traced under it, as ``report --routing``;
            a pipeline's stages then traced afresh, not through the trace cache); None: balanced.

    Returns:
        ``peak`` (bytes per rank: the most loaded pipeline rank's), ``source`` (the function that
        gave it), ``recompute_flops`` (the hardware FLOPs the checkpointed forward adds per rank
        per step: traced), or None where the layout has no traced counterpart (:func:`mesh_of`).

    Raises:
        SymcostError: the trace or the schedule run fails (its reason).
    """
    import sympy

    from symcost.frontends.megatron import for_run
    from symcost.frontends.models import resolve

    mesh = mesh_of(lay, sp)
    if mesh is None:
        return None

    def resolved():  # (the model as report --routing traces it)
        spec = resolve(model)
        if routing is None:
            return spec
        from symcost.frontends.moe import with_routing

        return with_routing(spec, routing)
    req = {k: v for k, v in sizes.items() if k not in ("B", "DP", "TP", "PP")}
    mesh_sizes = {"B": lay["micro_batch"], **({"DP": lay["dp"]} if mesh.shard else {}),
                  **({"TP": lay["tp"]} if mesh.tp else {})}
    if mesh.pipeline is not None:  # report --pp (commands/_pipeline.py report_pipeline)
        from symcost.passes.pipeline import summary

        spec = for_run(resolved(), precision, "cuda", None)
        r = summary(spec, lay["pp"], mesh.pipeline.schedule, lay["microbatches"], mesh.pipeline.virtual, precision,
                    {**req, **mesh_sizes}, optimizer, cache=(model, {}, None) if use_cache and routing is None else None,
                    inner=mesh.inner)
        rows = [(row.get("peak_with_optimizer"), row) for row in r["ranks"]]
        missing = next((row for pk, row in rows if pk is None), None)
        if missing is not None:
            raise SymcostError(f"plan: pipeline rank {missing['rank']}'s peak could not be run: "
                               f"{missing.get('memory_note')}")
        peak, worst = max(rows, key=lambda x: x[0])
        extra = max(float(row.get("flops_hardware", row["flops"])) - float(row["flops"]) for _, row in rows)
        return {"peak": int(peak), "rank": worst["rank"], "recompute_flops": extra,
                "source": "passes.pipeline.summary (report --pp): the most loaded rank's peak_with_optimizer"}
    from symcost.graph.cache import cached_trace
    from symcost.passes.parallel import rank_peak
    import symcost

    tsizes = {**req, **mesh_sizes}

    def fresh():  # (commands/_options.py _trace_fresh: the layout's spec, then the run's)
        return symcost.trace(for_run(mesh.spec(resolved()), precision, "cuda", None), sizes=tsizes,
                             precision=precision)

    options = {**({"routing": routing} if routing is not None else {}), **mesh.cache_options()}
    an = cached_trace(model, {}, None, precision, tsizes, fresh, use_cache, options=options) \
        if isinstance(model, str) else fresh()
    pk = rank_peak(an, precision, optimizer, tsizes)
    if "error" in pk:
        raise SymcostError(f"plan: the rank's peak of {mesh.describe(mesh_sizes)} could not be computed: "
                           f"{pk['error']}")
    env = an.bind(**tsizes)
    extra = 0.0
    if mesh.ac is not None:  # the recomputed forward: hardware FLOPs beyond the model FLOPs
        extra = float(sympy.sympify(an.flops("train", "hardware")).xreplace(env)) - \
            float(sympy.sympify(an.flops("train")).xreplace(env))
    return {"peak": int(pk["value"]), "rank": 0, "recompute_flops": extra * lay["microbatches"],
            "source": "passes.parallel.rank_peak on the layout's traced rank (report --dp/--tp/--ac)"}


def _kind(x: Mapping[str, Any]) -> tuple:
    """A plan row's layout without its micro-batch size and count."""
    return tuple(sorted((k, v) for k, v in x.items() if k not in ("micro_batch", "microbatches")))


def refine(res: dict[str, Any], model: str, sizes: Mapping[str, int], precision: str, optimizer: str = "adamw",
           sp: bool = False, k: int = 15, near: float = 0.1, use_cache: bool = True,
           progress=None, routing: str | None = None) -> dict[str, Any]:
    """Re-rank a screened plan (:func:`symcost.passes.plan.plan` with ``keep_all=True``) with the
    traced peaks of its best candidates: the rows whose screened memory is within ``near`` (a
    fraction) of the cap, ``selective`` rows among them (the screen gives those bounds only: full
    recomputation's memory, no recomputation's time), get :func:`traced_peak` in step-time
    order until ``k`` of them fit the cap (at most 4·k traced); a row whose traced peak exceeds
    the cap is dropped, and so are, untraced (``pruned``), the later rows of the same
    pipeline-free layout at a micro-batch at least as large (one rank's step peaks higher at a
    larger micro-batch); a ``selective`` row
    adds its traced recomputation at the peak FLOP rate to its step time; every row is labelled
    ``peak_source`` ``"traced"`` or ``"screened"`` (``memory.traced_peak`` holds the traced
    bytes), and the rows are ranked by step time again. Untraced ``selective`` rows are left out
    (bounds are not estimates).

    ``routing``: ``--routing capacity=C``, passed to :func:`traced_peak` (None: balanced).

    Returns:
        ``res`` with ``layouts`` re-ranked, ``traced`` (rows traced), ``dropped`` (traced rows
        over the cap), ``pruned`` (how many rows were left out by a smaller micro-batch's
        traced peak), ``trace_top`` = k and ``near``.

    A candidate whose trace is refused (:class:`SymcostError`) keeps its screened memory, with
    ``trace_error`` and a line in ``notes``.

    Raises:
        SymcostError: ``k`` < 0 or ``near`` < 0.
    """
    if k < 0 or near < 0:
        raise SymcostError(f"--trace-top must be >= 0 and the near-cap margin >= 0 (got {k}, {near})")
    cap = res["memory_cap"]
    rows = list(res["layouts"]) + list(res.get("excluded", ()))
    pool = sorted((r for r in rows if r["memory"]["total"] <= cap * (1 + near) and mesh_of(r["layout"], sp)),
                  key=lambda r: r["step_seconds"])
    dropped, pruned, traced, fit = [], [], 0, 0
    over: dict = {}  # a pipeline-free layout kind -> the smallest micro-batch whose traced peak was over the cap
    tried = []
    for r in pool:
        if fit >= k or len(tried) >= 4 * k:
            break
        x = r["layout"]
        kind = _kind(x)
        if x["pp"] == 1 and kind in over and x["micro_batch"] >= over[kind]:
            # (one rank's step at a larger micro-batch peaks higher: the same layout at a smaller
            # one was over the cap when traced)
            pruned.append(r)
            continue
        tried.append(r)
        if progress is not None:
            progress(r)
        try:
            t = traced_peak(model, r["layout"], sizes, precision, optimizer, sp, use_cache, routing)
        except SymcostError as e:  # (a layout the trace refuses keeps its screened memory, and says why)
            r["trace_error"] = str(e)
            continue
        traced += 1
        r["memory"]["traced_peak"] = t["peak"]
        r["peak_source"], r["peak_function"] = "traced", t["source"]
        if r["layout"]["checkpoint"] == "selective":
            bub = r["bubble"]
            extra = t["recompute_flops"] / res["peak_flops"] * (1 + bub)
            r["time"]["compute"] += extra / (1 + bub)
            r["time"]["bubble"] += extra * bub / (1 + bub)
            r["time"]["step"] += extra
            r["step_seconds"] += extra
            n = r["layout"]["dp"] * r["layout"]["tp"] * r["layout"]["pp"]
            r["mfu"] = r["model_flops"] / (n * res["peak_flops"] * r["step_seconds"])
            if "bound_seconds" in r and r["time_bound"] is not r["time"]:  # (the bound: the same FLOPs at the peak)
                r["time_bound"]["compute"] += extra / (1 + bub)
                r["time_bound"]["bubble"] += extra * bub / (1 + bub)
                r["time_bound"]["step"] += extra
            if "bound_seconds" in r:
                r["bound_seconds"] = r["time_bound"]["step"]
                r["mfu_bound"] = r["model_flops"] / (n * res["peak_flops"] * r["bound_seconds"])
        if t["peak"] > cap:
            dropped.append(r)
            if x["pp"] == 1:
                over[kind] = min(over.get(kind, x["micro_batch"]), x["micro_batch"])
        else:
            fit += 1
    gone = {id(r) for r in pruned}
    rows = [r for r in rows if id(r) not in gone]
    pool = tried
    done = {id(r) for r in pool if "traced_peak" in r["memory"]}
    keep = [r for r in rows if id(r) in done and r["memory"]["traced_peak"] <= cap] + \
        [r for r in rows if id(r) not in done and r["memory"]["total"] <= cap and r["layout"]["checkpoint"] != "selective"]
    for r in keep:
        r.setdefault("peak_source", "screened")
    res = dict(res)
    res["layouts"] = sorted(keep, key=lambda r: r["step_seconds"])
    res["traced"], res["dropped"], res["trace_top"], res["near"] = traced, dropped, k, near
    res["pruned"] = len(pruned)
    refused = [r for r in pool if "trace_error" in r]
    if refused:
        res["notes"] = list(res.get("notes", ())) + [
            f"{len(refused)} candidate(s) could not be traced and keep their screened memory (first: "
            f"{refused[0]['trace_error']})"]
    return res
