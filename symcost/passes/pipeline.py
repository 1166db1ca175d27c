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

import functools
from typing import Any, Mapping

import sympy

from symcost._memo import BoundedMemo
from symcost.errors import SymcostError
from symcost.frontends.pipeline import (SCHEDULES, check_schedule, schedule_order, simulate, split_words,
                                        stage_blocks, stage_kind, stage_spec)
from symcost.tracing.fit import SYMS

PP = sympy.Symbol("PP", positive=True, integer=True)


#: stage traces by (model, defaults, part, block container, precision, requested sizes but L)
_TRACES = BoundedMemo(16)  # (the 16 last used)


def _saved(an) -> sympy.Expr:
    return sympy.expand(sympy.Add(*[rep * nb for _, nb, _, rep in an.saved]))


#: the totals of ``report --json``'s contract (symcost.render.report.to_json) a stage and a rank carry
TOTALS = ("flops", "flops_hw", "flops_all", "bytes", "transcendentals")


def _stage_totals(an, ev) -> dict[str, Any]:
    """One micro-batch of a stage in ``report --json``'s contract keys (:data:`TOTALS` per phase,
    ``attention_flops``, ``unsupported_ops``), integers through ``ev``."""
    from symcost.graph.analysis import PHASES

    phases = PHASES + ("train",)
    return {"flops": {p: ev(an.flops(p)) for p in phases},
            "flops_hw": {p: ev(an.flops(p, "hardware")) for p in phases},
            "flops_all": {p: ev(an.flops(p, "all")) for p in phases},
            "bytes": {p: ev(an.bytes(p)) for p in phases},
            "transcendentals": {p: ev(an.transcendentals(p)) for p in phases},
            "attention_flops": ev(an.attention_flops),
            "unsupported_ops": {k: ev(v) for k, v in an.unsupported.items()}}


def _rank_totals(stages: list[dict], microbatches: int) -> dict[str, Any]:
    """A rank's step in the keys of :func:`_stage_totals`: ``microbatches`` times the sum over its stages."""
    out: dict[str, Any] = {k: {} for k in TOTALS + ("unsupported_ops",)}
    out["attention_flops"] = 0
    for st in stages:
        for k in TOTALS + ("unsupported_ops",):
            for p, v in st[k].items():
                out[k][p] = out[k].get(p, 0) + microbatches * v
        out["attention_flops"] += microbatches * st["attention_flops"]
    return out


def stage_analysis(ans: Mapping[str, Any], s: int, blocks: list[int]):
    """The trace (of :func:`trace_stages`'s ``ans``) that stands for stage ``s`` of a pipeline whose
    stages hold ``blocks`` blocks: its kind (:func:`symcost.frontends.pipeline.stage_kind`, the
    model's leading blocks read from the first stage's spec, which keeps them)."""
    if f"stage{s}" in ans:  # (a model of several stacks: each stage its own trace, passes.pipeline_stacks)
        return ans[f"stage{s}"]
    lead = int(getattr(ans["first"].spec, "lead_blocks", 0) or 0) if "first" in ans else 0
    return ans[stage_kind(s, blocks, lead)[0]]


def _blocks_env(an, blocks: int) -> dict:
    """``{"L": blocks}`` for a stage trace whose L is its own block count; ``{}`` for a stage of a
    model of several stacks (:mod:`symcost.passes.pipeline_stacks`: no L, the stacks' lengths
    pinned at the request)."""
    return {"L": blocks} if "L" in an.symbols or "L" in an.pinned else {}


def _first(ans):
    """The first stage's trace (``first``, or ``stage0`` of a model of several stacks)."""
    return ans["first"] if "first" in ans else ans["stage0"]


