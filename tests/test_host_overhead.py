"""The host's work in an eager step (issue 29; docs/performance-model.md, "Host overhead"): per
aten op of each phase, measured on a microbenchmark; added to the device's time on a CPU (one
thread does both), max(host, device) per stretch on an asynchronous device (a GPU's stream).

Oracles: the queue arithmetic by hand; PyTorch timing a real eager training step on this CPU
(CPU time of this process) of models at sizes the host microbenchmark never runs."""
from __future__ import annotations

import dataclasses
import os

import pytest

from symcost.hardware.efficiency import Efficiency, parse_efficiency
from symcost.passes.performance import host_stretches

DATA = os.path.join(os.path.dirname(__file__), "data")


def test_stretches_add_on_a_cpu_and_overlap_on_an_asynchronous_device():
    """Synchronous: host + device. Asynchronous: forward and backward one queue (the forward ends
    at max(host_f, device_f), the backward at max(that + device_b, host_f + host_b)), the optimizer
    max(host, device); worked by hand for a host-bound, a device-bound and a mixed step."""
    sync = host_stretches({"forward": 3.0, "backward": 5.0}, {"forward": 2.0, "backward": 4.0}, 1.0, 0.5, False)
    assert sync["phase_overhead"] == {"forward": 3.0, "backward": 5.0}
    assert sync["optimizer"] == 1.5 and sync["step"] == pytest.approx(2 + 4 + 3 + 5 + 1.5)
    host_bound = host_stretches({"forward": 3.0, "backward": 5.0}, {"forward": 2.0, "backward": 4.0}, 1.0, 0.5, True)
    assert host_bound["step"] == pytest.approx(3 + 5 + 1)  # the device waits for the host throughout
    device_bound = host_stretches({"forward": 1.0, "backward": 1.0}, {"forward": 2.0, "backward": 4.0}, 0.2, 0.5,
                                  True)
    assert device_bound["phase_overhead"] == {"forward": 0.0, "backward": 0.0}
    assert device_bound["step"] == pytest.approx(2 + 4 + 0.5)
    # the forward's device backlog (2 s) covers the backward's host work: max(2 + 1, 1 + 2.5) = 3.5
    mixed = host_stretches({"forward": 1.0, "backward": 2.5}, {"forward": 2.0, "backward": 1.0}, 0.0, 0.0, True)
    assert mixed["phase_overhead"]["forward"] == 0.0 and mixed["phase_overhead"]["backward"] == pytest.approx(0.5)
    assert mixed["step"] == pytest.approx(3.5)


def test_host_figures_parse_and_fall_back_to_launch_eager():
    e = parse_efficiency({"host_forward": 2e-6, "host_backward": 3e-6, "host_launch": 1e-6, "host_async": True}, "t")
    assert (e.host_per_op("forward"), e.host_per_op("backward"), e.host_launch, e.host_async) == (2e-6, 3e-6, 1e-6,
                                                                                                  True)
    assert Efficiency(launch_eager=4e-6).host_per_op("backward") == 4e-6
    with pytest.raises(Exception, match="host_async must be true or false"):
        parse_efficiency({"host_async": "yes"}, "t")
    with pytest.raises(Exception, match="non-negative"):
        parse_efficiency({"host_forward": -1.0}, "t")


def test_a_gpu_step_is_the_longer_of_host_and_device_per_stretch():
    """predict on the catalogue's H100 (host_async): the step is device + the host time the
    device leaves exposed, equal to host_stretches over predict's own host and device seconds;
    the same trace on a copy of the device made synchronous adds every host second."""
    from symcost.graph.build import trace
    from symcost.hardware.devices import get_device
    from symcost.passes.performance import predict

    sizes = {"B": 2, "S": 32, "D": 64, "L": 2}
    an = trace("mlp", sizes=sizes, precision="fp32")
    h100 = get_device("h100-sxm")
    p = predict(an, h100, sizes)
    assert p["host_async"] is True
    want = host_stretches(p["host"], p["device"], p["host"]["optimizer"], p["device"]["optimizer"], True)
    assert p["step_seconds"] == pytest.approx(want["step"]) == pytest.approx(sum(p["terms"].values()))
    serial = dataclasses.replace(h100, efficiency=dataclasses.replace(h100.efficiency, host_async=False))
    q = predict(an, serial, sizes)
    assert q["step_seconds"] == pytest.approx(sum(q["host"].values()) + sum(q["device"].values()))
    assert q["step_seconds"] > p["step_seconds"]


@pytest.mark.timing
def test_host_term_predicts_a_host_bound_eager_step_on_this_cpu():
    """Measure the host's work per aten op on its microbenchmark (calibrate_perf.host_per_op: a
    6-block stack of width 8) and AdamW's costs (optimizer_costs), then predict eager training
    steps of gpt2 and megatron-gpt at tiny sizes the microbenchmark never runs (host time 5-7 times
    the device's), and time them in PyTorch (this process's CPU time): within 20% each. The
    microbenchmark and the steps are timed in alternation, five rounds, medians of each, so both
    see the same load (on a shared machine CPU time still counts the caches others share). The
    recorded calibration (tests/data/perf-cpu.json) prices the device's kernels. About 10 s."""
    import statistics

    import torch

    from symcost.graph.build import trace
    from symcost.hardware.calibrate_perf import host_per_op, optimizer_costs
    from symcost.hardware.devices import load_file
    from symcost.passes.performance import predict
    from symcost.validation.steps import eager_step, time_step

    cases = (("gpt2", {"B": 1, "S": 12, "H": 2, "D": 12, "L": 2, "V": 96}),
             ("megatron-gpt", {"B": 2, "S": 6, "H": 2, "D": 10, "L": 2, "V": 80}))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        dev = next(iter(load_file(os.path.join(DATA, "perf-cpu.json")).values()))
        cpu = torch.device("cpu")
        ans = {m: trace(m, sizes=sz, precision="fp32") for m, sz in cases}
        steps = {m: eager_step(m, sz) for m, sz in cases}
        hf, hb, opt, took = [], [], [], {m: [] for m, _ in cases}
        for _ in range(5):
            h = host_per_op(cpu, 0.1)
            hf.append(h["host_forward"])
            hb.append(h["host_backward"])
            opt.append(optimizer_costs(cpu, 0.05))
            for m, _ in cases:
                took[m].append(time_step(steps[m], min_runs=5, min_seconds=0.1)["cpu_median"])
        eff = dataclasses.replace(dev.efficiency, host_forward=statistics.median(hf),
                                  host_backward=statistics.median(hb),
                                  optimizer_per_tensor=statistics.median(c["optimizer_per_tensor"] for c in opt),
                                  optimizer_per_byte=statistics.median(c["optimizer_per_byte"] for c in opt))
        dev = dataclasses.replace(dev, efficiency=eff)
        errors = {}
        for m, sz in cases:
            p = predict(ans[m], dev, sz)
            assert p["host_async"] is False and sum(p["host"].values()) > 3 * sum(p["device"].values())
            errors[m] = p["step_seconds"] / statistics.median(took[m]) - 1
    finally:
        torch.set_num_threads(threads)
    assert all(abs(e) <= 0.20 for e in errors.values()), errors
