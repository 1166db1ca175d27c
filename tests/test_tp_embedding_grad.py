"""The vocabulary-parallel embedding's gradient under ``--tp`` (docs/parallel.md §11): PyTorch's
``RowwiseParallel`` on an ``nn.Embedding`` (symcost's Megatron plan, torchtitan's) gives it back
whole, a ``Replicate`` ``[V, d]`` DTensor beside the ``Shard(0)`` weight (the trace's gradient
storages, ``grads_traced``, and ``report --tp``'s ``grads``: tests/test_tensor_parallel.py
``test_rank_peak_parts_follow_the_shards``); Megatron-LM's ``VocabParallelEmbedding`` computes
and reduces the local ``[V/TP, d]`` rows (megatron/core/tensor_parallel/layers.py: its weight is
``[num_embeddings_per_partition, embedding_dim]``, its gradient that shape, and the DDP buffer
holds one ``main_grad`` per parameter of the parameter's shape). Oracle: PyTorch on the fake
process group, tiny sizes, no trace (a few seconds)."""
from __future__ import annotations

import random

import torch
from torch import nn
import torch.nn.functional as F


class Tiny(nn.Module):
    """Token embedding, a norm, an untied output head: ``ids [B, S]`` -> logits ``[B, S, V]``."""

    def __init__(self, v: int, d: int):
        super().__init__()
        self.embed = nn.Embedding(v, d)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, v, bias=False)

    def forward(self, ids):
        return self.head(self.norm(self.embed(ids)))


def test_megatron_engine_reduces_the_embedding_rows_the_rank_holds():
    """``frontends.megatron.wrap_in_place`` over DP 2 × TP 2 at random sizes: every gradient is
    all-reduced over the data-parallel group in its parameter's local shape, as Megatron's buffer
    holds it (the embedding's ``[V/TP, d]`` rows: before, PyTorch's whole ``[V, d]``, 85.9 MB
    traced on MG7 against Megatron's 47.0 MB), although the backward returned the embedding's
    gradient whole (``Replicate``, local ``[V, d]``)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module
    from torch.utils._python_dispatch import TorchDispatchMode

    from symcost.frontends import tensor_parallel
    from symcost.frontends.megatron import wrap_in_place
    from symcost.frontends.parallel import fake_world

    rng = random.Random(47)
    dp, tp = 2, 2
    V, d, B, S = tp * rng.randint(3, 20), rng.randint(2, 9), rng.randint(1, 3), rng.randint(2, 7)
    fake_world(dp * tp)
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = Tiny(V, d)
    styles, has_head = tensor_parallel.plan(model, None, sp=False)
    assert type(styles["embed"]).__name__ == "RowwiseParallel" and has_head
    parallelize_module(model, mesh["tp"], styles)
    wrap_in_place(model, mesh["dp"])
    reduced = []

    class Reduces(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if str(func.overloadpacket) == "c10d.allreduce_":  # (dist.all_reduce: the DP hook's)
                reduced.extend(tuple(t.shape) for t in args[0])
            return func(*args, **(kwargs or {}))

    ids = torch.randint(0, V, (B, S))
    with Reduces(), loss_parallel():
        F.cross_entropy(model(ids).flatten(0, 1), ids.roll(-1, 1).flatten()).backward()
    w = model.embed.weight
    assert (w.placements, w.grad.placements, tuple(w.grad.to_local().shape)) == ((Shard(0),), (Replicate(),), (V, d))
    local = sorted(tuple(getattr(p, "_local_tensor", p).shape) for p in model.parameters())
    assert sorted(reduced) == local and (V // tp, d) in reduced and (V, d) not in reduced, (reduced, local)
