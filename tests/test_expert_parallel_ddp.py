"""Expert parallelism under a replicating data-parallel engine (docs/parallel.md §14.11):
``--ep N --dp M --shard ddp|zero1``, as Megatron-LM runs MoE models (its DistributedDataParallel,
and with ``zero1`` its distributed optimizer) over DP·EP ranks: the dense gradients reduced over
the DP·EP ranks (Megatron's data-parallel group), the experts' over the DP ranks that hold the
same E/EP experts (its expert-data-parallel group).

Oracles, independent of symcost's recorder, engine and fit: PyTorch running the expert-parallel
step on the fake process group (tests/data/ep_rank.py ``build``/``measure``: FLOPs by
``torch.utils.flop_counter``'s registry, ``saved_tensors_hooks``, each collective's bytes per rank
by its process group, nccl-tests' factors typed there) with the gradient reduction written out
here as Megatron-Core's DDP does it (a gradient of an expert-parallel parameter, a DTensor over
the ep mesh, all-reduced over the expert-data-parallel group; every other over the data-parallel
group: megatron/core/distributed/distributed_data_parallel.py, ``expert_parallel_buffers``); and
the distributed optimizer's shard from Megatron's arithmetic (each buffer's elements over its own
group: distrib_optimizer.py ``_build_gbuf_range_map``) on the parameters PyTorch built.
"""
from __future__ import annotations

import os
import random
import sys
from fractions import Fraction

import pytest

import symcost

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "data"))
from ep_rank import build, measure  # noqa: E402

PRECISION = "fp32"
#: the traced request: the widths pinned (the test's), B, S, L, DP and EP symbols
REQUEST = {"DP": 2, "EP": 2, "B": 2, "S": 16, "H": 4, "D": 8, "L": 2, "V": 96, "F": 24, "E": 16, "R": 2}
WIDTHS = ("H", "D", "V", "F", "E", "R")


