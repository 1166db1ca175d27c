"""``plan --routing capacity=C|skew=X`` (issue 28 item 4 with report's routing models;
docs/performance-model.md "plan: layouts ranked by the predicted step").

Oracles: PyTorch running the most loaded expert-parallel rank under ``skew=X`` (tests/data/ep_rank.py
``measure`` on the fake process group: FLOPs by ``torch.utils.flop_counter``'s registry, the
all-to-alls seen at dispatch with (n−1)/n of their input), against a composed EP row of the plan;
and, for ``capacity=C``, the padded buffers' all-to-all bytes by hand: every expert's buffer holds
C·N·R/E slots, so each of the four slot exchanges per MoE layer moves C·N·R·M fp32 values, and the
rank sends (EP−1)/EP of them plus the E int64 counts.
"""
from __future__ import annotations

import json
import os
import random
import sys
from fractions import Fraction

import pytest
from click.testing import CliRunner

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "data"))
sys.path.insert(0, os.path.dirname(__file__))
from test_plan_ep_cp import _device, _moe_trace  # noqa: E402  (the plan's one-device moe trace, shared)


@pytest.mark.heavy
def test_plan_skew_row_equals_pytorch_most_loaded_rank():
    """The built-in ``moe`` (fp32) planned from its one-device trace under ``skew=2``: a row with
    EP ranks (dp = EP, each its own micro-batch) has the FLOPs and all-to-all bytes of PyTorch's
    expert-parallel rank with ``skew=2`` routing, at random sizes; a skew above EP is EP (the rank
    receives at most every slot: PyTorch refuses more); a row without EP is the balanced one;
    ``plan``'s result says which routing and notes it."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from ep_rank import build, measure
    from symcost.frontends import moe
    from symcost.frontends.parallel import fake_world
    from symcost.passes.plan import Layout, Planner, plan

    an = _moe_trace()
    rng = random.Random(2831)
    for _ in range(2):
        ep, e, r = rng.choice((2, 4)), rng.choice((8, 16)), rng.choice((2, 3))
        v = {"E": e, "R": r, "B": rng.randint(1, 3), "S": e * rng.randint(1, 2), "H": 2 * rng.randint(1, 3),
             "D": 4 * rng.randint(1, 3), "L": rng.randint(1, 3), "V": rng.randint(40, 120), "F": 8 * rng.randint(1, 4)}
        lay = Layout(ep, 1, 1, v["B"], 1, "ddp", "none", "none", ep=ep)
        skewed, balanced = (Planner(an, v, _device(), "fp32", predicted=False, skew=x) for x in (2, 1))
        row = skewed.evaluate(lay)
        fake_world(ep)
        model = build(v, init_device_mesh("cpu", (ep,), mesh_dim_names=("ep",))["ep"])
        moe.set_routing(model, moe.parse_routing("skew=2"))
        got = measure(model, torch.randint(0, v["V"], (v["B"], v["S"])))
        assert Fraction(row["comm_bytes"]["ep"]) == Fraction(got["comm"]["all_to_all"]) > 0, v
        assert row["flops_rank"] == got["flops"], v
        bal = balanced.evaluate(lay)
        assert row["step_seconds"] > bal["step_seconds"] and row["model_flops"] == bal["model_flops"], v
        if ep == 2:
            over = Planner(an, v, _device(), "fp32", predicted=False, skew=3).evaluate(lay)
            assert over["comm_bytes"]["ep"] == row["comm_bytes"]["ep"] and over["flops_rank"] == row["flops_rank"]
        one = Layout(ep, 1, 1, v["B"], 1, "ddp", "none", "none")  # (no EP: balanced whatever the skew)
        assert skewed.evaluate(one)["step_seconds"] == balanced.evaluate(one)["step_seconds"]
    sizes = {"B": 2, "S": 16, "H": 4, "D": 8, "L": 2, "V": 96, "F": 24, "E": 16, "R": 2}
    res = plan(an, sizes, _device(), 2, 2**30, 2, "fp32", routing="skew=2", checkpoints=("none",), micro_batches=(1,),
               shards=("ddp",))
    assert res["routing"]["model"] == "skew" and res["routing"]["skew"] == 2
    assert any("skew=2" in n for n in res["notes"]) and {r["layout"]["ep"] for r in res["layouts"]} == {1, 2}


@pytest.mark.heavy
def test_plan_capacity_rows_move_the_padded_buffers():
    """``plan moe --routing capacity=2 --json``: the plan's tensor-parallel trace is traced under
    the routing (the report's: every expert's buffer C = 2·N·R/E slots), so a row with EP ranks and
    tp = 1 sends m·(EP−1)/EP·(4·2·N·R·M·4·l + 8·E·l) bytes over its EP group, N = b·S, l the MoE
    layers of its (first) pipeline stage (by hand);
    the JSON says the routing. A dense model is refused in one line.

    H odd (3): TP = 2 cannot split the heads, so the plan traces at TP = 1 alone (the trace of the
    rows checked here; the same ops as at an even H); at H = 4 it traced TP = 2 first (TP pinned
    there) and then TP = 1 for the same tp = 1 rows (10 of them, ep 2 and 4, pp 1 and 2, as here):
    30 CPU-s, 11.5 at H = 3 (the command alone, 2026-12-06, loaded machine)."""
    from symcost.cli import main

    sizes = {"S": 16, "H": 3, "D": 8, "L": 2, "V": 96, "F": 24, "E": 16, "R": 2}
    args = ["plan", "moe", "--devices", "4", "--memory", "1GiB", "--global-batch", "8", "--precision", "fp32",
            "--checkpoint", "none", "--shard", "ddp", "--micro-batch", "1,2", "--trace-top", "0", "--top", "100",
            "--json", "--set"] + [f"{k}={x}" for k, x in sizes.items()]
    r = CliRunner().invoke(main, args + ["--routing", "capacity=2"])
    assert r.exit_code == 0, r.output[-2000:]
    res = json.loads(r.output[r.output.index("{"):])
    assert res["routing"]["model"] == "capacity" and res["routing"]["capacity_factor"] == 2
    rows = [x for x in res["layouts"] if x["layout"]["ep"] > 1 and x["layout"]["tp"] == 1]
    assert rows
    M, L, E, R = sizes["H"] * sizes["D"], sizes["L"], sizes["E"], sizes["R"]
    for x in rows:
        lay = x["layout"]
        ep, m, N, nb = lay["ep"], lay["microbatches"], lay["micro_batch"] * sizes["S"], lay["blocks"]
        assert nb == L // lay["pp"]
        want = Fraction(m * (ep - 1), ep) * (4 * 2 * N * R * M * 4 * nb + 8 * E * nb)
        assert Fraction(x["comm_bytes"]["ep"]) == want, lay
    r = CliRunner().invoke(main, ["plan", "megatron-gpt", "--devices", "2", "--memory", "80GiB", "--global-batch", "2",
                                  "--routing", "capacity=2", "--set", "L=2", "H=2", "D=8", "S=16", "V=64",
                                  "--trace-top", "0"])
    assert r.exit_code == 2 and "no routed experts" in r.output, r.output
