"""max-batch at a pinned size: ``--solve S`` at B = 1 and ``--solve B`` at S = 1.

Size 1 is its own regime: B (or S) is pinned, not a symbol, and every solver and validity check
must still see it (the bug: the check lost the pinned B, so ``--solve S --set B=1`` answered
"even S = 1 does not fit" under a cap that M(1) was far below). Each answer is compared with
what ``symcost eval`` reports at the boundary (the same trace's memory section, evaluated at
the answer and one above it), with caps drawn at random between two consecutive sizes, so the
answer is known without reading symcost's solver.
"""
from __future__ import annotations

import json
import random

import pytest
from click.testing import CliRunner

from symcost.passes import memory
from symcost.cli import main
from symcost.render.report import memory_section

# (model, config) with the hf: configs' own defaults: the solve runs at real sizes
CASES = [("cs336-lm", ()), ("hf:llama", ()), ("hf:gpt2", ())]
# where the answer S is drawn: where the peak grows with S (Llama-2-7B in fp32 peaks at the
# optimizer step below a few thousand tokens, whose live set does not grow with S)
S_RANGE = {"cs336-lm": (2, 4096), "hf:llama": (8192, 32768), "hf:gpt2": (2, 1023)}


def eval_peak(an, **sizes) -> int:
    """What ``symcost eval MODEL --set ... --json`` reports as ``memory.peak``."""
    return memory_section(an, sizes, "80GiB", an.precision, "adamw", evaluate=True)["json"]["peak"]


def _cap_between(an, var, n, rng, **fixed) -> int:
    lo, hi = eval_peak(an, **fixed, **{var: n}), eval_peak(an, **fixed, **{var: n + 1})
    assert hi > lo
    return rng.randint(lo, hi - 1)


@pytest.mark.parametrize("model,config", CASES)
def test_solve_S_at_B1(traced, model, config):
    an = traced(model, "fp32", "eager", config, (("B", 1),))
    assert an.pinned == {"B": 1} and "B" not in an.symbols
    mm = memory.memory_model(an, "fp32", "adamw")
    rng = random.Random(f"S|{model}")
    limit = an.spec.defaults.get("S") if model == "hf:gpt2" else None  # learned positions: S <= 1024
    for _ in range(3):
        n = rng.randint(*S_RANGE[model])
        cap = _cap_between(an, "S", n, rng)
        sol = mm.solve(cap, "S")
        assert sol.limited_by is None, sol.limited_by
        assert sol.value == n and sol.checked
        assert eval_peak(an, S=sol.value) <= cap < eval_peak(an, S=sol.value + 1)
        assert sol.sizes["B"] == 1
    if limit:  # a cap that allows more than the position table: the model's limit, stated
        cap = eval_peak(an, S=limit) * 2
        sol = mm.solve(cap, "S")
        assert sol.value == an.spec.defaults["S"] and sol.limited_by and "B must" not in sol.limited_by


@pytest.mark.parametrize("model,config", CASES)
def test_solve_B_at_S1(traced, model, config):
    an = traced(model, "fp32", "eager", config, (("S", 1),))
    assert an.pinned == {"S": 1} and "S" not in an.symbols
    mm = memory.memory_model(an, "fp32", "adamw")
    rng = random.Random(f"B|{model}")
    for _ in range(3):
        n = rng.randint(2, 5000)
        cap = _cap_between(an, "B", n, rng)
        sol = mm.solve(cap, "B")
        assert sol.limited_by is None, sol.limited_by
        assert sol.value == n and sol.checked
        assert eval_peak(an, B=sol.value) <= cap < eval_peak(an, B=sol.value + 1)


def test_cli_solve_S_at_B1_fits_and_says_so(traced):
    """The issue's command, through the CLI: a cap above M(1) gives a positive answer, never
    "even S = 1 does not fit", and its JSON has no limit when memory is what binds."""
    an = traced("mlp", "fp32", "eager", (), (("B", 1),))
    n = random.Random(5).randint(100, 30000)
    cap = (eval_peak(an, S=n) + eval_peak(an, S=n + 1)) // 2
    res = CliRunner().invoke(main, ["max-batch", "mlp", "--precision", "fp32", "--solve", "S", "--set", "B=1",
                                    "--memory", str(cap), "--json"])
    assert res.exit_code == 0, res.output
    js = json.loads(res.output)
    assert js["max_S"] == n and js["check"] and "limited_by" not in js
    res = CliRunner().invoke(main, ["max-batch", "mlp", "--precision", "fp32", "--solve", "S", "--set", "B=1",
                                    "--memory", str(cap)])
    assert res.exit_code == 0 and "does not fit" not in res.output and f"{n}" in res.output
