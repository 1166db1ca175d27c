"""FSDP2 with CPU offload (issue 27 item 2; ``--offload``, ``Layout(offload=True)``; docs/parallel.md
§0.2): one rank traced with ``CPUOffloadPolicy``, its host<->device copies as ops, the device's
storage schedule without the host's storages.

Oracles, independent of symcost's recorder, rules, fit and wrapping (tests/data/offload_rank.py):
PyTorch running torchtitan's ``apply_fsdp`` with ``CPUOffloadPolicy`` (typed in the oracle from
torchtitan's source) on the fake process group at random sizes, and in a real ``torchrun`` + gloo
run of 2 ranks on this CPU (heavy marker).
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
from offload_rank import fake_rank, gloo_ranks, host_bytes, transfer_counts  # noqa: E402
from tp_rank import measure  # noqa: E402

PRECISION = "bf16-true"


@functools.lru_cache(maxsize=None)
def _trace():
    from symcost.frontends.layout import Layout
    from symcost.frontends.models import resolve

    return symcost.trace(resolve("megatron-gpt"), layout=Layout(shard="fsdp", offload=True),
                         sizes={"DP": 4, "S": 64, "H": 16, "D": 8, "V": 128}, precision=PRECISION,
                         torch_device="cpu")  # (the CPU's kernels: the oracles run on CPU tensors)


def _check(an, v: dict, got: dict, what) -> None:
    """symcost's rank at ``v`` against one measured rank ``got``: model FLOPs, saved bytes,
    collective bytes of each kind, parameter elements, bytes copied each way, host bytes."""
    from symcost.passes.memory import memory_model
    from symcost.passes.offload import transfer_bytes

    env = an.bind(**v)
    assert int(an.flops("train").subs(env)) == got["flops"], what
    assert int(sum(rep * nb for _, nb, _, rep in an.saved).subs(env)) == got["saved"], what
    for kind, want in got["comm"].items():
        assert Fraction(str(an.comm_bytes(kind).subs(env))) == Fraction(want), (kind, what)
    assert Fraction(str(an.comm_bytes("all_gather").subs(env))) > 0, what
    assert int(an.params_shard.subs(env)) == got["shard"], what
    for kind in ("h2d", "d2h"):
        assert int(transfer_bytes(an, kind).subs(env)) == got[kind], (kind, what)
    host = memory_model(an, PRECISION, "adamw", impl="for-loop", device="cpu").host
    for k in ("params", "grads", "optimizer"):
        assert int(host[k].subs(env)) == got["host"][k], (k, what)


def test_offload_rank_against_pytorch_on_the_fake_group():
    """At random DP and model sizes where DP divides every first dimension (FSDP2 pads
    elsewhere): the rank's FLOPs, saved bytes, collective bytes of each kind, parameter
    elements, H2D and D2H bytes per step, and the host's parameter, gradient and AdamW-state
    bytes equal PyTorch's FSDP2 with CPUOffloadPolicy on the fake group; the device holds no
    model state (its schedule allocates no gradient that outlives the step)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from symcost.frontends.layout import layout_of
    from symcost.frontends.models import resolve
    from symcost.passes.memory import memory_model

    an = _trace()
    assert "DP" in an.symbols and not an.pinned and layout_of(an).offload
    mm = memory_model(an, PRECISION, "adamw", impl="for-loop", device="cpu")
    assert mm.params == mm.grads == mm.optimizer == 0 and not mm.grad_events
    rng = random.Random(2702)
    spec = resolve("megatron-gpt")
    for _ in range(3):
        dp = rng.choice((2, 4, 8))
        v = {"DP": dp, "B": rng.randint(1, 3), "S": rng.randint(2, 40), "H": 4 * rng.randint(1, 3),
             "D": 4 * rng.randint(1, 3), "L": rng.randint(2, 4), "V": 8 * dp * rng.randint(1, 3)}
        m = fake_rank(spec, v)
        with FakeTensorMode(allow_non_fake_inputs=True):
            m.to_empty(device="cpu")
            import contextlib

            got = measure(m, spec, v, contextlib.nullcontext)
            got.update(transfer_counts(m, spec, v))
            opt = torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=False)
            opt.step()
            got["host"] = host_bytes(m, opt)
        _check(an, v, got, v)


def test_offload_report_and_refusals():
    """``report --json`` carries ``parallel.offload`` (host bytes, copies per step) and ``layout.offload``;
    ``--gpu`` prices the copies over the device's host link; ``--offload`` without a sharding
    FSDP2 strategy is refused in one line."""
    import json

    from click.testing import CliRunner

    from symcost.cli import main

    args = ["report", "mlp", "--dp", "4", "--shard", "fsdp", "--offload", "--set", "B=2", "S=16", "D=32", "L=3"]
    r = CliRunner().invoke(main, args + ["--json", "--gpu", "h100-sxm"])
    assert r.exit_code == 0, r.output
    js = json.loads(r.output)
    off, P = js["parallel"]["offload"], 3 * (32 * 32 + 32)
    assert js["layout"]["offload"] is True
    # mlp in bf16-mixed: fp32 shards; each block gathered in the forward and again in the backward
    assert off["h2d"]["train"] == 2 * 4 * P // 4 and off["d2h"]["train"] == 4 * P // 4
    assert off["host"]["params"] == off["host"]["grads"] == 4 * P // 4
    step = js["parallel"]["step"]
    assert step["host_bandwidth"] == 64e9 and step["transfer"]["backward"] == pytest.approx(4 * P / 4 / 64e9)
    for bad, want in ((["--dp", "4"], "not ddp"), (["--dp", "4", "--shard", "zero2"], "not zero2"), ([], "--shard fsdp")):
        r = CliRunner().invoke(main, ["report", "mlp", "--offload", *bad])
        assert r.exit_code != 0 and want in r.output and "Traceback" not in r.output, (bad, r.output)
        assert len(r.output.strip().splitlines()) == 1, r.output


@pytest.mark.heavy
def test_real_gloo_offload_two_ranks(tmp_path):
    """``torchrun --standalone --nproc-per-node 2`` with gloo on this CPU, FSDP2 with
    CPUOffloadPolicy on real bf16 tensors (tests/data/offload_rank.py): each rank's FLOPs, saved
    bytes, collective bytes of each kind, parameter elements, copies and host bytes equal
    symcost's at a random size, and its device peak (the run's forward and backward with the
    copies allocated as on an accelerator, the host's storages left out: offload_rank.py says
    what this proves) is within 5% of symcost's."""
    from symcost.passes.memory import memory_model

    rng = random.Random(2703)
    v = {"DP": 2, "H": 8, "D": rng.choice((4, 8)), "L": rng.randint(2, 3), "V": 32 * rng.randint(1, 3),
         "B": rng.randint(2, 3), "S": rng.randint(64, 128)}
    ranks = gloo_ranks(tmp_path, v)
    an = _trace()
    want = memory_model(an, PRECISION, "adamw", impl="for-loop", device="cpu").peak(**v)
    for rank, got in enumerate(ranks):
        assert got["world"] == 2
        _check(an, v, got, rank)
        assert abs(want - got["peak_ops"]) <= 0.05 * got["peak_ops"], (rank, want, got)