def megatron_grad_reduction(model, dense_group, expert_group) -> None:
    """Megatron-Core's DDP gradient reduction, written out: once a parameter's gradient is
    accumulated, it is all-reduced over the expert-data-parallel group if the parameter is an
    expert-parallel one (here: a DTensor over the ep mesh, the rank's ``[E/EP, ...]`` experts),
    else over the data-parallel group."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    for p in model.parameters():
        expert = isinstance(p, DTensor)

        def hook(p, expert=expert):
            g = p.grad
            dist.all_reduce(g._local_tensor if isinstance(g, DTensor) else g,
                            group=expert_group if expert else dense_group)

        p.register_post_accumulate_grad_hook(hook)


@pytest.mark.heavy
def test_ep_under_zero1_rank_against_pytorch_on_the_fake_group():
    """``--ep N --dp M --shard zero1`` (Megatron's DDP + distributed optimizer; the widths pinned,
    one trace ~30 s idle): DP and EP symbols; at random B, S, L, DP, EP (DP·EP ranks, mesh
    (dp_replicate, ep)) rank 0's FLOPs, saved bytes, parameter elements (the dense ones whole, E/EP
    experts) and each group's all-reduce and all-to-all bytes equal PyTorch's step on the fake group
    with Megatron's reduction (:func:`megatron_grad_reduction`); the rank's optimizer state is 8
    bytes (AdamW's two fp32 moments) per element of its distributed-optimizer shard, P_dense/(DP·EP)
    + (P_experts/EP)/DP counted on the parameters PyTorch built; parameters and gradients whole."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from symcost.frontends.layout import Layout
    from symcost.frontends.models import resolve
    from symcost.frontends.parallel import fake_world
    from symcost.passes.parallel import summary

    pins = {s: "the test's widths" for s in WIDTHS}
    an = symcost.trace(resolve("moe"), layout=Layout(ep=True, shard="zero1"), sizes=REQUEST, precision=PRECISION,
                       _pins=pins)
    assert {"B", "S", "L", "DP", "EP"} <= set(an.symbols), an.pinned
    rng = random.Random(2911)
    for dp, ep in ((2, 2), rng.choice(((4, 2), (2, 4)))):
        v = {**{k: REQUEST[k] for k in WIDTHS}, "DP": dp, "EP": ep, "B": rng.randint(1, 3),
             "S": 16 * rng.randint(1, 2), "L": rng.randint(1, 3)}
        fake_world(dp * ep)
        mesh = init_device_mesh("cpu", (dp, ep), mesh_dim_names=("dp_replicate", "ep"))
        flat = mesh["dp_replicate", "ep"]._flatten("dp_replicate_ep")
        model = build(v, mesh["ep"])
        megatron_grad_reduction(model, flat.get_group(), mesh["dp_replicate"].get_group())
        groups = {mesh["ep"].get_group().group_name: "EP", mesh["dp_replicate"].get_group().group_name: "DP_expert",
                  flat.get_group().group_name: "DP"}
        got = measure(model, torch.randint(0, v["V"], (v["B"], v["S"])), groups=groups)
        env = an.bind(**{k: x for k, x in v.items() if k in an.symbols})
        assert int(an.flops("train").subs(env)) == got["flops"], v
        assert int(sum(rep * nb for _, nb, _, rep in an.saved).subs(env)) == got["saved"], v
        assert int(an.params_shard.subs(env)) == got["shard"], v
        for g in ("DP", "DP_expert", "EP"):
            for k in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
                want = Fraction(str(an.comm_bytes(k, group=g).subs(env)))
                assert want == Fraction(got["by_group"].get(g, {}).get(k, "0")), (v, g, k)
        assert Fraction(got["by_group"]["DP_expert"]["all_reduce"]) > 0 and Fraction(got["by_group"]["DP"]["all_reduce"]) > 0
        # the distributed optimizer's shard: the dense buffer over DP·EP ranks, the experts' over DP
        local = [(isinstance(p, DTensor), (p._local_tensor if isinstance(p, DTensor) else p).numel())
                 for p in model.parameters()]
        dense = sum(n for e, n in local if not e)
        experts = sum(n for e, n in local if e)
        share = Fraction(dense, dp * ep) + Fraction(experts, dp)
        s = summary(an, PRECISION, sizes={k: x for k, x in v.items() if k in an.symbols})
        mem = s["values"]["memory"]
        # (two fp32 moments of the shard, and torch.optim's 4-byte step per parameter tensor, unsharded)
        assert mem["optimizer_state"] == 8 * -(-share.numerator // share.denominator) + 4 * len(local), v
        assert mem["params"] == mem["grads"] == 4 * (dense + experts), v
        assert Fraction(str(s["values"]["comm_by_group"]["DP"]["all_reduce"])) == Fraction(
            got["by_group"]["DP"]["all_reduce"]), v


def test_ep_with_replicating_engines_is_accepted_and_hsdp_refused():
    """``--ep`` with ``--shard ddp`` and ``zero1`` is a layout (the groups DP·EP and DP, the mesh
    (dp_replicate, ep)); with HSDP, CPU offload, or a pipeline or TP under DDP/ZeRO-1 it is refused
    in one line."""
    from symcost.errors import SymcostError
    from symcost.frontends.layout import Layout

    for shard in ("ddp", "zero1"):
        lay = Layout(ep=True, shard=shard)
        assert lay.ep_fsdp and lay.ep_replicate and lay.dims == ("dp_replicate", "ep")
        assert lay.group_labels == ("DP", "EP", "DP_expert")
        assert lay.group_size("DP", {"DP": 3, "EP": 4}.get) == 12 and lay.group_size("DP_expert", {"DP": 3}.get) == 3
    assert not Layout(ep=True, shard="fsdp").ep_replicate
    from symcost.frontends.layout import Pipeline

    for kw in ({"shard": "fsdp", "replicate": 2}, {"shard": "zero3", "offload": True},
               {"shard": "ddp", "pipeline": Pipeline()}, {"shard": "zero1", "tp": True}):
        with pytest.raises(SymcostError):
            Layout(ep=True, **kw)


def test_megatron_engine_reduces_experts_over_the_expert_data_parallel_group():
    """Megatron-LM's engine as symcost runs it (``frontends.megatron.wrap_in_place`` with the
    expert-data-parallel mesh, docs/parallel.md §14.11) on the fake group, EP 2 × DP 2 at tiny sizes:
    the bytes it all-reduces per rank over each group equal Megatron's arithmetic on the
    parameters PyTorch built: 2·(n−1)/n of the dense gradients over the DP·EP ranks, 2·(DP−1)/DP of
    the rank's E/EP experts' gradients over DP (fp32: 4 bytes; nccl-tests' all-reduce factor); the
    all-to-alls stay on the EP group (a few seconds)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from symcost.frontends.megatron import wrap_in_place
    from symcost.frontends.parallel import fake_world

    dp, ep = 2, 2
    v = {"B": 1, "S": 16, "H": 2, "D": 8, "L": 2, "V": 48, "F": 8, "E": 8, "R": 2}
    fake_world(dp * ep)
    mesh = init_device_mesh("cpu", (dp, ep), mesh_dim_names=("dp_replicate", "ep"))
    flat = mesh["dp_replicate", "ep"]._flatten("dp_replicate_ep")
    model = build(v, mesh["ep"])
    wrap_in_place(model, flat, mesh["dp_replicate"])
    groups = {mesh["ep"].get_group().group_name: "EP", mesh["dp_replicate"].get_group().group_name: "DP_expert",
              flat.get_group().group_name: "DP"}
    got = measure(model, torch.randint(0, v["V"], (v["B"], v["S"])), groups=groups)
    dense = sum(p.numel() for p in model.parameters() if not isinstance(p, DTensor))
    experts = sum(p._local_tensor.numel() for p in model.parameters() if isinstance(p, DTensor))
    assert experts == 3 * v["E"] // ep * v["F"] * v["H"] * v["D"] * v["L"]
    n = dp * ep
    assert Fraction(got["by_group"]["DP"]["all_reduce"]) == Fraction(2 * (n - 1), n) * 4 * dense
    assert Fraction(got["by_group"]["DP_expert"]["all_reduce"]) == Fraction(2 * (dp - 1), dp) * 4 * experts
    assert set(got["by_group"]["EP"]) == {"all_to_all"} and Fraction(got["comm"]["other"]) == 0
