"""FSDP2's ``MixedPrecisionPolicy`` with ``--dp`` (``--fsdp-mp PARAM[,REDUCE]``, issue 15).

Oracle: rank 0 run by PyTorch on fake tensors (``tests/test_parallel.py``'s ``_run_rank``: the
bytes of every collective seen at dispatch with nccl-tests' ring factors typed by hand,
``FlopCounterMode``, a ``saved_tensors_hooks`` pair), the model wrapped here by calling
``fully_shard`` / ``replicate`` with ``MixedPrecisionPolicy(param_dtype=..., reduce_dtype=...)``
directly (not through symcost's wrapping). Sizes and DP drawn at random (seeded).
"""
from __future__ import annotations

import functools
import json
import random

import pytest
import sympy
import torch

import symcost
import symcost.frontends.parallel as parallel
from symcost.errors import SymcostError
from symcost.tracing.fit import SYMS

from test_parallel import _draw, _run_rank

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _oracle_wrap(param: str, reduce: str):
    """Per block, then the root (reshard_after_forward=False), as torchtitan wraps; the policy
    built here from torch's own class."""
    from torch.distributed._composable.replicate_with_fsdp import replicate
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=DTYPES[param], reduce_dtype=DTYPES[reduce])

    def wrap(model, layers, shard, mesh, mp=None):
        blocks = list(model.get_submodule(layers).children()) if layers else []
        if shard in ("ddp", "zero1"):
            for m in blocks + [model]:
                replicate(m, mesh=mesh, mp_policy=policy)
        else:
            for m in blocks:
                fully_shard(m, mesh=mesh, reshard_after_forward=shard != "zero2", mp_policy=policy)
            fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=policy)
        return model

    return wrap


@functools.lru_cache(maxsize=None)
def _trace(shard, mp, precision):
    return symcost.trace("mlp", sizes={"DP": 8}, precision=precision, shard=shard, fsdp_mp=mp, use_cache=False)


@pytest.mark.parametrize("shard,mp,precision", [("fsdp", "bf16", "fp32"), ("zero2", "bf16,bf16", "bf16-mixed"),
                                                ("ddp", "fp16,fp32", "fp32")])
def test_collectives_match_pytorch_under_policy(shard, mp, precision, monkeypatch):
    an = _trace(shard, mp, precision)
    param, reduce = parallel.parse_fsdp_mp(mp)
    monkeypatch.setattr(parallel, "wrap", _oracle_wrap(param, reduce))
    rng = random.Random(2023 + len(shard) + len(mp))
    for _ in range(2):
        v = _draw(an, rng)
        got = _run_rank("mlp", shard, v, precision)
        env = {SYMS[k]: x for k, x in v.items() if k in an.symbols}
        for kind, want in got["comm"].items():
            assert sympy.Rational(an.comm_bytes(kind).subs(env)) == sympy.Rational(want.numerator, want.denominator), \
                (v, kind)
        assert int(an.flops("train").subs(env)) == got["flops"], v
        assert int(sum(rep * nb for _, nb, _, rep in an.saved).subs(env)) == got["saved"], v


def test_policy_halves_the_all_gathers():
    """fp32 parameters all-gathered as bf16 move half the bytes; gradients reduced in fp32 move
    what they moved without the policy (formulas: every size and DP)."""
    plain, mp = _trace("fsdp", None, "fp32"), _trace("fsdp", "bf16", "fp32")
    assert sympy.simplify(mp.comm_bytes("all_gather") * 2 - plain.comm_bytes("all_gather")) == 0
    assert sympy.simplify(mp.comm_bytes("reduce_scatter") - plain.comm_bytes("reduce_scatter")) == 0
    assert sympy.simplify(plain.comm_bytes("all_gather")) != 0


