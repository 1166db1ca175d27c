"""The probe plan where the model's constraints are many divisibilities at once (issue 27:
``hf:llama --tp 2 --dp 2`` was refused, "could not find probe sizes ... that satisfy the model's
constraints": every first dimension a multiple of lcm(DP, 4)·TP, H and V in their classes mod 8,
which random sizes drawn all at once almost never meet together)."""
from __future__ import annotations

import random

from symcost.tracing.fit import POOLS, plan_probes

SYMBOLS = ("B", "S", "H", "D", "V", "F")


def _check(p):
    """Every size a multiple of 8: about one draw in 10^5 of the small pools meets it."""
    bad = [s for s in SYMBOLS if p[s] % 8]
    return f"{bad[0]}={p[bad[0]]} is no multiple of 8" if bad else None


def test_random_probes_where_all_at_once_never_fit():
    """The plan still holds random probes (each varying several sizes of the base at once), and
    every probe meets the constraints; the draw of every size at once is indeed hopeless here."""
    rng = random.Random(0)
    joint = sum(_check({s: rng.choice(list(POOLS[s])[:24]) for s in SYMBOLS}) is None for _ in range(2000))
    assert joint == 0
    base = {"B": 8, "S": 16, "H": 8, "D": 8, "V": 64, "F": 48}
    plan = plan_probes(SYMBOLS, _check, n_random=6, seed=1, base=base,
                       request={"B": 8, "S": 16, "H": 8, "D": 8, "V": 64, "F": 48})
    assert all(_check(p) is None for p in plan.points)
    randoms = plan.points[1 + len(plan.axis):]
    assert len(randoms) >= 6
    # the random probes vary several sizes together (most of them two or more: where the axis
    # probes cannot tell a product from a sum)
    assert sum(sum(p[s] != base[s] for s in SYMBOLS) >= 2 for p in randoms) >= len(randoms) // 2
