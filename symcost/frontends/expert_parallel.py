"""Expert parallelism of a mixture-of-experts :class:`ModelSpec`: the routed experts sharded over
EP ranks, each MoE layer's tokens sent to the ranks that hold their experts and back by
``all_to_all_single`` on the EP group, one rank recorded on a fake process group
(docs/parallel.md §14, "Expert parallelism").

An expert-parallel spec is the model's own spec with one more symbol, ``EP`` (the expert-parallel
group size), and a layout (:class:`symcost.frontends.layout.Layout`) with an ``ep`` dimension. The
recorder (:mod:`symcost.tracing.record`) builds it on the meta device and :func:`apply` (through
:meth:`Layout.parallelize`) does what torchtitan's expert-parallel MoE does
(torchtitan/models/common/token_dispatcher.py ``AllToAllTokenDispatcher``, formerly
torchtitan/distributed/expert_parallel.py ``ExpertParallel``; GShard, Lepikhin et al. 2020,
Sec. 3.2, Fig. 3):

* every stacked expert weight ``[E, ...]`` becomes a ``DTensor`` sharded on dim 0 over the ``ep``
  mesh (``distribute_tensor(param, mesh, [Shard(0)])``, torchtitan's ``_partition_fn``): a rank
  holds the E/EP experts of its shard, their gradients and optimizer state (AdamW on the
  DTensors runs on the local shards);
* per MoE layer, forward: the tokens per expert (``[E]`` int64, each expert's slots on this rank)
  exchanged first (``all_to_all_single`` of ``[EP, E/EP]``: the split sizes, torchtitan's
  ``_token_count_exchange``), then the dispatch ``all_to_all_single`` of the routed slots (each
  rank sends the slots of expert group j to rank j), the rank-major rows permuted to expert-major
  (``_permute``), the E/EP local experts' GEMMs on the local weight shards, the inverse
  permutation (``_unpermute``) and the combine ``all_to_all_single`` (the inverse exchange);
  backward: the two token all-to-alls again, transposed (``all_to_all_single``'s autograd).

The split sizes follow the routing model (:mod:`symcost.frontends.moe`): the built-in ``moe``
dispatches into per-expert buffers of C = c·N·R/E slots (GShard's fixed capacity; balanced
routing is c = 1), so every rank sends ``E/EP·C`` rows to every rank, the exchange's size is
``E·C·M`` elements (``N·R·M`` under balanced routing) whatever the router chose, and the split
sizes are known without reading the counts on the host (torchtitan's ``tolist()``, which fake
tensors cannot answer). Bytes per rank: (EP-1)/EP of each all-to-all's input
(:data:`symcost.graph.rules.RING_FACTOR`; nccl-tests' all-to-all bus bandwidth).

Without a data-parallel dimension the EP ranks each run their own micro-batch with the dense
(non-expert) parameters replicated, and nothing reduces the dense gradients across them. Under
FSDP2 (``--ep N --dp M --shard fsdp|zero3|zero2``, docs/parallel.md §14.6) the layout is
torchtitan's (``parallelize_deepseekv3``/``parallelize_qwen3``'s ``apply_fsdp``, ``ParallelDims``'
``dp_shard_mod_ep``/``efsdp`` and ``dp_shard_in_ep``/``ep`` meshes): DP·EP ranks, each its own
micro-batch; every experts module its own ``fully_shard`` unit over the DP ranks that hold the same
E/EP experts (:func:`shard_experts`: ``Shard(0)`` of the local experts, ``Shard(1)`` where
DP·EP > E), the rest of each block and the root over all DP·EP ranks (the flattened
``dp_shard × ep`` mesh: torchtitan's ``dp_shard``, of which EP is a factor).

Torch is imported only inside the functions that need it.
"""
from __future__ import annotations

import dataclasses
import math
import weakref
from typing import Mapping

from symcost.errors import SymcostError

#: spec.build -> {experts' placement dim -> memo of :func:`fsdp_indivisible`'s parameter dimensions}
_FSDP_DIMS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

#: the built-in ``moe`` experts' stacked weights (symcost/frontends/builtin/moe.py ``Experts``)
BUILTIN_WEIGHTS = ("w1", "w2", "w3")

