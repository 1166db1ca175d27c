"""Data-parallel training per rank: collective bytes and model-state memory of one rank
(docs/parallel.md).

The collectives come from the traced graph (``Analysis.comm_bytes``: every all-gather,
reduce-scatter and all-reduce PyTorch's engine dispatched, ring bytes per rank). The model
states (parameters, gradients, optimizer state, master weights) follow the precision policy
(:mod:`symcost.passes.memory.policies`) and what the strategy shards: Rajbhandari et al. 2020,
"ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", section 5 and Table 1:
with Ψ parameters, K bytes of optimizer state per parameter and N_d ranks, per rank

* DDP (baseline): (2 + 2 + K)·Ψ
* ZeRO-1 (P_os): 2Ψ + 2Ψ + K·Ψ/N_d
* ZeRO-2 (P_os+g): 2Ψ + (2 + K)·Ψ/N_d
* ZeRO-3 (P_os+g+p), FSDP: (2 + 2 + K)·Ψ/N_d

here with the policy's bytes in place of 2, 2 and K (mixed precision with fp32 master weights
and Adam, ``bf16-true-fp32-master``, ``deepspeed-fp16``, ``deepspeed-bf16``: 2, 2 and 4 + 4·2 = 12,
the paper's numbers; Megatron-LM's ``--use-distributed-optimizer`` shards what ZeRO-1 shards:
``megatron-bf16`` with ``zero1`` is its 2 + 4 + 12/DP, docs/memory.md). For FSDP/ZeRO-3
traced with ``fully_shard`` the elements a rank holds are the traced DTensor shards
(``Analysis.params_shard``, P/DP where DP divides the sharded dims); ZeRO-1 and ZeRO-2 are
memory policies (DeepSpeed partitions flat buffers evenly: P/DP).
"""
from __future__ import annotations

import math
from typing import Any, Mapping

import sympy

from symcost.errors import SymcostError
from symcost.frontends.layout import layout_of
from symcost.frontends.parallel import SHARDS
from symcost.graph.ops import COMM_KINDS
from symcost.passes.memory.states import (SHARDED, model_state_bytes, optimizer_share, params_tp_local,  # noqa: F401
                                         shard_degree, step_counter_bytes)  # (re-exported)
from symcost.passes.memory.states import grads_traced
from symcost.passes.memory.policies import policy as get_policy
from symcost.tracing.fit import SYMS
from symcost.passes.accumulation import overlapped  # noqa: F401  (re-exported: the overlap rule)
from symcost.passes import megatron_buckets as mb
from symcost.passes.megatron_buckets import is_megatron_engine

def _units(an) -> list[str]:
    """The FSDP2 units of a ``fully_shard`` trace (folded module names; ``""`` the root), longest
    first: the modules its all-gathers and reduce-scatters belong to."""
    from symcost.graph.totals import comm_group

    return sorted({op.module for op in an.ops if op.comm is not None and op.comm[0] in ("all_gather", "reduce_scatter")
                   and comm_group(an, op) == "DP"}, key=len, reverse=True)


def _owner(name: str, units: list[str]) -> str | None:
    return next((u for u in units if u == "" or name.startswith(u + ".")), None)


