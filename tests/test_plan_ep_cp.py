"""``symcost plan`` over expert and context parallelism (issue 28 item 4; docs/parallel.md §13.6).

Oracles: the enumeration against a brute force over every factorisation of the devices with
torchtitan's ``ParallelDims._validate`` rule for EP (``etp = 1``: "EP would borrow all cp and tp and
some dp_shard degree": ``ep % (cp·tp) == 0 and (dp_shard·cp·tp) % ep == 0``), typed here from
torchtitan/distributed/parallel_dims.py; a composed EP row's per-rank FLOPs, all-to-all bytes and
parameter elements against PyTorch running that expert-parallel rank (tests/data/ep_rank.py
``measure`` on the fake process group: FLOPs by ``torch.utils.flop_counter``'s registry, the
all-to-alls seen at dispatch, the DTensor shards' elements), and a composed CP row's FLOPs and
ring bytes against PyTorch's ``context_parallel`` rank (tests/data/cp_rank.py ``measure``), at
random sizes. The plan's one trace there is the model's plain one-device trace (tp = 1 layouts).
Each test takes 3-4 s on an idle machine (tiny sizes; the fake group).
"""
from __future__ import annotations

import functools
import os
import random
import sys
from fractions import Fraction

import pytest

import symcost

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "data"))
sys.path.insert(0, os.path.dirname(__file__))


def _device():
    from symcost.hardware.devices import get_device

    return get_device("h100-sxm", None, None, None)


def test_ep_and_cp_enumeration_is_every_factorisation_torchtitan_accepts():
    """Every (dp, tp, pp, cp, ep, shard, R) of 16 devices that torchtitan's rule accepts, and no
    other, for E = 8 experts, S = 64 (cp from {1, 2, 4}; 2·cp | S), over a brute force."""
    from symcost.passes.plan import enumerate_layouts
    from symcost.passes.plan_dims import cp_options

    n, L, H, E, G = 16, 4, 8, 8, 32
    cps = cp_options(64, n, (2, 4, 32))
    assert cps == [1, 2, 4]  # (32 does not divide the 16 devices)
    got = {(x.dp, x.tp, x.pp, x.cp, x.ep, x.shard, x.replicate)
           for x in enumerate_layouts(n, G, L, H, shards=("ddp", "fsdp", "hsdp"), checkpoints=("none",),
                                      micro_batches=(1,), E=E, cps=tuple(cps))}
    want = set()
    rng = range(1, n + 1)
    for dp, tp, pp, cp in ((a, b, c, d) for a in rng for b in rng for c in rng for d in (1, 2, 4)):
        if dp * tp * pp * cp != n or H % tp or H // tp < 2 or L % pp or G % dp or G // dp < pp:
            continue
        for shard in (("ddp", "fsdp", "hsdp") if dp * cp > 1 else ("ddp",)):
            for r in ([k for k in range(2, dp) if dp % k == 0] if shard == "hsdp" else [1]):
                dp_shard = dp // r
                for ep in rng:
                    ok = ep == 1 or (E % ep == 0 and ep % (cp * tp) == 0 and (dp_shard * cp * tp) % ep == 0)
                    if ok:
                        want.add((dp, tp, pp, cp, ep, shard, r))
    assert got == want
    assert any(x[4] > 1 for x in got) and any(x[3] > 1 for x in got)
    # a dense model (E None) gets ep = 1 only; default CP sizes keep >= 8192 tokens per rank
    assert {x.ep for x in enumerate_layouts(n, G, L, H, checkpoints=("none",), micro_batches=(1,))} == {1}
    assert cp_options(32768, 64, None) == [1, 2, 4] and cp_options(8192, 64, None) == [1]


@functools.lru_cache(maxsize=None)
def _moe_trace():
    from symcost.frontends.models import resolve

    return symcost.trace(resolve("moe"), sizes={"B": 2, "S": 16, "H": 4, "D": 8, "L": 2, "V": 96, "F": 24, "E": 16,
                                                "R": 2}, precision="fp32")


