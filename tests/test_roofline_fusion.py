"""Fused bytes (symcost.fusion) against inductor's own count of the bytes its scheduled kernels
of the compiled training step read and write (GraphLowering.count_bytes)."""
from __future__ import annotations

import pytest

from symcost import fusion, validate


@pytest.mark.parametrize("model,sizes", [
    ("mlp", {"B": 4, "S": 48, "D": 320, "L": 3}),
    pytest.param("cs336-lm", {"B": 2, "S": 32, "H": 4, "D": 16, "L": 2, "V": 97, "F": 48}, marks=pytest.mark.heavy),
])
def test_fused_bytes_track_inductor(traced, model, sizes):
    an = traced(model, "fp32")
    env = an.bind(**sizes)
    fe = fusion.estimate(an)
    fused = int(fe.total(an).subs(env))
    unfused = int(an.bytes("train").subs(env))
    inductor = validate.inductor_bytes(model, sizes)
    assert fused < unfused
    for op in an.ops:  # per op, fusing never adds traffic
        assert int((op.cost.bytes - fe.node_bytes[op.index]).subs(env)) >= 0
        assert 0 <= int(fe.node_written[op.index].subs(env)) <= int(fe.node_bytes[op.index].subs(env))
    # closer to inductor than the unfused count, and within 25% of it
    assert abs(fused - inductor) < abs(unfused - inductor), (fused, unfused, inductor)
    assert fused == pytest.approx(inductor, rel=0.25), (fused, unfused, inductor)