def padded(an, env: Mapping) -> dict[str, Any]:
    """Exact per-rank values at concrete sizes ``env`` (symbol -> int) with FSDP2's padding:
    ``fully_shard`` gives every rank ``ceil(d0/DP)`` rows of a parameter with ``d0`` rows
    (``torch.chunk``, the last ranks padded; torch/distributed/fsdp/_fully_shard/_fsdp_param.py),
    so a unit's all-gather and reduce-scatter move ``DP·Σ ceil(d0/DP)·rest`` elements, not the
    ``Σ d0·rest`` of the fitted formulas (equal where DP divides every d0). On the 2-D mesh
    (``--tp``) ``d0`` and ``rest`` are the TP-local shape (FSDP2 shards the TP shard); under HSDP
    ``DP`` is the ``dp_shard`` group's DP/R, and the gradient all-reduce over ``dp_replicate``
    moves the padded shards too. Collectives of the TP group are not padded. Where TP does not
    divide a dimension, rank 0's TP-local size is ``ceil(d/TP)`` (DTensor's ``Shard``, as
    ``torch.chunk``).

    Returns:
        ``params_shard`` (elements rank 0 holds; ``params_shard_frozen`` those of its frozen
        parameters, ``requires_grad=False``) and ``comm`` {kind: bytes per rank, ring},
        each a sympy Rational/Integer; for a ``replicate`` (DDP) trace, the formulas evaluated;
        ``by_group`` {(group label, phase): bytes per rank}, the same bytes by the process group
        each collective runs over (``"DP"``, ``"TP"``, ``"CP"``, ``"EP"``, ``"DP_expert"``,
        ``"DP_replicate"``) and phase (``"forward"``, ``"backward"``: the optimizer's with it).
    """
    from symcost.graph.totals import comm_group

    env = {SYMS[str(k)] if not isinstance(k, sympy.Symbol) else k: v for k, v in env.items()}
    if layout_of(an).ep_fsdp and not layout_of(an).ep_replicate:
        return _padded_ep(an, env)
    dp = shard_degree(an, env.get(SYMS["DP"], an.pinned.get("DP", 1)))
    comm = {k: sympy.Integer(0) for k in COMM_KINDS if k != "broadcast"}
    if SHARDS.get(an.parallel, ("none",))[0] != "fully_shard":  # (replicate, or no DP engine: nothing padded)
        for k in comm:
            comm[k] = sympy.sympify(an.comm_bytes(k)).xreplace(env)
        return {"params_shard": sympy.sympify(an.params_shard).xreplace(env), "comm": comm,
                "params_shard_frozen": sympy.sympify(an.params_shard_frozen).xreplace(env),
                "by_group": _by_group(an, env)}
    # On the 2-D mesh FSDP2 shards each parameter's TP-local tensor (its rows: the fitted shard's
    # first dimension times the shard group's size), under HSDP over the dp_shard group (DP/R).
    local = bool(getattr(an, "tensor_parallel", None)) or layout_of(an).hsdp
    shards = getattr(an, "param_shards", None) or {}
    units = _units(an)
    whole: dict[str, Any] = {u: 0 for u in units}
    pad: dict[str, Any] = {u: 0 for u in units}
    shard = fshard = 0
    frozen = set(getattr(an, "frozen", ()) or ())
    for name, (shape, _, rep) in an.param_shapes.items():
        if local and name in shards:
            sh = shards[name][0]
            dims = [sympy.sympify(d).xreplace(env) for d in sh]
            dims = [sympy.sympify(d) for d in ([dims[0] * dp] + dims[1:] if dims else dims)]
            # where TP does not divide a dimension, DTensor's Shard chunks it as torch.chunk does:
            # rank 0 (the traced rank) holds ceil(d/TP) of it
            dims = [int(sympy.ceiling(d)) for d in dims]
        else:
            dims = [int(sympy.sympify(d).xreplace(env)) for d in shape]
        r = int(sympy.sympify(rep).xreplace(env))
        rest = math.prod(dims[1:])
        rows = -(-dims[0] // dp) if dims else 1
        u = _owner(name, units)
        if u is not None:
            whole[u] += r * math.prod(dims)
            pad[u] += r * dp * rows * rest
        shard += r * rows * rest
        if name in frozen:
            fshard += r * rows * rest
    by_group: dict[tuple[str, str], Any] = {}
    for op in an.ops:
        if op.comm is None or op.comm[0] not in comm:
            continue
        n = int(sympy.sympify(op.repeat).xreplace(env))
        val = sympy.sympify(op.comm[2]).xreplace(env)
        # FSDP2's collectives (over dp_shard, and HSDP's all-reduce of the padded gradient shards
        # over dp_replicate) move the padded rows; the TP group's move activations
        u = op.module if op.module in whole and comm_group(an, op) in ("DP", "DP_replicate") else None
        if u is not None and whole[u]:  # every unit a folded op stands for pads alike
            val = val * sympy.Rational(pad[u], whole[u])
        comm[op.comm[0]] += n * val
        _add(by_group, an, op, n * val)
    return {"params_shard": sympy.Integer(shard), "params_shard_frozen": sympy.Integer(fshard), "comm": comm,
            "by_group": by_group}


def _add(by_group: dict, an, op, nbytes) -> None:
    """``by_group[(group, phase)] += nbytes`` for collective ``op`` (the optimizer's with the
    backward)."""
    from symcost.graph.totals import comm_group

    key = (comm_group(an, op), "forward" if op.phase == "forward" else "backward")
    by_group[key] = by_group.get(key, 0) + nbytes


def _by_group(an, env: Mapping) -> dict[tuple[str, str], Any]:
    """``{(group, phase): bytes per rank}`` of every collective of ``an`` at ``env``, unpadded."""
    out: dict[tuple[str, str], Any] = {}
    for op in an.ops:
        if op.comm is not None and op.comm[0] in COMM_KINDS and op.comm[0] != "broadcast":
            _add(out, an, op, sympy.sympify(op.repeat).xreplace(env) * sympy.sympify(op.comm[2]).xreplace(env))
    return out


def _padded_ep(an, env: Mapping) -> dict[str, Any]:
    """:func:`padded` of expert parallelism under FSDP2 (docs/parallel.md §14.6): each parameter's
    traced shard (the dense ones' rows over DP·EP ranks, DP·EP/TP of their TP-local rows under
    ``--tp``, §14.9; the experts' local ``[E/EP, ...]`` over DP
    on the dimension the layout names) evaluated at ``env`` with every split dimension rounded up
    (rank 0 holds the first, largest chunk, as ``torch.chunk``); a unit's all-gather and
    reduce-scatter move its group's size times its padded shard, so each of its collectives is
    scaled by padded / whole elements (the unit's group: ``DP_expert`` for the experts modules,
    ``DP`` for the rest)."""
    from symcost.graph.totals import comm_group

    lay = layout_of(an)
    size = {g: int(sympy.sympify(lay.group_size(g, lambda x: env.get(SYMS[x], an.pinned.get(x, 1))))) for g in ("DP", "DP_expert")}
    shards = getattr(an, "param_shards", None) or {}
    units = sorted({op.module for op in an.ops if op.comm is not None and op.comm[0] in ("all_gather", "reduce_scatter")
                    and comm_group(an, op) in size}, key=len, reverse=True)
    group_of = {op.module: comm_group(an, op) for op in an.ops if op.comm is not None and op.module in units
                and comm_group(an, op) in size}
    whole = {u: 0 for u in units}
    pad = {u: 0 for u in units}
    shard = fshard = 0
    frozen = set(getattr(an, "frozen", ()) or ())
    for name, (shape, _, rep) in an.param_shapes.items():
        sh = shards.get(name, (shape,))[0]
        local = math.prod(int(sympy.ceiling(sympy.sympify(d).xreplace(env))) for d in sh)
        r = int(sympy.sympify(rep).xreplace(env))
        shard += r * local
        if name in frozen:
            fshard += r * local
        u = _owner(name, units)
        if u is not None:
            # (what the fitted collectives move: the group's size times the exact shard, the unit's
            # TP-local (and EP-local) elements; FSDP2 moves the group's size times the padded one)
            whole[u] += r * size[group_of[u]] * math.prod(sympy.sympify(d).xreplace(env) for d in sh)
            pad[u] += r * size[group_of[u]] * local
    comm = {k: sympy.Integer(0) for k in COMM_KINDS if k != "broadcast"}
    by_group: dict[tuple[str, str], Any] = {}
    for op in an.ops:
        if op.comm is None or op.comm[0] not in comm:
            continue
        n = int(sympy.sympify(op.repeat).xreplace(env))
        val = sympy.sympify(op.comm[2]).xreplace(env)
        u = op.module if op.module in whole and comm_group(an, op) in size else None
        if u is not None and whole[u] and comm_group(an, op) == group_of[u]:
            val = val * pad[u] / sympy.nsimplify(whole[u])
        comm[op.comm[0]] += n * val
        _add(by_group, an, op, n * val)
    return {"params_shard": sympy.Integer(shard), "params_shard_frozen": sympy.Integer(fshard), "comm": comm,
            "by_group": by_group}


def rank_peak(an, precision: str | None = None, optimizer: str = "adamw", sizes: Mapping[str, int] | None = None,
              impl: str = "default", device: str = "cuda") -> dict[str, Any]:
    """The peak memory of one rank of a data-parallel trace, from the traced storage schedule
    (:class:`~symcost.passes.memory.MemoryModel`: every storage the rank allocates and frees,
    FSDP2's unsharded parameters and collective buffers included, folded over L; docs/parallel.md
    "The rank's peak"), on top of the rank's model states (:func:`model_state_bytes`).

    Returns:
        ``formula`` (the peak in the symbols and DP, a sympy expression, ``Max`` where the live
        set that peaks depends on the sizes), ``where`` and ``parts`` (bytes by part, adding up to
        the peak: :meth:`~symcost.passes.memory.MemoryModel.peak_parts`) and ``value`` (bytes) at
        ``sizes`` (the model's defaults where not given); ``error`` (and nothing else) where the
        trace has no schedule.

    Raises:
        SymcostError: bad sizes or options.
    """
    from symcost.passes.memory import memory_model

    try:
        mm = memory_model(an, precision, optimizer, impl, device)
    except SymcostError as e:
        if an.schedule is not None and an.schedule.error:
            return {"error": str(e)}
        raise
    parts = mm.peak_parts(**dict(sizes or {}))
    return {"formula": mm.peak_expr(), "value": parts["peak"], "where": parts["where"],
            "parts": {k: v for k, v in parts.items() if k not in ("peak", "where")}}


def rank_parts(an, dim: str, precision: str | None = None, optimizer: str = "adamw",
               sizes: Mapping[str, int] | None = None, impl: str = "default", device: str = "cuda") -> dict[str, Any]:
    """What every one-rank summary of a model-parallel trace shares (``--tp``:
    :func:`symcost.passes.tensor_parallel.summary`; ``--ep``:
    :func:`symcost.passes.expert_parallel.summary`): ``comm`` (bytes one rank sends per step by
    collective kind and ``total``, from the traced collectives), ``memory`` (model states of the
    rank's parameter elements, :func:`model_state_bytes` with nothing sharded over DP, its
    ``grads`` under ``--tp`` the traced ones, :func:`grads_traced`: PyTorch keeps the
    vocabulary-parallel embedding's gradient whole, ``[V, d]``; a policy's persistent gradient
    buffer, Megatron-LM's main_grad, is the shards'; and ``activations``: bytes autograd saves
    on the rank), ``peak`` (:func:`rank_peak`); with
    ``sizes`` also ``values`` (``comm`` and ``memory`` as numbers, and the mesh size ``dim``
    under its lower-case name, e.g. ``tp``)."""
    from symcost.graph.ops import COMM_KINDS

    comm = {k: an.comm_bytes(k) for k in COMM_KINDS if k != "broadcast"}
    comm["total"] = an.comm_bytes("total")
    mem = model_state_bytes(an.params_shard, 1, "ddp", precision or an.precision, optimizer,
                            frozen=an.params_shard_frozen)
    pol = get_policy(precision or an.precision)
    held = grads_traced(an) if dim == "TP" and not pol.grad_buffer else None
    if held is not None:  # (the vocabulary-parallel embedding's gradient is kept whole: grads_traced)
        grads = sympy.expand(pol.grad * held)
        mem["total"], mem["grads"] = sympy.expand(mem["total"] - mem["grads"] + grads), grads
    _add_steps(mem, step_counter_bytes(an, optimizer, precision or an.precision))
    mem["activations"] = sympy.expand(sympy.Add(*[rep * nb for _, nb, _, rep in an.saved]))
    out = {"comm": comm, "memory": mem, "peak": rank_peak(an, precision, optimizer, sizes, impl, device)}
    if sizes is not None:
        env = an.bind(**sizes)
        out["values"] = {
            "comm": {k: sympy.sympify(v).xreplace(env) for k, v in comm.items()},
            "memory": {k: sympy.sympify(v).xreplace(env) for k, v in mem.items()},
            dim.lower(): env.get(sympy.Symbol(dim, positive=True, integer=True), an.pinned.get(dim)),
        }
    return out


def _add_steps(mem: dict, steps) -> None:
    """``steps`` (:func:`step_counter_bytes`) into ``mem``'s ``optimizer_state`` and ``total``."""
    if steps != 0:
        mem["optimizer_state"] = sympy.expand(mem["optimizer_state"] + steps)
        mem["total"] = sympy.expand(mem["total"] + steps)


def summary(an, precision: str | None = None, optimizer: str = "adamw",
            sizes: Mapping[str, int] | None = None, impl: str = "default", device: str = "cuda") -> dict[str, Any]:
    """One rank of a data-parallel trace (``symcost.trace(..., shard=...)``): formulas in the
    symbols and ``DP``.

    Returns:
        ``shard``, ``engine`` (what was traced) and ``label`` (what is sharded),
        ``comm`` (``all_gather``, ``reduce_scatter``, ``all_reduce``, ``total``: bytes each rank
        sends, equal to those it receives, per step, ring algorithm), ``memory`` (per-rank
        model states, :func:`model_state_bytes`, ``optimizer_state`` and ``total`` with the
        optimizer's step counters, :func:`step_counter_bytes`, plus ``activations``: the bytes
        autograd saves on the rank, from the trace), ``peak`` (:func:`rank_peak`: the rank's peak memory, its
        formula, and its value, place and parts at ``sizes`` or the defaults); with ``sizes``,
        also ``values``: the same at those sizes, exact with FSDP2's padding (:func:`padded`)
        where DP does not divide a dimension (the peak is exact where it divides).

    Raises:
        SymcostError: ``an`` is no data-parallel trace.
    """
    if an.parallel is None:
        raise SymcostError("this trace is of one device; trace with --dp N (shard=...) for data parallelism")
    shard = an.parallel
    DP = sympy.Symbol("DP", positive=True, integer=True) if "DP" in an.symbols else an.pinned.get("DP", 1)
    comm = {k: an.comm_bytes(k) for k in COMM_KINDS if k != "broadcast"}
    comm["total"] = an.comm_bytes("total")
    traced_shards = SHARDS[shard][0] == "fully_shard" and "params" in SHARDED[shard]
    mesh2 = getattr(an, "tensor_parallel", None)
    P = params_tp_local(an)  # what the data-parallel engine holds (the TP-local parameters on the 2-D mesh)
    mem = model_state_bytes(P, shard_degree(an, DP), shard, precision or an.precision, optimizer,
                            an.params_shard if traced_shards else optimizer_share(an, DP),
                            params_tp_local(an, frozen=True),
                            an.params_shard_frozen if traced_shards else optimizer_share(an, DP, frozen=True))
    steps = step_counter_bytes(an, optimizer, precision or an.precision)
    _add_steps(mem, steps)
    mem["activations"] = sympy.expand(sympy.Add(*[rep * nb for _, nb, _, rep in an.saved]))
    engine, reshard, label = SHARDS[shard]
    engine = {"replicate": "torch.distributed._composable.replicate_with_fsdp.replicate (DDP) per block",
              "fully_shard": f"torch.distributed.fsdp.fully_shard(reshard_after_forward={reshard}) per block"}[engine]
    mp = layout_of(an).fsdp_mp
    from symcost.frontends.megatron import is_megatron

    if SHARDS[shard][0] == "replicate" and not mp and is_megatron(an.precision):
        # (a megatron-* policy traces Megatron-LM's engine, not PyTorch's replicate:
        # frontends.parallel.wrap with engine="megatron-ddp")
        engine = ("Megatron-LM's DistributedDataParallel (parameters used in place, each gradient all-reduced "
                  "once accumulated: symcost.frontends.megatron.wrap_in_place)")
    if mp:
        from symcost.frontends.parallel import MP_DTYPES

        engine += (f", MixedPrecisionPolicy(param_dtype=torch.{MP_DTYPES[mp[0]]}, "
                   f"reduce_dtype=torch.{MP_DTYPES[mp[1]]})")
    if mesh2:
        dp_dim = ("(dp_replicate, dp_shard)" if layout_of(an).hsdp
                  else next(d for d in layout_of(an).dims if d.startswith("dp")))
        engine = ("torch.distributed.tensor.parallel.parallelize_module (Megatron plan"
                  + (", SequenceParallel norms" if mesh2 == "tp+sp" else "") + ") over the mesh's tp dimension, then "
                  + engine + f" over its {dp_dim} dimension" + ("s" if layout_of(an).hsdp else ""))
    elif layout_of(an).hsdp:
        engine += " over the 2-D mesh (dp_replicate, dp_shard) (HSDP)"
    if layout_of(an).offload:
        engine += ", CPUOffloadPolicy() (parameters, gradients and optimizer state on the host)"
    if layout_of(an).ep_replicate:  # (docs/parallel.md §14.11)
        engine = ("experts as Shard(0) DTensors over the ep mesh, tokens by all_to_all_single (torchtitan's "
                  "AllToAllTokenDispatcher), then " + engine.replace(" per block", "")
                  + ": the experts' gradients all-reduced over the DP ranks holding the same experts (DP_expert: "
                  "Megatron's expert-data-parallel group), the rest's over "
                  + ("dp_replicate × ep_rest (DP·EP/TP ranks, beside tp)" if layout_of(an).tp
                     else "dp_replicate × ep (DP·EP ranks: Megatron's data-parallel group)"))
    elif layout_of(an).ep_fsdp:  # (docs/parallel.md §14.6)
        engine = ("experts as Shard(0) DTensors over the ep mesh, tokens by all_to_all_single (torchtitan's "
                  "AllToAllTokenDispatcher), then per block " + engine.replace(" per block", "")
                  + f": each experts module over dp_shard (DP ranks, Shard({layout_of(an).experts_shard or 0}) of "
                  "the local experts), the rest over "
                  + ("dp_shard × ep_rest (DP·EP/TP ranks, beside tp: §14.9)" if layout_of(an).tp
                     else "dp_shard × ep (DP·EP ranks)") + ", as torchtitan's apply_fsdp")
    out = {"shard": shard, "engine": engine, "label": label, "comm": comm, "memory": mem,
           "peak": rank_peak(an, precision, optimizer, sizes, impl, device)}
    if layout_of(an).offload:  # host bytes and host<->device copies (symcost.passes.offload)
        from symcost.passes.memory import memory_model
        from symcost.passes.offload import summary as offload_summary

        out["offload"] = offload_summary(an, memory_model(an, precision, optimizer, impl, device), sizes)
    if mesh2:
        out["tensor_parallel"] = mesh2
    if layout_of(an).ep_fsdp:  # (the rank's parameter elements: P/(DP·EP), docs/parallel.md §14.6)
        out["params_rank"] = an.params_shard
    if mesh2 or layout_of(an).hsdp or layout_of(an).ep_fsdp:
        out["comm_by_group"] = {g: {**{k: an.comm_bytes(k, group=g) for k in COMM_KINDS if k != "broadcast"},
                                    "total": an.comm_bytes("total", group=g)} for g in layout_of(an).group_labels}
    if sizes is not None:
        env = an.bind(**sizes)
        ev = padded(an, env)
        vcomm = dict(ev["comm"])
        vcomm["total"] = sum(vcomm.values())
        dp = env.get(SYMS["DP"], an.pinned.get("DP", 1))
        ep = int(env.get(SYMS["EP"], an.pinned.get("EP", 1))) if layout_of(an).ep_fsdp else None
        P = int(sympy.sympify(P).xreplace(env))
        Pf = int(sympy.sympify(params_tp_local(an, frozen=True)).xreplace(env))
        # DeepSpeed's ZeRO-1/2 partitions pad the flat buffer of the trainable parameters to a
        # multiple of DP: ceil(P_train/DP) each (under EP with DDP / Megatron's distributed
        # optimizer: the whole model's over DP·EP, §14.11); the frozen ones are in no partition
        if traced_shards:
            share, fshare = ev["params_shard"], ev.get("params_shard_frozen", 0)
        else:
            fshare = 0
            share = int(sympy.ceiling(sympy.sympify(optimizer_share(an, dp, ep) - optimizer_share(an, dp, ep, frozen=True))
                                      .xreplace(env)))
        vmem = model_state_bytes(P, shard_degree(an, dp, ep), shard, precision or an.precision, optimizer, share,
                                 Pf, fshare)
        _add_steps(vmem, sympy.sympify(steps).xreplace(env))
        vmem["activations"] = mem["activations"].xreplace(env)
        fsdp_sharded = SHARDS[shard][0] == "fully_shard"
        out["values"] = {"comm": vcomm, "memory": vmem, "dp": dp,
                         "divisible": (ev["params_shard"] if fsdp_sharded else share) * shard_degree(an, dp, ep)
                         == (int(sympy.sympify(an.params).xreplace(env)) if layout_of(an).ep_replicate else P)}
        if ep is not None:
            out["values"].update(ep=ep, params_rank=ev["params_shard"])
        if mesh2:
            if fsdp_sharded:  # FSDP2 pads where DP does not divide a TP-local first dimension
                # (xreplace of a bare symbol returns the bound value itself: a Python int)
                out["values"]["divisible"] = all(sympy.sympify(sympy.sympify(d).xreplace(env)).is_integer
                                                 for sh, _, _ in an.param_shards.values() for d in sh)
            out["values"]["tp"] = env.get(SYMS["TP"], an.pinned.get("TP", 1))
        if "comm_by_group" in out:
            out["values"]["comm_by_group"] = {g: {k: sympy.sympify(v).xreplace(env) for k, v in d.items()}
                                              for g, d in out["comm_by_group"].items()}
    return out


#: how much communication hides under compute (docs/parallel.md, "Step time")
OVERLAPS = {
    "none": "collectives run after one another with compute (nothing hidden)",
    "backward": "the backward's collectives (gradient reduce-scatter / all-reduce, FSDP2's backward "
                "all-gathers, issued ahead by its prefetch) hide under the backward compute; the "
                "forward's all-gathers are exposed",
    "full": "every collective hides under compute (the step is the longer of the two)",
}


def step_time(an, device, sizes: Mapping[str, int] | None = None, overlap: str = "backward",
              nodes: int | None = None, devices_per_node: int | None = None, fused: bool = True,
              dispatcher: str | None = None) -> dict[str, Any]:
    """One rank's step time on ``device``: the roofline's compute (per phase,
    :func:`symcost.passes.roofline.roofline`) plus the communication the ``overlap`` model does
    not hide, and the rank's MFU.

    Communication time is a phase's bytes per rank (:func:`padded`: ring algorithm, FSDP2's
    padding included) over the per-direction bandwidth of the slowest link the ring crosses:
    the scale-up link (NVLink) when the DP ranks fit in one node, else the per-device network
    (a ring over nodes passes every node boundary through one NIC per device; nccl-tests' bus
    bandwidth is measured against exactly this figure).

    Without ``--dp`` (``--tp``, ``--ep``, ``--cp`` and their pairs ``--ep --tp``, ``--cp --tp``) the
    same per process group with no data-parallel group: the mesh is torchtitan's (``cp, tp`` or,
    under ``--ep --tp``, ``(ep_rest, tp)`` with the EP group over all EP ranks: :func:`group_sizes`),
    each group's collectives over its own link, all exposed (docs/performance-model.md).

    Args:
        an: a parallel trace (``--dp``, ``--tp``, ``--ep``, ``--cp``; any of them composed).
        device: a :class:`~symcost.hardware.devices.Device` with an ``interconnect`` table.
        sizes: symbol values (the mesh's sizes among them).
        overlap: ``none``, ``backward`` or ``full`` (:data:`OVERLAPS`).
        nodes, devices_per_node: the cluster (default: DP ranks on as few nodes of the device's
            ``devices_per_node`` as hold them).
        fused: the roofline's fused bytes (a compiled step) or not.
        dispatcher: ``"deepep"`` or ``"hybridep"``: the EP group's exchanges run Megatron's flex
            dispatcher with that backend (:mod:`symcost.passes.hybrid_ep`: a token once per
            destination node over the network, once per destination rank over NVLink, expected
            over uniform routing), priced as shares of the traced all-to-alls' bytes per tier;
            None (default): the traced all-to-alls, each peer's bytes over its own link.

    Returns:
        ``compute`` {forward, backward}, ``comm`` {forward, backward} (seconds), ``bytes``
        {forward, backward}, ``link``, ``link_bandwidth``, ``nodes``, ``overlap``, ``step_seconds``,
        ``exposed_comm_seconds``, ``mfu`` (model FLOPs / (step time × peak)), ``precision`` and
        ``peak_flops`` (the peak: the device's figure for the dtype the traced matmuls ran in,
        :func:`~symcost.passes.roofline.training_precision`; bf16 under ``--precision fp32
        --fsdp-mp bf16``, whose matmuls FSDP2's policy runs in bf16). On the 2-D mesh
        (``--dp`` with ``--tp``): ``comm`` is the DP group's, over ``link`` (the network when the
        DP·TP ranks span nodes); ``tp_comm`` {forward, backward} the TP group's over ``tp_link``
        (the scale-up link when TP ranks share a node), added exposed (Shoeybi et al. 2019 §3:
        each all-reduce sits between the ops that make and use its tensor). Under Megatron-LM's
        engine (``megatron-*`` with ``--shard ddp|zero1``) the data-parallel groups' bytes are its
        buckets' (:func:`symcost.passes.megatron_buckets.engine`: the gradient buffer's dtype, the
        distributed optimizer's reduce-scatter and its parameters' all-gather, this one in the
        forward's phase), not the trace's all-reduce per gradient, and ``buckets`` describes them.

    Raises:
        SymcostError: a trace of one device (no layout), an unknown overlap, a device without an
            interconnect, a cluster that does not hold the mesh's ranks.
    """
    from symcost.passes.roofline import roofline

    if an.parallel is None and not layout_of(an).cp:  # (--cp alone: no engine label, a CP group)
        raise SymcostError("step time over links needs a parallel trace (--dp, --tp, --ep or --cp N)")
    if overlap not in OVERLAPS:
        raise SymcostError(f"unknown --overlap {overlap!r}; accepted: {', '.join(OVERLAPS)}")
    ic = device.interconnect
    if not ic.get("link_bandwidth"):
        raise SymcostError(f"{device.key} lists no interconnect; add an [{device.key}.interconnect] table "
                           "(link_bandwidth, devices_per_node, network_bandwidth) with --devices-file")
    env = an.bind(**(sizes or {}))
    lay = layout_of(an)
    sizes_of = group_sizes(an, env)
    ranks = sizes_of["ranks"]
    what = "·".join(s for s, on in (("DP", lay.shard is not None), ("CP", lay.cp), ("EP", lay.ep),
                                    ("TP", "TP" in sizes_of and not (lay.ep_tp and not lay.etp))) if on)
    per_node = devices_per_node or ic.get("devices_per_node") or ranks
    nodes = nodes or -(-ranks // per_node)
    if nodes * per_node < ranks:
        raise SymcostError(f"{nodes} node(s) of {per_node} devices do not hold {what} = {ranks} ranks")
    if nodes > 1 and not ic.get("network_bandwidth"):
        raise SymcostError(f"{device.key} lists no network_bandwidth for a ring over {nodes} nodes")

    def over(n_nodes):
        return ((ic.get("network", "network"), ic["network_bandwidth"]) if n_nodes > 1
                else (ic.get("link", "link"), ic["link_bandwidth"]))

    def inner(span):  # a group of consecutive ranks (span of them): inside a node where it divides one
        return over(1 if span <= per_node and per_node % span == 0 else 2)

    # torchtitan's mesh (dp_replicate, dp_shard, cp, tp) or (dp_shard, ep), innermost last: a TP
    # group is TP consecutive ranks, a CP group CP ranks TP apart (CP·TP consecutive), an EP group
    # EP consecutive ranks; the data-parallel groups stride over them and cross nodes when the mesh
    # does, except HSDP's dp_shard (its shard·CP·TP consecutive ranks, inside a node where they fit)
    links = {g: over(nodes) for g in ("DP", "DP_replicate", "DP_expert")}
    links.update(TP=inner(sizes_of.get("TP", 1)),
                 EP=inner(sizes_of.get("EP", 1) * (sizes_of.get("TP", 1) if lay.etp else 1)))
    if lay.hsdp:
        links["DP"] = inner(sizes_of["DP"] * sizes_of.get("TP", 1))
    link, bw = links["DP"]
    ep_tiers = all_to_all_tiers(sizes_of.get("EP", 1), sizes_of.get("TP", 1) if lay.etp else 1, per_node,
                                (ic.get("link", "link"), ic["link_bandwidth"]),
                                (ic.get("network", "network"), ic.get("network_bandwidth") or 0.0))
    # (the per-op seconds only: the symbolic step time and intensities, which nothing here reads,
    # cost more than the rest of the call; with_formulas=False)
    r = roofline(an, device, {str(k): v for k, v in env.items()}, fused=fused, with_formulas=False)
    compute = {ph: r["per_phase"].get(ph, {}).get("seconds", 0.0) for ph in ("forward", "backward")}
    by_group = padded(an, env)["by_group"]
    buckets = None
    if is_megatron_engine(an):  # (Megatron's buckets, not the trace's all-reduce per gradient: megatron_buckets)
        buckets = mb.engine(an, env, sizes_of, overlap)
        by_group = {k: v for k, v in by_group.items() if k[0] not in mb.GROUPS}
        by_group.update(buckets.pop("by_group"))
    groups = sorted({g for g, _ in by_group})
    per_group = {}
    for g in groups:
        if g == "CP":
            continue
        gl, gbw = links.get(g, links["DP"])
        b = {ph: float(by_group.get((g, ph), 0)) for ph in ("forward", "backward")}
        per_group[g] = {"link": gl, "bandwidth": gbw, "ranks": sizes_of.get(g, 1), "bytes": b,
                        "seconds": {ph: b[ph] / gbw for ph in b},
                        "overlapped": g in OVERLAPPED_GROUPS}
        if g == "EP" and dispatcher:  # (DeepEP/HybridEP: a token once per node, then once per rank)
            t = _flex_tiers(an, env, sizes_of, lay, per_node, ic)
            per_group[g].update(tiers=t, dispatcher=dispatcher,
                                link=" + ".join(f"{x['link']} ({x['rows']:.3g} rows/token)" for x in t),
                                seconds={ph: max(b[ph] * x["share"] / x["bandwidth"] for x in t) for ph in b})
        elif g == "EP" and ep_tiers is not None:  # (the EP group spans nodes: each peer's bytes over its own link)
            per_group[g].update(tiers=ep_tiers, link=" + ".join(f"{t['link']} ({t['peers']} peers)" for t in ep_tiers),
                                seconds={ph: max(b[ph] * t["share"] / t["bandwidth"] for t in ep_tiers)
                                                          for ph in b})
    cp = None
    if lay.cp:  # the ring's exchange overlapped with its own blocks as PyTorch schedules it (§15)
        from symcost.passes.context_parallel import ring_exposure, ring_link

        cp_link, cp_bw, inside = ring_link(an, device, env, None, per_node)
        ring = ring_exposure(an, env, {n["index"]: n["seconds"] for n in r["nodes"]}, cp_bw)
        cp = {"link": cp_link, "bandwidth": cp_bw, "inside": inside, "ranks": sizes_of["CP"], **ring}
    nbytes = {ph: sum(d["bytes"][ph] for d in per_group.values()) + (cp["bytes"][ph] if cp else 0)
              for ph in ("forward", "backward")}
    # the data-parallel engine's collectives under the overlap model; the TP group's (Megatron's
    # all-reduces between the ops that make and use their tensors, Shoeybi et al. 2019 §3) and the
    # EP group's all-to-alls (the dispatch's output is the experts' input, the combine's the next
    # op's: torchtitan's token dispatcher waits on each) on the critical path, exposed
    comm = {ph: sum(d["seconds"][ph] for d in per_group.values() if d["overlapped"]) for ph in ("forward", "backward")}
    exposed = {ph: sum(d["seconds"][ph] for d in per_group.values() if not d["overlapped"])
               for ph in ("forward", "backward")}
    if cp:
        exposed = {ph: exposed[ph] + cp["exposed"][ph] for ph in exposed}
    tp_comm = {ph: per_group["TP"]["seconds"][ph] if "TP" in per_group else 0.0 for ph in ("forward", "backward")}
    offload = {}
    if lay.offload or lay.offload_activations:
        # FSDP2's CPU offload and activation offload: each phase's host<->device copies over the
        # host link, counted with the phase's communication (a copy engine beside the kernels);
        # FSDP2's on the
        # collectives' path (the H2D copy before its all-gather, the D2H after its reduce-scatter)
        from symcost.passes.offload import host_link, transfer_seconds

        name, host_bw = host_link(device)
        transfer = transfer_seconds(an, device, env)
        comm = {ph: comm[ph] + transfer[ph] for ph in comm}
        offload = {"transfer": transfer, "host_link": name, "host_bandwidth": host_bw}
    step = overlapped(compute, comm, overlap) + sum(exposed.values())
    # the peak of the dtype the traced matmuls ran in (the roofline's: bf16 under --precision fp32
    # --fsdp-mp bf16, whose compute the roofline timed at the bf16 peak), not the flag's
    peak, key = device.peak_for(r["precision"])
    model_flops = r["model_flops"]
    mesh2 = bool(getattr(an, "tensor_parallel", None))
    extra = {}
    if mesh2:
        extra.update(tp_link=links["TP"][0], tp_link_bandwidth=links["TP"][1], tp_comm=tp_comm)
    if lay.hsdp:
        extra.update(replicate_link=links["DP_replicate"][0], replicate_link_bandwidth=links["DP_replicate"][1])
    if "EP" in per_group:
        extra.update(ep_link=per_group["EP"]["link"], ep_link_bandwidth=links["EP"][1],
                     ep_comm=dict(per_group["EP"]["seconds"]))
    if cp:
        extra["cp"] = cp
    if buckets:
        extra["buckets"] = buckets
    return {"compute": compute, "comm": comm, "bytes": nbytes, "link": link, "link_bandwidth": bw, **extra,
            **offload, "groups": per_group, "exposed": exposed, "ranks": ranks,
            "nodes": nodes, "devices_per_node": per_node, "overlap": overlap, "overlap_model": OVERLAPS[overlap],
            "step_seconds": step, "exposed_comm_seconds": step - sum(compute.values()),
            "mfu": model_flops / (step * peak) if step else 0.0, "precision": key, "peak_flops": peak,
            "source": ic.get("source", "")}


def _flex_tiers(an, env, sizes_of, lay, per_node: int, ic) -> list[dict[str, Any]]:
    """:func:`symcost.passes.hybrid_ep.tiers` of the traced EP group: E and R from the trace's
    sizes, the group's ranks per node (EP ranks TP apart under ``--etp``)."""
    from symcost.passes.hybrid_ep import tiers

    def size(sym):
        v = env.get(SYMS[sym], an.pinned.get(sym))
        if v is None:
            raise SymcostError(f"the flex dispatcher's routing needs {sym} (experts, top-k) in the trace")
        return int(v)

    n = sizes_of["EP"]
    stride = sizes_of.get("TP", 1) if lay.etp else 1
    local = n if n * stride <= per_node else max(per_node // stride, 1)
    return tiers(size("E"), size("R"), n, local, (ic.get("link", "link"), ic["link_bandwidth"]),
                 (ic.get("network", "network"), ic.get("network_bandwidth") or 0.0))


def all_to_all_tiers(ranks: int, stride: int, per_node: int, link: tuple[str, float],
                     network: tuple[str, float]) -> list[dict[str, Any]] | None:
    """The link tiers an all-to-all over a group that spans nodes crosses, and each tier's share of
    a rank's bytes; None where the group sits inside one node or its placement is not whole nodes.

    NCCL's all-to-all is a point-to-point send and receive to every peer inside one NCCL group
    (PyTorch's ``all_to_all_single``: ``torch/csrc/cuda/nccl.cpp`` ``all2all_single_equal_split``,
    ``ncclGroupStart``, ``ncclSend``/``ncclRecv`` per peer, ``ncclGroupEnd``, or ``ncclAllToAll``,
    the same per-peer transfers inside NCCL), so each peer's 1/n of the buffer travels over the
    link between the two ranks: NVLink to a peer on the same node, the rank's own NIC to a peer on
    another node, all transfers at once. Of the (n-1)/n of the buffer a rank sends (the bytes the
    trace counts), the on-node peers' share is (l-1)/(n-1) and the other nodes' (n-l)/(n-1), with l
    the group's ranks per node; the collective takes the slower tier, max over tiers of
    share · bytes / bandwidth.

    Args:
        ranks: n, the group's ranks (EP).
        stride: how far apart its ranks are in the mesh (1: consecutive; TP under ``--etp``).
        per_node: devices per node.
        link, network: ``(name, byte/s per direction)`` of the scale-up link and of the per-device network.

    Returns:
        ``[{"link", "bandwidth", "share", "peers"}, ...]`` (scale-up link first) or None: the group
        inside one node (``n·stride`` divides ``per_node``), or ranks not placed whole nodes at a time
        (then the caller keeps the whole buffer on the network).
    """
    n, span = int(ranks), int(ranks) * int(stride)
    if n <= 1 or (span <= per_node and per_node % span == 0) or span % per_node or per_node % stride:
        return None
    local = per_node // stride  # the group's ranks on one node
    if local <= 1 or not network[1]:
        return None
    return [{"link": link[0], "bandwidth": link[1], "share": (local - 1) / (n - 1), "peers": local - 1},
            {"link": network[0], "bandwidth": network[1], "share": (n - local) / (n - 1), "peers": n - local}]


#: the process groups whose collectives the overlap model hides under compute (the data-parallel
#: engine's: FSDP2's all-gathers and reduce-scatters, DDP's all-reduces, HSDP's replicate
#: all-reduce, the experts' FSDP2 group under EP); the others (TP, EP, CP) sit on the critical path
OVERLAPPED_GROUPS = ("DP", "DP_replicate", "DP_expert")


def group_sizes(an, env: Mapping) -> dict[str, int]:
    """``{label: ranks}`` of each process group of a data-parallel trace at ``env`` (``"DP"`` the
    FSDP2 / DDP group: DP, DP/R under HSDP, DP·CP with context parallelism, DP·EP with expert
    parallelism; ``"DP_replicate"`` R; ``"DP_expert"`` DP; ``"TP"``, ``"CP"``, ``"EP"`` their
    sizes) and ``"ranks"``, the ranks of the whole mesh (DP·TP, DP·CP, DP·EP, DP·CP·TP)."""
    lay = layout_of(an)

    def size_of(sym):
        return int(env.get(SYMS[sym], an.pinned.get(sym, 1)))

    out = {"DP": int(lay.group_size("DP", size_of))}
    dp = size_of("DP")
    ranks = dp
    if getattr(an, "tensor_parallel", None) or lay.tp:
        out["TP"] = size_of("TP")
        ranks *= out["TP"]
    if lay.cp:
        out["CP"] = size_of("CP")
        ranks *= out["CP"]
    if lay.ep:
        out["EP"] = size_of("EP")
        out["DP_expert"] = dp
        # (under --ep --tp the EP group borrows the TP ranks: EP/TP TP groups, docs/parallel.md §14.8;
        # with --etp the mesh (ep, tp) has EP·TP ranks, an EP group EP ranks TP apart)
        ranks = ranks // out["TP"] * out["EP"] if lay.ep_tp and not lay.etp else ranks * out["EP"]
    if lay.hsdp:
        out["DP_replicate"] = lay.replicate
    out["ranks"] = ranks
    return out


def train_time_dp(an, device, sizes: Mapping[str, int] | None, tokens: int, accumulate: int = 1,
                  overlap: str = "backward", nodes: int | None = None,
                  devices_per_node: int | None = None) -> dict[str, Any]:
    """The whole run's training time on DP data-parallel ranks, from one rank's step time.

    Every rank runs the traced step on its own micro-batch of B sequences of S tokens; an
    optimizer step is ``accumulate`` = K such micro-steps on each of the DP ranks, so the global
    batch is B·K·DP sequences (shared/conventions.md: B_global = B_micro × K × N_devices) and a run
    of ``tokens`` tokens takes tokens / (B·S·K·DP) optimizer steps, i.e. tokens / (B·S·DP)
    micro-steps per rank. An optimizer step of K micro-steps is composed as the engine runs them
    (:func:`symcost.passes.accumulation.accumulated`): DDP and Megatron (``--shard ddp``/``zero1``)
    reduce the gradients once per optimizer step, under the last micro-step's backward (Megatron's
    ``no_sync_func`` over the first K − 1, PyTorch's ``no_sync``); FSDP2 as torchtitan runs it
    reduce-scatters every micro-step; the roofline bound has no optimizer term. K = 1: each step is
    :func:`step_time`'s ``step_seconds``.

    Args:
        an: a data-parallel trace (``DP`` a symbol or pinned).
        device: a :class:`~symcost.hardware.devices.Device` with an interconnect.
        sizes: symbol values (DP among them).
        tokens: training tokens of the run (all ranks together).
        accumulate: gradient-accumulation micro-steps K per optimizer step (>= 1).
        overlap, nodes, devices_per_node: as :func:`step_time`.

    Returns:
        ``dp``, ``ranks`` (the mesh's: DP, DP·CP, DP·EP), ``micro_batch`` (B), ``accumulation``
        (K), ``global_batch`` (B·K·DP; B·K·DP·EP under expert parallelism, each EP rank its own
        tokens),
        ``tokens``, ``tokens_per_step`` (B·S·K·DP), ``steps`` (optimizer steps, exact: an int
        or a float), ``step`` (:func:`step_time`'s dict, one micro-step of one rank),
        ``accumulated`` (:func:`~symcost.passes.accumulation.accumulated` of that step: one
        optimizer step of K micro-steps),
        ``mfu`` (per rank: model FLOPs of its micro-step / (step seconds × peak)), ``peak_flops``
        and ``precision`` (that peak: the device's figure for the dtype the traced matmuls ran
        in, :func:`step_time`'s), ``flops.train_step``
        (model FLOPs of one rank's micro-step), ``flops.per_token``, ``compute.total`` (model FLOPs of
        the run on all ranks), ``compute.6NP``, ``sizes``, and ``time.seconds``, ``time.days``,
        ``time.device_hours`` (seconds × ranks / 3600).

    Raises:
        SymcostError: not a data-parallel trace, ``tokens`` or ``accumulate`` not positive, and
            :func:`step_time`'s errors.
    """
    from fractions import Fraction

    from symcost.passes.roofline import _exact, tokens_compute

    if an.parallel is None and not layout_of(an).cp:
        raise SymcostError("time over parallel ranks needs a parallel trace (--dp, --tp, --ep or --cp N)")
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens <= 0:
        raise SymcostError(f"--tokens must be a positive integer, got {tokens!r}")
    if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate <= 0:
        raise SymcostError(f"--accumulate must be a positive integer, got {accumulate!r}")
    st = step_time(an, device, sizes, overlap, nodes, devices_per_node)
    tc = tokens_compute(an, sizes, tokens)  # 6·N·P: P active (R of E experts)
    env = an.bind(**(sizes or {}))
    dp = int(env.get(SYMS["DP"], an.pinned.get("DP", 1)))
    B, S = (int(an.pinned[n]) if n in an.pinned else int(env[SYMS[n]]) for n in ("B", "S"))
    # the ranks with a micro-batch of their own: DP, and under expert parallelism DP·EP (every EP
    # rank runs its own tokens, docs/parallel.md §14.6; under --ep --tp the EP/TP tensor-parallel
    # groups, §14.8); a CP group of CP ranks shares its B sequences (each rank S/CP tokens of them,
    # §15), as a TP group's ranks do; without --dp the same with DP = 1
    g = group_sizes(an, env)
    lay = layout_of(an)
    replicas = dp * ((g["EP"] // g["TP"] if lay.ep_tp and not lay.etp else g["EP"]) if "EP" in g else 1)
    micro_steps = Fraction(tokens, B * S * replicas)  # per rank
    # the run's model FLOPs: every rank's micro-steps (a TP rank runs 1/TP of its tokens' FLOPs)
    total = _exact(micro_steps * st["ranks"] * int(tc["flops.train_step"]))
    from symcost.passes.accumulation import accumulated

    acc = accumulated(st, accumulate, lay.shard, overlap)
    seconds = float(micro_steps / accumulate) * acc["step_seconds"]
    peak, key = st["peak_flops"], st["precision"]
    return {
        "dp": dp, "ranks": st["ranks"], "micro_batch": B, "accumulation": accumulate,
        "global_batch": B * accumulate * replicas,
        "tokens": tokens, "tokens_per_step": B * S * accumulate * replicas,
        "steps": _exact(micro_steps / accumulate), "step": st, "accumulated": acc, "mfu": st["mfu"], "peak_flops": peak,
        "precision": key, "sizes": tc["sizes"], "flops.train_step": tc["flops.train_step"],
        "flops.per_token": tc["flops.per_token"], "compute.total": total,
        "compute.6NP": tc["compute.6NP"],
        "time.seconds": seconds, "time.days": seconds / 86400, "time.device_hours": seconds * st["ranks"] / 3600,
    }
