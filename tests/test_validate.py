"""Validation with compiled kernels on this CPU (issue 9's acceptance), CI-sized, and the checks'
own logic on hand-made rows."""
from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from symcost.validation import validate as val


def _row(kernel, family, flops, nbytes, predicted, measured, bound, large=True):
    return {"kernel": kernel, "family": family, "flops": flops, "bytes": nbytes, "predicted": predicted,
            "measured": measured, "bound": bound, "large": large, "ratio": measured / predicted}


def test_check_logic():
    ok = [_row("mm 1", "square", 2e9, 1.2e7, 0.02, 0.021, "compute"),
          _row("mm 2", "square", 1.6e10, 4.8e7, 0.16, 0.17, "compute")]
    assert val.check(ok) == ([], val.check(ok)[1])
    assert val.check(ok)[1][0]["agrees"] is True
    # time that follows bytes (x4) instead of FLOPs (x8) for a compute-bound pair
    bad = [ok[0], _row("mm 2", "square", 1.6e10, 4.8e7, 0.16, 0.084, "compute")]
    fails, _ = val.check(bad)
    assert any("follows bytes" in f for f in fails) and any("below the predicted bound" in f for f in fails)
    slow = [_row("add", "add", 1e7, 1.2e8, 0.01, 0.03, "memory")]
    assert any("< 50%" in f for f in val.check(slow)[0])
    assert val.check([_row("add", "add", 1e7, 1.2e8, 0.01, 0.03, "memory", large=False)])[0] == []
    step = [_row("mlp step", "training step", 1e10, 1e8, 0.1, 0.25, "compute")]
    assert any("not within 2x" in f for f in val.check(step)[0])
    # decode steps (issue 17): within 2x whatever their time, and no scaling check across batches
    dec = [_row("decode B=1", "decode step", 1e8, 2.5e8, 0.010, 0.013, "memory"),
           _row("decode B=64", "decode step", 7e9, 4e8, 0.100, 0.190, "compute")]
    assert val.check(dec) == ([], [])
    fails, _ = val.check(dec[:1] + [_row("decode B=64", "decode step", 7e9, 4e8, 0.100, 0.210, "compute")])
    assert len(fails) == 1 and "decode B=64" in fails[0] and "not within 2x" in fails[0]


def test_floor_is_judged_against_the_retry_rounds_own_calibration():
    """A kernel that missed the 50% floor and was timed again is judged against the calibration of
    its own round: its bound from that round's rates, by the same rules (an add of n fp32 elements
    moves 12·n bytes), not against a faster round's. Other failures are kept as they are."""
    import random

    import torch

    n = random.Random(9).randint(2**20, 2**22)
    costs = val.kernel_costs(lambda a, b: a + b, torch.randn(n), torch.randn(n))
    assert sum(c["bytes"] for c in costs) == 12 * n  # two operands read, one written, fp32
    fast = val.device_from_entry({"fp32": 1e11, "bandwidth": 4e10})
    slow = val.device_from_entry({"fp32": 1e11, "bandwidth": 1e10})
    measured = 12 * n / 1e10 * 1.25  # 80% of the slow round's bound, 20% of the fast one's
    row = _row("add", "add", n, 12 * n, 12 * n / 4e10, measured, "memory")
    cases = [("add", "add", True, costs, None)]
    other = "mm: measured 1 ms is 20% below the predicted bound 1.25 ms"
    fails, _ = val.check([row])
    assert len(fails) == 1 and "reaches 20% of its bound" in fails[0]
    kept = val._floor_against_round(fails + [other], [row], cases, {"add": {"min": measured}}, slow, 2)
    assert kept == [other] and abs(row["floor_ratio"] - 1.25) < 1e-9 and row["floor_round"] == 2
    # against a round as fast as the first, the kernel still misses the floor: kept, both ratios said
    row = _row("add", "add", n, 12 * n, 12 * n / 4e10, measured, "memory")
    kept = val._floor_against_round(fails, [row], cases, {"add": {"min": measured}}, fast, 2)
    assert len(kept) == 1 and "20% of its bound (< 50%) against round 2's own calibration" in kept[0]


def test_a_gemv_faster_than_the_calibration_raises_the_read_bandwidth():
    """The sweep's matrix-vector product is a calibration kernel too: one that read its matrix
    faster than the calibrated bandwidth raises the read rate to bytes read / (time - bytes
    written at the write rate), the write rate kept; one slower, or another memory-bound kernel
    faster, leaves the device as it was. Bytes from symcost's own rules on a real [n, n] x [n, 1]."""
    import random

    import torch

    n = random.Random(17).choice((512, 768, 1024))
    costs = val.kernel_costs(lambda a, x: a @ x, torch.randn(n, n), torch.randn(n, 1))
    written = sum(c["written"] for c in costs)
    read = sum(c["bytes"] for c in costs) - written
    assert read == 4 * (n * n + n) and written == 4 * n  # the matrix and the vector read, fp32
    dev = val.device_from_entry({"fp32": 1e11, "bandwidth": 2e10, "write_bandwidth": 1e10})
    measured = read / 2.5e10 + written / 1e10  # read at 25 GB/s, above the calibrated 20
    row = _row(f"[{n},{n}]x[{n},1]", "matrix-vector", 2 * n * n, read + written, measured, measured, "memory")
    raised = val._read_rate_of_gemvs([row], [("matrix-vector", row["kernel"], True, costs, None)], dev)
    assert abs(raised.bandwidth / 2.5e10 - 1) < 1e-9 and raised.write_bandwidth == 1e10
    slow = dict(row, measured=read / 1.5e10 + written / 1e10)
    assert val._read_rate_of_gemvs([slow], [("matrix-vector", row["kernel"], True, costs, None)], dev) is None
    add = dict(row, family="add")
    assert val._read_rate_of_gemvs([add], [("add", row["kernel"], True, costs, None)], dev) is None
    # a device of one bandwidth keeps writing at it
    one = val.device_from_entry({"fp32": 1e11, "bandwidth": 2e10})
    raised = val._read_rate_of_gemvs([dict(row, measured=read / 2.5e10 + written / 2e10)],
                                     [("matrix-vector", row["kernel"], True, costs, None)], one)
    assert abs(raised.bandwidth / 2.5e10 - 1) < 1e-9 and raised.write_bandwidth == 2e10


