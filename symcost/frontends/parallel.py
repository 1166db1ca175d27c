"""Data-parallel and sharded training of a :class:`ModelSpec`: which PyTorch engine wraps the
model, per block, for each ``--shard`` strategy (docs/parallel.md).

A data-parallel spec is the model's own spec with one more symbol, ``DP`` (the data-parallel
group size: ranks the batch, and for sharded strategies the parameters, gradients and optimizer
state, are split over), and a layout (:class:`symcost.frontends.layout.Layout`) whose
data-parallel dimension names the strategy. The recorder (:mod:`symcost.tracing.record`) builds
the layout's mesh on a fake process group (``torch.testing._internal.distributed.fake_pg``) and
wraps every block of the model, then the root, the way torchtitan and accelerate do:

========  ====================================================================================
shard     engine recorded (one rank), and what the memory policy adds
========  ====================================================================================
ddp       ``torch.distributed._composable.replicate_with_fsdp.replicate`` per block: PyTorch's
          DDP on the FSDP2 engine, one gradient all-reduce per block (classic
          ``DistributedDataParallel``'s C++ reducer cannot run on fake tensors; it buckets
          the same gradient bytes into 25 MiB buckets instead of one bucket per block)
fsdp      ``fully_shard(reshard_after_forward=True)`` per block (FSDP2; ZeRO-3)
zero3     the same as ``fsdp``
zero2     ``fully_shard(reshard_after_forward=False)`` per block: FSDP2's ZeRO-2-like mode
          (parameters stay unsharded from forward to backward; no second all-gather). Model
          states follow DeepSpeed's ZeRO-2 (gradients and optimizer state sharded, parameters
          replicated) as a labelled memory policy
zero1     the ``ddp`` trace (all-reduce: the same bytes as ZeRO-1's reduce-scatter +
          all-gather); model states follow DeepSpeed's ZeRO-1 (optimizer state sharded) as a
          labelled memory policy: PyTorch has no exact counterpart (``ZeroRedundancyOptimizer``
          is the closest)
========  ====================================================================================

Under a ``megatron-*`` precision, ``ddp`` and ``zero1`` trace Megatron-LM's DDP instead: the
parameters used in place, each gradient all-reduced once accumulated
(:func:`symcost.frontends.megatron.wrap_in_place`; ``replicate`` copies every parameter into an
all-gather buffer on its shard group of 1, a second live copy of the weights).

Torch is imported only inside the functions that need it.
"""
from __future__ import annotations

import contextvars
import dataclasses
import math
import weakref
from typing import Mapping

from symcost.errors import SymcostError
from symcost.frontends.memo import memo_per_model, meta_model  # noqa: F401  (memo_per_model re-exported)

#: strategy -> (engine traced, reshard_after_forward or None, what is sharded for model states)
SHARDS: dict[str, tuple[str, bool | None, str]] = {
    "ddp": ("replicate", None, "nothing sharded (DDP)"),
    "zero1": ("replicate", None, "optimizer state sharded (ZeRO-1, a memory policy on the DDP trace)"),
    "zero2": ("fully_shard", False, "gradients and optimizer state sharded (ZeRO-2, a memory policy on "
                                    "FSDP2 reshard_after_forward=False)"),
    "zero3": ("fully_shard", True, "parameters, gradients and optimizer state sharded (ZeRO-3 = FSDP2 "
                                   "reshard_after_forward=True)"),
    "fsdp": ("fully_shard", True, "parameters, gradients and optimizer state sharded (FSDP2, "
                                  "reshard_after_forward=True)"),
}


