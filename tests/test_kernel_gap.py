"""The device's time at each kernel boundary of an eager step (issue 29; docs/performance-model.md,
"Kernel boundaries on the device"): ``kernel_gap`` per op that runs a kernel, added to its phase's
device seconds before the host's work is overlapped with them.

Oracles: the kernels an eager step runs, counted by PyTorch's dispatcher on a real step at sizes the
trace never ran (every aten op that is not a view: ``OpOverload.is_view``; ``_unsafe_view``, a view
whose alias PyTorch hides from autograd, counted as the view it is); the step's arithmetic redone
by hand from the per-op seconds and those counts."""
from __future__ import annotations

import dataclasses
import random

import pytest

from symcost.hardware.efficiency import parse_efficiency


def _dispatched_kernels(model: str, sizes: dict) -> dict:
    """Non-view aten ops of one real eager forward (with the loss) and backward, run on the meta
    device (PyTorch's dispatcher runs the same ops, without data)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from symcost.frontends.models import resolve

    spec = resolve(model)
    values = {**spec.defaults, **sizes}
    values.update({a: values[b] for a, b in spec.tied.items()})
    torch.manual_seed(0)
    with torch.device("meta"):
        m = spec.build(values)
    args, kwargs = spec.make_inputs(values, torch.device("meta"))
    count = {"forward": 0, "backward": 0}

    class _Count(TorchDispatchMode):
        def __init__(self, phase):
            super().__init__()
            self.phase = phase

        def __torch_dispatch__(self, func, types, a=(), kw=None):
            if not func.is_view and func.__name__.split(".")[0] != "_unsafe_view":
                count[self.phase] += 1
            return func(*a, **(kw or {}))

    with _Count("forward"):
        loss = spec.loss(m(*args, **kwargs), (args, kwargs))
    with _Count("backward"):
        loss.backward()
    return count


def test_kernel_boundaries_are_the_dispatched_kernels_times_the_gap():
    """On the catalogue's H100 (kernel_gap 2.1 us, host_async): an mlp traced at one size and
    predicted at random others (small: the host bounds the step; large: the device does) has, per
    phase, as many kernels as PyTorch dispatches non-view ops in a step there; each phase's device seconds are its ops' seconds plus kernel_gap per
    kernel; the step is the host/device queue over those by hand (the forward ends at
    max(host_f, device_f), the backward at max(that + device_b, host_f + host_b)), plus AdamW; the
    same device without the figure is shorter by what the boundaries add to a device-bound step."""
    from symcost.graph.build import trace
    from symcost.hardware.devices import get_device
    from symcost.passes.performance import predict

    an = trace("mlp", sizes={"B": 2, "S": 32, "D": 64, "L": 2}, precision="fp32")
    h100 = get_device("h100-sxm")
    gap = h100.efficiency.kernel_gap
    assert gap > 0
    rng = random.Random(29)
    bound = set()
    for scale in (1, 1, 64, 64):
        sizes = {"B": rng.randint(2, 5) * scale, "S": rng.choice((8, 24, 40)) * scale,
                 "D": rng.choice((16, 48, 96)) * scale, "L": rng.randint(3, 6)}
        p = predict(an, h100, sizes)
        assert p["kernels"] == _dispatched_kernels("mlp", sizes), sizes
        ops = {"forward": 0.0, "backward": 0.0}
        for n in p["nodes"]:
            ops["forward" if n["phase"] == "forward" else "backward"] += n["seconds"]
        dev = {ph: ops[ph] + gap * p["kernels"][ph] for ph in ops}
        assert p["device"]["forward"] == pytest.approx(dev["forward"])
        assert p["device"]["backward"] == pytest.approx(dev["backward"])
        assert p["terms"]["kernel_gap"] == pytest.approx(gap * sum(p["kernels"].values()))
        hf, hb = p["host"]["forward"], p["host"]["backward"]
        end_f = max(hf, dev["forward"])
        end_b = max(end_f + dev["backward"], hf + hb)
        opt = max(p["host"]["optimizer"], p["device"]["optimizer"])
        assert p["step_seconds"] == pytest.approx(end_b + opt) == pytest.approx(sum(p["terms"].values()))
        # what callers compose per phase (predict_dp, pipelines, plan): the ops' seconds + phase_overhead
        assert ops["forward"] + ops["backward"] + sum(p["phase_overhead"].values()) == pytest.approx(end_b)
        none = dataclasses.replace(h100, efficiency=dataclasses.replace(h100.efficiency, kernel_gap=0.0))
        q = predict(an, none, sizes)
        assert q["terms"]["kernel_gap"] == 0.0 and q["step_seconds"] <= p["step_seconds"] * (1 + 1e-12)
        if hf <= ops["forward"] and hf + hb <= ops["forward"] + ops["backward"]:  # device-bound either way
            bound.add("device")
            assert p["step_seconds"] - q["step_seconds"] == pytest.approx(p["terms"]["kernel_gap"])
        elif hf >= dev["forward"] and hf + hb >= dev["forward"] + dev["backward"]:  # host-bound: hidden
            bound.add("host")
            assert p["step_seconds"] == pytest.approx(q["step_seconds"])
    assert bound == {"device", "host"}


def test_a_compiled_step_and_a_cpu_pay_no_boundary_term():
    """A compiled step keeps launch_compiled per fused kernel (no kernel_gap on top of it); the
    recorded CPU calibration has none (its kernels run inside the op: kernel_gap 0) and says the
    figure is defaulted; the calibration's reading on a CPU times nothing and gives 0."""
    import torch

    from symcost.graph.build import trace
    from symcost.hardware.calibrate_perf import kernel_gap
    from symcost.hardware.devices import get_device
    from symcost.passes.performance import predict

    sizes = {"B": 2, "S": 32, "D": 64, "L": 2}
    an = trace("mlp", sizes=sizes, precision="fp32")
    c = predict(an, get_device("h100-sxm"), sizes, mode="compiled")
    assert c["terms"]["kernel_gap"] == 0.0 and c["kernels"] == {"forward": 0, "backward": 0}
    a100 = get_device("a100-80gb")
    assert a100.efficiency.kernel_gap == 0.0 and "kernel_gap" in a100.efficiency.defaulted
    assert predict(an, a100, sizes)["terms"]["kernel_gap"] == 0.0
    assert kernel_gap(torch.device("cpu"))["kernel_gap"] == 0.0


def test_kernel_gap_parses_and_reads_back():
    e = parse_efficiency({"kernel_gap": 1.5e-6, "host_async": True}, "t")
    assert e.kernel_gap == 1.5e-6 and "kernel_gap" not in e.defaulted
    assert parse_efficiency(e.to_json(), "t").kernel_gap == 1.5e-6
    assert parse_efficiency({}, "t").kernel_gap == 0.0
    with pytest.raises(Exception, match="non-negative"):
        parse_efficiency({"kernel_gap": -1e-6}, "t")
