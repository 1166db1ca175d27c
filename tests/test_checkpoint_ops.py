"""Op-level selective recomputation (symcost.passes.checkpoint_ops): the ILP against Korthikanti et al.
2022 (a published, hand-worked formula) and the applied selective plan against the plain model."""
from __future__ import annotations

import dataclasses
import random

import torch

from symcost.passes import checkpoint_ops as co
from test_checkpoint import run_step


def test_korthikanti_selective_point(traced):
    """GPT-3 175B (s = 2048, h = 12288, a = 96, L = 96): keeping all the backward reads is
    s·b·h·(34 + 5·a·s/h) + 8·s·b bytes per layer (Korthikanti et al. Sec. 4.1, plus the
    LayerNorm statistics docs/memory.md lists); under a budget of 34·s·b·h + 8·s·b the ILP drops
    the s²-sized tensors and reruns only the attention core (QK^T, scale, softmax, dropout):
    2·b·s²·h model FLOPs; with attention over V, which Korthikanti et al. count as recomputed,
    4·b·s²·h per layer, 2.7 % of the forward (their Sec. 5)."""
    an = traced("megatron-gpt", "fp16-true")
    b, s, a, d, L = 1, 2048, 96, 128, 96
    h = a * d
    env = an.bind(B=b, S=s, H=a, D=d, L=L, V=51200)
    bg = co.block_graph(an)
    full = co.op_plan(an, env, None, bg)
    assert full.saved_bytes == s * b * h * 34 + 5 * a * s * s * b + 8 * s * b
    budget = 34 * s * b * h + 8 * s * b
    p = co.op_plan(an, env, budget, bg)
    names = {bg.name[x] for x in p.recompute}
    print("recomputed:", sorted(names), "kept", p.saved_bytes, "of", budget)
    assert p.saved_bytes <= budget
    assert "aten._softmax.default" in names and names <= {
        "aten.bmm.default", "aten.mul.Tensor", "aten._softmax.default", "aten.native_dropout.default"}
    assert p.recompute_model_flops == 2 * b * s * s * h
    forward = int(an.flops("forward").xreplace(env))
    paper = (p.recompute_model_flops + 2 * b * s * s * h) * L / forward
    print(f"Korthikanti et al.'s recompute: {paper:.4f} of the forward")
    assert round(paper, 3) == 0.027


def test_selective_tradeoff_monotone_and_apply_equal(traced):
    """Over falling budgets the ILP keeps no more and reruns no less; the applied selective plan
    (PyTorch's selective checkpoint API) gives the plain model's outputs and gradients."""
    an = traced("megatron-gpt", "fp32")
    rng = random.Random(2)
    sizes = {"B": 2, "S": rng.randint(8, 16), "H": 2, "D": rng.choice((4, 8)), "L": 3, "V": rng.randint(30, 60)}
    rows = co.tradeoff(an, an.bind(**sizes), steps=5)
    for x, y in zip(rows, rows[1:]):
        assert y["saved_bytes"] <= x["saved_bytes"] and y["recompute_flops"] >= x["recompute_flops"]
    assert rows[-1]["recompute_flops"] > 0
    p = co.op_plan(an, an.bind(**sizes), rows[len(rows) // 2]["budget"])
    spec = an.spec
    got = run_step(dataclasses.replace(spec, build=lambda v: p.apply(spec.build(v))), sizes)
    want = run_step(spec, sizes)
    torch.testing.assert_close(got[0], want[0])
    for n in want[2]:
        torch.testing.assert_close(got[2][n], want[2][n])


def test_block_graph_from_a_cached_analysis(traced):
    """The op-level plan needs which tensor each op reads: a cached analysis (data, no recordings)
    keeps it (``Analysis.dataflow``), so the block graph and the ILP's plan read back from JSON
    equal those of the live trace at random sizes."""
    import json

    from symcost.graph.analysis import Analysis

    an = traced("megatron-gpt", "fp32")
    back = Analysis.from_dict(json.loads(json.dumps(an.to_dict())))
    assert not back.recordings
    live, cached = co.block_graph(an), co.block_graph(back)
    assert (live.bases, live.needed, live.inputs, live.name) == (cached.bases, cached.needed, cached.inputs, cached.name)
    rng = random.Random(9)
    env = an.bind(B=2, S=rng.randint(8, 64), H=2, D=rng.choice((4, 8)), L=3, V=rng.randint(30, 60))
    budget = rng.randint(0, co.op_plan(an, env, None).saved_bytes)
    a, b = co.op_plan(an, env, budget), co.op_plan(back, back.bind(**{str(k): int(v) for k, v in env.items()}), budget)
    assert (a.save, a.recompute, a.saved_bytes) == (b.save, b.recompute, b.saved_bytes)


def test_a_collective_is_never_recomputed_on_a_tensor_parallel_rank():
    """On one rank of tensor parallelism the block's forward holds collectives (the row-parallel
    outputs' all-reduces). The op-level optimum kept none of them and reran them in the backward
    (a collective costs no FLOPs): every rank would have to join the rerun. Now a collective's
    output is always kept, as torchtitan's selective policy keeps it. Oracle: PyTorch running the
    plan (``OpPlan.apply``) on rank 0 of the fake process group, counting the collectives it
    dispatches in a step: as many as the step without checkpointing, at the least budget that
    still has a plan."""
    import sys
    from pathlib import Path

    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    import symcost
    from symcost.frontends.layout import Layout
    from symcost.frontends.models import resolve

    sys.path.insert(0, str(Path(__file__).parent / "data"))
    from tp_rank import fake_rank_model

    spec = resolve("megatron-gpt")
    an = symcost.trace(spec, layout=Layout(tp=True), precision="bf16-true",
                       sizes={"TP": 2, "S": 64, "H": 8, "D": 8, "V": 128})
    v = {"TP": 2, "B": 2, "S": 32, "H": 8, "D": 8, "L": 2, "V": 128}
    env = an.bind(**v)
    bg = co.block_graph(an)
    assert bg.collectives, "the TP block's forward has collectives"
    rows = co.tradeoff(an, env)
    p = co.op_plan(an, env, rows[-1]["budget"], bg)
    assert p.recompute and not (p.recompute & bg.collectives)

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if co.is_collective(str(func)) and "wait" not in str(func):
                Count.n += 1
            return func(*args, **(kwargs or {}))

    counts = []
    for plan in (None, p):
        model, ctx = fake_rank_model(spec, v, False)
        with FakeTensorMode(allow_non_fake_inputs=True):
            model.to_empty(device="cpu")
            if plan is not None:
                plan.apply(model)
            args, kwargs = spec.make_inputs(v, torch.device("cpu"))
            Count.n = 0
            with Count(), ctx():
                spec.loss(model(*args, **kwargs), (args, kwargs)).backward()
            counts.append(Count.n)
    assert counts[0] == counts[1] > 0, counts