#: dtypes of ``--fsdp-mp`` (FSDP2's ``MixedPrecisionPolicy``): name -> torch dtype name
MP_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def parse_fsdp_mp(text: str | None) -> tuple[str, str] | None:
    """``--fsdp-mp PARAM[,REDUCE]`` -> ``(param, reduce)`` dtype names of
    :data:`MP_DTYPES` (REDUCE defaults to fp32, torchtitan's ``mixed_precision_reduce``; FSDP2's
    own default, ``reduce_dtype=None``, reduces in the parameter dtype: write ``bf16,bf16``).
    None for None.

    Raises:
        SymcostError: an unknown dtype or more than two.
    """
    if text is None:
        return None
    parts = [p.strip().lower() for p in str(text).split(",")]
    if len(parts) == 1:
        parts.append("fp32")
    bad = [p for p in parts if p not in MP_DTYPES]
    if len(parts) != 2 or bad:
        raise SymcostError(f"--fsdp-mp takes PARAM[,REDUCE] of {', '.join(MP_DTYPES)} (e.g. bf16 or bf16,fp32), "
                           f"got {text!r}")
    return parts[0], parts[1]


def check_shard(shard: str) -> str:
    """``shard`` if it is a known strategy (:data:`SHARDS`).

    Raises:
        SymcostError: an unknown strategy (the message lists the accepted ones).
    """
    if shard not in SHARDS:
        raise SymcostError(f"unknown --shard {shard!r}; accepted: {', '.join(SHARDS)}")
    return shard


def data_parallel(spec, shard: str, mp: tuple[str, str] | str | None = None, tp_sizes=None,
                  replicate: int | None = None, indivisible=None):
    """The data-parallel dimension's part of a layout's spec (:meth:`symcost.frontends.layout.Layout.spec`
    calls it; a traced spec is the layout's): ``spec`` with the symbol ``DP`` (the group size:
    ``shard`` over ``DP`` ranks) and the probe check that keeps the per-rank sizes polynomial in
    it. ``mp`` (``(param, reduce)`` or ``--fsdp-mp``'s text, :func:`parse_fsdp_mp`) is checked
    here; the layout gives it to the engine as ``MixedPrecisionPolicy(param_dtype, reduce_dtype)``.

    Probes (never requests) of a sharding strategy must have ``DP`` (and 4) divide the first
    dimension of every parameter (``ddp``/``zero1``, the replicate engine, shard nothing):
    FSDP2 shards each parameter on dim 0 into ``ceil(d0/DP)`` rows and pads, so sizes are
    polynomial in ``DP`` only there (``probe_check``); the formulas then say ``/DP``, exact
    where DP divides the sharded dims (a request that does not is padded by at most
    ``DP - 1`` rows per parameter, docs/parallel.md). Over a tensor-parallel dimension (the
    layout's 2-D mesh) FSDP2 shards the TP-local rows: ``tp_sizes(values)`` gives the tensor-
    parallel sizes the probes can draw at ``values`` (those the TP plan splits), and the first
    dimensions must be multiples of lcm(DP, 4) times the largest (8 where not given). Under
    expert parallelism (docs/parallel.md §14.6: the dense parameters sharded over DP·EP ranks, each
    rank's experts over DP) ``indivisible(spec, values)`` says why a probe with ``EP`` is not
    polynomial (:func:`symcost.frontends.expert_parallel.fsdp_indivisible`).

    Raises:
        SymcostError: an unknown ``shard``.
    """
    check_shard(shard)
    mp = parse_fsdp_mp(mp) if isinstance(mp, str) else (tuple(mp) if mp is not None else None)
    if mp is not None:
        parse_fsdp_mp(",".join(mp))  # the same checks
    if "DP" in spec.symbols:
        return spec
    inner_probe = spec.probe_check

    def probe_check(values: Mapping[str, int]):
        why = inner_probe(values) if inner_probe else None
        if why or "DP" not in values:
            return why
        if replicate and values["DP"] % replicate:
            return f"DP={values['DP']} is no multiple of the replicate degree {replicate} (HSDP)"
        if replicate and replicate > 1 and values["DP"] == replicate:
            # (a dp_shard group of one rank shards nothing: other bytes than at 2 or more, a regime
            # of its own; seen: encdec.py --dp 4 --dp-replicate 2 pinned every size when a check
            # drew DP = 2)
            return f"DP={values['DP']} = the replicate degree leaves dp_shard one rank (HSDP), a regime of its own"
        if SHARDS[shard][0] == "replicate":
            # (DDP shards nothing: no size depends on DP, any first dimension runs as it is;
            # OPT's 2,050 learned positions refused hf:opt --dp 2)
            return None
        if MESH_PINNED.get():
            # (every mesh size pinned at the request's: a first dimension the group does not divide
            # is padded to the same ceil(d0/n) rows at every probe that keeps it, and one that
            # follows a free symbol and stops being polynomial is caught by the fit's checks)
            return None
        if indivisible is not None and "EP" in values:
            return indivisible(spec, values)
        return _indivisible(spec, values, tp_sizes, replicate)

    defaults = dict(spec.defaults, DP=spec.defaults.get("DP", 8 if not replicate else 4 * replicate))
    moduli = dict(spec.moduli, DP=replicate) if replicate and replicate > 1 else spec.moduli
    return dataclasses.replace(spec, symbols=tuple(spec.symbols) + ("DP",), defaults=defaults,
                               probe_check=probe_check, moduli=moduli)


