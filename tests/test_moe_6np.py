"""6·N·P of a mixture of experts in ``mfu``, ``time`` and ``roofline`` (issue 31, item 6): P is the
matmul parameters one token runs through (R of the E routed experts), as ``report``'s form and
docs/moe.md count it, not every expert.

Oracle (no symcost count involved): the model built at the requested sizes on the meta device;
its parameters walked by hand: embedding tables (lookups) and vectors (norm gains) are no matmul
operand, a stacked ``experts.*`` weight (first dimension E) counts R/E, every other weight in full.
"""
from __future__ import annotations

import json
import random
from fractions import Fraction

import pytest

import symcost
from conftest import run_cli


def active_matmul_params(model: str, values: dict[str, int]) -> int:
    """Matmul parameters one token runs through, counted on the meta-device model at ``values``."""
    spec = symcost.resolve(model)
    full = {**spec.defaults, **values}
    full.update({a: full[b] for a, b in spec.tied.items()})
    m = spec.build_meta(full)
    lookups = {id(mod.weight) for mod in m.modules()
               if type(mod).__name__.endswith("Embedding") and hasattr(mod, "weight")}
    total, seen = Fraction(0), set()
    for name, p in m.named_parameters(remove_duplicate=False):
        if id(p) in seen:  # a tied weight once (the untied lm_head of these models: no tie)
            continue
        seen.add(id(p))
        if id(p) in lookups or p.dim() < 2:
            continue
        if ".experts." in name:
            assert p.shape[0] == full["E"], name
            total += Fraction(full["R"], full["E"]) * p.numel()
        else:
            total += p.numel()
    assert total.denominator == 1
    return int(total)


def _sizes(model: str, rng: random.Random) -> dict[str, int]:
    if model == "moe":
        return {"B": rng.randint(2, 6), "S": rng.randint(16, 300), "H": rng.choice((4, 8)), "D": rng.choice((16, 32)),
                "L": rng.randint(1, 5), "V": rng.randint(500, 3000), "F": rng.randint(64, 600),
                "E": rng.randint(4, 16), "R": rng.randint(2, 3)}
    return {"B": rng.randint(2, 4), "S": rng.randint(16, 200), "H": 8, "K": rng.choice((2, 4)),
            "D": rng.choice((16, 32)), "L": rng.randint(1, 3), "V": rng.randint(500, 3000),
            "F": rng.randint(64, 400), "E": rng.randint(3, 12), "R": 2}


def _json(capsys, *args):
    code, out, err = run_cli(capsys, *args)
    assert code == 0, err
    return json.loads(out)


# the built-in moe is traced afresh by every command (its size check is code: not kept in the trace
# cache), so it runs mfu and time at one size; hf:mixtral's trace is cached: every command, two sizes
@pytest.mark.parametrize("model,n,commands", [
    ("moe", 1, ("mfu", "time")),
    pytest.param("hf:mixtral", 2, ("mfu", "time", "roofline", "eval"), marks=pytest.mark.hf),
])
def test_mfu_time_roofline_6NP_use_the_active_parameters(capsys, model, n, commands):
    rng = random.Random(f"6NP:{model}")
    for _ in range(n):
        v = _sizes(model, rng)
        sets = ["--set", *(f"{k}={x}" for k, x in v.items()), "--precision", "fp32"]
        dev = ["--device", "h100"]
        P = active_matmul_params(model, v)
        tokens = rng.randint(10**9, 10**12)
        args = {"mfu": [*dev, "--tokens-per-second", "1e3"], "time": [*dev, "--tokens", str(tokens), "--mfu", "0.01"],
                "roofline": [*dev, "--tokens", str(tokens)], "eval": []}
        out = {c: _json(capsys, c, model, *sets, *args[c], "--json") for c in commands}
        for c in set(commands) - {"eval"}:
            assert out[c]["params_active_matmul"] == P, (model, v, c)
            assert out[c]["flops.per_token_6P"] == 6 * P, (model, v, c)
            assert out[c]["params_matmul"] > P  # every expert is a matmul operand: all of them are more (R < E)
            if c != "mfu":
                assert out[c]["compute.6NP"] == 6 * P * tokens, (model, v, c)
        # time's 6·N·P days follow the active count (fp32 peak: --precision fp32)
        assert out["time"]["time.6NP.seconds"] == pytest.approx(6 * P * tokens / (out["time"]["peak_flops"] * 0.01))
        if "eval" in out:  # the report's 6·N·P form counts the same P
            assert out["eval"]["moe"]["params_active_matmul"] == P


def test_dense_model_6NP_unchanged(capsys):
    """A dense model's active matmul parameters are its matmul parameters: 6·N·P as before."""
    sets = ["--set", "B=2", "S=64", "L=2", "--precision", "fp32", "--device", "h100"]
    out = _json(capsys, "time", "cs336-lm", *sets, "--tokens", "1e9", "--mfu", "0.01", "--json")
    assert out["params_active_matmul"] == out["params_matmul"]
    assert out["compute.6NP"] == 6 * out["params_matmul"] * 10**9
