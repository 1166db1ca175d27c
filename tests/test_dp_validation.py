"""The 2-rank gloo data-parallel validation of the performance model (issue 29; validate --steps --dp):
the all-reduce's alpha-beta fit from its microbenchmark, and the command's one-line refusals. The
timed run itself (validation/steps.py validate_dp_steps) is a measurement of this machine, run by hand
(docs/performance-model.md)."""
from __future__ import annotations

import random

import pytest

from conftest import run_cli
from symcost.errors import SymcostError
from symcost.hardware.calibrate_perf import ALLREDUCE_SIZES, fit_alpha_beta
from symcost.hardware.efficiency import Efficiency


def test_the_alpha_beta_fit_recovers_a_ring():
    """Times made by the ring all-reduce of the alpha-beta model (Efficiency.collective_seconds:
    2(n-1) steps of alpha, 2(n-1)/n of the bytes over beta) at random alpha, beta and ranks are
    read back exactly; with 5% noise the line still fits within 5%."""
    rng = random.Random(29)
    for _ in range(4):
        n, alpha, beta = rng.randint(2, 8), rng.uniform(1e-6, 1e-3), rng.uniform(1e8, 1e11)
        e = Efficiency(collective_latency=alpha)
        pts = {b: e.collective_seconds(b, n, beta) for b in ALLREDUCE_SIZES}
        f = fit_alpha_beta(pts, n)
        assert f["alpha"] == pytest.approx(alpha, rel=1e-6) and f["beta"] == pytest.approx(beta, rel=1e-9)
        noisy = {b: t * rng.uniform(0.975, 1.025) for b, t in pts.items()}
        assert fit_alpha_beta(noisy, n)["rms_rel_error"] < 0.05
    with pytest.raises(SymcostError, match="two ranks"):
        fit_alpha_beta({1: 1.0, 2: 2.0}, 1)
    with pytest.raises(SymcostError, match="do not grow"):
        fit_alpha_beta({1 << 10: 2.0, 1 << 20: 1.0}, 2)


def test_validate_dp_needs_steps(capsys):
    code, out, err = run_cli(capsys, "validate", "--dp", "2")
    assert code == 2 and err.count("\n") == 1 and "--steps" in err