#: True while a trace runs with every mesh size of its layout pinned and no probe passed the checks
#: (``graph.build.trace``, on ``tracing.fit.NoProbes``): the sharding probe checks' divisibilities
#: (lcm(DP, 4)·lcm(EP, 4), ...) exist so that DP, EP, TP can vary from a probe, and at a pinned size
#: they ask the request's own mesh to divide every first dimension (Qwen3-30B-A3B's 128-row router
#: over DP·EP = 256 ranks: no probe at all); then waived
MESH_PINNED: "contextvars.ContextVar[bool]" = contextvars.ContextVar("symcost_mesh_pinned", default=False)

#: spec.build -> {"skip": the sizes no parameter depends on, (config values) -> dim 0 of each parameter}
_DIMS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _dims0(spec, values: Mapping[str, int]) -> tuple[tuple[str, int], ...]:
    """The distinct first dimensions of the parameters of ``spec`` built on the meta device at
    ``values`` (scalars left out; L at most the leading blocks + 2: later blocks repeat them),
    memoised per model (:func:`memo_per_model`): a probe search asks this for about a thousand
    candidate sizes (each build :meth:`ModelSpec.build_meta`, without parameter init)."""
    def build(v):
        model = meta_model(spec, v)  # (the build the tensor-parallel check made at these sizes)
        return tuple(sorted({int(p.shape[0]) for p in model.parameters() if p.dim()}))

    return memo_per_model(_DIMS.setdefault(spec.build, {}), _dims0_key(spec, values), build)


def _dims0_key(spec, values: Mapping[str, int]) -> dict[str, int]:
    """The sizes :func:`_dims0` builds at: ``values`` without the mesh sizes DP and TP, L at most
    the leading blocks + 2."""
    values = {k: x for k, x in values.items() if k not in ("DP", "TP")}
    if "L" in values:  # (the blocks after the leading ones repeat the same first dimensions)
        values["L"] = min(values["L"], int(getattr(spec, "lead_blocks", 0) or 0) + 2)
    return values