def trace_stages(model, pp: int, virtual: int = 1, precision: str = "fp32", sizes: Mapping[str, int] | None = None,
                 cache: tuple | None = None, inner=None, split=None):
    """Trace the stage modules a pipeline of ``pp`` ranks × ``virtual`` stages needs
    (``first`` and ``last``, ``middle`` when there are more than 2 stages). Returns
    ``(spec, {kind: Analysis})``; each Analysis's ``L`` is the blocks of that stage. The kinds
    are ``first`` and ``last`` (``middle`` when there are more than 2 stages) and, for a model
    whose leading blocks of another kind (``ModelSpec.lead_blocks``) reach past the first stage,
    ``"{part}:lead{k}"`` for each stage that holds k of them
    (:func:`symcost.frontends.pipeline.stage_kind`; :func:`stage_analysis` finds a stage's).

    ``cache``: ``(model, config, attention)`` as the command line named them: each stage kind's
    trace is then read from (or written to) the trace cache (:mod:`symcost.graph.cache`) under
    the options ``{"pp_stage": part}``; one entry serves every PP, m and schedule (L is a symbol
    of the stage), within the regime of the requested sizes.

    ``inner``: the layout's other dimensions and techniques (a
    :class:`~symcost.frontends.layout.Layout` without a pipeline: ``--dp``, ``--tp``/``--sp``,
    ``--ac``), applied to each stage module as torchtitan applies them after its pipeline split;
    each stage is then one rank of its (DP, TP) mesh, its formulas in DP and TP too. ``split``:
    the blocks of each stage (:func:`symcost.frontends.pipeline.stage_blocks`; None: even)."""
    import symcost
    from symcost.frontends.models import resolve
    from symcost.frontends.spec import ModelSpec
    from symcost.tracing.record import find_layer_container

    spec = model if isinstance(model, ModelSpec) else resolve(model)
    if spec.layers is None:
        from symcost.passes.pipeline_stacks import trace_stack_stages
        from symcost.tracing.stacks import pipeline_stacks

        if pipeline_stacks(spec, spec.values(dict(sizes or {}))):  # (several stacks: the blocks cut as one list)
            return trace_stack_stages(spec, pp, virtual, precision, sizes, cache, inner, split)
    if "L" not in spec.symbols:
        raise SymcostError(f"{spec.name} has no symbol L (repeated blocks), so no pipeline stages")
    n = pp * virtual
    values = spec.values(dict(sizes or {}))
    if values["L"] < n and virtual > 1:  # (the stage count is PP·v: say where it comes from)
        raise SymcostError(f"L = {values['L']} blocks cannot fill {n} pipeline stages (--pp {pp} × "
                           f"--virtual-stages {virtual}, one block each at least)")
    blocks = stage_blocks(values["L"], n, split)  # (enough blocks for the stages)
    lead = int(getattr(spec, "lead_blocks", 0) or 0)

    @functools.cache
    def container():
        if spec.layers is not None:
            return spec.layers
        return find_layer_container(spec, spec.build_meta(values), values)

    # each stage kind once: its part, the leading blocks before it and its own block count (that
    # of its first stage: a kind holding leading blocks is one stage)
    kinds: dict = {}
    for s in range(n):
        kind, before = stage_kind(s, blocks, lead)
        kinds.setdefault(kind, (kind.split(":")[0], before, blocks[s]))
    # the regime is that of the requested sizes; L is each stage's own block count, a symbol
    # fitted from the probes like any other (so one trace serves every PP and split)
    mesh = set(inner.symbols) if inner else set()
    req = tuple(sorted((k, v) for k, v in (sizes or {}).items() if (k in spec.all_symbols or k in mesh) and k != "L"))
    out = {}
    probes: dict = {}  # the stage boundary at each probe's sizes, shared by the stage kinds
    for kind in sorted(kinds):
        part, before, own = kinds[kind]
        opts = inner.cache_options() if inner else {}
        if spec.extra.get("torch_device") not in (None, "cuda"):  # (its kernels: tracing.device_kernels)
            opts = {**opts, "torch_device": spec.extra["torch_device"]}
        if spec.extra.get("loss_choice") not in (None, "megatron" if precision.startswith("megatron-") else "model"):
            opts = {**opts, "loss": spec.extra["loss_choice"]}  # (--loss: frontends.megatron.for_run)
        if kind != part:  # (a stage holding some of the leading blocks: its own cache entry)
            opts = {**opts, "pp_lead": lead - before}
        key = (spec.name, tuple(sorted(spec.defaults.items())), kind, spec.layers, precision, req,
               (cache[0], tuple(sorted((cache[1] or {}).items())), cache[2]) if cache else None,
               tuple(sorted(opts.items())))
        if key not in _TRACES:
            def fresh(part=part, own=own, before=before):
                stage = stage_spec(spec, part, container(), precision=precision, probes=probes,
                                   sp=bool(inner and inner.sp), cp=bool(inner and inner.cp), before=before)
                if inner:
                    stage = inner.spec(stage)
                # (the stage's own block count is the request's L: where the blocks of a stage
                # cannot be folded and L is pinned, the pinned value is the stage's)
                return symcost.trace(stage, sizes={**dict(req), "L": own}, precision=precision)

            if cache is not None:
                from symcost.graph.cache import cached_trace

                name, config, attention = cache
                # (the stage's own block count in the request: a trace that pins L, as one whose
                # single block cannot fold does, then matches the next request of that stage)
                _TRACES[key] = cached_trace(name, config, attention, precision, {**dict(req), "L": own}, fresh,
                                            options={"pp_stage": part, **opts})
            else:
                _TRACES[key] = fresh()
        out[kind] = _TRACES[key]
    return spec, out


