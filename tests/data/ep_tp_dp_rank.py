"""One rank of an EP × TP step under FSDP2 (tests/test_ep_tp.py, docs/parallel.md §14.9) on real
tensors over gloo: the oracle of symcost's per-rank numbers for ``--ep N --tp M --dp D --shard fsdp``.

``python -m torch.distributed.run --standalone --nproc-per-node W ep_tp_dp_rank.py OUT H D L V F E R B S DP TP``
builds the built-in ``moe`` model (fp32) on each of the W = DP·EP ranks, on the mesh
``(dp_shard, ep_rest, tp) = (DP, EP/TP, TP)`` (torchtitan's ``ParallelDims`` with etp = 1 at aeb3a4b:
``dp_shard_mod_ep × dp_shard_in_ep × tp``, ``ep`` = ``dp_shard_in_ep × tp`` flattened, the dense
``dp_shard`` = ``dp_shard_mod_ep × dp_shard_in_ep`` flattened); lays it out EP × TP with symcost's
layout (``Layout(ep=True, tp=True).parallelize``: the input, as tests/data/ep_rank.py ``ep_tp``);
then applies FSDP2 written out here as torchtitan's ``apply_fsdp`` does under EP
(:func:`fsdp_as_torchtitan`); checks the loss against the same model on one device with the TP
group's tokens; and measures one step with :func:`ep_rank.measure` (FLOPs by
``flop_counter``'s registry, ``saved_tensors_hooks``, each collective's bytes per process group
with its bus-bandwidth factor typed there, the local shards' elements, MemTracker's peak), written
to ``OUT/rank{r}.json``. Each TP group its own tokens; the routers balanced.
"""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def fsdp_as_torchtitan(model, mesh, ep: int):
    """FSDP2 over an EP × TP ``model`` on the 3-D ``mesh`` ``(dp_shard, ep_rest, tp)``, as torchtitan's
    ``apply_fsdp`` does with etp = 1 (torchtitan/models/llama4/parallelize.py at 83e4904, ``edp_mesh``
    the ``efsdp`` / formerly ``dp_shard_mod_ep`` mesh): each ``moe.experts`` module ``fully_shard``
    over ``dp_shard`` (the DP ranks holding the same E/EP experts; ``Shard(1)`` of the local experts
    where efsdp·ep > E, else ``Shard(0)``), then each block and the root over the flattened
    ``(dp_shard, ep_rest)`` mesh, torchtitan's dense ``dp_shard`` beside ``tp`` (DP·EP/TP ranks),
    which it returns."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    dense = mesh["dp_shard", "ep_rest"]._flatten("dp_shard_ep")
    for block in model.layers:
        experts = block.moe.experts
        placement = None
        if mesh["dp_shard"].size() * ep > experts.num_experts:
            def placement(p):
                return Shard(1)
        fully_shard(experts, mesh=mesh["dp_shard"], shard_placement_fn=placement)
        fully_shard(block, mesh=dense)
    fully_shard(model, mesh=dense, reshard_after_forward=False)
    return dense


def main():
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from ep_rank import balanced_router, measure
    from symcost.frontends.builtin.cs336_lm import lm_loss
    from symcost.frontends.builtin.moe import MoELM
    from symcost.frontends.layout import Layout

    out_dir = sys.argv[1]
    v = dict(zip("HDLVFERBS", (int(x) for x in sys.argv[2:11])))
    dp, tp = int(sys.argv[11]), int(sys.argv[12])
    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    ep = n // dp
    mesh = init_device_mesh("cpu", (dp, ep // tp, tp), mesh_dim_names=("dp_shard", "ep_rest", "tp"))
    flat = mesh["ep_rest", "tp"]._flatten("ep")
    torch.manual_seed(100 + rank // tp)  # each TP group its own tokens
    tokens = torch.randint(0, v["V"], (v["B"], v["S"]))

    def make():
        torch.manual_seed(0)
        return MoELM(v["V"], v["H"] * v["D"], v["L"], v["H"], v["F"], v["E"], v["R"])

    model, ref = make(), make()
    loss_context = Layout(ep=True, tp=True).parallelize(model, "layers", {"TP": mesh["tp"], "EP": flat})
    dense = fsdp_as_torchtitan(model, mesh, ep)
    groups = {mesh["tp"].get_group().group_name: "TP", flat.get_group().group_name: "EP",
              mesh["dp_shard"].get_group().group_name: "DP_expert", dense.get_group().group_name: "DP"}
    assert len(set(groups)) == 4, groups  # (four process groups of their own, even where two share ranks)
    with balanced_router(), torch.no_grad():
        want = lm_loss(ref(tokens), ((tokens,), {}))
        with loss_context():
            got = lm_loss(model(tokens), ((tokens,), {}))
    got = got.full_tensor() if hasattr(got, "full_tensor") else got
    checks = {"loss": abs(float(got) - float(want))}
    out = measure(model, tokens, peak=True, groups=groups, loss_context=loss_context)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({**out, "world": n, "checks": checks,
                   "ranks": {label: sorted(dist.get_process_group_ranks(g)) for label, g in (
                       ("TP", mesh["tp"].get_group()), ("EP", flat.get_group()),
                       ("DP_expert", mesh["dp_shard"].get_group()), ("DP", dense.get_group()))}}, f)
    from gloo_teardown import finish

    finish()


if __name__ == "__main__":
    main()