def _indivisible(spec, values: Mapping[str, int], tp_sizes=None, replicate: int | None = None) -> str | None:
    """Why ``DP`` does not divide the first dimension of every parameter (built on the meta
    device), or None. With ``TP`` in ``values`` (the 2-D mesh: FSDP2 shards the rank's TP-local
    rows, ``d0/TP`` of a column-parallel weight), times the largest TP the probes can draw here
    (``tp_sizes(values)``, :func:`data_parallel`; 8 of 2, 4, 8 where not given): where the plan
    splits K = 2 heads, TP = 2 is the only one, and D need not be a multiple of 16 for 2·D."""
    dp = values["DP"] // (replicate or 1)  # (HSDP: the dp_shard group's size)
    # a multiple of lcm(DP, 4): then DP = 2 and 4 both divide the base probe's dimensions, so
    # DP can vary alone from it (fit.plan_probes); on the 2-D mesh, TP too
    tp = 1
    if "TP" in values:
        tp = max((tp_sizes(values) if tp_sizes is not None else None) or [8 if tp_sizes is None else values["TP"]])
    # with context parallelism FSDP2 shards over dp_shard × cp: times CP (pinned), so that DP = 2 and
    # 4 both still divide the base probe's dimensions
    m = math.lcm(dp, 4) * tp * values.get("CP", 1)
    bad = _first_bad(spec, values, m)
    why = (f" times {tp} (the largest TP the plan can split here)" if "TP" in values else "") + (
        f" times CP={values['CP']} (FSDP2 over dp_shard × cp)" if "CP" in values else "")
    return f"a parameter's first dimension, {bad}, is no multiple of lcm(DP={dp}, 4){why}" if bad is not None else None


#: spec.build -> memo (:func:`memo_per_model`) of a pipeline stage's ``param_bounds``
_BOUNDS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _first_bad(spec, values: Mapping[str, int], m: int) -> int | None:
    """The smallest of :func:`_dims0` that ``m`` does not divide, or None. A pipeline stage's
    build (:func:`symcost.frontends.pipeline.stage_spec`) probes its boundary with a forward of the
    whole model first; its ``build.param_bounds(values)`` gives, without that probe, the first
    dimensions of the parameters no stage deletes (``lo``) and of all of them (``hi``): the stage's
    lie between, so where ``m`` divides every one of ``hi``, or the smallest that it does not is
    in ``lo``, that is the answer, and only the rest builds the stage (a probe search asks about
    a thousand sizes: PP 2 × FSDP 2 built the stage 294 times, 36 % of the report's CPU time)."""
    bounds = getattr(spec.build, "param_bounds", None)
    if bounds is not None:
        import torch

        from symcost.frontends.spec import _skip_init, model_stdout

        def build(v):
            with torch.device("meta"), _skip_init(), model_stdout():
                return bounds(v)

        lo, hi = memo_per_model(_BOUNDS.setdefault(spec.build, {}), _dims0_key(spec, values), build)
        bad = [d0 for d0 in hi if d0 % m]
        if not bad:
            return None
        if bad[0] in lo:
            return bad[0]
    bad = [d0 for d0 in _dims0(spec, values) if d0 % m]
    return bad[0] if bad else None


def fake_group(world_size: int):
    """A 1-D ``DeviceMesh`` of ``world_size`` CPU ranks on PyTorch's fake process group (rank 0;
    collectives run no communication). Re-initialises the default group when its size differs.
    Call it outside ``FakeTensorMode`` (the mesh reads a real tensor)."""
    from torch.distributed.device_mesh import init_device_mesh

    fake_world(world_size)
    return init_device_mesh("cpu", (world_size,))


def fake_world(world_size: int) -> None:
    """The default process group: the fake one of ``world_size`` ranks, this process rank 0."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized() and (dist.get_world_size() != world_size or dist.get_backend() != "fake"):
        destroy_world()
    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)


def destroy_world() -> None:
    """Destroy the default process group and forget DTensor's cached sharding decisions.

    DTensor caches each op's output placements and each redistribution's steps keyed by the
    tensors' specs, and a spec's mesh compares equal to any mesh of the same shape and dimension
    names (torch/distributed/tensor/_sharding_prop.py ``propagate_op_sharding``,
    _redistribute.py ``_gen_transform_infos``): after the world is destroyed a cached output
    would carry a mesh whose group names no longer resolve, or name another group of the new
    world (process group names restart from 0)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, _redistribute

    if dist.is_initialized():
        dist.destroy_process_group()
    torch._C._clear_DTensor_sharding_propagator_cache()  # (the C++ fast path's own cache)
    prop = DTensor._op_dispatcher.sharding_propagator
    prop.propagate_op_sharding.cache.cache_clear()
    prop._propagate_tensor_meta_cached.cache_clear()
    _redistribute._gen_transform_infos.cache_clear()
    _redistribute.clear_redistribute_planner_cache()


