"""HSDP (issue 27): FSDP2 over the 2-D mesh ``(dp_replicate R, dp_shard DP/R)``, torchtitan's
``data_parallel_replicate_degree`` × ``data_parallel_shard_degree``: one rank traced on the fake
process group with DP (replicate × shard, shared/conventions.md) a symbol and R pinned.

Oracles, independent of symcost's recorder, rules and fit: PyTorch running the same HSDP on the
fake process group (tests/data/tp_rank.py ``fake_hsdp_rank`` + ``measure``: FLOPs by
``torch.utils.flop_counter``'s registry, ``saved_tensors_hooks``, collectives seen at dispatch
with the size of the process group PyTorch resolves for each, nccl-tests' ring factors typed by
hand) at random sizes, and a real ``torchrun`` + gloo run of 2 × 2 ranks on this CPU.
"""
from __future__ import annotations

import functools
import os
import random
import sys
from fractions import Fraction

import pytest

import symcost

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "data"))
from tp_rank import check_rank as _check, fake_hsdp_rank, gloo_ranks, measure  # noqa: E402

PRECISION = "bf16-true"
R = 2


@functools.lru_cache(maxsize=None)
def _trace(shard: str = "fsdp"):
    from symcost.frontends.layout import Layout
    from symcost.frontends.models import resolve

    return symcost.trace(resolve("megatron-gpt"), layout=Layout(shard=shard, replicate=R),
                         sizes={"DP": 4, "S": 64, "H": 16, "D": 8, "V": 128}, precision=PRECISION)


def test_hsdp_rank_against_pytorch_on_the_fake_mesh():
    """At random DP (a multiple of R: shard groups of 1, 2 and 4 ranks, which divide
    megatron-gpt's 2,048 learned positions) and model sizes where DP/R divides every first
    dimension (FSDP2 pads elsewhere, which the formulas leave out: docs/parallel.md): the rank's FLOPs, saved bytes, collective bytes of each group
    (reduce-scatter and all-gather over dp_shard, the gradient all-reduce over dp_replicate) and
    parameter elements equal PyTorch's HSDP on the fake group."""
    from symcost.frontends.layout import layout_of
    from symcost.frontends.models import resolve

    an = _trace()
    assert "DP" in an.symbols and not an.pinned and layout_of(an).replicate == R
    rng = random.Random(27)
    spec = resolve("megatron-gpt")
    for _ in range(3):
        dp = R * rng.choice((1, 2, 4))
        v = {"DP": dp, "B": rng.randint(1, 3), "S": rng.randint(2, 40), "H": 4 * rng.randint(1, 3),
             "D": 4 * rng.randint(1, 3), "L": rng.randint(1, 3), "V": 24 * dp * rng.randint(1, 2)}
        from torch._subclasses.fake_tensor import FakeTensorMode

        m, ctx, groups = fake_hsdp_rank(spec, v, R)
        with FakeTensorMode(allow_non_fake_inputs=True):
            m.to_empty(device="cpu")
            got = measure(m, spec, v, ctx, groups=groups)
        assert Fraction(got["comm"]["DP_replicate.all_reduce"]) > 0
        _check(an, v, got, v)


def test_hsdp_refusals_are_one_line():
    from click.testing import CliRunner

    from symcost.cli import main

    for args, want in ((["--dp", "6", "--shard", "fsdp", "--dp-replicate", "4"], "no multiple of --dp-replicate 4"),
                       (["--dp-replicate", "2"], "needs --dp N"),
                       (["--dp", "4", "--dp-replicate", "2"], "give --shard fsdp, zero3 or zero2")):
        r = CliRunner().invoke(main, ["report", "mlp", *args])
        assert r.exit_code != 0 and want in r.output and "Traceback" not in r.output, (args, r.output)


@pytest.mark.heavy
def test_real_gloo_hsdp_two_by_two(tmp_path):
    """``torchrun --standalone --nproc-per-node 4`` with gloo on this CPU: HSDP (dp_replicate 2 ×
    dp_shard 2), real bf16 tensors (tests/data/tp_rank.py): each rank's FLOPs, saved bytes,
    collective bytes per group and kind, and parameter elements equal symcost's at a random size,
    and its peak memory of a steady-state AdamW step (torch.profiler) is within 5% of symcost's."""
    from symcost.passes.memory import memory_model

    rng = random.Random(28)
    v = {"DP": 4, "H": 8, "D": rng.choice((4, 8)), "L": rng.randint(2, 3), "V": 32 * rng.randint(1, 3),
         "B": rng.randint(2, 3), "S": rng.randint(64, 128)}
    ranks = gloo_ranks(tmp_path, v, [R, "hsdp:fsdp"])
    an = _trace()
    want = memory_model(an, PRECISION, "adamw", impl="for-loop", device="cpu").peak(**v)
    for rank, got in enumerate(ranks):
        _check(an, v, got, rank)
        assert abs(want - got["peak_ops"]) <= 0.05 * got["peak_ops"], (rank, want, got)


def test_hsdp_padding_against_pytorch_on_the_fake_mesh():
    """Where DP/R does not divide a first dimension (shard groups of 3 ranks: megatron-gpt's 2,048
    learned positions, V rows), FSDP2 pads each rank's chunk to ceil(rows/(DP/R)):
    :func:`symcost.passes.parallel.padded` gives the rank's parameter elements and each kind's
    collective bytes (dp_shard and dp_replicate together) PyTorch's HSDP on the fake group has;
    the formulas alone differ there."""
    from fractions import Fraction

    from torch._subclasses.fake_tensor import FakeTensorMode

    from symcost.frontends.models import resolve
    from symcost.passes.parallel import padded

    an, spec = _trace(), resolve("megatron-gpt")
    rng = random.Random(2711)
    v = {"DP": 3 * R, "B": rng.randint(1, 3), "S": rng.randint(2, 40), "H": 4 * rng.randint(1, 3),
         "D": 4 * rng.randint(1, 3), "L": rng.randint(1, 2), "V": 8 * (3 * rng.randint(1, 3) + 1)}
    m, ctx, groups = fake_hsdp_rank(spec, v, R)
    with FakeTensorMode(allow_non_fake_inputs=True):
        m.to_empty(device="cpu")
        got = measure(m, spec, v, ctx, groups=groups)
    ev = padded(an, an.bind(**v))
    assert int(ev["params_shard"]) == got["shard"], v
    for kind in ("all_gather", "reduce_scatter", "all_reduce"):
        want = sum((Fraction(x) for k, x in got["comm"].items() if k.endswith("." + kind)), Fraction(0))
        assert Fraction(str(ev["comm"][kind])) == want, (kind, v)
    assert an.params_shard.subs(an.bind(**v)) != got["shard"], "no padding at these sizes"
