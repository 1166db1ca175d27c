"""``plan`` ranks layouts by the performance model's predicted step, the roofline bound beside
(issue 29 item 3; docs/performance-model.md, "plan").

The oracle for one row is :func:`symcost.passes.performance.predict` run directly on the same
trace at the whole L: a layout of one device (dp = tp = pp = 1, one micro-batch, nothing
checkpointed, no communication) must be predicted at exactly that step, although the planner
composes it from per-block and outside-the-blocks times read off L = 2 and L = 3.
"""
from __future__ import annotations

import pytest

from symcost.hardware.devices import get_device
from symcost.passes.performance import predict
from symcost.passes.plan import Layout, Planner, plan
from test_plan import PREC, SZ, _an


def test_one_device_row_is_the_performance_models_step():
    dev = get_device("a100-80gb")
    pl = Planner(_an(), SZ, dev, PREC)
    for b in (1, 2):
        r = pl.evaluate(Layout(1, 1, 1, b, 1, "ddp", "none", "none"))
        want = predict(_an(), dev, {**SZ, "B": b, "TP": 1}, mode="compiled")
        assert r["step_seconds"] == pytest.approx(want["step_seconds"], rel=1e-9)
        assert r["bound_seconds"] == pytest.approx(want["bound_seconds"], rel=1e-9)  # the fused roofline
        assert r["bound_seconds"] < r["step_seconds"]


def test_layouts_are_ranked_by_the_prediction_with_the_bound_beside():
    dev = get_device("a100-80gb")
    res = plan(_an(), SZ, dev, 8, 10**12, 16, PREC, checkpoints=("none", "full"))
    rows = res["layouts"]
    assert rows and [r["step_seconds"] for r in rows] == sorted(r["step_seconds"] for r in rows)
    for r in rows:
        assert r["predicted"] and r["bound_seconds"] <= r["step_seconds"]
        assert r["mfu_bound"] >= r["mfu"] > 0
    bound = plan(_an(), SZ, dev, 8, 10**12, 16, PREC, checkpoints=("none", "full"), rank_by="bound")["layouts"]
    assert [r["step_seconds"] for r in bound] == sorted(r["bound_seconds"] for r in rows)
    with pytest.raises(Exception, match="unknown ranking"):
        plan(_an(), SZ, dev, 8, 10**12, 16, PREC, rank_by="fastest")