def wrap(model, layers: str | None, shard: str, mesh, mp: tuple[str, str] | list | None = None,
         offload: bool = False, engine: str | None = None, inner=None, experts_mesh=None):
    """Wrap ``model`` in place for ``shard`` (:data:`SHARDS`): each child of the ``layers``
    container (the L blocks; a list of containers: each block of each stack, an encoder's then a
    decoder's), then the root, as torchtitan does. ``mp``: ``(param, reduce)``
    dtype names (:data:`MP_DTYPES`) given to every unit as FSDP2's
    ``MixedPrecisionPolicy(param_dtype=..., reduce_dtype=...)`` (all-gathers move parameters in
    ``param``, reduce-scatters and all-reduces gradients in ``reduce``). ``offload``: every
    ``fully_shard`` unit also takes ``offload_policy=CPUOffloadPolicy(...)``
    (:func:`symcost.frontends.offload.policy`; torchtitan's ``training.enable_cpu_offload``).
    ``engine``: ``"megatron-ddp"`` with ``ddp``/``zero1`` runs Megatron-LM's engine instead of
    ``replicate`` (parameters used in place, each gradient all-reduced once accumulated:
    :func:`symcost.frontends.megatron.wrap_in_place`; the ``megatron-*`` precisions ask for it).
    ``inner(reshard, kw)``: wraps the units inside the blocks first (``fully_shard`` only; under
    expert parallelism every experts module over the expert-data-parallel mesh,
    :func:`symcost.frontends.expert_parallel.shard_experts`), with the blocks' ``reshard_after_forward``
    and the other ``fully_shard`` options ``kw``; ``mesh`` then shards the rest (under ``replicate``,
    :func:`symcost.frontends.expert_parallel.replicate_experts`: the experts' gradients all-reduced
    over the expert-data-parallel mesh). ``experts_mesh``: with Megatron-LM's engine under expert
    parallelism, the expert-data-parallel mesh the experts' gradients are reduced over
    (:func:`symcost.frontends.megatron.wrap_in_place`; docs/parallel.md §14.11).
    Returns the model.

    Raises:
        SymcostError: PyTorch refuses to wrap the model (its message, one line).
    """
    import torch

    asked = engine
    engine, reshard, _ = SHARDS[check_shard(shard)]
    if asked == "megatron-ddp" and engine == "replicate" and mp is None:
        from symcost.frontends.megatron import wrap_in_place

        wrap_in_place(model, mesh, experts_mesh)
        return model
    kw = {}
    if mp is not None:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        p, r = mp
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=getattr(torch, MP_DTYPES[p]),
                                               reduce_dtype=getattr(torch, MP_DTYPES[r]))
    if offload:
        from symcost.frontends.offload import policy

        kw["offload_policy"] = policy()
    if engine == "replicate":
        from torch.distributed._composable.replicate_with_fsdp import replicate

        def apply(m, root):
            replicate(m, mesh=mesh, **kw)
    else:
        from torch.distributed.fsdp import fully_shard

        def apply(m, root):
            # the root's parameters stay unsharded after forward (FSDP2 and torchtitan's default)
            fully_shard(m, mesh=mesh, reshard_after_forward=False if root else reshard, **kw)
    try:
        if inner is not None:
            inner(reshard, kw)
        for c in ([layers] if isinstance(layers, str) else layers or ()):
            for block in model.get_submodule(c).children():
                apply(block, False)
        apply(model, True)
    except Exception as e:  # noqa: BLE001
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise SymcostError(f"wrapping the model for --shard {shard} failed: {msg}") from e
    return model
