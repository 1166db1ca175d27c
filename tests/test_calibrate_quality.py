"""A calibration on a busy machine (issue 14, item 7): detect contention, retry, say so, and
have validate refuse a file marked contended. The timings and the machine's CPU counters are
injected (a fake ``measure`` and ``cpu_times``), so nothing here depends on how busy the machine
running the tests is."""
from __future__ import annotations

import itertools
import json

import pytest

from conftest import run_cli
from symcost.hardware import calibrate as cal


class Clock:
    """Fake /proc/stat counters: each reading adds ``total`` CPU-seconds to the machine, of which
    ``others`` were used by other processes (this process uses none)."""

    def __init__(self, others: float = 0.0):
        self.others, self.busy, self.total = others, 0.0, 0.0

    def __call__(self):
        self.busy += self.others
        self.total += 1.0
        return self.busy, self.total, 0.0


def fake_measure(slow_every: int | None = None, factor: float = 3.0, calm_after: int | None = None):
    """A ``measure`` whose kernel takes a time fixed by its arguments (matmul: 2·n³ at 1e11
    FLOP/s; a vector: 4 bytes per element at 1e10 byte/s, twice for two arguments); every
    ``slow_every``-th call ``factor`` times longer (a busy machine), until call ``calm_after``."""
    calls = itertools.count(1)

    def measure(fn, *args, min_run_time=0.3, warmup=1):
        i = next(calls)
        a = args[0]
        t = 2 * a.shape[0] ** 3 / 1e11 if a.dim() == 2 else 4 * a.numel() * len(args) / 1e10
        if slow_every and i % slow_every == 0 and (calm_after is None or i <= calm_after):
            t *= factor
        return {"min": t, "median": t, "runs": 1}

    return measure


@pytest.mark.parametrize("times,share,reasons", [
    ([1.0, 1.02, 0.99], 0.05, []),
    ([1.0, 1.6, 1.0], 0.05, ["spread"]),
    ([1.0, 1.0, 1.01], 0.6, ["other processes used 60%"]),
    ([1.0, 2.0, 1.0], 0.9, ["spread", "other processes"]),
    ([1.0, 1.1], None, []),
])
def test_assess(times, share, reasons):
    why = cal.assess(times, share)
    assert len(why) == len(reasons) and all(r in w for r, w in zip(reasons, why)), why


def test_measure_rate_retries_and_keeps_the_fastest(monkeypatch):
    """A kernel slow in every third timing is retried; once the machine calms down the round is
    clean and the rate is the fastest seen; a machine busy throughout stays contended after the
    retries, and so does one where others hold the CPU although the timings agree."""
    import torch

    x = torch.ones(1000)
    monkeypatch.setattr(cal, "cpu_times", Clock(0.0))
    monkeypatch.setattr(cal, "measure", fake_measure(slow_every=3, calm_after=3))
    r = cal.measure_rate(lambda a: a, x, repeats=3, retries=2)
    assert r["rounds"] == 2 and not r["contended"] and r["min"] == pytest.approx(4e3 / 1e10)
    monkeypatch.setattr(cal, "measure", fake_measure(slow_every=2))
    r = cal.measure_rate(lambda a: a, x, repeats=3, retries=2)
    assert r["rounds"] == 3 and r["contended"] and "spread" in r["reasons"][0] and r["spread"] == pytest.approx(2.0)
    monkeypatch.setattr(cal, "measure", fake_measure())
    monkeypatch.setattr(cal, "cpu_times", Clock(0.7))
    r = cal.measure_rate(lambda a: a, x, repeats=3, retries=1)
    assert r["rounds"] == 2 and r["contended"] and r["other_cpu_share"] == pytest.approx(0.7)
    r = cal.measure_rate(lambda a: a, x, repeats=3, retries=1, cpu_bound=False)  # a GPU kernel: spread only
    assert r["rounds"] == 1 and not r["contended"]


def test_contended_calibration_is_marked_and_validate_refuses_it(monkeypatch, capsys, tmp_path):
    """``calibrate --out`` on a machine that stays busy: the output says contended, the file's
    ``quality.contended`` is true with the kernels and reasons; ``validate`` refuses that file in
    one line (exit 2) before timing anything, unless --accept-contended. A calm run is marked not
    contended and its rates are the injected ones."""
    from symcost.validation import validate as val

    monkeypatch.setattr(cal, "cpu_times", Clock(0.0))
    monkeypatch.setattr(cal, "measure", fake_measure(slow_every=2))
    out = tmp_path / "busy.json"
    code, text, err = run_cli(capsys, "calibrate", "--quick", "--no-efficiency", "--out", str(out))
    assert code == 0, err
    flat = " ".join(text.split())
    assert "contended" in flat and "calibrate again" in flat
    entry = json.loads(out.read_text())["this-machine"]
    q = entry["quality"]
    assert q["contended"] is True and q["kernels"] and any("spread" in r for r in q["reasons"])
    assert all(k["rounds"] == 1 + cal.RETRIES for k in entry["measured"]["kernels"])

    def no_sweep(*a, **k):
        raise AssertionError("validate timed kernels against a contended calibration")

    monkeypatch.setattr(val, "validate", no_sweep)
    code, text, err = run_cli(capsys, "validate", "--devices-file", str(out), "--device", "this-machine", "--quick")
    assert code == 2 and err.count("\n") == 1 and "busy machine" in err and "--accept-contended" in err, err
    seen = {}

    def fake_validate(device, **kw):
        seen["device"] = device
        return val.Validation(device)

    monkeypatch.setattr(val, "validate", fake_validate)
    code, text, err = run_cli(capsys, "validate", "--devices-file", str(out), "--device", "this-machine", "--quick",
                              "--accept-contended")
    assert code == 0, err
    assert seen["device"].contended and "warning" in text and "busy machine" in " ".join(text.split())

    monkeypatch.setattr(cal, "measure", fake_measure())
    calm = tmp_path / "calm.json"
    code, text, err = run_cli(capsys, "calibrate", "--quick", "--no-efficiency", "--out", str(calm))
    assert code == 0, err
    entry = json.loads(calm.read_text())["this-machine"]
    assert entry["quality"]["contended"] is False and "not contended" in text
    assert entry["fp32"] == pytest.approx(1e11, rel=0.1)  # the injected matmul rate (the packing taken off)
    assert entry["bandwidth"] == pytest.approx(2e10, rel=1e-6)  # the scale kernel: 8 bytes per element in 4e-10 s
    code, text, err = run_cli(capsys, "validate", "--devices-file", str(calm), "--device", "this-machine", "--quick")
    assert code == 0 and not seen["device"].contended, err
