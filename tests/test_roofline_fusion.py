"""Fused bytes (symcost.graph.fusion) against inductor's own count of the bytes its scheduled kernels
of the compiled training step read and write (GraphLowering.count_bytes)."""
from __future__ import annotations

import pytest
import sympy

from symcost.graph import fusion
from symcost.validation import validate


@pytest.mark.parametrize("model,sizes", [("mlp", {"B": 4, "S": 48, "D": 320, "L": 3})])
def test_fused_bytes_track_inductor(traced, model, sizes):
    """(cs336-lm is checked the same way by hand, see docs/roofline.md: its compile alone takes
    longer than this file's CI budget.)"""
    an = traced(model, "fp32")
    env = an.bind(**sizes)
    fe = fusion.estimate(an)
    fused = int(fe.total(an).subs(env))
    unfused = int(an.bytes("train").subs(env))
    inductor = validate.inductor_bytes(model, sizes)
    assert fused < unfused
    for op in an.ops:  # per op, fusing never adds traffic
        b, f, w = (int(sympy.sympify(x).subs(env)) for x in
                   (op.cost.bytes, fe.node_bytes[op.index], fe.node_written[op.index]))
        assert 0 <= w <= f <= b
    # closer to inductor than the unfused count, and within 25% of it
    assert abs(fused - inductor) < abs(unfused - inductor), (fused, unfused, inductor)
    assert fused == pytest.approx(inductor, rel=0.25), (fused, unfused, inductor)


def test_estimate_is_kept_per_analysis(traced):
    """The estimate is computed once per analysis (every roofline and prediction asks for it) and
    computed again, with the same bytes, for a copy whose ops or recordings are other objects."""
    import copy

    an = traced("mlp", "fp32")
    fe = fusion.estimate(an)
    assert fusion.estimate(an) is fe
    other = copy.copy(an)
    other.ops = list(an.ops)
    again = fusion.estimate(other)
    assert again is not fe and again.node_bytes == fe.node_bytes and again.node_written == fe.node_written
