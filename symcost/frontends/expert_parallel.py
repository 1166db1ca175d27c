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
(non-expert) parameters replicated, and nothing reduces the dense gradients across them: that
reduction belongs to a data-parallel dimension (torchtitan borrows the EP ranks from
``dp_shard·cp·tp``); ``--ep`` is modelled alone for now (docs/parallel.md §14).

Torch is imported only inside the functions that need it.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Mapping

from symcost.errors import SymcostError

#: the built-in ``moe`` experts' stacked weights (symcost/frontends/builtin/moe.py ``Experts``)
BUILTIN_WEIGHTS = ("w1", "w2", "w3")


def expert_parallel(spec):
    """The expert-parallel dimension's part of a layout's spec (:meth:`symcost.frontends.layout.
    Layout.spec` calls it): ``spec`` with the symbol ``EP`` (the ranks the E routed experts are
    sharded over) and the probe rules that keep the per-rank sizes polynomial in it.

    Probes must have EP divide E (each rank holds E/EP whole experts: ``Shard(0)`` of the
    stacked weights, which PyTorch would otherwise split unevenly); probes draw EP from 2, 4 and
    8 and keep E in the request's residue class mod 8 (``moduli``), so EP can vary alone. The
    formulas say ``/EP`` where a rank holds a share of the experts.

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
        return indivisible(values)

    def check(values: Mapping[str, int]):
        return (inner_check(values) if inner_check else None) or indivisible(values)

    defaults = dict(spec.defaults, EP=spec.defaults.get("EP", 8))
    moduli = dict(spec.moduli, E=math.lcm(spec.moduli.get("E", 1), 8))
    return dataclasses.replace(spec, symbols=tuple(spec.symbols) + ("EP",), defaults=defaults,
                               probe_check=probe_check, check=check, moduli=moduli)


def indivisible(values: Mapping[str, int]) -> str | None:
    """Why ``values["EP"]`` ranks cannot each hold whole experts of ``values["E"]``, or None."""
    ep, e = values.get("EP"), values.get("E")
    if ep is None or e is None:
        return None
    if e % ep:
        return (f"--ep {ep} does not divide the E={e} routed experts (each EP rank holds E/EP whole experts; "
                "accepted: an EP that divides E)")
    return None


def experts_modules(model) -> list[tuple[str, object]]:
    """``[(name, module)]`` of the built-in ``moe`` model's experts modules (stacked weights
    ``w1, w3 [E, F, M]``, ``w2 [E, M, F]``, a routing model)."""
    from symcost.frontends.moe import ROUTING_ATTR

    return [(n, m) for n, m in model.named_modules()
            if hasattr(m, ROUTING_ATTR) and all(hasattr(m, w) for w in BUILTIN_WEIGHTS)]


def apply(model, mesh) -> None:
    """Shard every experts module of ``model`` over the 1-D ``mesh`` (the ``ep`` dimension) in
    place, as torchtitan's expert-parallel style does: each stacked weight a ``DTensor``
    ``Shard(0)`` (the rank's E/EP experts; ``src_data_rank=None``: every rank cuts its own shard,
    no scatter), and the module's forward the all-to-all dispatch of :func:`builtin_forward`.

    Raises:
        SymcostError: the model has no experts module symcost can shard (``--ep`` covers the
            built-in ``moe`` for now).
    """
    import types

    import torch
    from torch.distributed.tensor import Shard, distribute_tensor

    found = experts_modules(model)
    if not found:
        raise SymcostError("--ep: the model has no experts module symcost shards over EP ranks yet (the built-in "
                           "`moe` model's; transformers' experts under --ep are not modelled yet)")
    for _, m in found:
        if m.num_experts % mesh.size():
            raise SymcostError(f"--ep {mesh.size()} does not divide the {m.num_experts} experts")
        for name in BUILTIN_WEIGHTS:
            p = getattr(m, name)
            d = distribute_tensor(p.detach(), mesh, [Shard(0)], src_data_rank=None)
            m.register_parameter(name, torch.nn.Parameter(d, requires_grad=p.requires_grad))
        object.__setattr__(m, "ep_mesh", mesh)
        m.forward = types.MethodType(builtin_forward, m)


def _local(t):
    """A DTensor weight's local shard through autograd (``to_local()``: its gradient comes back
    as a ``Shard(0)`` DTensor, the parameter's), else ``t``."""
    return t.to_local() if hasattr(t, "to_local") else t