def summary(model, pp: int, schedule: str, microbatches: int, virtual: int = 1, precision: str = "fp32",
            sizes: Mapping[str, int] | None = None, optimizer: str = "adamw", peak: bool = True,
            device=None, devices_per_node: int | None = None, cache: tuple | None = None,
            inner=None, split=None, mode: str = "eager", overlap: str = "backward",
            megatron_args=None) -> dict[str, Any]:
    """One pipeline step (``microbatches`` micro-batches of B sequences) on each of ``pp`` ranks.

    Args:
        model: a model name or :class:`ModelSpec`.
        pp: pipeline ranks (PP). schedule: ``gpipe``, ``1f1b`` or ``interleaved-1f1b``.
        microbatches: micro-batches per step (m). virtual: stages per rank (v, interleaved only).
        precision: precision policy of the trace (and of the model states).
        sizes: symbol values (B is the micro-batch size; L the whole model's blocks).
        cache: ``(model, config, attention)``: the stage traces through the trace cache
            (:func:`trace_stages`).
        inner: the layout's other mesh dimensions and techniques (a
            :class:`~symcost.frontends.layout.Layout` without a pipeline): each stage is then
            traced as one rank of its (DP, TP) mesh (:func:`trace_stages`; ``sizes``
            hold DP and TP), the model states follow the data-parallel strategy's sharding of
            the rank's TP-local parameters (:func:`symcost.passes.parallel.model_state_bytes`),
            and the rank's step runs through PyTorch's schedule on the composed mesh
            (:func:`symcost.tracing.pipeline.rank_memory`), which also counts each group's
            collectives per step (``comm``: FSDP2 under ``PipelineStage`` all-gathers and
            reduces as the schedule drives it, not once per micro-batch).
            With ``inner.offload`` (FSDP2's ``CPUOffloadPolicy`` on every stage unit, as
            torchtitan's ``training.enable_cpu_offload`` gives it under a pipeline too), each
            rank's model states are on the host (``host``: ``params``, ``grads``, ``optimizer``,
            ``master_weights``, ``total`` bytes, the policy's bytes of its shards), the peak is
            the device's (the run's parameters and gradients are host memory,
            :func:`~symcost.tracing.pipeline.rank_memory`; no optimizer state added), and
            ``transfer`` ``{h2d, d2h}`` the bytes the step copied each way; with ``device``,
            ``transfer_seconds``: the larger direction over its host link
            (:func:`symcost.passes.offload.host_link`; not part of ``step``, as the
            data-parallel collectives are not). With ``inner.offload_activations``, per rank
            ``activation_offload`` ``{host, d2h, h2d}`` (:func:`~symcost.tracing.pipeline.rank_memory`:
            the most pinned host bytes the packed saved tensors of the micro-batches in flight
            hold at once, and the bytes copied each way per step; with ``device``, ``seconds``
            {forward, backward}: each over the host link, not part of ``step``); the peak is the
            device's.
        mode, overlap: the predicted step's (:func:`predict_price`): ``eager`` or ``compiled``
            kernels; how the data-parallel collectives hide (``none``, ``backward``, ``full``).
        megatron_args: the Megatron-LM run's flags for its per-iteration work under Megatron's engine
            (:func:`predict_price`; :func:`symcost.passes.megatron_iteration.parse_args`).
        split: the blocks of each of the PP·v stages (:func:`symcost.frontends.pipeline.parse_split`:
            None the even split, ``"torchtitan"``, or a tuple); the per-rank rows follow it.

    Returns:
        ``schedule``, ``source``, ``pp``, ``microbatches``, ``virtual``, ``blocks`` (of each
        stage) and ``split`` (as ``--pp-split`` names it), ``bubble`` (idle/busy of
        the slowest rank, simulated on PyTorch's action lists), ``bubble_formula`` ((PP−1)/(v·m)),
        ``formulas`` per stage kind (one micro-batch: ``flops`` (model FLOPs: MFU's, no
        recomputation), ``flops_hardware`` (what the stage runs, activation checkpointing's
        recomputation included; equal without ``inner.ac``), ``flops_forward``,
        ``flops_backward``, ``saved``, ``send``, ``recv``, ``params``; L → L/(PP·v)), ``pinned``
        per stage kind (the symbols its trace fixed at the requested value, ``Analysis.pinned``), and
        ``ranks``: per rank ``stages``, ``blocks``, ``flops`` and ``flops_hardware`` (per step), ``in_flight``
        (micro-batch-stages held at most), ``activations`` (bytes held at most), ``send`` and
        ``recv`` (bytes per step), ``params`` and ``model_states`` (bytes, the precision
        policy with ``optimizer``, :func:`symcost.passes.parallel.model_state_bytes`), ``totals``
        (the rank's step in ``report --json``'s contract keys: ``flops``, ``flops_hw``,
        ``flops_all``, ``bytes``, ``transcendentals`` per phase, ``attention_flops``,
        ``unsupported_ops``; m times the sum over its stages, each stage's one micro-batch in
        ``stages[s]["totals"]``, its whole-model parameter counts in ``stages[s]["params_model"]``); with
        ``peak``, ``memory``: the rank's step run through PyTorch's schedule on fake tensors
        (:func:`symcost.tracing.pipeline.rank_memory`: ``params``, ``grads``, ``kept`` engine
        buffers, ``top`` and ``peak`` bytes of a step without the optimizer) and ``peak_with_optimizer``
        (that peak plus the optimizer state and master weights of the policy). With ``device``
        (and ``devices_per_node``, default the device's), ``step``: the step priced on it
        (:func:`price`: the bound), ``step["predicted"]`` (:func:`predict_price`: the performance
        model's step, each rank's data-parallel bytes those its run of the schedule counted), and
        per rank ``busy_seconds`` and ``idle_seconds`` (the bound's). ``symbols`` (the
        stage traces' symbols with their meaning and value) and ``attention_flops_count``.

    Raises:
        SymcostError: an invalid pipeline (:func:`check_schedule`), fewer blocks than stages, a
            model without blocks.
    """
    from symcost.passes.parallel import model_state_bytes, step_counter_bytes

    check_schedule(schedule, pp, microbatches, virtual)
    order = schedule_order(schedule, pp, microbatches, virtual)  # PyTorch's refusals before any trace
    spec, ans = trace_stages(model, pp, virtual, precision, sizes, cache, inner, split)
    sim = simulate(order)
    n = pp * virtual
    values = spec.values(dict(sizes or {}))
    stacked = getattr(ans, "plan", None)  # (several stacks: passes.pipeline_stacks)
    blocks = [st.blocks for st in stacked] if stacked else stage_blocks(values["L"], n, split)
    shard = inner.shard if inner and inner.shard else "ddp"
    dp = int(values.get("DP", 1)) if inner and inner.shard else 1
    per_stage = {}
    for s in range(n):
        an = stage_analysis(ans, s, blocks)
        env = an.bind(**{**{k: v for k, v in values.items() if k in an.symbols or k in ("B", "S")},
                         **({} if stacked else {"L": blocks[s]})})
        ev = lambda e: int(sympy.sympify(e).xreplace(env))  # noqa: E731
        local, held = _rank_params(an)
        local_frozen, held_frozen = _rank_params(an, frozen=True)
        per_stage[s] = {"flops": ev(an.flops("train")), "flops_hardware": ev(an.flops("train", "hardware")),
                        "flops_forward": ev(an.flops("forward")),
                        "flops_backward": ev(an.flops("backward")), "saved": ev(_saved(an)),
                        "send": ev(an.comm_bytes("send")), "recv": ev(an.comm_bytes("recv")),
                        "params": ev(local), "params_held": ev(held),
                        # (requires_grad=False: held, no gradient or optimizer state; the tensors
                        # with a gradient each hold torch.optim's step counter)
                        "frozen": ev(local_frozen), "frozen_held": ev(held_frozen),
                        "steps": ev(step_counter_bytes(an, optimizer, precision)),
                        "params_model": {k: ev(getattr(an, k)) for k in
                                         ("params", "params_embedding", "params_nonembedding", "params_active")},
                        # (report --json's params_matmul: the P of 6·N·P, params_active_matmul)
                        "params_matmul": ev(an.train_simplified()[0]),
                        "totals": _stage_totals(an, ev),
                        # (the stage's p2p left out: on a mesh whose flattened group spans the fake
                        # world, FSDP2's dp_shard × cp, the world's send and receive carry its label)
                        **({"comm": {g: ev(an.comm_bytes("total", group=g) - an.comm_bytes("send", group=g)
                                           - an.comm_bytes("recv", group=g) if len(inner.traced_dims) > 1
                                           else an.comm_bytes("total") - an.comm_bytes("send") - an.comm_bytes("recv"))
                                     for g in inner.symbols}} if inner and inner.traced_dims else {})}
    ranks, extra, host = [], {}, {}
    offload = bool(inner and inner.offload)
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
        held = sum(per_stage[s]["params_held"] for s in mine)
        frozen = sum(per_stage[s]["frozen"] for s in mine)
        sharded = shard in ("fsdp", "zero3")
        states = model_state_bytes(params, dp, shard, precision, optimizer, held if sharded else None, frozen,
                                   sum(per_stage[s]["frozen_held"] for s in mine) if sharded else None)
        # torch.optim's 0-d step counters, one per parameter tensor with a gradient, unsharded
        # (:func:`symcost.passes.parallel.step_counter_bytes`; none under Megatron's or DeepSpeed's fused Adam)
        steps = sum(per_stage[s]["steps"] for s in mine)
        states["optimizer_state"] += steps
        states["total"] += steps
        # (beside the peak run's parameters and gradients; a policy's gradient buffer wider than the
        # traced gradients, Megatron's fp32 main_grad beside bf16 parameters, adds its difference)
        extra[r] = (int(states["optimizer_state"] + states["master"]), int(states["grads"]))
        if offload:  # FSDP2's CPU offload: the model states on the host, the optimizer steps there
            host[r] = {"params": int(states["params"]), "grads": int(states["grads"]),
                       "optimizer": int(states["optimizer_state"]), "master_weights": int(states["master"]),
                       "total": int(states["total"])}
            extra[r] = (0, 0)
        ranks.append({"rank": r, "stages": mine, "blocks": sum(blocks[s] for s in mine),
                      "flops": microbatches * sum(per_stage[s]["flops"] for s in mine),
                      "flops_hardware": microbatches * sum(per_stage[s]["flops_hardware"] for s in mine),
                      "in_flight": sim["in_flight"][r], "activations": top,
                      "send": microbatches * sum(per_stage[s]["send"] for s in mine),
                      "recv": microbatches * sum(per_stage[s]["recv"] for s in mine),
                      "params": params, "model_states": int(states["total"]),
                      "totals": _rank_totals([per_stage[s]["totals"] for s in mine], microbatches),
                      **({"host": host[r]} if offload else {})})
    if peak:
        from symcost.tracing.pipeline import rank_memory

        layers = None if stacked else ans["first"].layer_container or spec.layers
        for row in ranks:
            def run(rank=row["rank"]):
                return rank_memory(spec, values, layers, pp, schedule, microbatches, rank, virtual, precision, inner,
                                   split, stacks=stacked)
            try:
                if cache is not None:
                    # (the rank's run, tens of seconds at 70B, kept in the trace cache: the same
                    # request with the same sources reads it back)
                    from symcost.graph.cache import cached_result

                    request = {"rank_memory": 1, "values": dict(values), "layers": layers, "pp": pp,
                               "schedule": schedule, "microbatches": microbatches, "rank": row["rank"],
                               "virtual": virtual, "inner": repr(inner),
                               **({"stacks": repr(stacked)} if stacked else {}),
                               **({"split": repr(split)} if split is not None else {}),
                               "extra": {k: v for k, v in spec.extra.items()
                                         if isinstance(v, (str, int, float, bool, type(None)))}}
                    mem = cached_result(cache[0], cache[1] or {}, cache[2], precision, request, run)
                else:
                    mem = run()
            except SymcostError as e:  # (keyword inputs: hf: models) the peak is left out, and why
                row["memory_note"] = str(e)
                continue
            row["comm"] = comm_by_group(mem.pop("collectives"))
            if offload:  # (the copies as the schedule drives FSDP2: bytes per step, each way)
                row["transfer"] = mem.pop("transfers")
            if "activation_offload" in mem:  # (--offload-activations: the packed tensors in flight)
                row["activation_offload"] = mem.pop("activation_offload")
            row["memory"] = mem
            opt, grads = extra[row["rank"]]
            row["peak_with_optimizer"] = mem["peak"] + opt + max(0, grads - mem["grads"])
    L = SYMS["L"]
    v = sympy.Integer(virtual)
    formulas = {}
    for part, an in ans.items():
        sub = {L: L / (PP * v)}
        f = lambda e: sympy.factor_terms(sympy.expand(sympy.sympify(e).xreplace(sub)))  # noqa: E731
        formulas[part] = {"flops": f(an.flops("train")), "flops_hardware": f(an.flops("train", "hardware")),
                          "flops_forward": f(an.flops("forward")),
                          "flops_backward": f(an.flops("backward")), "saved": f(_saved(an)),
                          "send": f(an.comm_bytes("send")), "recv": f(an.comm_bytes("recv")),
                          "params": f(an.params)}
    m = sympy.Symbol("m", positive=True, integer=True)
    step = None
    if device is not None:
        step = price(ans, values, blocks, order, device, pp, microbatches, devices_per_node)
        from symcost.frontends.megatron import ENGINE

        dp_bytes = {row["rank"]: float(sum(b for g, d in row["comm"].items() if g not in ("PP", "TP")
                                           for b in d.values())) for row in ranks if "comm" in row}
        if spec.extra.get("dp_engine") == ENGINE:
            # (Megatron-LM accumulates the micro-batches' gradients in its buffer and reduces them
            # once per step, after the forward-backward (megatron/training.py train_step); the
            # fake run's stand-in engine, frontends.megatron.wrap_in_place, reduces at every
            # accumulation, m times: the stage traces' one micro-batch of DP bytes is the step's)
            dp_bytes = {}
        step["predicted"] = predict_price(ans, values, blocks, order, device, pp, microbatches, devices_per_node,
                                          mode, overlap, dp_bytes or None, megatron_args)
        for row in ranks:
            row["busy_seconds"], row["idle_seconds"] = step["busy"][row["rank"]], step["idle"][row["rank"]]
        if any("transfer" in row or "activation_offload" in row for row in ranks):
            from symcost.passes.offload import host_link

            _, bw = host_link(device)
            for row in ranks:
                if "transfer" in row:
                    row["transfer_seconds"] = max(row["transfer"].values()) / bw
                if "activation_offload" in row:  # (the packs in the forward, the unpacks in the backward)
                    a = row["activation_offload"]
                    a["seconds"] = {"forward": a["d2h"] / bw, "backward": a["h2d"] / bw}
    return {**({"step": step} if step else {}), "schedule": schedule, "engine": f"torch.distributed.pipelining.{SCHEDULES[schedule][0]}",
            "source": SCHEDULES[schedule][2], "pp": pp, "microbatches": microbatches, "virtual": virtual,
            "bubble": sim["bubble"], "bubble_formula": (PP - 1) / (v * m) if virtual > 1 else (PP - 1) / m,
            "formulas": formulas, "pinned": {part: dict(an.pinned) for part, an in ans.items()},
            "pin_reasons": {part: dict(getattr(an, "pin_reasons", None) or {}) for part, an in ans.items()},
            # (several stacks: each stage's blocks per stack and what crosses its boundaries)
            **({"stacks": [{"stage": st.index, "held": {c: list(r) for c, r in st.held}, "recv": list(st.recv),
                            "send": list(st.send)} for st in stacked]} if stacked else {}),
            "stages": per_stage, "ranks": ranks, "blocks": blocks,
            "divisible": (sum(blocks) if stacked else values["L"]) % n == 0, "split": split_words(split),
            "symbols": {k: {"meaning": mean, **({"value": int(values[k])} if k in values else {})}
                        for an in ans.values() for k, mean in an.symbols.items()},
            "attention_flops_count": getattr(_first(ans), "attention_count", "full")}