def test_compiled_branches_switch_transformers_sdpa():
    """The decode validation records the SDPA branch transformers takes under torch.compile."""
    import transformers.integrations.sdpa_attention as sdpa

    assert sdpa.is_torchdynamo_compiling() is False
    with val.compiled_branches():
        assert sdpa.is_torchdynamo_compiling() is True
    assert sdpa.is_torchdynamo_compiling() is False


@pytest.mark.heavy
@pytest.mark.timing
def test_quick_sweep_on_this_cpu():
    """Calibrate, then compile and time the CI-sized sweep and the training steps of mlp and
    cs336-lm. Always: every kernel measured, none faster than its predicted bound by more than
    10%. The checks of how close kernels come to their bound (large kernels >= 50%, training steps
    within 2x, time scaling with the predicted resource) are timing-quality claims: they are
    asserted when other processes used at most a quarter of the machine's CPU while kernels were
    timed (as on CI, where the tests run alone), and reported otherwise."""
    # in a process of its own, as a user runs it: timings in a long test process vary with what the
    # tests before it left behind (a newcomer's full run once saw the softmax 14x slower there)
    proc = subprocess.run([sys.executable, "-c", "from symcost.cli import main; main()", "validate", "--quick",
                           "--attempts", "3", "--json"], capture_output=True, text=True, timeout=900)
    assert proc.returncode in (0, 1), proc.stderr[-2000:]  # 1: a check failed (asserted below)
    res = json.loads(proc.stdout)
    v = SimpleNamespace(rows=res["kernels"], failures=res["failures"], contention=res["contention"])
    assert v.contention is not None  # /proc/stat is readable on the machines this runs on
    busy = v.contention > 0.25
    rows = {r["kernel"]: r for r in v.rows}
    assert {"square matmul", "skinny matmul", "matrix-vector", "add", "gelu", "softmax", "mlp block",
            "training step"} <= {r["family"] for r in v.rows}
    assert sum(1 for r in v.rows if r["family"] == "training step") == 2
    for r in v.rows:
        assert r["measured"] > 0 and r["predicted"] > 0 and r["bound"] in ("compute", "memory", "transcendental")
    below = [f for f in v.failures if "below the predicted bound" in f]
    assert not below, below
    steps = [r for r in v.rows if r["family"] == "training step"]
    assert all(r["measured"] >= 0.05 for r in steps), [(r["kernel"], r["measured"]) for r in steps]
    report = "\n".join(f"{k}: predicted {r['predicted'] * 1e3:.2f} ms measured {r['measured'] * 1e3:.2f} ms"
                       for k, r in rows.items())
    if busy:
        pytest.skip(f"other processes used {100 * v.contention:.0f}% of the CPU while kernels were timed: "
                    f"closeness checks not asserted; failures: {v.failures}\n{report}")
    assert not v.failures, "\n".join(v.failures) + "\n" + report


def test_validation_plot_points_are_the_rows(tmp_path):
    from symcost.render.plots import validation_plot

    rows = [_row("mm 1", "square", 2e9, 1.2e7, 0.02, 0.021, "compute"),
            _row("add", "add", 1e7, 1.2e8, 0.01, 0.013, "memory")]
    png = tmp_path / "v.png"
    pts = validation_plot(rows, str(png))
    assert png.exists() and png.stat().st_size > 1000
    assert pts == [(r["predicted"], r["measured"]) for r in rows]


def test_step_gemms_are_the_linear_layers_gemms():
    """The GEMM shapes validate calibrates the peak on (besides the squares) are those of one
    training step of mlp at random sizes: per Linear(D, D) on N = B·S tokens, the forward's
    [N, D] x [D, D] (addmm) and the backward's grad input (grad_out [N, D] x W [D, D]) and grad
    weight (grad_outᵀ [D, N] x x [N, D]) — torch.nn.functional.linear's autograd formulas."""
    import random

    rng = random.Random(7)
    for _ in range(3):
        B, S, D, L = rng.randint(1, 4), rng.randint(2, 40), rng.randint(2, 48), rng.randint(1, 3)
        N = B * S
        assert set(val.step_gemms("mlp", {"B": B, "S": S, "D": D, "L": L})) == {(N, D, D), (D, N, D)}
