"""``time --pp`` and ``mfu --pp`` (issue 29: the predicted step everywhere): the pipeline step
``report --pp --gpu`` predicts (symcost.passes.pipeline.predict_price: PyTorch's schedule over the
stages' predicted times, docs/performance-model.md "A pipeline rank"), reused by both.

Oracles: ``report --pp --gpu``'s own prediction (the same step, one number); the model FLOPs of m
micro-batches of the one-device trace (the stages' FLOPs add up to it:
test_pipeline_parallel.test_cli_report_pp_json_keeps_the_report_contract) and the H100's
datasheet fp32 peak, for MFU = model FLOPs / (ranks × peak × step) computed here.
"""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

import symcost
from symcost.cli import main

import os
import random
import sys

sys.path.insert(0, os.path.dirname(__file__))
from test_pipeline_parallel import SEED, _draw  # noqa: E402  (its sizes: the stage traces it caches)

SIZES = dict(_draw(random.Random(SEED)), L=2)


def _json(args):
    r = CliRunner().invoke(main, args + ["--json"])
    assert r.exit_code == 0, r.output[-2000:]
    return json.loads(r.output[r.output.index("{"):])


@pytest.mark.heavy
def test_time_and_mfu_pp_reuse_report_pp_prediction(monkeypatch):
    """cs336-lm, fp32, GPipe over 2 ranks with m = 3 micro-batches of B sequences on H100s:
    ``time --pp`` predicts the step ``report --pp --gpu`` does and runs tokens / (B·S·m) of them on
    2 devices; ``mfu --pp`` gives the predicted MFU m·F / (2 · peak · step), F the one-device step's
    model FLOPs, and the measured MFU F/(B·S) · R / (2 · peak) at R tokens/s. (The pipeline summary
    is kept per argument list, so the three commands run it once where they ask for the same
    pipeline, as they must to agree.)"""
    from symcost.hardware.devices import get_device
    from symcost.passes import pipeline

    seen, real = {}, pipeline.summary

    def once(spec, *args, **kwargs):
        key = repr((spec.name, args, sorted((k, getattr(v, "key", v)) for k, v in kwargs.items())))
        if key not in seen:
            seen[key] = real(spec, *args, **kwargs)
        return seen[key]

    monkeypatch.setattr(pipeline, "summary", once)

    m, pp = 3, 2
    pipe = ["cs336-lm", "--pp", str(pp), "--schedule", "gpipe", "--microbatches", str(m), "--precision", "fp32",
            "--set"] + [f"{k}={v}" for k, v in SIZES.items()]
    rep = _json(["report", *pipe, "--gpu", "h100"])["pipeline"]["step"]["predicted"]
    tokens = 10 ** 9
    t = _json(["time", *pipe, "--gpu", "h100", "--tokens", str(tokens)])
    step = t["predicted"]["step_seconds"]
    assert step == pytest.approx(rep["step_seconds"], rel=1e-12)
    per_step = SIZES["B"] * SIZES["S"] * m
    assert t["tokens_per_step"] == per_step and t["ranks"] == pp
    assert t["time.seconds"] == pytest.approx(tokens / per_step * step, rel=1e-12)
    assert t["time.device_hours"] == pytest.approx(t["time.seconds"] * pp / 3600, rel=1e-12)
    assert len(seen) == 1, list(seen)  # (time asked for report's pipeline)
    one = symcost.trace("cs336-lm", sizes=SIZES, precision="fp32")
    F = int(one.flops("train").subs(one.bind(**SIZES)))
    peak = get_device("h100").peak_for("fp32")[0]
    assert t["compute.total"] == pytest.approx(F * tokens / (SIZES["B"] * SIZES["S"]), rel=1e-12)
    R = 2.5e5
    u = _json(["mfu", *pipe, "--device", "h100", "--tokens-per-second", str(R)])
    assert u["devices"] == pp and u["peak_flops"] == peak
    assert u["predicted"]["step_seconds"] == pytest.approx(step, rel=1e-12)
    assert u["predicted"]["mfu_predicted"] == pytest.approx(m * F / (pp * peak * step), rel=1e-9)
    assert u["mfu"] == pytest.approx(F / (SIZES["B"] * SIZES["S"]) * R / (pp * peak), rel=1e-9)
    r = CliRunner().invoke(main, ["time", *pipe, "--tokens", "1e9", "--mfu", "0.4", "--gpu", "h100"])
    assert r.exit_code == 2 and "leave out --mfu" in r.output, r.output
