"""The fitted formulas hold far outside the probe ranges (the fit must not just interpolate).

Oracle: a fresh concrete recording of the step at the given sizes, costed op by op with the
same rules (``concrete_totals``); it takes no part in the fit. Sizes are drawn well beyond the
probe pools (K up to 16 with H = 32, D = 64, S = 96), where an over-fitted polynomial in K — the
failure this guards against — goes wrong, even negative.
"""
from __future__ import annotations

import random

import pytest

from symcost import SYMS
from symcost.graph.build import PHASES, concrete_totals
from symcost.tracing.record import record


@pytest.mark.heavy
@pytest.mark.parametrize("model", ["hf:mistral", "cs336-lm"])
def test_formulas_extrapolate(traced, model):
    an = traced(model)
    rng = random.Random(7)
    for _ in range(2):
        v = {"B": rng.randint(2, 5), "S": rng.choice((64, 96)), "H": 32, "D": rng.choice((32, 64)),
             "L": rng.randint(3, 5), "V": rng.randint(300, 900), "F": rng.randint(100, 300),
             "K": rng.choice((8, 16))}
        v = {s: v[s] for s in an.symbols}
        want = concrete_totals(record(an.spec, v, an.precision))
        env = {SYMS[k]: x for k, x in v.items()}
        for ph in PHASES:
            for key, got in ((f"flops.{ph}", an.flops(ph)), (f"flops_all.{ph}", an.flops(ph, "all")),
                             (f"bytes.{ph}", an.bytes(ph))):
                assert got.subs(env) == want[key], (model, v, key)
        assert an.params.subs(env) == want["params"], (model, v)
