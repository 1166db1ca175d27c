"""Activation checkpointing (symcost.checkpoint, ``symcost checkpoint``), against PyTorch.

Oracles: the applied plan run on real CPU tensors — outputs and gradients against the plain
model's; ``torch.profiler``'s memory timeline of a steady-state step (tests/test_memory_oracle.py)
against the predicted peak; ``FlopCounterMode`` (which sees the recomputed forward) against
``checkpoint.train_flops``; a brute-force search over every segmentation against the DP.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import math
import random
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from symcost import checkpoint as ck
from symcost.errors import SymcostError
from symcost.models import resolve
from test_memory_oracle import build, step_peak


def applied(spec, plan_fn):
    """``spec`` whose every built model gets ``plan_fn(L).apply``."""
    return dataclasses.replace(spec, build=lambda v: plan_fn(v["L"]).apply(spec.build(v)))


def run_step(spec, sizes, seed=0, input_grad=False):
    """Output, input gradient and parameter gradients of forward + loss + backward (fp32, CPU)."""
    model, args, kwargs, _ = build(spec, sizes, "fp32", seed=seed)
    if input_grad:
        args = tuple(a.detach().requires_grad_() if a.is_floating_point() else a for a in args)
    torch.manual_seed(1)
    out = model(*args, **kwargs)
    spec.loss(out, (args, kwargs)).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    gin = [a.grad for a in args if isinstance(a, torch.Tensor) and a.grad is not None]
    return out.detach(), gin, grads


def _plans(L, rng):
    cuts = sorted(rng.sample(range(1, L), min(2, L - 1)))
    bounds = [0] + cuts + [L]
    mixed = [(bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1) if i != 1]  # one segment left plain
    return {
        "every-layer": ck.uniform_segments(L, 1),
        "sqrt-L": ck.uniform_segments(L, math.ceil(math.sqrt(L))),
        "mixed": mixed,
        "sequential": ck.sequential_default(L, 2),
    }


@pytest.mark.parametrize("model", ["mlp", "cs336-lm", "gpt2"])
def test_apply_equals_original(model):
    """Outputs and gradients of every applied plan equal the original's, with and without an
    input that requires grad (mlp's float input; the LMs take token ids, which never do)."""
    rng = random.Random(hash(model) % 1000)
    spec = resolve(model)
    small = {"B": 2, "S": rng.randint(5, 12), "H": 2, "D": rng.choice((4, 8)), "V": rng.randint(30, 60),
             "F": rng.randint(8, 24), "L": rng.randint(4, 7)}
    sizes = {k: v for k, v in small.items() if k in spec.all_symbols}
    L = sizes["L"]
    ref = run_step(spec, sizes)
    for name, segs in _plans(L, rng).items():
        for input_grad in ((False, True) if model == "mlp" else (False,)):
            got = run_step(applied(spec, lambda n: ck.Plan(spec.layers, n, segs, name)), sizes,
                           input_grad=input_grad)
            want = run_step(spec, sizes, input_grad=input_grad) if input_grad else ref
            torch.testing.assert_close(got[0], want[0], msg=f"{model} {name}: output")
            assert got[2].keys() == want[2].keys()
            for n in want[2]:
                torch.testing.assert_close(got[2][n], want[2][n], msg=f"{model} {name}: grad of {n}")
            assert len(got[1]) == len(want[1])
            for g, w in zip(got[1], want[1]):
                torch.testing.assert_close(g, w)


def test_apply_rejects_wrong_depth():
    spec = resolve("mlp")
    with torch.device("meta"):
        model = spec.build({"D": 4, "L": 3})
    with pytest.raises(SymcostError, match="3"):
        ck.Plan("layers", 5, [(0, 5)]).apply(model)


def _brute(a, x, f, head, fr, budget=None):
    """Every segmentation of the chain, every segment checkpointed or not: the best (peak, rec)."""
    n = len(a)
    best = None
    for mask in range(1 << (n - 1)):
        bounds = [0] + [i + 1 for i in range(n - 1) if mask >> i & 1] + [n]
        segs = [(bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]
        for flags in itertools.product((0, 1), repeat=len(segs)):
            chosen = [s for s, fl in zip(segs, flags) if fl]
            pk, rec = ck.plan_cost(chosen, a, x, f, head, fr)
            if budget is not None and pk > budget:
                continue
            key = (pk, rec) if budget is None else (rec, pk)
            best = key if best is None or key < best else best
    return best


def test_dp_is_exact_against_brute_force():
    """The DP's optimum equals an exhaustive search over every segmentation (random chains)."""
    rng = random.Random(7)
    for _ in range(25):
        n = rng.randint(1, 7)
        a = [rng.randint(1, 50) for _ in range(n)]
        x = [rng.randint(1, 20) for _ in range(n)]
        f = [rng.randint(1, 30) for _ in range(n)]
        fr = [rng.randint(1, v) for v in f]
        head = rng.randint(0, 40)
        segs, pk, rec = ck.optimal_segments(a, x, f, head=head, fr=fr)
        assert ck.plan_cost(segs, a, x, f, head, fr) == (pk, rec)
        assert (pk, rec) == _brute(a, x, f, head, fr)
        budget = rng.randint(pk, ck.plan_cost([], a, x, f, head, fr)[0])
        segs, pk2, rec2 = ck.optimal_segments(a, x, f, budget, head, fr)
        assert pk2 <= budget and ck.plan_cost(segs, a, x, f, head, fr) == (pk2, rec2)
        assert (rec2, pk2) == _brute(a, x, f, head, fr, budget)
