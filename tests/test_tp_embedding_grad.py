"""The vocabulary-parallel embedding's gradient under ``--tp`` (docs/parallel.md §11): PyTorch's
``RowwiseParallel`` on an ``nn.Embedding`` (symcost's Megatron plan, torchtitan's) gives it back
whole, a ``Replicate`` ``[V, d]`` DTensor beside the ``Shard(0)`` weight (the trace's gradient
storages, ``grads_traced``, and ``report --tp``'s ``grads``: tests/test_tensor_parallel.py
``test_rank_peak_parts_follow_the_shards``); Megatron-LM's ``VocabParallelEmbedding`` computes
and reduces the local ``[V/TP, d]`` rows (megatron/core/tensor_parallel/layers.py: its weight is
``[num_embeddings_per_partition, embedding_dim]``, its gradient that shape, and the DDP buffer
holds one ``main_grad`` per parameter of the parameter's shape). Oracle: PyTorch on the fake
process group, tiny sizes, no trace (a few seconds). Under ``megatron-*`` the trace runs Megatron's
forward (``frontends.megatron.vocab_parallel_embedding``): its rows only, checked against
``nn.Embedding`` and Megatron's vocabulary range, and the traced rank's live set at that point
against PyTorch's, less the transient (heavy: two traces)."""
from __future__ import annotations

import random

import pytest
import sympy
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


def test_megatron_embedding_computes_the_ranks_rows_only():
    """``frontends.megatron.vocab_parallel_embedding`` (Megatron-LM's ``VocabParallelEmbedding.
    forward``) on the plan's ``RowwiseParallel`` embedding, rank 0 of TP on the fake process group,
    real tensors, random sizes: the rank's partial output is ``nn.Embedding``'s where the id lies
    in its rows ``[0, V/TP)`` (Megatron's ``vocab_range_from_global_vocab_size``) and 0 elsewhere
    (the fake group's all-reduce adds nothing), and its gradient is a ``Shard(0)`` DTensor of
    local ``[V/TP, d]``, equal to those rows of ``nn.Embedding``'s gradient for the same output
    gradient (where PyTorch's own gives a whole ``[V, d]`` ``Replicate`` one: above)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import parallelize_module

    from symcost.frontends import tensor_parallel
    from symcost.frontends.megatron import vocab_parallel_embedding
    from symcost.frontends.parallel import fake_world

    rng = random.Random(48)
    for _ in range(3):
        tp = rng.choice((2, 4))
        V, d, B, S = tp * rng.randint(2, 20), rng.randint(2, 9), rng.randint(1, 3), rng.randint(2, 7)
        fake_world(tp)
        mesh = init_device_mesh("cpu", (tp,))
        torch.manual_seed(rng.randint(0, 999))
        model, ref = Tiny(V, d), nn.Embedding(V, d)
        ref.load_state_dict(model.embed.state_dict())
        styles, _ = tensor_parallel.plan(model, None, sp=False)
        parallelize_module(model, mesh, {"embed": styles["embed"]})
        assert vocab_parallel_embedding(model) == ["embed"]
        ids = torch.randint(0, V, (B, S))
        grad_out = torch.randn(B, S, d)
        out = model.embed(ids)
        out.backward(grad_out)
        ref(ids).backward(grad_out)
        rows, w = V // tp, model.embed.weight
        inside = (ids < rows).unsqueeze(-1)
        assert torch.allclose(out, ref(ids) * inside)
        assert (w.grad.placements, tuple(w.grad.to_local().shape)) == ((Shard(0),), (rows, d))
        assert torch.allclose(w.grad.to_local(), ref.weight.grad[:rows])


def _live_at(an, module: str, op: str):
    """Bytes the traced step's schedule holds right after the allocation of ``op`` in
    ``module`` (its first event there), summed from the schedule's events (each unit's times its
    repeat), a polynomial."""
    from symcost.tracing.fit import parse_formula
    from symcost.tracing.poly import terms_expr

    sched = an.schedule
    own = tuple(getattr(sched, "inverses", None) or ())
    k = next(i for i, e in enumerate(sched.events)
             if e.module == module and e.op.startswith(op) and e.alloc == i and e.grad)
    total = sympy.Integer(0)
    for u in sched.units:
        rep = parse_formula(u.repeat)
        for i in range(u.start, min(u.stop, k + 1)):
            e = sched.events[i]
            total += (1 if e.once else rep) * terms_expr(sched.gens, e.bytes, own)
    return sympy.expand(total), sympy.expand(terms_expr(sched.gens, sched.events[k].bytes, own))


@pytest.mark.heavy
def test_megatron_trace_holds_the_ranks_rows_and_a_smaller_transient(monkeypatch):
    """``--tp --precision megatron-bf16`` (megatron-gpt) traces Megatron's embedding: every
    gradient the rank's backward allocates is its parameter's shard (``grads_traced`` =
    ``params_shard``; the word embedding's ``2·V·d/TP`` bytes, Megatron's rows per rank), and
    the live set right after the word embedding's ``embedding_dense_backward`` is PyTorch's
    (the same step traced with ``RowwiseParallel``'s own embedding, ``V·d`` whole) less exactly
    ``2·V·d·(1 − 1/TP)``, plus Megatron's masked local ids ``[B, S]`` int64 (8·B·S: saved by its
    lookup for that backward, where DTensor's reads the step's input ids)."""
    import symcost
    from symcost.frontends import megatron
    from symcost.frontends.layout import Layout
    from symcost.passes.memory.states import grads_traced
    from symcost.tracing.fit import SYMS

    B, S, H, D, V, TP = (SYMS[k] for k in ("B", "S", "H", "D", "V", "TP"))
    sizes = {"TP": 8, "S": 64, "H": 16, "D": 8, "V": 128}
    ans = {}
    for own in (True, False):
        if not own:
            monkeypatch.setattr(megatron, "vocab_parallel_embedding", lambda model: [])
        ans[own] = symcost.trace("megatron-gpt", layout=Layout(tp=True), sizes=sizes, precision="megatron-bf16",
                                 use_cache=False)
    meg, torch_own = ans[True], ans[False]
    assert sympy.expand(grads_traced(meg) - meg.params_shard) == 0
    assert sympy.expand(grads_traced(torch_own) - torch_own.params_shard - V * H * D * (TP - 1) / TP) == 0
    (live_m, grad_m), (live_t, grad_t) = (_live_at(a, "word_embeddings", "embedding_dense_backward") for a in (meg, torch_own))
    assert sympy.expand(grad_m - 2 * V * H * D / TP) == 0 and sympy.expand(grad_t - 2 * V * H * D) == 0
    assert sympy.expand(live_t - live_m - 2 * V * H * D * (TP - 1) / TP + 8 * B * S) == 0, (live_t, live_m)
