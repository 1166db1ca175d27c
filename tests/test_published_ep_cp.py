"""Published per-rank figures of expert and context parallelism (issue 28; docs/validation.md,
"Per-rank figures under expert and context parallelism").

The oracles are the published figures themselves, with their sources:

* Megatron-Core's MoE guide (NVIDIA/Megatron-LM ``megatron/core/transformer/moe/README.md``,
  "Tuning Guide of Parallel Mappings"), its EP row: peak activation memory **1** (unchanged by the
  EP size), weight memory **1/N in MoELayer** (every other parameter whole). Checked on symcost's
  traced EP rank of the built-in ``moe`` (its formulas in the symbol EP) and, independently of
  symcost, on PyTorch running the same expert-parallel step on the fake process group at EP 2
  and 4 (tests/data/ep_rank.py ``measure``: ``saved_tensors_hooks``, the local shards' elements).
"""
from __future__ import annotations

import os
import sys

import sympy

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "data"))
from ep_rank import build, measure  # noqa: E402


def _trace():
    """test_expert_parallel's traced EP rank of the built-in ``moe`` (its request, its cache: the
    module pytest collected, so one trace serves both files in a session)."""
    sys.path.insert(0, os.path.dirname(__file__))
    try:
        from test_expert_parallel import _trace as trace
    finally:
        sys.path.pop(0)
    return trace()


def test_megatron_moe_guide_ep_row():
    """Megatron-Core's table, EP row: activations 1, weights 1/N in the MoE layer. symcost's rank:
    saved bytes and dense parameters are no function of EP, expert parameters are P_experts/EP;
    PyTorch's rank at EP 2 and 4 (same sizes otherwise, E/EP >= 2): saved bytes equal, the
    parameter elements differ by exactly the expert stacks' (1/2 - 1/4) share."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from symcost.frontends.parallel import fake_world
    from symcost.passes.expert_parallel import expert_params
    from symcost.tracing.fit import SYMS

    an = _trace()
    ep = SYMS["EP"]
    saved = sympy.expand(sum(rep * nb for _, nb, _, rep in an.saved))
    whole, rank = expert_params(an)
    assert sympy.diff(saved, ep) == 0 and saved != 0
    assert sympy.expand(rank - whole / ep) == 0 and sympy.diff(whole, ep) == 0
    assert sympy.diff(sympy.expand(an.params_shard - rank), ep) == 0

    v = {"B": 2, "S": 16, "H": 4, "D": 8, "L": 2, "V": 96, "F": 24, "E": 16, "R": 2}
    got = {}
    for n in (2, 4):
        fake_world(n)
        model = build({**v, "EP": n}, init_device_mesh("cpu", (n,), mesh_dim_names=("ep",))["ep"])
        got[n] = measure(model, torch.randint(0, v["V"], (v["B"], v["S"])))
    experts = 3 * v["E"] * v["F"] * v["H"] * v["D"] * v["L"]  # SwiGLU stacks w1, w2, w3 [E, F, M]
    assert got[2]["saved"] == got[4]["saved"] == int(saved.subs(an.bind(**{**v, "EP": 2})))
    assert got[2]["shard"] - got[4]["shard"] == experts // 2 - experts // 4