def exchange(x, mesh):
    """``all_to_all_single`` of ``x [EP·k, ...]`` over ``mesh``'s group with equal splits (k rows
    to each rank), with autograd (its backward is the same exchange of the gradient):
    ``torch.distributed._functional_collectives.all_to_all_single_autograd``."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    n = mesh.size()
    k = x.shape[0] // n
    return all_to_all_single_autograd(x, [k] * n, [k] * n, mesh.get_group())


def builtin_forward(self, x, weights, experts):
    """The built-in ``moe`` experts (``Experts.forward``) on one EP rank: token states
    ``x [N, M]``, the router's ``weights, experts [N, R]`` -> ``[N, M]``.

    1. the static dispatch into ``[E, C, M]`` buffers (:func:`symcost.frontends.moe.dispatch`),
       C = c·N·R/E slots per expert (the routing model);
    2. the tokens per expert ``[E]`` (int64, ``histc`` of the choices) exchanged as ``[EP, E/EP]``
       (torchtitan's ``_token_count_exchange``; with fixed capacities the split sizes do not
       depend on it);
    3. dispatch: ``all_to_all_single`` of the ``[E·C, M]`` rows, E/EP·C to each rank; the
       received rows, rank-major ``[EP, E/EP, C, M]``, permuted to expert-major
       ``[E/EP, EP·C, M]`` (torchtitan's ``_permute``);
    4. the local experts' SwiGLU as batched GEMMs on the weight shards ``[E/EP, F, M]``:
       2·(E/EP)·(EP·C)·M·F FLOPs per GEMM, the same as one device's 2·E·C·M·F / EP;
    5. the inverse permutation and the combine ``all_to_all_single`` back to ``[E, C, M]``,
       then :func:`symcost.frontends.moe.combine`.
    """
    import torch
    import torch.nn.functional as F

    from symcost.frontends import moe

    mesh = self.ep_mesh
    ep = mesh.size()
    n, e = x.shape[0], self.num_experts
    r = experts.shape[-1]
    c = moe.routing_of(self).capacity(n, r, e)
    buf, dest, token = moe.dispatch(x, experts, e, c)  # [E, C, M]
    with torch.no_grad():  # the split-size exchange (its values are not read: fixed capacities)
        counts = torch.histc(experts.reshape(-1).float(), bins=e, min=0, max=e - 1).to(torch.int64)
        from torch.distributed._functional_collectives import all_to_all_single

        got = all_to_all_single(counts.view(ep, e // ep), None, None, mesh.get_group())
        torch.ops._c10d_functional.wait_tensor(got)  # (torchtitan waits explicitly here too)
    m = x.shape[-1]
    local = e // ep
    got = exchange(buf.reshape(e * c, m), mesh)  # rows of this rank's experts, from every rank
    h = got.view(ep, local, c, m).transpose(0, 1).reshape(local, ep * c, m)  # expert-major
    w1, w2, w3 = _local(self.w1), _local(self.w2), _local(self.w3)
    h = F.silu(moe.expert_linear(h, w1)) * moe.expert_linear(h, w3)
    out = moe.expert_linear(h, w2)  # [E/EP, EP·C, M]
    out = out.view(local, ep, c, m).transpose(0, 1).reshape(e * c, m)  # rank-major again
    out = exchange(out, mesh).view(e, c, m)
    return moe.combine(out, dest, token, weights, n)