#: spec.build -> memo of :func:`etp_indivisible`'s experts' hidden widths
_ETP_DIMS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def expert_parallel(spec, etp: bool = False):
    """The expert-parallel dimension's part of a layout's spec (:meth:`symcost.frontends.layout.
    Layout.spec` calls it): ``spec`` with the symbol ``EP`` (the ranks the E routed experts are
    sharded over) and the probe rules that keep the per-rank sizes polynomial in it.

    Probes must have EP divide E (each rank holds E/EP whole experts: ``Shard(0)`` of the
    stacked weights, which PyTorch would otherwise split unevenly); probes draw EP from 2, 4 and
    8 and keep E in the request's residue class mod 8 (``moduli``), so EP can vary alone. The
    formulas say ``/EP`` where a rank holds a share of the experts.

    With ``etp`` (``--ep N --tp M --etp M``, docs/parallel.md §14.10) every TP rank routes all of
    its micro-batch's tokens and holds 1/TP of each local expert's hidden width: probes must have
    TP divide that width (:func:`etp_indivisible`), and TP need not divide EP nor B·S.

    Raises:
        SymcostError: ``spec`` has no routed experts (no symbols E and R).
    """
    if "E" not in spec.all_symbols or "R" not in spec.all_symbols:
        raise SymcostError(f"--ep shards the routed experts of a mixture-of-experts model; {spec.name} has none "
                           "(no symbols E and R)")
    if "EP" in spec.symbols:
        return spec
    inner_probe = spec.probe_check
    inner_check = spec.check

    def probe_check(values: Mapping[str, int]):
        why = inner_probe(values) if inner_probe else None
        if why or "EP" not in values:
            return why
        if etp:
            return indivisible(values) or etp_indivisible(spec, values) or whole_slots(values, tp=1)
        return indivisible(values) or tp_indivisible(values) or whole_slots(values)

    def check(values: Mapping[str, int]):
        if etp:
            return ((inner_check(values) if inner_check else None) or indivisible(values)
                    or etp_indivisible(spec, values))
        return (inner_check(values) if inner_check else None) or indivisible(values) or tp_indivisible(values)

    defaults = dict(spec.defaults, EP=spec.defaults.get("EP", 8))
    moduli = dict(spec.moduli, E=math.lcm(spec.moduli.get("E", 1), 8))
    return dataclasses.replace(spec, symbols=tuple(spec.symbols) + ("EP",), defaults=defaults,
                               probe_check=probe_check, check=check, moduli=moduli)


def experts_shard_dim(values: Mapping[str, int]) -> int:
    """FSDP2's placement dimension of the experts' local weights ``[E/EP, ...]`` at ``values``
    (``DP``, ``EP``, ``E``), torchtitan's rule (``apply_fsdp``: ``Shard(1)`` where
    ``efsdp·ep > num_experts``, so that no DP rank is left with an empty or padded shard of the
    E/EP local experts; else ``Shard(0)``): 1 where DP·EP > E, else 0."""
    return 1 if int(values["DP"]) * int(values["EP"]) > int(values["E"]) else 0


