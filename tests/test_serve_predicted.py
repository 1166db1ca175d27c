"""``serve``: time per output token and time to first token from the performance model, beside
the roofline bounds (issue 29 item 3; docs/inference.md, docs/performance-model.md)."""
from __future__ import annotations

import json

import pytest

from conftest import run_cli

SMALL = ("hf:llama", "--config", "num_hidden_layers=2", "hidden_size=256", "num_attention_heads=4",
         "num_key_value_heads=2", "intermediate_size=512", "vocab_size=512", "--context", "64",
         "--device", "h100", "--memory", "64MiB")


def test_serve_prints_the_prediction_beside_the_bounds(capsys):
    code, out, err = run_cli(capsys, "serve", *SMALL, "--json")
    assert code == 0, err
    d = json.loads(out)
    p = d["predicted"]
    # a prediction is never below its bound (efficiency <= 1, launches >= 0)
    assert p["seconds_per_token"] >= d["seconds_per_token"] > 0
    assert p["seconds_per_token_batch_1"] >= d["decode_batch_1"]["seconds_per_token"] > 0
    assert p["prefill_seconds"] >= d["prefill_seconds"] > 0
    assert p["tokens_per_second"] == pytest.approx(d["max_batch"] / p["seconds_per_token"])
    assert p["calibrated"] is False and "launch_compiled" in p["defaulted"]
    code, text, err = run_cli(capsys, "serve", *SMALL)
    assert code == 0 and "predicted (performance model, compiled)" in " ".join(text.split()), err


def test_a_batch_1_decode_gemm_is_priced_at_the_bandwidth():
    """One row through a [k, n] weight: a GEMV, memory-bound on a GPU. The tile rule runs a
    one-row output on a one-row tile, so the GEMM is priced at its bytes over the achievable
    bandwidth (2·k·n weight bytes in bf16 dominate), not at 1/128 of the peak."""
    from symcost.hardware.devices import get_device

    dev = get_device("h100")
    e = dev.efficiency
    k = n = 4096
    t_in = 2 * k * n / (dev.peak_for("bf16")[0] * e.gemm(1, n, k, 1, "bf16"))
    t_mem = 2 * k * n / (dev.bandwidth * e.memory)
    assert t_in < t_mem
    assert e.gemm(130, 128, 4096, 1, "bf16") == pytest.approx(
        e.gemm_max_for("bf16") * (2 / 132) * 130 / 256 * (130 / 146) * (128 / 144) * (4096 / 4112))