def _rank_params(an, frozen: bool = False) -> tuple:
    """``(P, held)``: the parameter elements of one rank of a stage trace before data-parallel
    sharding (the TP-local ones, :func:`symcost.passes.parallel.params_tp_local`) and those it
    holds (its FSDP2 shards; P without sharding). ``frozen``: those of the frozen parameters only
    (``requires_grad=False``: ``Analysis.frozen``)."""
    from symcost.frontends.layout import layout_of
    from symcost.passes.parallel import params_tp_local

    if getattr(an, "parallel", None) is None:
        return (an.params_frozen, an.params_frozen) if frozen else (an.params, an.params)
    if layout_of(an).ep_fsdp:  # (before FSDP2: the dense parameters whole, E/EP of each expert stack)
        from symcost.tracing.fit import SYMS

        ep = SYMS["EP"] if "EP" in an.symbols else an.pinned.get("EP", 1)
        before = sympy.Add(*[rep * sympy.Mul(*shape) / (ep if ".experts." in f".{name}" and shape
                                                        and sympy.simplify(shape[0] - SYMS["E"]) == 0 else 1)
                             for name, (shape, _, rep) in an.param_shapes.items()
                             if not frozen or name in an.frozen])
        return sympy.expand(before), (an.params_shard_frozen if frozen else an.params_shard)
    return params_tp_local(an, frozen), (an.params_shard_frozen if frozen else an.params_shard)