def shard_experts(model, mesh, reshard: bool, kw: Mapping, dim: int = 0) -> None:
    """``fully_shard`` every experts module of ``model`` (:func:`experts_modules`, after
    :func:`apply`) as its own unit over ``mesh`` (the expert-data-parallel group: the DP ranks
    that hold the same E/EP experts), as torchtitan's ``apply_fsdp`` does under EP, before the
    blocks are wrapped over the dense mesh: its stacked weights, ``Shard(0)`` DTensors over ``ep``,
    sharded again on dimension ``dim`` (:func:`experts_shard_dim`) of their local tensor.
    ``reshard``: ``reshard_after_forward``; ``kw``: the other ``fully_shard`` options (mixed
    precision). Their gradients are reduce-scattered over ``mesh`` only."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    for _, m, _ in experts_modules(model):
        fully_shard(m, mesh=mesh, reshard_after_forward=reshard, shard_placement_fn=lambda p: Shard(dim), **kw)


def replicate_experts(model, mesh, kw: Mapping) -> None:
    """``replicate`` (PyTorch's DDP on the FSDP2 engine, :func:`symcost.frontends.parallel.wrap`)
    every experts module of ``model`` (:func:`experts_modules`, after :func:`apply`) as its own
    unit over ``mesh``, the expert-data-parallel group (the DP ranks that hold the same E/EP
    experts: Megatron-Core's ``expt_dp_group``, docs/parallel.md §14.11), before the blocks are
    replicated over the dense mesh: their gradients (the ``Shard(0)`` DTensors' local
    ``[E/EP, ...]`` tensors) are all-reduced over ``mesh`` only, as Megatron's DDP reduces its
    expert-parallel buffers over the expert-data-parallel group. ``kw``: the other engine options
    (mixed precision)."""
    from torch.distributed._composable.replicate_with_fsdp import replicate

    for _, m, _ in experts_modules(model):
        replicate(m, mesh=mesh, **kw)


def fsdp_indivisible(spec, values: Mapping[str, int], dim: int = 0) -> str | None:
    """Why a probe of expert parallelism under FSDP2 (:func:`shard_experts`) has per-rank sizes
    that are not polynomial in DP and EP, or None: the dense parameters' first dimensions must be
    multiples of lcm(DP, 4)·lcm(EP, 4) (FSDP2 shards them over DP·EP ranks; the lcm with 4 lets DP
    and EP each vary alone from the probe, as :func:`symcost.frontends.parallel.data_parallel`),
    and the experts' local weights ``[E/EP, ...]`` must split over DP on dimension ``dim``
    (``E/EP`` a multiple of lcm(DP, 4) for ``Shard(0)``, each weight's second dimension for
    ``Shard(1)``). Parameters built on the meta device, memoised per model."""
    from symcost.frontends.memo import memo_per_model, meta_model

    def build(v):
        model = meta_model(spec, v)
        experts = {id(p) for _, m, _ in experts_modules(model) for p in m.parameters()}
        dense = sorted({int(p.shape[0]) for p in model.parameters() if p.dim() and id(p) not in experts})
        ex = sorted({int(p.shape[dim]) for _, m, _ in experts_modules(model) for p in m.parameters(recurse=False)
                     if p.dim() > dim})
        return tuple(dense), tuple(ex)

    v = {k: x for k, x in values.items() if k not in ("DP", "EP", "TP")}
    if "L" in v:
        v["L"] = min(v["L"], int(getattr(spec, "lead_blocks", 0) or 0) + 2)
    memo = _FSDP_DIMS.setdefault(spec.build, {}).setdefault(dim, {})
    dense, ex = memo_per_model(memo, v, build)
    dp, ep = int(values["DP"]), int(values["EP"])
    m = math.lcm(dp, 4) * math.lcm(ep, 4)
    bad = [d for d in dense if d % m]
    if bad:
        return f"a dense parameter's first dimension, {bad[0]}, is no multiple of lcm(DP={dp}, 4)·lcm(EP={ep}, 4)"
    k = math.lcm(dp, 4)
    bad = [d for d in ex if (d // ep if dim == 0 else d) % k]
    if bad:
        return f"the experts' dimension {dim} ({bad[0]}{'/EP' if dim == 0 else ''}) is no multiple of lcm(DP={dp}, 4)"
    return None


def indivisible(values: Mapping[str, int]) -> str | None:
    """Why ``values["EP"]`` ranks cannot each hold whole experts of ``values["E"]``, or None."""
    ep, e = values.get("EP"), values.get("E")
    if ep is None or e is None:
        return None
    if e % ep:
        return (f"--ep {ep} does not divide the E={e} routed experts (each EP rank holds E/EP whole experts; "
                "accepted: an EP that divides E)")
    return None


def whole_slots(values: Mapping[str, int], tp: int | None = None) -> str | None:
    """Why a probe of an expert-parallel trace has no whole number N·R/E of slots per expert
    (the balanced split sizes of the all-to-alls, :func:`hf_forward`), or None; with ``TP``
    (``--ep --tp``: each TP rank routes N/TP tokens) N/TP·R/E; ``tp``: the ranks the tokens are
    split over where not ``values["TP"]`` (1 under ``--etp``: every TP rank routes all N)."""
    tp = int(values.get("TP", 1)) if tp is None else tp
    try:
        n = values["B"] * values["S"]
        if n % tp or (n // tp * values["R"]) % values["E"]:
            return "B·S/TP·R/E slots per expert must be whole at a probe (the all-to-all's split sizes)"
    except KeyError:
        return None
    return None


def tp_indivisible(values: Mapping[str, int]) -> str | None:
    """Why ``--ep`` with ``--tp`` cannot lay out ``values``, or None: the EP group borrows the TP
    ranks (torchtitan's ``ParallelDims``: ``ep`` innermost in ``efsdp × ep = dp_shard · tp``), so TP
    must divide EP; each TP rank routes N/TP of its micro-batch's N = B·S tokens
    (``_split_along_sp``), so TP must divide B·S."""
    tp, ep = values.get("TP"), values.get("EP")
    if tp is None or ep is None:
        return None
    if int(ep) % int(tp):
        return (f"--ep {ep} with --tp {tp}: the EP group borrows the TP ranks (torchtitan's layout: EP consecutive "
                "ranks hold EP/TP tensor-parallel groups), so TP must divide EP; accepted: an EP that is a "
                "multiple of TP")
    if "B" in values and "S" in values and (int(values["B"]) * int(values["S"])) % int(tp):
        return (f"--ep with --tp {tp}: each TP rank routes N/TP of the B·S = {values['B'] * values['S']} tokens; "
                "accepted: B·S a multiple of TP")
    return None


def hidden_dims(m, kind: str) -> dict[str, tuple[int, int]]:
    """``{parameter name: (dimension, packs)}`` of an experts module's stacked weights along
    each expert's hidden width F, the dimension expert-tensor parallelism splits over TP
    (torchtitan's ``ExpertTensorParallel``: ``w1``, ``w3 [E, F, M]`` ``Shard(1)``, ``w2 [E, M, F]``
    ``Shard(2)``): the built-in ``moe``'s ``w1``/``w3`` 1 and ``w2`` 2; transformers' ``gate_up_proj``
    (``[E, 2F, M]``, ``[E, M, 2F]`` where ``is_transposed``: the gate's F rows, then the up's, so
    ``packs`` = 2: each half split alike) or ``up_proj``, and ``down_proj`` (``[E, M, F]``, ``[E, F, M]``
    transposed). ``kind`` as :func:`experts_modules`."""
    if kind == "builtin":
        return {"w1": (1, 1), "w3": (1, 1), "w2": (2, 1)}
    t = bool(getattr(m, "is_transposed", False))
    up = ("gate_up_proj", 2) if m.has_gate else ("up_proj", 1)
    return {up[0]: (2 if t else 1, up[1]), "down_proj": (1 if t else 2, 1)}


def etp_indivisible(spec, values: Mapping[str, int]) -> str | None:
    """Why ``values["TP"]`` ranks cannot each hold 1/TP of every local expert's hidden width
    (:func:`hidden_dims`, ``--etp``), or None: TP must divide each expert's F (the model built on
    the meta device at ``values``, memoised per model). Checked at the request as at probes: an
    uneven split (a DTensor ``Shard`` of F/TP rounded up on some ranks) is not modelled."""
    from symcost.frontends.memo import memo_per_model, meta_model

    tp = values.get("TP")
    if tp is None:
        return None

    def build(v):
        model = meta_model(spec, v)
        return tuple(sorted({int(getattr(m, n).shape[d]) // k for _, m, kind in experts_modules(model)
                             for n, (d, k) in hidden_dims(m, kind).items()}))

    v = {k: x for k, x in values.items() if k not in ("DP", "EP", "TP")}
    if "L" in v:
        v["L"] = min(v["L"], int(getattr(spec, "lead_blocks", 0) or 0) + 2)
    v = {k: x for k, x in spec.values(v, inputs=False).items() if k not in ("DP", "EP", "TP")}  # (tied followers: K)
    widths = memo_per_model(_ETP_DIMS.setdefault(spec.build, {}), v, build)
    bad = [w for w in widths if w % int(tp)]
    if bad:
        return (f"--etp {tp} splits each expert's hidden width over the TP ranks, and {bad[0]} does not split "
                f"over {tp} (accepted: a TP that divides the experts' hidden width)")
    return None


def shard_hidden(p, mesh, dim: int, packs: int):
    """The stacked expert weight ``p [E, ...]`` as a ``DTensor`` on the 2-D ``(ep, tp)`` ``mesh``:
    ``[Shard(0), Shard(dim)]`` (torchtitan's ``ExpertTensorParallel._partition_fn``; each rank cuts
    its own shard, ``src_data_rank=None``). A packed weight (``packs`` = 2: transformers'
    ``gate_up_proj``, the gate's F rows then the up's) is cut half by half, so that the rank's
    local tensor holds its F/TP rows of the gate, then of the up projection (the local shard a
    split gate and up weight would give; the DTensor's global order is then rank-major, which
    only ``full_tensor`` would see)."""
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    if packs == 1:
        return distribute_tensor(p.detach(), mesh, [Shard(0), Shard(dim)], src_data_rank=None)
    shape = list(p.shape)
    split = shape[:dim] + [packs, shape[dim] // packs] + shape[dim + 1:]
    d = distribute_tensor(p.detach().reshape(split), mesh, [Shard(0), Shard(dim + 1)], src_data_rank=None)
    local = d.to_local()
    local = local.reshape(list(local.shape[:dim]) + [-1] + list(local.shape[dim + 2:]))
    return DTensor.from_local(local, mesh, [Shard(0), Shard(dim)], run_check=False, shape=p.shape,
                              stride=p.stride())


def experts_modules(model) -> list[tuple[str, object, str]]:
    """``[(name, module, kind)]`` of the experts modules of ``model``: ``kind`` ``"builtin"`` for
    the built-in ``moe`` model's (stacked weights ``w1, w3 [E, F, M]``, ``w2 [E, M, F]``, a
    routing model), ``"hf"`` for transformers' ``@use_experts_implementation`` classes
    (``gate_up_proj``/``up_proj`` and ``down_proj`` stacked over ``num_experts``)."""
    from symcost.frontends.moe import ROUTING_ATTR, _is_hf_experts

    out = []
    for n, m in model.named_modules():
        if hasattr(m, ROUTING_ATTR) and all(hasattr(m, w) for w in BUILTIN_WEIGHTS):
            out.append((n, m, "builtin"))
        elif _is_hf_experts(m):
            out.append((n, m, "hf"))
    return out


def apply(model, mesh, tp_mesh=None, experts_mesh=None) -> None:
    """Shard every experts module of ``model`` over the 1-D ``mesh`` (the ``ep`` dimension) in
    place, as torchtitan's expert-parallel style does: each stacked weight a ``DTensor``
    ``Shard(0)`` (the rank's E/EP experts; ``src_data_rank=None``: every rank cuts its own shard,
    no scatter), and the module's forward the all-to-all dispatch of :func:`builtin_forward`.
    With ``tp_mesh`` (``--ep --tp``): each TP rank routes its N/TP of the MoE layer's tokens and
    the layer is laid over the TP group as torchtitan's ``apply_moe_ep_tp`` does
    (:func:`symcost.frontends.expert_parallel_tp.apply`). With ``experts_mesh``, the 2-D
    ``(ep, tp)`` mesh (``--etp``, torchtitan's ``ExpertTensorParallel``, docs/parallel.md §14.10):
    each stacked weight ``[Shard(0), Shard(d)]`` along the experts' hidden width
    (:func:`hidden_dims`, :func:`shard_hidden`), the tokens not split over TP (every TP rank
    dispatches all N of its micro-batch over ``mesh``, the EP group of its TP coordinate), the
    experts' outputs partial sums over TP, reduced at the layer's boundary as under etp = 1.

    Raises:
        SymcostError: the model has no experts module symcost can shard (``--ep`` covers the
            built-in ``moe`` for now).
    """
    import types

    import torch
    from torch.distributed.tensor import Shard, distribute_tensor

    from symcost.frontends.moe import CODE_ATTR, routing_of

    found = experts_modules(model)
    if not found and getattr(model, "symcost_stage", None) is not None:
        # a pipeline stage of dense blocks only (DeepSeek-V3's first stage at PP >= 21): its
        # blocks run whole on every rank, as torchtitan's apply_moe_ep_tp visits MoE blocks only
        return
    if not found:
        raise SymcostError("--ep: the model has no experts module symcost shards over EP ranks (the built-in "
                           "`moe` model's, transformers' stacked experts)")
    for name, m, kind in found:
        e = m.num_experts
        if e % mesh.size():
            raise SymcostError(f"--ep {mesh.size()} does not divide the {e} experts")
        if kind == "hf" and routing_of(m).kind == "capacity":
            raise SymcostError(f"--ep with --routing {routing_of(m).name}: transformers' experts under expert "
                               "parallelism are traced under balanced routing and skew=X only for now "
                               "(docs/parallel.md §14.5)")
        if kind == "hf" and (m.has_bias or not getattr(m, "is_concatenated", True)):
            raise SymcostError(f"--ep: {type(m).__name__} has expert biases or interleaved gate/up weights "
                               "(gpt-oss); their expert-parallel dispatch is not modelled yet")
        hidden = hidden_dims(m, kind) if experts_mesh is not None else {}
        for pname, p in list(m.named_parameters(recurse=False)):
            if pname in hidden:  # (--etp: Shard(0) over ep, the hidden width over tp)
                d = shard_hidden(p, experts_mesh, *hidden[pname])
                m.register_parameter(pname, torch.nn.Parameter(d, requires_grad=p.requires_grad))
            elif p.dim() and p.shape[0] == e:  # (every stacked expert tensor: Shard(0))
                d = distribute_tensor(p.detach(), mesh, [Shard(0)], src_data_rank=None)
                m.register_parameter(pname, torch.nn.Parameter(d, requires_grad=p.requires_grad))
        object.__setattr__(m, "ep_mesh", mesh)
        # (the rank's N/TP tokens under etp = 1; all N under --etp, whose TP ranks split the experts)
        object.__setattr__(m, "tp_mesh", tp_mesh if experts_mesh is None else None)
        code = getattr(m, CODE_ATTR, None) if kind == "hf" else None
        if code is not None:  # (--precision megatron-*: Megatron-Core's dispatcher, frontends.megatron_moe)
            m.forward = types.MethodType(code[1], m)
        else:
            m.forward = types.MethodType(builtin_forward if kind == "builtin" else hf_forward, m)
    if tp_mesh is not None:
        from symcost.frontends import expert_parallel_tp

        expert_parallel_tp.apply(model, tp_mesh, found)


def _local(t):
    """A DTensor weight's local shard through autograd (``to_local()``: its gradient comes back
    as a ``Shard(0)`` DTensor, the parameter's), else ``t``. The local tensor is taken from a
    DTensor view of the parameter: a DTensor op on the parameter itself, through which the
    recorder names its local tensor (``name_local_params``) where FSDP2 set a new unsharded
    parameter after its all-gather (EP under FSDP2, docs/parallel.md §14.6; else the rank's GEMMs
    would not count the experts in 6·N·P's P). A view: no bytes, no FLOPs."""
    if not hasattr(t, "to_local"):
        return t
    return t.view(t.shape).to_local()


def exchange(x, mesh, received: int | None = None):
    """``all_to_all_single`` of ``x [EP·k, ...]`` over ``mesh``'s group with equal splits (k rows
    to each rank; ``received``: the rows received from each rank, default k), with autograd (its
    backward is the same exchange of the gradient, splits swapped):
    ``torch.distributed._functional_collectives.all_to_all_single_autograd``."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    n = mesh.size()
    k = x.shape[0] // n
    r = k if received is None else received
    return all_to_all_single_autograd(x, [r] * n, [k] * n, mesh.get_group())


def count_exchange(expert_ids, e: int, mesh):
    """The split-size exchange before a dispatch (torchtitan's ``_token_count_exchange``): the
    rank's tokens per expert ``[E]`` (int64, ``histc`` of ``expert_ids``) sent as ``[EP, E/EP]``
    by ``all_to_all_single`` (no autograd). Its values are not read: under the routing model the
    split sizes are fixed (the module docstring)."""
    import torch
    from torch.distributed._functional_collectives import all_to_all_single

    ep = mesh.size()
    with torch.no_grad():
        counts = torch.histc(expert_ids.reshape(-1).float(), bins=e, min=0, max=e - 1).to(torch.int64)
        got = all_to_all_single(counts.view(ep, e // ep), None, None, mesh.get_group())
        return torch.ops._c10d_functional.wait_tensor(got)  # (torchtitan waits explicitly here too)


def rank_slots(self, hidden_states, top_k_index, top_k_weights):
    """The tokens an expert-parallel rank routes and the rows it receives per local expert:
    ``(hidden_states, top_k_index, top_k_weights, start, xq)``. With the ``tp_mesh`` of ``--ep --tp``
    this TP rank's N/TP tokens from row ``start`` (docs/parallel.md §14.8), else all N (start 0); ``xq`` = X·N·R/E, the rows
    per local expert this rank receives from each rank (X = 1 balanced, ``--routing skew=X`` the
    most loaded rank). Used by :func:`hf_forward` and Megatron's dispatcher
    (:func:`symcost.frontends.megatron_moe.ep_forward`).

    Raises:
        SymcostError: X > EP, or X·N·R/E no whole number."""
    from symcost.frontends.moe import routing_of

    ep, e = self.ep_mesh.size(), self.num_experts
    tp_mesh, start = getattr(self, "tp_mesh", None), 0
    if tp_mesh is not None:
        from symcost.frontends.expert_parallel_tp import token_slice

        start, rows = token_slice(hidden_states.shape[0], tp_mesh)
        hidden_states = hidden_states[start:start + rows]
        top_k_index, top_k_weights = top_k_index[start:start + rows], top_k_weights[start:start + rows]
    s = hidden_states.shape[0] * top_k_index.shape[-1]
    routing = routing_of(self)
    if routing.skew > ep:
        raise SymcostError(f"--routing {routing.name} with --ep {ep}: the most loaded rank receives at most every "
                           f"rank's slots (accepted: 1 <= X <= EP)")
    xq = routing.skew * (s // e)  # (skew=X: the rows per local expert this rank receives from each rank)
    if xq.denominator != 1:
        raise SymcostError(f"--routing {routing.name}: X·N·R/E = {xq} rows per expert is no whole number "
                           "(accepted: an X that makes it whole)")
    return hidden_states, top_k_index, top_k_weights, start, int(xq)


def hf_forward(self, hidden_states, top_k_index, top_k_weights):
    """transformers' stacked experts (``grouped_mm_experts_forward``, transformers/integrations/
    moe.py) on one EP rank, under balanced routing: ``hidden_states [N, M]``, ``top_k_index``,
    ``top_k_weights [N, R]`` -> ``[N, M]``.

    The N·R slots sorted by expert and gathered (``[N·R, M]``, expert-major: rank j's experts'
    rows are the j-th 1/EP), the count exchange (:func:`count_exchange`), the dispatch
    ``all_to_all_single`` of N·R/EP rows to each rank, rank-major ``[EP, E/EP, N·R/E, M]`` ->
    expert-major (torchtitan's ``_permute``), the local experts' grouped GEMMs
    (transformers' ``_grouped_linear`` on the weight shards ``[E/EP, …]``, offsets of
    EP·N·R/E slots per local expert), the gate, the inverse permutation, the combine
    ``all_to_all_single``, then the routing weights, the inverse sort and the sum over a token's R
    slots as transformers does. Balanced routing makes every split N·R/EP rows, so N·R/E must be a
    whole number (the probes keep it).

    Under ``--routing skew=X`` the rank is the most loaded one, as in :func:`builtin_forward`: it
    receives X·N·R/E rows per local expert from every rank (the dispatch's output splits), its
    grouped GEMMs run on EP·X·N·R/E rows per expert, and the combine sends those rows back (its
    input splits); its own N·R slots go out balanced. X·N·R/E must be whole (the probes keep it).
    """
    import torch
    from transformers.integrations.moe import _grouped_linear

    mesh = self.ep_mesh
    ep, e = mesh.size(), self.num_experts
    local = e // ep
    full = hidden_states
    tp_mesh = getattr(self, "tp_mesh", None)
    hidden_states, top_k_index, top_k_weights, start, xq = rank_slots(self, hidden_states, top_k_index, top_k_weights)
    n, m = hidden_states.shape
    r = top_k_index.shape[-1]
    s = n * r
    ids_g, perm = torch.sort(top_k_index.reshape(-1))
    x_g = hidden_states[perm // r]  # [N·R, M], expert-major
    w_g = top_k_weights.reshape(-1)[perm]
    count_exchange(ids_g, e, mesh)
    h = exchange(x_g, mesh, local * xq).view(ep, local, xq, m).transpose(0, 1).reshape(ep * local * xq, m)  # expert-major
    offsets = torch.full((local,), ep * xq, dtype=torch.int32, device=h.device).cumsum(0, dtype=torch.int32)
    w_up = _local(self.gate_up_proj if self.has_gate else self.up_proj)
    out = _grouped_linear(h, w_up, offsets, is_transposed=self.is_transposed)
    out = self._apply_gate(out) if self.has_gate else self.act_fn(out)
    out = _grouped_linear(out, _local(self.down_proj), offsets, is_transposed=self.is_transposed)
    if self.has_post_expert_norm:
        out = self.post_expert_norm(out)
    out = out.view(local, ep, xq, m).transpose(0, 1).reshape(ep * local * xq, m)  # rank-major again
    out = exchange(out, mesh, local * (s // e)) * w_g.unsqueeze(-1)  # back in x_g's order, weighted
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.size(0), device=perm.device)
    out = out[inv].view(n, r, m).sum(dim=1).to(hidden_states.dtype)
    if tp_mesh is not None:
        from symcost.frontends.expert_parallel_tp import place

        out = place(out, start, full.shape[0])
    return out


def builtin_forward(self, x, weights, experts):
    """The built-in ``moe`` experts (``Experts.forward``) on one EP rank: token states
    ``x [N, M]``, the router's ``weights, experts [N, R]`` -> ``[N, M]``.

    1. the static dispatch into ``[E, C, M]`` buffers (:func:`symcost.frontends.moe.dispatch`),
       C = c·N·R/E slots per expert (the routing model);
    2. the tokens per expert ``[E]`` (int64, ``histc`` of the choices) exchanged as ``[EP, E/EP]``
       (torchtitan's ``_token_count_exchange``, :func:`count_exchange`; with fixed capacities
       the split sizes do not depend on it);
    3. dispatch: ``all_to_all_single`` of the ``[E·C, M]`` rows, E/EP·C to each rank; the
       received rows, rank-major ``[EP, E/EP, C, M]``, permuted to expert-major
       ``[E/EP, EP·C, M]`` (torchtitan's ``_permute``);
    4. the local experts' SwiGLU as batched GEMMs on the weight shards ``[E/EP, F, M]``:
       2·(E/EP)·(EP·C)·M·F FLOPs per GEMM, the same as one device's 2·E·C·M·F / EP;
    5. the inverse permutation and the combine ``all_to_all_single`` back to ``[E, C, M]``,
       then :func:`symcost.frontends.moe.combine`.

    Under ``--routing skew=X`` the rank is the most loaded one: it receives X·C rows per local
    expert from every rank (the dispatch's output splits), its experts run on EP·X·C slots each,
    and the combine sends those X·C rows back (its input splits); its own tokens go out balanced.
    """
    import torch
    import torch.nn.functional as F

    from symcost.frontends import moe

    mesh = self.ep_mesh
    ep = mesh.size()
    full = x.shape[0]
    tp_mesh = getattr(self, "tp_mesh", None)
    if tp_mesh is not None:  # (--ep --tp: this TP rank's N/TP tokens, docs/parallel.md §14.8)
        from symcost.frontends.expert_parallel_tp import token_slice

        start, rows = token_slice(full, tp_mesh)
        x, weights, experts = x[start:start + rows], weights[start:start + rows], experts[start:start + rows]
    n, e = x.shape[0], self.num_experts
    r = experts.shape[-1]
    routing = moe.routing_of(self)
    if routing.skew > ep:
        raise SymcostError(f"--routing {routing.name} with --ep {ep}: the most loaded rank receives at most every "
                           f"rank's slots (accepted: 1 <= X <= EP)")
    c = routing.capacity(n, r, e)
    # skew=X: the most loaded rank's experts receive X·C rows from every rank (moe.Routing)
    xc = int(routing.skew * c)
    buf, dest, token = moe.dispatch(x, experts, e, c)  # [E, C, M]
    count_exchange(experts, e, mesh)
    m = x.shape[-1]
    local = e // ep
    got = exchange(buf.reshape(e * c, m), mesh, local * xc)  # rows of this rank's experts, from every rank
    h = got.view(ep, local, xc, m).transpose(0, 1).reshape(local, ep * xc, m)  # expert-major
    w1, w2, w3 = _local(self.w1), _local(self.w2), _local(self.w3)
    h = F.silu(moe.expert_linear(h, w1)) * moe.expert_linear(h, w3)
    out = moe.expert_linear(h, w2)  # [E/EP, EP·X·C, M]
    out = out.view(local, ep, xc, m).transpose(0, 1).reshape(ep * local * xc, m)  # rank-major again
    out = exchange(out, mesh, local * c).view(e, c, m)
    out = moe.combine(out, dest, token, weights, n)
    if tp_mesh is not None:
        from symcost.frontends.expert_parallel_tp import place

        out = place(out, start, full)
    return out


def grouped_mm_shapes():
    """A context under which ``aten._grouped_mm`` (transformers' experts code) answers with a new
    output of its shape only, for model code run on fake tensors outside the recorder to learn
    shapes (a pipeline stage's boundary, :func:`symcost.frontends.pipeline.probe_spec`): the meta
    kernel PyTorch's ``FakeTensorMode`` runs asks for bf16 operands (the CUDA kernel's rule;
    torch/_meta_registrations.py ``_meta_grouped_mm_common``) while the step passes fp32 ones under
    fp32 and bf16-mixed (transformers casts the tokens to the weights' dtype). The shapes are
    PyTorch's (``_create_grouped_mm_output_tensor``): ``[M, K] × [G, K, N] -> [M, N]``,
    ``[M, K] × [K, N] -> [G, M, N]``, ``[G, M, K] × [K, N] -> [M, N]``, ``[G, M, K] × [G, K, N] ->
    [G, M, N]``; the recorder answers the op itself (:mod:`symcost.tracing.grouped_mm`)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    op = torch.ops.aten._grouped_mm.default

    class Shapes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is not op:
                return func(*args, **kwargs)
            a, b = args[0], args[1]
            offs = args[2] if len(args) > 2 else kwargs.get("offs")
            a2, b2 = a.dim() == 2, b.dim() == 2
            shape = ((offs.shape[0], a.shape[0], b.shape[1]) if a2 and b2 else (a.shape[0], b.shape[-1]) if a2
                     else (a.shape[1], b.shape[-1]) if b2 else (a.shape[0], a.shape[1], b.shape[-1]))
            dtype = kwargs.get("out_dtype") or (args[4] if len(args) > 4 and args[4] is not None else a.dtype)
            return a.new_empty(shape, dtype=dtype)

    return Shapes()
