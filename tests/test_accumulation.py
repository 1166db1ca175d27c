"""Gradient accumulation: the arithmetic (real gradients), the plan, and its memory (issue 3).

B_global = B_micro x K x N_devices; each micro-batch's loss is scaled by 1/K so the update equals
the full-batch mean gradient (conventions.md).
"""
from __future__ import annotations

import random

import pytest
import torch

from conftest import random_sizes
from symcost.passes import memory
from symcost.errors import SymcostError
from memory_oracle import accumulation_peak, build


def _grads(model):
    return [p.grad.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("model_name,K", [("cs336-lm", 4), ("gpt2", 3)])
def test_accumulated_gradients_equal_full_batch(model_name, K):
    """K micro-batches with loss/K give the full batch's gradient; without /K, K times it."""
    spec = __import__("symcost").resolve(model_name)
    sizes = {"B": 2 * K, "S": 11, "H": 2, "D": 8, "L": 2, "V": 37, "F": 24}
    sizes = {k: v for k, v in sizes.items() if k in spec.all_symbols}
    torch.manual_seed(0)
    model, args, _, _ = build(spec, sizes, "fp32")
    model.float()
    tokens = args[0]
    model.zero_grad()
    spec.loss(model(tokens), ((tokens,), {})).backward()  # mean over the whole batch
    full = _grads(model)

    def accumulate(scale):
        model.zero_grad()
        for chunk in tokens.chunk(K, dim=0):
            loss = spec.loss(model(chunk), ((chunk,), {}))
            (loss / K if scale else loss).backward()
        return _grads(model)

    scaled = accumulate(True)
    for a, b in zip(full, scaled):
        torch.testing.assert_close(a.double(), b.double(), rtol=1e-4, atol=1e-6)
    unscaled = accumulate(False)
    for a, b in zip(full, unscaled):
        torch.testing.assert_close(b.double(), K * a.double(), rtol=1e-4, atol=1e-5)
    assert max((b - a).abs().max().item() for a, b in zip(full, unscaled)) > 0  # really K x, not equal


def test_plan_splits_exactly(traced):
    an = traced("cs336-lm")
    mm = memory.memory_model(an, "bf16-mixed", "adamw")
    sizes = {"S": 1024}
    rng = random.Random(4)
    for _ in range(5):
        devices = rng.choice((1, 2, 4, 8))
        per_device = rng.randint(8, 400)
        g = per_device * devices
        cap = rng.randint(mm.peak(accumulate=True, B=2, S=1024), mm.peak(B=200, S=1024))
        plan = mm.plan_accumulation(g, devices, cap, **sizes)
        assert plan.micro_batch * plan.accumulation_steps * plan.devices == g
        assert plan.per_device_batch % plan.micro_batch == 0
        assert plan.memory <= cap
        if plan.accumulation_steps == 1:
            assert mm.peak(B=per_device, S=1024) <= cap
        else:
            assert mm.peak(accumulate=True, B=plan.micro_batch, S=1024) <= cap
            # the largest divisor that fits: the next divisor up does not
            bigger = [d for d in range(plan.micro_batch + 1, per_device + 1) if per_device % d == 0]
            if bigger:
                assert mm.peak(accumulate=True, B=bigger[0], S=1024) > cap
            assert plan.exact == (plan.micro_batch == min(plan.max_micro_batch, per_device))
            if not plan.exact:
                assert "no exact split" in plan.note
        # FLOPs: K micro-steps of B_micro = one step of the per-device batch
        flops = lambda b: int(an.flops("train").subs(an.bind(B=b, S=1024)))  # noqa: E731
        assert plan.flops_per_device == plan.accumulation_steps * flops(plan.micro_batch) == flops(per_device)


def test_plan_reports_no_exact_split(traced):
    an = traced("cs336-lm")
    mm = memory.memory_model(an, "bf16-mixed", "adamw")
    per_device = 97  # prime: only 1 and 97 divide it
    cap = mm.peak(accumulate=True, B=40, S=256)
    plan = mm.plan_accumulation(per_device * 2, 2, cap, S=256)
    assert plan.micro_batch == 1 and plan.accumulation_steps == 97 and not plan.exact
    assert "no exact split" in plan.note


def test_plan_rejects_indivisible(traced):
    an = traced("mlp")
    mm = memory.memory_model(an, "fp32", "adamw")
    with pytest.raises(SymcostError, match="not divisible"):
        mm.plan_accumulation(1000, 7, "80GiB")


@pytest.mark.parametrize("model", ["cs336-lm", "gpt2"])
def test_accumulation_peak_measured(traced, model):
    """The last micro-step of an accumulation cycle (gradients live from the start, added in
    place, then the optimizer step), against torch.profiler on a real step, within 10 %."""
    an = traced(model)
    mm = memory.memory_model(an, "fp32", "adamw")
    for sz in random_sizes(an, random.Random(3), n=3):
        meas = accumulation_peak(an.spec, sz, "fp32")["peak"]
        pred = mm.peak(accumulate=True, **sz)
        assert abs(pred - meas) <= 0.10 * meas, (
            f"{model} at {sz}: measured {meas} B (torch.profiler), predicted {pred} B ({pred / meas - 1:+.2%})")