def test_composed_ep_rank_equals_pytorch_expert_parallel_rank():
    """The built-in ``moe`` (fp32) planned from its one-device trace: a row with EP ranks (dp = EP,
    each rank its own micro-batch, as ``report --ep`` traces it) has the FLOPs, all-to-all bytes
    (dispatch and combine forward and backward, (EP−1)/EP of each, and the split-size exchange)
    and parameter elements (dense whole, E/EP experts) of PyTorch's expert-parallel rank on the
    fake group, at random sizes (EP 2 or 4, routers balanced); and ``plan`` lists EP candidates,
    labelled composed."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from ep_rank import build, measure
    from symcost.frontends.parallel import fake_world
    from symcost.passes.plan import Layout, Planner, plan

    an = _moe_trace()
    rng = random.Random(2804)
    for _ in range(2):
        ep, e, r = rng.choice((2, 4)), rng.choice((8, 16)), rng.choice((2, 3))
        v = {"E": e, "R": r, "B": rng.randint(1, 3), "S": e * rng.randint(1, 2), "H": 2 * rng.randint(1, 3),
             "D": 4 * rng.randint(1, 3), "L": rng.randint(1, 3), "V": rng.randint(40, 120), "F": 8 * rng.randint(1, 4)}
        row = Planner(an, v, _device(), "fp32", predicted=False).evaluate(
            Layout(ep, 1, 1, v["B"], 1, "ddp", "none", "none", ep=ep))
        fake_world(ep)
        got = measure(build(v, init_device_mesh("cpu", (ep,), mesh_dim_names=("ep",))["ep"]),
                      torch.randint(0, v["V"], (v["B"], v["S"])))
        assert Fraction(row["comm_bytes"]["ep"]) == Fraction(got["comm"]["all_to_all"]) > 0, v
        assert row["flops_rank"] == got["flops"] and row["params_rank"] == got["shard"], v
        assert row["composed"] == ["ep"] and row["links"]["ep"] == "node", v
    res = plan(an, {"B": 2, "S": 16, "H": 4, "D": 8, "L": 2, "V": 96, "F": 24, "E": 16, "R": 2}, _device(), 4,
               2**30, 8, "fp32", checkpoints=("none",), micro_batches=(1, 2), keep_all=True)
    eps = {r["layout"]["ep"] for r in res["layouts"]}
    assert eps == {1, 2, 4} and res["ep_sizes"] == [1, 2, 4]
    assert all(r["composed"] == (["ep"] if r["layout"]["ep"] > 1 else []) for r in res["layouts"])
    assert any("expert parallelism" in n for n in res["notes"])


def test_composed_cp_rank_equals_pytorch_context_parallel_rank():
    """hf:llama (sdpa, fp32) planned from its one-device trace: a row with CP = 2 (PyTorch's
    all-gather rotation, the load-balanced causal ring) has the model FLOPs and the ring's bytes
    (K/V all-gathers forward and backward, fp32 dK/dV passes) of PyTorch's context_parallel rank 0
    on the fake group, at the traced and at another random B, S; ``plan`` lists CP candidates."""
    from cp_rank import config
    from symcost.passes.plan import Layout, Planner, plan
    from test_context_parallel import _draw, _fake_rank0

    rng = random.Random(2812)
    v = _draw(rng)
    an = symcost.trace("hf:llama", config=config(v), sizes={"B": v["B"], "S": v["S"]}, precision="fp32")
    for w in (v, dict(v, B=rng.randrange(2, 5), S=4 * rng.randrange(3, 12))):
        sizes = {k: x for k, x in w.items() if k in an.symbols}
        row = Planner(an, sizes, _device(), "fp32", predicted=False).evaluate(
            Layout(1, 1, 1, w["B"], 1, "ddp", "none", "none", cp=2))
        got = _fake_rank0(w, "allgather")
        assert row["flops_rank"] == got["flops"], w
        assert Fraction(row["comm_bytes"]["cp"]) == sum(Fraction(x) for x in got["comm"].values()) > 0, w
        assert row["composed"] == ["cp"], w
    res = plan(an, {k: x for k, x in v.items() if k in an.symbols}, _device(), 4, 2**30, 4, "fp32",
               checkpoints=("none",), micro_batches=(1,), cps=(2, 4), keep_all=True)
    cps = {r["layout"]["cp"] for r in res["layouts"]}
    assert 2 in cps and res["cp_sizes"][0] == 1
