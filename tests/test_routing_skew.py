"""``--routing skew=X`` under ``--ep`` (issue 28 item 1): the traced expert-parallel rank is the most
loaded one, its experts receiving X times the balanced slots from every rank
(symcost/frontends/moe.py ``Routing``, symcost/frontends/expert_parallel.py ``builtin_forward``).

Oracle: PyTorch running that rank (tests/data/ep_rank.py ``measure`` on the fake process group, real
tensors: FLOPs by ``torch.utils.flop_counter``'s registry, ``saved_tensors_hooks``, the all-to-alls
seen at dispatch with (n−1)/n of their input, the DTensor shards' elements), at random sizes, and by
hand: the expert part of the FLOPs is X times the balanced one (18·F·M FLOPs per slot and layer,
the built-in moe's SwiGLU experts in fp32), and the rank sends (EP−1)/EP of 2 + 2·X slot exchanges
of N·R·M fp32 per layer (dispatch and the backward of the combine balanced, the combine and the
backward of the dispatch X times), plus the E int64 counts. About 5 s on an idle machine.
"""
from __future__ import annotations

import functools
import os
import random
import sys
from fractions import Fraction

import pytest

import symcost
from symcost.errors import SymcostError
from symcost.frontends import moe

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "data"))

REQUEST = {"EP": 4, "B": 2, "S": 16, "H": 4, "D": 8, "L": 2, "V": 96, "F": 24, "E": 16, "R": 2}


@functools.lru_cache(maxsize=None)
def _trace(routing: str):
    from symcost.frontends.layout import Layout
    from symcost.frontends.models import resolve

    spec = moe.with_routing(resolve("moe"), routing)
    return symcost.trace(spec, layout=Layout(ep=True), sizes=REQUEST, precision="fp32")


def test_skewed_rank_against_pytorch_on_the_fake_group():
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from ep_rank import build, measure
    from symcost.frontends.parallel import fake_world

    an, bal = _trace("skew=2"), _trace("balanced")
    assert "EP" in an.symbols and an.spec.extra["routing"] == "skew=2"
    rng = random.Random(2806)
    for _ in range(2):
        ep, e, r = rng.choice((2, 4)), rng.choice((8, 16)), rng.choice((2, 3))
        v = {"EP": ep, "E": e, "R": r, "B": rng.randint(1, 3), "S": e * rng.randint(1, 2), "H": 2 * rng.randint(1, 3),
             "D": 4 * rng.randint(1, 3), "L": rng.randint(1, 3), "V": rng.randint(40, 120), "F": 8 * rng.randint(1, 4)}
        fake_world(ep)
        model = build(v, init_device_mesh("cpu", (ep,), mesh_dim_names=("ep",))["ep"])
        moe.set_routing(model, moe.parse_routing("skew=2"))
        got = measure(model, torch.randint(0, v["V"], (v["B"], v["S"])))
        env, envb = an.bind(**v), bal.bind(**v)
        flops = int(an.flops("train").subs(env))
        assert flops == got["flops"], v
        assert int(sum(rep * nb for _, nb, _, rep in an.saved).subs(env)) == got["saved"], v
        a2a = Fraction(str(an.comm_bytes("all_to_all").subs(env)))
        assert a2a == Fraction(got["comm"]["all_to_all"]), v
        assert int(an.params_shard.subs(env)) == got["shard"], v
        # by hand: X = 2 doubles the expert part; the slot exchanges are 2 + 2X of N·R·M fp32
        M, slots = v["H"] * v["D"], v["B"] * v["S"] * v["R"]
        assert flops - int(bal.flops("train").subs(envb)) == (2 - 1) * slots * 18 * v["F"] * M * v["L"], v
        assert a2a == Fraction(ep - 1, ep) * v["L"] * ((2 + 2 * 2) * slots * M * 4 + 8 * e), v


def test_skew_is_one_line_where_it_does_not_apply():
    from symcost.frontends.models import resolve

    for text in ("skew=0.5", "skew", "skew=x"):
        with pytest.raises(SymcostError, match="skew must be a number >= 1"):
            moe.parse_routing(text)
    assert moe.parse_routing("skew=1") == moe.BALANCED and moe.parse_routing("skew=1.5").name == "skew=1.5"
    spec = moe.with_routing(resolve("moe"), "skew=2")  # (on one device every expert is there)
    with pytest.raises(SymcostError, match="needs --ep"):
        symcost.trace(spec, sizes={"B": 2, "S": 8, "H": 2, "D": 4, "L": 1, "V": 32, "F": 8, "E": 4, "R": 2},
                      precision="fp32")


#: a tiny Mixtral (transformers' experts code: packed gate_up, grouped GEMMs)
TINY_MIXTRAL = {"hidden_size": "32", "num_local_experts": "8", "num_experts_per_tok": "2", "num_hidden_layers": "2",
                "intermediate_size": "32", "num_attention_heads": "4", "num_key_value_heads": "4", "vocab_size": "64"}


@pytest.mark.heavy
def test_skewed_rank_of_transformers_experts_against_pytorch_on_the_fake_group():
    """``--routing skew=2`` on transformers' experts (a tiny Mixtral, EP 2): the traced rank's
    FLOPs, saved bytes, all-to-all bytes and parameter elements equal PyTorch running it on the
    fake group (ep_rank.measure: transformers' grouped GEMMs counted by their shapes), and by hand
    X = 2 adds one balanced expert part, 18·F·M FLOPs per slot and layer, and the rank sends
    (EP−1)/EP of 2 + 2·X slot exchanges of N·R·M fp32 per layer plus the E int64 counts
    (symcost/frontends/expert_parallel.py ``hf_forward``). One trace, ~25 s CPU."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from ep_rank import measure
    from symcost.frontends.expert_parallel import apply
    from symcost.frontends.layout import Layout
    from symcost.frontends.parallel import fake_world

    spec = moe.with_routing(symcost.resolve("hf:mixtral", TINY_MIXTRAL, "eager"), "skew=2")
    v = {**spec.values({}, inputs=False), "B": 2, "S": 16, "EP": 2}
    an = symcost.trace(spec, layout=Layout(ep=True), sizes=v, precision="fp32")
    assert "EP" in an.symbols and not an.pinned, an.pinned
    fake_world(2)
    model = spec.build({k: x for k, x in v.items() if k != "EP"})
    apply(model, init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))["ep"])
    got = measure(model, torch.randint(0, v["V"], (v["B"], v["S"])), spec=spec)
    env = an.bind(**v)
    assert int(an.flops("train").subs(env)) == got["flops"]
    assert int(sum(rep * nb for _, nb, _, rep in an.saved).subs(env)) == got["saved"]
    a2a = Fraction(str(an.comm_bytes("all_to_all").subs(env)))
    assert a2a == Fraction(got["comm"]["all_to_all"])
    assert int(an.params_shard.subs(env)) == got["shard"]
    m, slots, e = v["H"] * v["D"], v["B"] * v["S"] * v["R"], v["E"]
    assert a2a == Fraction(1, 2) * v["L"] * ((2 + 2 * 2) * slots * m * 4 + 8 * e)
    # (the balanced rank's FLOPs, by the same oracle, one expert part less)
    fake_world(2)
    model = moe.set_routing(spec.build({k: x for k, x in v.items() if k != "EP"}), moe.BALANCED)
    apply(model, init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))["ep"])
    bal = measure(model, torch.randint(0, v["V"], (v["B"], v["S"])), spec=spec)
    assert got["flops"] - bal["flops"] == slots * 18 * v["F"] * m * v["L"]
