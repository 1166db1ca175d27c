"""Pipeline-parallel training per rank: FLOPs, activations held with the micro-batches in
flight, point-to-point bytes and the bubble, from traced stages and PyTorch's schedules
(docs/parallel.md, "Pipeline parallelism").

Each kind of stage module (first: embeddings + blocks; middle: blocks; last: blocks + head +
loss; :mod:`symcost.frontends.pipeline`) is traced for one micro-batch like any model, its L
being the blocks of that stage; the formulas of a pipeline of ``PP`` ranks with ``v`` stages
each substitute L → L/(PP·v). A rank's step runs its stages' forward and backward once per
micro-batch in the order of PyTorch's schedule (``schedule_order``), so per step and rank:

* FLOPs = m · Σ over its stages of one micro-batch's forward + backward;
* activations held at most: the largest, over the rank's action list, of Σ saved bytes of the
  micro-batch-stages whose forward ran and whose backward has not (1F1B's first rank:
  min(PP, m) micro-batches; GPipe: m; interleaved: v·PP + PP − 1 chunks,
  Korthikanti et al. 2022 §4.2.3);
* point-to-point bytes = m · (activation sent forward + its gradient received backward, and
  the same received from the stage before), traced as ``c10d.send``/``c10d.recv_`` ops;
* the bubble: idle / busy time of the schedule run on a dependency clock (t_b = 2·t_f), which
  is PTD-P's (PP−1)/m, and (PP−1)/(v·m) interleaved (Narayanan et al. 2021 §2.2).
"""
from __future__ import annotations

from typing import Any, Mapping

import sympy

from symcost.errors import SymcostError
from symcost.frontends.pipeline import (SCHEDULES, check_schedule, part_of, schedule_order, simulate, stage_blocks,
                                        stage_spec)
from symcost.tracing.fit import SYMS

PP = sympy.Symbol("PP", positive=True, integer=True)


#: stage traces by (model, defaults, part, block container, precision, requested sizes but L)
_TRACES: dict = {}


def _saved(an) -> sympy.Expr:
    return sympy.expand(sympy.Add(*[rep * nb for _, nb, _, rep in an.saved]))


def trace_stages(model, pp: int, virtual: int = 1, precision: str = "fp32", sizes: Mapping[str, int] | None = None):
    """Trace the stage modules a pipeline of ``pp`` ranks × ``virtual`` stages needs
    (``first`` and ``last``, ``middle`` when there are more than 2 stages). Returns
    ``(spec, {part: Analysis})``; each Analysis's ``L`` is the blocks of that stage."""
    import symcost
    from symcost.frontends.models import resolve
    from symcost.frontends.spec import ModelSpec
    from symcost.tracing.record import find_layer_container

    spec = model if isinstance(model, ModelSpec) else resolve(model)
    if "L" not in spec.symbols:
        raise SymcostError(f"{spec.name} has no symbol L (repeated blocks), so no pipeline stages")
    n = pp * virtual
    values = spec.values(dict(sizes or {}))
    layers = spec.layers
    if layers is None:
        import torch

        with torch.device("meta"):
            layers = find_layer_container(spec, spec.build(values), values)
    stage_blocks(values["L"], n)  # enough blocks for the stages
    parts = {"first", "last"} | ({"middle"} if n > 2 else set())
    # the regime is that of the requested sizes; L is each stage's own block count, a symbol
    # fitted from the probes like any other (so one trace serves every PP and split)
    req = tuple(sorted((k, v) for k, v in (sizes or {}).items() if k in spec.all_symbols and k != "L"))
    out = {}
    for part in sorted(parts):
        key = (spec.name, tuple(sorted(spec.defaults.items())), part, layers, precision, req)
        if key not in _TRACES:
            _TRACES[key] = symcost.trace(stage_spec(spec, part, layers), sizes=dict(req), precision=precision)
        out[part] = _TRACES[key]
    return spec, out