def comm_by_group(collectives) -> dict[str, dict[str, int]]:
    """``{group symbol: {kind: bytes}}`` of a rank's step from the c10d ops it dispatched
    (:func:`symcost.tracing.pipeline.rank_memory`'s ``collectives``): bytes each rank sends per
    step, ring algorithm (:func:`symcost.graph.rules.comm_volume`'s sizes and factors), an
    all-to-all with split sizes the rows it sends to other ranks (a sixth element, the bytes
    counted at dispatch); the point-to-point ops go to ``PP``, others without a mesh group to ``world``."""
    from symcost.graph.rules import COMM_OPS, RING_FACTOR

    out: dict[str, dict[str, int]] = {}
    for op, group, n, ins, outs, *sent in collectives:
        if op not in COMM_OPS or COMM_OPS[op][1] is None:
            continue
        kind, (side, pos) = COMM_OPS[op]
        sizes = ins if side == "in" else outs
        size = sum(sizes) if pos == "all" else sizes[pos]
        g = group or ("PP" if kind in P2P else "world")
        per = out.setdefault(g, {})
        # (an all-to-all with split sizes: the rows the rank sends to the others, as counted at
        # dispatch; ring attention's permute_tensor sends its whole input to one rank)
        per[kind] = per.get(kind, 0) + (sent[0] if sent and sent[0] is not None
                                        else int(round(RING_FACTOR[kind](n) * size)))
    return out


P2P = ("send", "recv")


