"""``symcost time --dp N --shard S --gpu G --tokens T``: the whole run from one rank's step time
(issue 15, symcost.passes.parallel.train_time_dp).

The oracle evaluates docs/parallel.md's step-time model by hand: the bytes each rank sends come
from PyTorch (``tests/test_parallel.py``'s ``_run_rank``: every collective seen at dispatch,
nccl-tests' ring factors typed by hand), the link bandwidth and the peak FLOP/s are read from the
catalogue file itself (``tomllib``), the model FLOPs from ``FlopCounterMode``, and the compute
per phase is the roofline's (checked in tests/test_roofline.py). Then

* overlap none:  step = compute_fwd + compute_bwd + bytes / bandwidth
* overlap full:  step = max(compute_fwd + compute_bwd, bytes / bandwidth)
* overlap backward, DDP (every all-reduce runs in the backward): compute_fwd + max(compute_bwd, bytes / bw)

and the run takes tokens / (B·S·K·DP) optimizer steps of K micro-steps per rank, each
(K-1)·(compute_fwd + compute_bwd) + step under DDP (the gradients reduced once per optimizer step)
and K·step under FSDP2 (every micro-step, as torchtitan runs it); MFU = FLOPs / (step × peak). Sizes, DP,
nodes and the accumulation are drawn at random (seeded).
"""
from __future__ import annotations

import json
import random
import tomllib
from importlib import resources

import pytest

from test_parallel import _run_rank


from test_parallel_cache import _fresh  # (the same fresh traces)


def _cli(*args, code=0):
    from click.testing import CliRunner

    from symcost.cli import main

    r = CliRunner().invoke(main, list(args))
    assert r.exit_code == code, (args, r.output)
    return json.loads(r.output[r.output.index("{"):]) if code == 0 else r.output


def _catalogue(key):
    return tomllib.loads(resources.files("symcost.hardware").joinpath("devices.toml").read_text())[key]


@pytest.mark.parametrize("shard,gpu", [("fsdp", "h100-sxm"), ("ddp", "a100-80gb")])
def test_time_dp_matches_hand_computed_step(shard, gpu, cache_dir):
    from symcost.hardware.devices import get_device
    from symcost.passes.roofline import roofline

    cat = _catalogue(gpu)
    rng = random.Random(31 + len(shard))
    width = 8 * rng.randint(2, 16)
    for i in range(3):
        dp = rng.choice((2, 4, 8, 16))
        v = {"B": rng.randint(2, 8), "S": rng.randint(8, 256), "D": width, "L": rng.randint(2, 6), "DP": dp}
        tokens = rng.randint(10**6, 10**12)
        k = rng.randint(1, 8)
        nodes = rng.choice((1, 2)) if dp > 1 else 1
        per_node = dp // nodes
        got = _run_rank("mlp", shard, v)
        for overlap in ("none", "full") + (("backward",) if shard == "ddp" else ()):
            d = _cli("time", "mlp", "--dp", str(dp), "--shard", shard, "--gpu", gpu, "--tokens", str(tokens),
                     "--accumulate", str(k), "--overlap", overlap, "--nodes", str(nodes), "--devices-per-node",
                     str(per_node), "--json", "--set", *[f"{s}={x}" for s, x in v.items() if s != "DP"])
            nbytes = float(sum(got["comm"].values()))
            bw = cat["interconnect"]["network_bandwidth" if nodes > 1 else "link_bandwidth"]
            peak = cat["bf16"]
            an = _fresh(shard)
            ph = roofline(an, get_device(gpu), v)["per_phase"]
            cf, cb = ph["forward"]["seconds"], ph["backward"]["seconds"]
            comm = nbytes / bw
            step = {"none": cf + cb + comm, "full": max(cf + cb, comm), "backward": cf + max(cb, comm)}[overlap]
            assert d["step"]["step_seconds"] == pytest.approx(step, rel=1e-9), (v, overlap)
            assert d["step"]["link_bandwidth"] == bw and d["peak_flops"] == peak
            assert d["mfu"] == pytest.approx(got["flops"] / (step * peak), rel=1e-9)
            # one optimizer step of k micro-steps: DDP reduces once (under the last micro-step, Megatron's
            # no_sync_func / PyTorch's no_sync), FSDP2 as torchtitan runs it every micro-step
            step_k = (k - 1) * (cf + cb if shard == "ddp" else step) + step
            assert d["time.seconds"] == pytest.approx(tokens / (v["B"] * v["S"] * k * dp) * step_k, rel=1e-9)
            assert d["time.device_hours"] == pytest.approx(d["time.seconds"] * dp / 3600, rel=1e-12)
            assert d["global_batch"] == v["B"] * k * dp and d["tokens_per_step"] == v["B"] * v["S"] * k * dp
            assert d["steps"] == pytest.approx(tokens / (v["B"] * v["S"] * k * dp), rel=1e-12)
            assert d["compute.total"] == pytest.approx(got["flops"] * tokens / (v["B"] * v["S"]), rel=1e-12)


def test_time_dp_refusals(cache_dir):
    base = ("time", "mlp", "--tokens", "1e9", "--set", "D=64")
    assert "needs --dp N" in _cli(*base, "--gpu", "h100-sxm", code=2)
    assert "--accumulate needs --dp" in _cli(*base, "--mfu", "0.4", "--accumulate", "2", code=2)
    assert "--gpu NAME" in _cli(*base, "--dp", "4", code=2)
    assert "leave out --mfu" in _cli(*base, "--dp", "4", "--gpu", "h100-sxm", "--mfu", "0.4", code=2)
    assert "--devices 2 and --dp 4 disagree" in _cli(*base, "--dp", "4", "--gpu", "h100-sxm", "--devices", "2",
                                                      code=2)
    assert "name two devices" in _cli(*base, "--dp", "4", "--gpu", "h100-sxm", "--device", "a100-80gb", code=2)


def test_report_takes_device_for_gpu(cache_dir):
    """report's --device NAME is --gpu NAME (the other commands name the catalogue device
    --device): the same JSON; both at once must name one device."""
    base = ("report", "mlp", "--dp", "4", "--shard", "fsdp", "--set", "D=64", "B=4", "S=32", "--json")
    by_gpu, by_device = _cli(*base, "--gpu", "h100-sxm"), _cli(*base, "--device", "h100-sxm")
    assert by_gpu == by_device and by_gpu["parallel"]["step"]["step_seconds"] > 0
    assert "name two devices" in _cli(*base, "--gpu", "h100-sxm", "--device", "a100-80gb", code=2)
    assert "--device needs --dp N" in _cli("report", "mlp", "--device", "h100-sxm", code=2)