def test_cli_option_and_refusals(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from symcost.cli import main

    monkeypatch.setenv("SYMCOST_CACHE_DIR", str(tmp_path))
    base = ["report", "mlp", "--set", "B=2", "S=8", "D=32", "L=2", "--precision", "fp32", "--json"]
    r = CliRunner().invoke(main, base + ["--fsdp-mp", "bf16"])
    assert r.exit_code == 2 and "--fsdp-mp needs --dp N" in r.output
    r = CliRunner().invoke(main, base + ["--dp", "4", "--shard", "fsdp", "--fsdp-mp", "bf8"])
    assert r.exit_code == 2 and "--fsdp-mp takes PARAM[,REDUCE]" in r.output
    with pytest.raises(SymcostError, match="give shard"):
        symcost.trace("mlp", fsdp_mp="bf16", use_cache=False)
    out = {}
    for flag in ([], ["--fsdp-mp", "bf16"]):  # two cache entries: the policy is part of the key
        r = CliRunner().invoke(main, base + ["--dp", "4", "--shard", "fsdp"] + flag)
        assert r.exit_code == 0, r.output
        out[bool(flag)] = json.loads(r.output)
    assert out[True]["comm"]["all_gather"] * 2 == out[False]["comm"]["all_gather"]
    assert out[True]["comm"]["reduce_scatter"] == out[False]["comm"]["reduce_scatter"]
    assert "MixedPrecisionPolicy(param_dtype=torch.bfloat16" in out[True]["parallel"]["engine"]
    assert len([p for p in tmp_path.iterdir() if p.is_dir()]) == 2


def test_mfu_divides_by_the_peak_the_matmuls_ran_at(cache_dir):
    """Issue 27: under ``--precision fp32 --fsdp-mp bf16`` FSDP2's policy all-gathers bf16
    parameters and every matmul runs in bf16, so the step's compute is timed at the bf16 peak and
    its MFU must divide by the bf16 peak too (the fp32 peak gave Llama-3-8B an MFU of 1174% on 8
    H100s). Oracle: the peaks read from the catalogue file itself (``tomllib``), the dtypes of the
    matmuls in the traced rank, and the MFU computed here from the run's model FLOPs / (devices ×
    bf16 peak × time), and per rank from its step's model FLOPs / (bf16 peak × step time)."""
    from test_parallel_time import _catalogue, _cli

    from symcost.hardware.devices import get_device
    from symcost.passes.roofline import roofline

    gpu = "h100-sxm"
    cat = _catalogue(gpu)
    assert cat["bf16"] > 10 * cat["fp32"]  # the two peaks are far apart: the wrong one shows
    dp, tokens = 4, 10**9
    size_args = ["--set", "B=8", "S=512", "D=256", "L=2"]
    base = ["mlp", "--dp", str(dp), "--shard", "fsdp", "--gpu", gpu, "--json", *size_args]
    out = {}
    for name, flags in (("mp", ["--precision", "fp32", "--fsdp-mp", "bf16"]), ("bf16", ["--precision", "bf16-true"]),
                        ("fp32", ["--precision", "fp32"])):
        t = _cli("time", *base, "--tokens", str(tokens), *flags)
        r = _cli("report", *base, *flags)
        out[name] = t
        assert r["parallel"]["step"]["mfu"] == pytest.approx(t["mfu"], rel=1e-12)  # report --gpu says the same
        assert r["parallel"]["step"]["peak_flops"] == t["peak_flops"]
        step = t["step"]["step_seconds"]
        assert 0 < t["mfu"] <= 1, (name, t["mfu"])
        # the run: model FLOPs of all ranks / (devices x peak x time); one rank: its step's / (peak x step)
        assert t["mfu"] == pytest.approx(t["compute.total"] / (dp * t["peak_flops"] * t["time.seconds"]), rel=1e-9)
        assert t["mfu"] == pytest.approx(t["flops.train_step"] / (t["peak_flops"] * step), rel=1e-9)
    mp, bf16, fp32 = out["mp"], out["bf16"], out["fp32"]
    assert mp["peak_flops"] == bf16["peak_flops"] == cat["bf16"] and mp["precision"] == "bf16"
    assert mp["step"]["precision"] == "bf16"
    assert fp32["peak_flops"] == cat["fp32"] and fp32["precision"] == "fp32"  # no policy: fp32 matmuls
    assert mp["mfu"] == pytest.approx(mp["flops.train_step"] / (cat["bf16"] * mp["step"]["step_seconds"]), rel=1e-9)
    # the compute the step time holds is timed at the bf16 peak: every matmul of the rank ran in bf16
    an = symcost.trace("mlp", sizes={"DP": dp, "B": 8, "S": 512, "D": 256, "L": 2}, precision="fp32", shard="fsdp",
                       fsdp_mp="bf16", use_cache=False)
    mm = [op for op in an.ops if op.cost.flops != 0]
    assert mm and all(str(d) == "torch.bfloat16" for op in mm for d in op.out_dtypes)
    rf = roofline(an, get_device(gpu), {"DP": dp, "B": 8, "S": 512, "D": 256, "L": 2})
    assert {n["precision"] for n in rf["nodes"] if n["model_flops"]} == {"bf16"}
    assert sum(rf["per_phase"][ph]["seconds"] for ph in ("forward", "backward")) == pytest.approx(
        mp["step"]["compute"]["forward"] + mp["step"]["compute"]["backward"], rel=1e-9)
    assert rf["mfu_ceiling"] <= 1