def summary(model, pp: int, schedule: str, microbatches: int, virtual: int = 1, precision: str = "fp32",
            sizes: Mapping[str, int] | None = None, optimizer: str = "adamw", peak: bool = True) -> dict[str, Any]:
    """One pipeline step (``microbatches`` micro-batches of B sequences) on each of ``pp`` ranks.

    Args:
        model: a model name or :class:`ModelSpec`.
        pp: pipeline ranks (PP). schedule: ``gpipe``, ``1f1b`` or ``interleaved-1f1b``.
        microbatches: micro-batches per step (m). virtual: stages per rank (v, interleaved only).
        precision: precision policy of the trace (and of the model states).
        sizes: symbol values (B is the micro-batch size; L the whole model's blocks).

    Returns:
        ``schedule``, ``source``, ``pp``, ``microbatches``, ``virtual``, ``bubble`` (idle/busy of
        the slowest rank, simulated on PyTorch's action lists), ``bubble_formula`` ((PP−1)/(v·m)),
        ``formulas`` per stage kind (one micro-batch: ``flops``, ``flops_forward``,
        ``flops_backward``, ``saved``, ``send``, ``recv``, ``params``; L → L/(PP·v)), and
        ``ranks``: per rank ``stages``, ``blocks``, ``flops`` (per step), ``in_flight``
        (micro-batch-stages held at most), ``activations`` (bytes held at most), ``send`` and
        ``recv`` (bytes per step), ``params`` and ``model_states`` (bytes, the precision
        policy with ``optimizer``, :func:`symcost.passes.parallel.model_state_bytes`); with
        ``peak``, ``memory``: the rank's step run through PyTorch's schedule on fake tensors
        (:func:`symcost.tracing.pipeline.rank_memory`: ``params``, ``grads``, ``kept`` engine
        buffers, ``top`` and ``peak`` bytes of a step without the optimizer) and ``peak_with_optimizer``
        (that peak plus the optimizer state and master weights of the policy).

    Raises:
        SymcostError: an invalid pipeline (:func:`check_schedule`), fewer blocks than stages, a
            model without blocks.
    """
    from symcost.passes.parallel import model_state_bytes

    check_schedule(schedule, pp, microbatches, virtual)
    order = schedule_order(schedule, pp, microbatches, virtual)  # PyTorch's refusals before any trace
    spec, ans = trace_stages(model, pp, virtual, precision, sizes)
    sim = simulate(order)
    n = pp * virtual
    values = spec.values(dict(sizes or {}))
    blocks = stage_blocks(values["L"], n)
    per_stage = {}
    for s in range(n):
        an = ans[part_of(s, n)]
        env = an.bind(**{**{k: v for k, v in values.items() if k in an.symbols or k in ("B", "S")}, "L": blocks[s]})
        ev = lambda e: int(sympy.sympify(e).xreplace(env))  # noqa: E731
        per_stage[s] = {"flops": ev(an.flops("train")), "flops_forward": ev(an.flops("forward")),
                        "flops_backward": ev(an.flops("backward")), "saved": ev(_saved(an)),
                        "send": ev(an.comm_bytes("send")), "recv": ev(an.comm_bytes("recv")),
                        "params": ev(an.params)}
    ranks = []
    for r in range(pp):
        mine = [s for s in range(n) if s % pp == r]
        live = top = 0
        for kind, s, _ in order[r]:
            if kind == "F":
                live += per_stage[s]["saved"]
            elif kind in ("B", "I"):
                live -= per_stage[s]["saved"]
            top = max(top, live)
        params = sum(per_stage[s]["params"] for s in mine)
        states = model_state_bytes(params, 1, "ddp", precision, optimizer)
        ranks.append({"rank": r, "stages": mine, "blocks": sum(blocks[s] for s in mine),
                      "flops": microbatches * sum(per_stage[s]["flops"] for s in mine),
                      "in_flight": sim["in_flight"][r], "activations": top,
                      "send": microbatches * sum(per_stage[s]["send"] for s in mine),
                      "recv": microbatches * sum(per_stage[s]["recv"] for s in mine),
                      "params": params, "model_states": int(states["total"])})
    if peak:
        from symcost.tracing.pipeline import rank_memory

        layers = ans["first"].layer_container or spec.layers
        for row in ranks:
            try:
                mem = rank_memory(spec, values, layers, pp, schedule, microbatches, row["rank"], virtual, precision)
            except SymcostError as e:  # (keyword inputs: hf: models) the peak is left out, and why
                row["memory_note"] = str(e)
                continue
            states = model_state_bytes(row["params"], 1, "ddp", precision, optimizer)
            row["memory"] = mem
            row["peak_with_optimizer"] = mem["peak"] + int(states["optimizer_state"] + states["master"])
    L = SYMS["L"]
    v = sympy.Integer(virtual)
    formulas = {}
    for part, an in ans.items():
        sub = {L: L / (PP * v)}
        f = lambda e: sympy.factor_terms(sympy.expand(sympy.sympify(e).xreplace(sub)))  # noqa: E731
        formulas[part] = {"flops": f(an.flops("train")), "flops_forward": f(an.flops("forward")),
                          "flops_backward": f(an.flops("backward")), "saved": f(_saved(an)),
                          "send": f(an.comm_bytes("send")), "recv": f(an.comm_bytes("recv")),
                          "params": f(an.params)}
    m = sympy.Symbol("m", positive=True, integer=True)
    return {"schedule": schedule, "engine": f"torch.distributed.pipelining.{SCHEDULES[schedule][0]}",
            "source": SCHEDULES[schedule][2], "pp": pp, "microbatches": microbatches, "virtual": virtual,
            "bubble": sim["bubble"], "bubble_formula": (PP - 1) / (v * m) if virtual > 1 else (PP - 1) / m,
            "formulas": formulas, "stages": per_stage, "ranks": ranks, "blocks": blocks,
            "divisible": values["L"] % n == 0}