def price(ans: Mapping[str, Any], values: Mapping[str, int], blocks: list[int], order: Mapping[int, list], device,
          pp: int, microbatches: int, devices_per_node: int | None = None, fused: bool = True) -> dict[str, Any]:
    """The pipeline step priced on ``device``: PyTorch's action lists (``order``) run on the
    dependency clock of :func:`~symcost.frontends.pipeline.simulate` with each stage's own times.

    A stage's forward (backward) time per micro-batch is its roofline seconds of that phase at
    its block count (:func:`symcost.passes.roofline.roofline` on the stage's trace, ``values`` with
    L = ``blocks[s]``) plus the bytes it sends in that phase (the activation forward, its
    gradient backward) over the link between pipeline ranks, on the critical path as in PTD-P's
    performance model (Narayanan et al. 2021 §3.2: point-to-point time per micro-batch and
    stage): the scale-up link when the PP ranks share a node (PP·DP·TP ≤ devices per node on
    torchtitan's mesh (pp, dp, tp), :func:`_links`), else the network (one NIC per device). One device per rank; the optimizer step is not timed (as
    ``report --dp --gpu``).

    Returns:
        ``stage_seconds`` {stage: {forward, backward, p2p}} (seconds per micro-batch, p2p
        included in the first two), ``step_seconds`` (the makespan, seconds), per rank ``busy``
        and ``idle`` seconds, ``bubble`` (idle / busy of the slowest rank at these times:
        PTD-P's t_pb / t_id priced; (PP − 1)/m for equal stages under GPipe and 1F1B),
        ``bubble_rank`` (that rank) and ``bubble_seconds`` (its idle time), ``busiest_rank`` (the
        rank with the most work, which sets the pace), ``model_flops`` (FLOPs of the step, all ranks),
        ``mfu`` (model FLOPs / (PP · peak FLOP/s · step seconds), the peak of the trace's training
        precision), ``link``, ``link_bandwidth`` (byte/s per direction), ``devices_per_node``, ``device`` (its key).

    Raises:
        SymcostError: a device without a peak for the trace's precision, or without the link
            bandwidth the pipeline's transfers need (an ``interconnect`` table).
    """
    from symcost.passes.roofline import roofline, training_precision

    ic = device.interconnect or {}
    per_node = devices_per_node or ic.get("devices_per_node") or pp
    link, bw = _links(device, pp, values, devices_per_node)["PP"]
    n = len(blocks)
    times, model_flops = {}, 0.0
    for s in range(n):
        an = stage_analysis(ans, s, blocks)
        env = {k: v for k, v in values.items() if k in an.symbols or k in ("B", "S")}
        env.update(_blocks_env(an, blocks[s]))
        r = roofline(an, device, env, fused=fused, with_formulas=False)
        bound = an.bind(**env)
        sent = {ph: float(sympy.sympify(an.comm_bytes("send", ph)).xreplace(bound)) for ph in ("forward", "backward")}
        times[s] = {ph: r["per_phase"].get(ph, {}).get("seconds", 0.0) + sent[ph] / bw for ph in ("forward", "backward")}
        times[s]["p2p"] = sum(sent.values()) / bw
        model_flops += float(r["model_flops"]) * microbatches
    sim = simulate(order, {s: t["forward"] for s, t in times.items()}, {s: t["backward"] for s, t in times.items()})
    slow = max(sim["busy"], key=lambda r: sim["idle"][r] / sim["busy"][r] if sim["busy"][r] else 0.0)
    peak, _ = device.peak_for(training_precision(_first(ans)))
    step = sim["makespan"]
    busiest = max(sim["busy"], key=sim["busy"].get)
    return {"stage_seconds": times, "step_seconds": step, "busy": sim["busy"], "idle": sim["idle"],
            "bubble": sim["bubble"], "bubble_rank": slow, "bubble_seconds": sim["idle"][slow],
            "busiest_rank": busiest, "model_flops": model_flops,
            "mfu": model_flops / (pp * peak * step) if step else 0.0, "link": link, "link_bandwidth": bw,
            "devices_per_node": per_node, "device": device.key}


def _links(device, pp: int, values: Mapping[str, int], devices_per_node: int | None) -> dict[str, tuple]:
    """``{"PP", "TP", "DP": (link name, byte/s per direction)}`` of a pipeline of ``pp`` ranks on
    torchtitan's mesh ``(pp, dp, tp)`` (tp innermost): a group whose ranks span ``s`` consecutive
    devices runs on the scale-up link when ``s`` fits in a node and divides it, else on the network
    (one NIC per device): TP spans tp, DP spans dp·tp, a pipeline neighbour pp·dp·tp.

    Raises:
        SymcostError: the device lists no bandwidth for a link the pipeline needs."""
    ic = device.interconnect or {}
    dp, tp = int(values.get("DP", 1)), int(values.get("TP", 1))
    per_node = devices_per_node or ic.get("devices_per_node") or pp * dp * tp

    def over(group: int, span: int):
        if group <= 1:
            return "none", float("inf")
        # (aligned groups of span ranks stay in a node when span divides it; all ranks when they fit in one)
        inside = span <= per_node and (per_node % span == 0 or pp * dp * tp <= per_node)
        key = "link_bandwidth" if inside else "network_bandwidth"
        if not ic.get(key):
            raise SymcostError(f"{device.key} lists no {key} for the pipeline's transfers; add an "
                               f"[{device.key}.interconnect] table with --devices-file")
        return ic.get("link" if key == "link_bandwidth" else "network", key.split("_")[0]), ic[key]

    return {"PP": over(pp, pp * dp * tp), "TP": over(tp, tp), "DP": over(dp, dp * tp)}


def predict_price(ans: Mapping[str, Any], values: Mapping[str, int], blocks: list[int], order: Mapping[int, list],
                  device, pp: int, microbatches: int, devices_per_node: int | None = None, mode: str = "eager",
                  overlap: str = "backward", dp_bytes: Mapping[int, float] | None = None,
                  megatron_args=None) -> dict[str, Any]:
    """The performance model's prediction of the pipeline step (docs/performance-model.md, "A
    pipeline rank"), beside :func:`price`'s bound; PyTorch's action lists (``order``) run on the
    dependency clock of :func:`~symcost.frontends.pipeline.simulate` with each stage's predicted
    times.

    Per stage and micro-batch, forward and backward (seconds):

    * compute: :func:`symcost.passes.performance.predict` on the stage's trace at its block count
      (GEMM efficiency by shape, memory-bound ops at the achievable bandwidth; ``mode`` eager: a
      host's work per aten op, compiled: a launch per fused kernel), plus each phase's kernel boundaries
      and the host time the device does not hide (``phase_overhead``, as :func:`~symcost.passes.performance.predict_dp`
      adds it);
    * the stage's tensor-parallel collectives (group TP): α–β, bytes per rank (ring) over the TP
      link + ``collective_latency`` per ring step (2(TP−1) an all-reduce, TP−1 the others:
      Thakur et al. 2005), exposed: each sits between the ops that make and use its tensor
      (Shoeybi et al. 2019 §3), as ``report --dp --tp --gpu`` prices them;
    * its point-to-point sends: ``collective_latency`` + bytes / β over the link to the next
      pipeline rank, on the critical path (Narayanan et al. 2021 §3.2), as :func:`price` adds them.

    Per rank, after its last action: its data-parallel collectives of the step (``dp_bytes[r]``,
    bytes it sends per step, as the run of PyTorch's schedule counted them; without it, one
    micro-batch's DP bytes of its stages' traces, once per step, as DDP reduces under
    ``PipelineStage`` and Megatron-LM after its forward-backward) over the DP link, hidden as ``overlap`` says (``none``: all exposed;
    ``backward``: under its last backward action, where DDP's buckets and FSDP2's reduce-scatter
    run; ``full``: under its busy time), then the AdamW (foreach) step over its stages'
    parameters (``optimizer_per_tensor`` x tensors + ``optimizer_per_byte`` x bytes). The step is
    the latest rank's end (the next step's first forward waits on every rank's optimizer). Under
    Megatron-LM's engine each rank also runs Megatron's per-iteration work over its chunks
    (:mod:`symcost.passes.megatron_iteration`, with ``megatron_args``: the run's flags, its
    defaults when None) after the optimizer step, the loss checks in the last stage's forward of
    every micro-batch (``megatron_iteration`` {rank: totals}).

    Returns:
        ``step_seconds`` (predicted), ``mode``, ``overlap``, ``stage_seconds`` {stage:
        {forward, backward, p2p, tp_comm}} (per micro-batch; p2p and tp_comm included in the
        first two), per rank ``busy``, ``idle`` (to the step's end), ``finish`` (its last action),
        ``dp_seconds``, ``dp_exposed`` and ``optimizer`` seconds, ``bubble`` (idle / busy of the
        slowest rank at these times, before the data-parallel and optimizer tail), ``mfu_predicted``
        (model FLOPs of the step, all ranks / (PP · peak · step)), ``links`` {PP, TP, DP: name},
        ``calibrated`` and ``defaulted`` (:func:`~symcost.passes.performance.predict`'s).

    Raises:
        SymcostError: an unknown overlap or mode, a device without a peak for the trace's
            precision or without a link the pipeline uses.
    """
    from symcost.graph.totals import comm_group
    from symcost.passes import megatron_buckets as mb
    from symcost.passes.megatron_buckets import is_megatron_engine
    from symcost.passes.parallel import OVERLAPS
    from symcost.passes.performance import efficiency_of, predict
    from symcost.passes.roofline import _num, training_precision

    if overlap not in OVERLAPS:
        raise SymcostError(f"unknown --overlap {overlap!r}; accepted: {', '.join(OVERLAPS)}")
    eff = efficiency_of(device)
    links = _links(device, pp, values, devices_per_node)
    dp, tp = int(values.get("DP", 1)), int(values.get("TP", 1))
    alpha = eff.collective_latency

    def steps(kind: str, n: int) -> int:
        return 2 * (n - 1) if kind == "all_reduce" else 1 if kind in P2P else n - 1

    n = len(blocks)
    times, opt, dp_trace, model_flops, first = {}, {}, {}, 0.0, None
    chunks = {}  # stage -> (analysis, sizes, buckets) under Megatron's engine (its per-iteration work)
    for s in range(n):
        an = stage_analysis(ans, s, blocks)
        env = {k: v for k, v in values.items() if k in an.symbols or k in ("B", "S")}
        env.update(_blocks_env(an, blocks[s]))
        p = predict(an, device, env, mode=mode)
        first = first or p
        bound = an.bind(**env)
        t = {"forward": p["phase_overhead"]["forward"], "backward": p["phase_overhead"]["backward"], "p2p": 0.0,
             "tp_comm": 0.0}  # (each phase's kernel boundaries and host time the device does not hide: performance.predict)
        for node in p["nodes"]:
            t["forward" if node["phase"] == "forward" else "backward"] += node["seconds"]
        dp_trace[s] = 0.0
        buckets = None
        if dp > 1 and is_megatron_engine(an):
            # Megatron's buckets (passes/megatron_buckets.py) in place of the stage trace's all-reduce
            # per gradient; bucketed only on the first pipeline rank's first model chunk (stage 0:
            # pp_rank > 0 and disable_bucketing for chunks after the first keep one bucket per buffer)
            buckets = mb.engine(an, bound, {"DP": dp}, overlap, bucketing=s == 0)
            dp_trace[s] = (sum(buckets["by_group"].values()) / links["DP"][1]
                           + sum(sum(d.values()) for d in buckets["latency_steps"].values()) * alpha)
        if is_megatron_engine(an):
            chunks[s] = (an, bound, buckets)
        for op in an.ops:
            ph = "forward" if op.phase == "forward" else "backward"
            rep = _num(op.repeat, bound)
            if op.comm is None:
                continue
            kind, nbytes = op.comm[0], rep * float(sympy.sympify(op.comm[2]).xreplace(bound))
            group = "PP" if kind in P2P else comm_group(an, op)
            if kind == "send":
                x = nbytes / links["PP"][1] + rep * alpha
                t[ph] += x
                t["p2p"] += x
            elif group == "TP" and kind not in P2P + ("wait",):
                x = nbytes / links["TP"][1] + rep * steps(kind, tp) * alpha
                t[ph] += x
                t["tp_comm"] += x
            elif kind not in P2P + ("wait",) and buckets is None:
                dp_trace[s] += nbytes / links["DP"][1] + rep * steps(kind, dp) * alpha
        times[s] = t
        opt[s] = p["terms"]["optimizer"]
        if buckets and "optimizer_shard" in buckets:  # (Megatron's distributed optimizer: over the stage's shard)
            from symcost.passes.performance import host_stretches

            sh = buckets["optimizer_shard"]
            opt[s] = host_stretches({}, {}, eff.optimizer_per_tensor * sh["tensors"],
                                    eff.optimizer_per_byte * sh["param_bytes"], p["host_async"])["optimizer"]
        model_flops += float(p["model_flops"]) * microbatches
    iteration = {}
    if chunks:  # Megatron-LM's per-iteration work per rank (passes/megatron_iteration.py): one optimizer
        # over the rank's chunks; the loss checks in the last stage's forward, each micro-batch
        from symcost.passes import megatron_iteration as mi

        flags = mi.parse_args(megatron_args) if not isinstance(megatron_args, Mapping) else {**mi.DEFAULTS, **megatron_args}
        for r, acts in order.items():
            mine = sorted({s for _, s, _ in acts})
            parts = [chunks[s] for s in mine if s in chunks]
            if parts:
                last = n - 1 in mine
                iteration[r] = mi.price(mi.work(parts[0][0], parts[0][1], {"DP": dp, "TP": tp, "PP": pp,
                                                                           "ranks": dp * tp * pp},
                                                parts[0][2], flags, parts[1:], last_stage=last),
                                        device, microbatches, flags)
                if last:
                    times[n - 1]["forward"] += iteration[r]["per_micro_batch"]
                # (the main-gradient adds in each chunk's backward, every micro-batch: by its trained elements)
                share = {s: sum(x for _, x in mb._expanded(chunks[s][0], chunks[s][1])) for s in mine if s in chunks}
                for st, e in share.items():
                    times[st]["backward"] += iteration[r]["per_micro_batch_backward"] * e / max(1, sum(share.values()))
    sim = simulate(order, {s: t["forward"] for s, t in times.items()}, {s: t["backward"] for s, t in times.items()})
    ends, dp_s, exposed, opt_r = {}, {}, {}, {}
    for r, acts in order.items():
        mine = sorted({s for _, s, _ in acts})
        if dp_bytes is not None and r in dp_bytes:
            dp_s[r] = dp_bytes[r] / links["DP"][1] if dp > 1 else 0.0
            dp_s[r] += sum(_dp_latency(stage_analysis(ans, s, blocks), values, blocks[s], dp, alpha) for s in mine)
        else:
            dp_s[r] = sum(dp_trace[s] for s in mine)
        last = next((times[s]["backward"] for kind, s, _ in reversed(acts) if kind in ("B", "I")), 0.0)
        hide = {"none": 0.0, "backward": last, "full": sim["busy"][r]}[overlap]
        exposed[r] = max(0.0, dp_s[r] - hide)
        opt_r[r] = sum(opt[s] for s in mine)
        if r in iteration:  # (after the optimizer's inner step: once per optimizer step)
            opt_r[r] += iteration[r]["seconds"] - microbatches * (iteration[r]["per_micro_batch"]
                                                                  + iteration[r]["per_micro_batch_backward"])
        ends[r] = sim["finish"][r] + exposed[r] + opt_r[r]
    step = max(ends.values())
    peak, _ = device.peak_for(training_precision(_first(ans)))
    return {"step_seconds": step, "mode": mode, "overlap": overlap, "stage_seconds": times,
            "busy": sim["busy"], "idle": {r: step - sim["busy"][r] for r in sim["busy"]}, "finish": sim["finish"],
            "dp_seconds": dp_s, "dp_exposed": exposed, "optimizer": opt_r, "bubble": sim["bubble"],
            **({"megatron_iteration": {r: {k: v for k, v in it.items() if k != "items"} for r, it in iteration.items()}}
               if iteration else {}),
            "model_flops": model_flops, "mfu_predicted": model_flops / (pp * peak * step) if step else 0.0,
            "links": {k: v[0] for k, v in links.items()}, "calibrated": first["calibrated"],
            "defaulted": first["defaulted"]}


def _dp_latency(an, values: Mapping[str, int], blocks: int, dp: int, alpha: float) -> float:
    """α of one step's data-parallel collectives of a stage: its trace's DP collectives (one
    micro-batch's, as DDP and FSDP2's reduce-scatter issue them once per step under the schedule)
    times their ring steps times ``alpha``."""
    from symcost.graph.totals import comm_group
    from symcost.passes.roofline import _num

    if dp <= 1:
        return 0.0
    env = {k: v for k, v in values.items() if k in an.symbols or k in ("B", "S")}
    bound = an.bind(**{**env, **_blocks_env(an, blocks)})
    out = 0.0
    for op in an.ops:
        if op.comm is None or op.comm[0] in P2P + ("wait",) or comm_group(an, op) == "TP":
            continue
        out += _num(op.repeat, bound) * (2 * (dp - 1) if op.comm[0] == "all_reduce" else dp - 1) * alpha
    return out
